"""Executable spec of sandbox/landlock_seccomp.py: the system-call tables against the kernel's headers, the seccomp program
against a reference interpreter of classic BPF (for both architectures, whatever this machine is), what the sandbox
line and tool_require_isolation say, and a kernel with less (an older Landlock ABI, none, no seccomp) getting what
it has. The hostile calls themselves: tests/test_code_tool_boundary.py."""
import contextlib
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

import code_tool
from plumbing import tool_sandbox
from sandbox import landlock_seccomp as ls
from code_tool import CodeTool, Sandbox, SandboxError

HEADERS = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "aarch64": "/usr/include/asm-generic/unistd.h"}
LINUX = os.uname().sysname == "Linux"


def header_numbers(path: str) -> dict:
    """name -> number from a kernel unistd header (asm-generic's __NR3264_ names included)."""
    numbers = {}
    for name, number in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", Path(path).read_text()):
        numbers.setdefault(name, int(number))
    return numbers


@pytest.mark.parametrize("machine", ls.ARCHES)
def test_system_call_numbers_match_the_kernel_headers(machine):
    if not os.path.exists(HEADERS[machine]):
        pytest.skip(f"no kernel headers at {HEADERS[machine]} (Debian: linux-libc-dev)")
    headers, ours = header_numbers(HEADERS[machine]), ls.ARCHES[machine][1]
    known = {name for name in ours if name in headers}  # (headers older than a call lack it)
    assert len(known) > 0.8 * len(ours) and {name: ours[name] for name in known} == {n: headers[n] for n in known}


def test_every_rule_names_a_known_system_call():
    names = set(ls.X86_64) | set(ls.AARCH64) | set(ls.COMMON)
    assert set(ls.DENIED) | set(ls.NOT_IMPLEMENTED) | set(ls.ONLY_IF) <= names
    assert not set(ls.DENIED) & set(ls.ONLY_IF) and not set(ls.X86_64) & set(ls.COMMON)
    # x86_64 lacks no call aarch64 has, but the legacy ones aarch64 never had
    assert set(ls.AARCH64) <= set(ls.X86_64)


def run_bpf(program: list, nr: int, arch: int, args: tuple = (0,) * 6) -> int:
    """A reference interpreter of the classic BPF subset the program uses, on struct seccomp_data."""
    data = {ls.NR: nr & 0xFFFFFFFF, ls.ARCH: arch}
    data.update({ls.ARGS + 8 * i: a & 0xFFFFFFFF for i, a in enumerate(args)})
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        pc += 1
        if code == ls.LD_W_ABS:
            acc = data[k]
        elif code == ls.ALU_AND_K:
            acc &= k
        elif code in (ls.JEQ_K, ls.JGE_K):
            pc += jt if (acc == k if code == ls.JEQ_K else acc >= k) else jf
        elif code == ls.RET_K:
            return k
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")


@pytest.mark.parametrize("machine", ls.ARCHES)
def test_the_filter_refuses_exactly_its_rules(machine):
    program = ls.seccomp_program(machine)
    arch, numbers = ls.ARCHES[machine]
    eperm, enosys, allow = ls.RET_ERRNO | ls.EPERM, ls.RET_ERRNO | ls.ENOSYS, ls.RET_ALLOW
    for name, nr in numbers.items():
        want = eperm if name in ls.DENIED else enosys if name in ls.NOT_IMPLEMENTED else allow
        assert run_bpf(program, nr, arch) == want or name in ls.ONLY_IF, name
    for nr in range(0, 480):  # every other number is allowed
        if nr not in numbers.values():
            assert run_bpf(program, nr, arch) == allow, nr
    assert run_bpf(program, numbers["clone"], arch, (0x01200011,)) == allow  # fork's flags
    assert run_bpf(program, numbers["clone"], arch, (0x003D0F00,)) == allow  # a thread's
    assert run_bpf(program, numbers["clone"], arch, (0x10000011,)) == eperm  # CLONE_NEWUSER
    assert run_bpf(program, numbers["openat"], arch, (0, 0, os.O_WRONLY | os.O_TRUNC | os.O_CREAT)) == allow
    assert run_bpf(program, numbers["openat"], arch, (0, 0, os.O_RDONLY)) == allow
    assert run_bpf(program, numbers["openat"], arch, (0, 0, os.O_RDONLY | os.O_TRUNC)) == eperm
    assert [run_bpf(program, numbers["personality"], arch, (p,)) for p in (0xFFFFFFFF, 0, 8)] == [allow, eperm, eperm]
    assert [run_bpf(program, numbers["prlimit64"], arch, (pid,)) for pid in (0, 1234)] == [allow, eperm]
    assert [run_bpf(program, numbers["setpriority"], arch, (w, who)) for w, who in ((0, 0), (0, 99), (2, 0))] == \
        [allow, eperm, eperm]
    assert run_bpf(program, numbers["openat"], 0x40000003) == eperm  # a foreign ABI (AUDIT_ARCH_I386)
    if machine == "x86_64":
        assert run_bpf(program, 0x40000000 | 39, arch) == eperm  # an x32 call
    kept = ls.seccomp_program(machine, keep=("fchown",))
    assert run_bpf(kept, numbers["fchown"], arch) == allow and run_bpf(kept, numbers["fchmod"], arch) == eperm


def test_describe_names_the_layers():
    assert [ls.describe(7, True), ls.describe(9, True), ls.describe(3, False), ls.describe(0, True),
            ls.describe(0, False)] == ["landlock(v7)+seccomp", "landlock(v7)+seccomp", "landlock(v3)", "seccomp", ""]


@pytest.mark.skipif(not LINUX, reason="Landlock and seccomp are Linux's")
def test_the_sandbox_line_says_which_layers_hold(capfd):
    abi, seccomp = ls.landlock_abi(), ls.seccomp_available()
    with CodeTool(workers=1, preload=("math",)) as t:
        assert t.sandbox_line.startswith(f"code tool sandbox: {t.sandbox}" + "".join(
            f"+{x}" for x in ls.describe(abi, seccomp).split("+") if x) + " (")
    with CodeTool(workers=1, preload=("math",), kernel_layers=False) as bare:
        assert bare.sandbox_line.startswith(f"code tool sandbox: {bare.sandbox} (") and bare.layers == ""
        assert bare.run("open('/proc/1/status').read()\nprint('read')").stdout == "read\n"  # no Landlock: /proc open


def test_require_isolation_asks_for_namespaces_landlock_and_seccomp(monkeypatch):
    full = Sandbox("namespaces", landlock=7, seccomp=True)
    assert full.isolated() == "" and Sandbox("namespaces", landlock=7).isolated() == "seccomp"
    assert Sandbox("fallback-root", landlock=1, seccomp=True).isolated() == "namespaces"
    monkeypatch.setattr(tool_sandbox, "_PROBED", Sandbox("namespaces", why=""))
    with pytest.raises(SandboxError, match=r"sandbox here is namespaces \(no landlock, seccomp\)"):
        code_tool.choose_sandbox("auto", require_isolation=True, layers=False)


@pytest.mark.skipif(not LINUX or ls.landlock_abi() < 6, reason="needs a kernel with Landlock ABI 6 or later")
@pytest.mark.parametrize("abi", [0, 1, 3])
def test_an_older_kernel_gets_what_it_has(monkeypatch, abi):
    """A kernel reporting an older ABI (or none): the line says so and the calls confine themselves with just that;
    what ABI 1 has (files) still holds, what it lacks (signal scoping, ABI 6) does not."""
    monkeypatch.setattr(ls, "landlock_abi", lambda: abi)
    monkeypatch.setattr(tool_sandbox, "_PROBED", Sandbox("fallback-root" if os.geteuid() == 0 else "fallback-user"))
    folder = Path(tempfile.mkdtemp(prefix="rstar2-abi-"))  # (readable by nobody, unlike pytest's tmp_path as root)
    folder.chmod(0o755)
    secret = folder / "config.yaml"
    secret.write_text("key\n")
    secret.chmod(0o644)
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, folder, True)
        t = stack.enter_context(CodeTool(workers=1, preload=("math", "socket")))
        assert t.layers == ls.describe(abi, ls.seccomp_available())
        read = t.run(f"print(open({str(secret)!r}).read(), end='')")
        assert (read.stdout == "key\n") == (abi == 0), read
        signal = t.run("import os, signal\nos.kill(os.getppid(), 0)\nprint('reached')")  # the server, outside
        assert (signal.stdout == "reached\n") == (os.geteuid() != 0), signal  # (nobody cannot signal root anyway)
        assert t.run("import socket\nsocket.socket()").status == ("error" if ls.seccomp_available() else "ok")
