"""The code tool as a boundary (sandbox/landlock_seccomp.py, code_tool.py's modes): one test per hostile act of model code
against the user's files, the trainer's process, the network and the kernel, in every mode this machine can make:
the worker servers in namespaces, the servers without them (the fallback, forced) and the subprocess backend, each as
the caller (root, in CI) and, where the caller is root, as an unprivileged user (nobody) who holds the tool for its
whole life (tests/tool_user.py: that process is then the trainer). A hostile call must fail with the tool's result
saying so, change nothing outside the call's own directory, and leave the tool answering the next call; legitimate
calls keep working. A test that needs a layer the kernel lacks skips, saying which (the sandbox line names the
layers that hold)."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from plumbing import tool_sandbox
from code_tool import CodeTool, Sandbox, ToolResult
from protocol import last_line

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
TIMEOUT = 20.0  # generous: the legitimate calls import numpy and sympy from disk, on a loaded machine
SECRET = "rstar2-test-secret-7f3a"  # in the stand-in key and config files, and in the user trainer's environment
MODES = ("namespaces", "fallback", "subprocess", "namespaces-nobody", "fallback-nobody", "subprocess-nobody")
SYSCALL_NUMBERS = {  # from the kernel's tables (arch/x86/entry/syscalls/syscall_64.tbl, asm-generic/unistd.h)
    "x86_64": {"clone": 56, "bpf": 321, "perf_event_open": 298, "keyctl": 250, "io_uring_setup": 425},
    "aarch64": {"clone": 220, "bpf": 280, "perf_event_open": 241, "keyctl": 219, "io_uring_setup": 425},
}


def install_hidden_from_nobody() -> bool:
    """Whether uid nobody cannot reach the Python install (e.g. pyenv's under root's 0700 home): then the fallback as
    root gives its calls only the modules the server holds (code_tool.py's documented gap)."""
    parts = Path(os.path.realpath(sys.base_prefix)).parts
    return any(not os.stat(Path(*parts[:i])).st_mode & 0o001 for i in range(2, len(parts) + 1))


HIDDEN = install_hidden_from_nobody()
PRELOAD = ("math", "socket")  # (socket: for the fallback as root where the install is hidden)


class UserTool:
    """tests/tool_user.py, started as root and held by uid nobody: the CodeTool calls a test needs."""

    def __init__(self, backend: str, mode: str):
        self.proc = subprocess.Popen(
            ["unshare", "--mount", sys.executable, str(ROOT / "tests" / "tool_user.py"), str(NOBODY), backend, mode,
             str(TIMEOUT)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "RSTAR2_TEST_SECRET": SECRET})
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"tests/tool_user.py did not start (exit code {self.proc.wait()}; see its stderr)")
        info = json.loads(hello)
        self.pid, self.sandbox, self.sandbox_line = info["pid"], info["sandbox"], info["line"]

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def run(self, code: str, stdin: str = "") -> ToolResult:
        return ToolResult(**self.ask({"code": code, "stdin": stdin}))

    def signals(self) -> int:
        return self.ask({"signals": True})["signals"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


@dataclass
class World:
    mode: str  # one of MODES
    tool: object  # a CodeTool, or a UserTool
    uid: int  # who owns the files below, and holds the tool
    home: Path  # the user's home: .bashrc, .ssh/id_ed25519
    run: Path  # a run folder: config.yaml, checkpoint.pt
    trainer: int  # the process holding the tool
    signals: object  # () -> SIGUSR2 the trainer has received

    @property
    def layers(self) -> set:
        """The kernel layers the tool's sandbox line names ({"landlock(v7)", "seccomp"})."""
        return set(self.tool.sandbox_line.split()[3].split("+")[1:])

    @property
    def namespaced(self) -> bool:
        return self.tool.sandbox == "namespaces"

    def needs(self, *layers: str) -> None:
        have = {layer.split("(")[0] for layer in self.layers}
        if missing := [layer for layer in layers if layer not in have]:
            pytest.skip(f"no {' or '.join(missing)} here ({self.tool.sandbox_line})")


def user_files(base: Path, uid: int) -> tuple[Path, Path]:
    """A home (0755, as on many systems; .ssh 0700 with a 0600 key) and a world-readable run folder, owned by uid."""
    home, run = base / "home", base / "run"
    (home / ".ssh").mkdir(parents=True)
    run.mkdir()
    files = {home / ".bashrc": ("export PATH\n", 0o644), home / ".ssh" / "id_ed25519": (f"key {SECRET}\n", 0o600),
             run / "config.yaml": (f"wandb_key: {SECRET}\n", 0o644), run / "checkpoint.pt": ("weights\n", 0o644)}
    for path, (text, mode) in files.items():
        path.write_text(text)
        path.chmod(mode)
    (home / ".ssh").chmod(0o700)
    for path in [base, *base.rglob("*")]:
        os.chown(path, uid, uid)
    base.chmod(0o755)
    return home, run


@pytest.fixture(scope="module", params=MODES)
def world(request):
    mode = request.param
    backend = "subprocess" if mode.startswith("subprocess") else "servers"
    base = Path(tempfile.mkdtemp(prefix="rstar2-world-"))
    tool = None
    try:
        if mode.endswith("-nobody"):
            if os.geteuid() != 0 or not shutil.which("unshare"):
                pytest.skip("an unprivileged uid for the tool's whole life needs a root caller (and unshare)")
            home, run = user_files(base, NOBODY)
            tool = UserTool(backend, "fallback" if mode.startswith("fallback") else "probe")
            uid, trainer, signals = NOBODY, tool.pid, tool.signals
        else:
            home, run = user_files(base, os.geteuid())
            received = []
            previous = signal.signal(signal.SIGUSR2, lambda *_: received.append(1))
            request.addfinalizer(lambda: signal.signal(signal.SIGUSR2, previous))
            with pytest.MonkeyPatch.context() as patch:
                if mode == "fallback":
                    root = os.geteuid() == 0
                    patch.setattr(tool_sandbox, "_PROBED", Sandbox("fallback-root" if root else "fallback-user",
                                                                why="unshare failed: (test)"))
                tool = CodeTool(workers=1, timeout=TIMEOUT, preload=PRELOAD, backend=backend)
            uid, trainer, signals = os.geteuid(), os.getpid(), lambda: len(received)
        if mode.startswith("namespaces") and tool.sandbox != "namespaces":
            pytest.skip(f"no namespaces here: {tool.sandbox_line}")
        yield World(mode, tool, uid, home, run, trainer, signals)
    finally:
        if tool is not None:
            tool.close()
        shutil.rmtree(base, ignore_errors=True)


def snapshot(*dirs: Path) -> dict:
    """Every entry below dirs: mode, owner, size, modification time and content."""
    entries = {}
    for top in dirs:
        for path in [top, *sorted(top.rglob("*"))]:
            st = path.lstat()
            entries[str(path)] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns,
                                  path.read_bytes() if path.is_file() else None)
    return entries


def hostile(world: World, code: str, errors: tuple = ("PermissionError",)) -> ToolResult:
    """Run code that must fail: its result says so (an error whose last line names one of errors), the user's files
    are as they were, and the tool answers the next call."""
    before = snapshot(world.home, world.run)
    result = world.tool.run(code)
    assert result.status == "error" and last_line(result.stderr).startswith(errors), result
    assert snapshot(world.home, world.run) == before
    assert world.tool.run("print(6 * 7)").stdout == "42\n"
    return result


def test_the_tool_runs_as_the_mode_says(world):
    uid = world.tool.run("import os\nprint(os.getuid())").stdout
    runs_as = world.uid if world.mode.endswith("nobody") or world.uid != 0 or world.mode == "subprocess" else NOBODY
    assert uid == f"{runs_as}\n"


# ----------------------------------------------------------------------------------- the user's files
FILE_ACTS = {
    "write": "open({path!r}, 'a').write('pwned')",
    "create": "open({folder!r} + '/new.txt', 'w').write('pwned')",
    "delete": "import os\nos.remove({path!r})",
    "rename": "import os\nos.rename({path!r}, {path!r} + '.moved')",
    "truncate": "import os\nos.truncate({path!r}, 0)",
    "chmod": "import os\nos.chmod({path!r}, 0o777)",
    "touch": "import os\nos.utime({path!r}, (0, 0))",
}


@pytest.mark.parametrize("place", ["home", "run folder"])
@pytest.mark.parametrize("act", FILE_ACTS)
def test_cannot_change_the_users_files(world, act, place):
    world.needs("landlock", "seccomp")
    path = world.home / ".bashrc" if place == "home" else world.run / "config.yaml"
    hostile(world, FILE_ACTS[act].format(path=str(path), folder=str(path.parent)))


@pytest.mark.parametrize("what", ["ssh key", "run config", "the project", "home listing"])
def test_cannot_read_the_users_files(world, what):
    world.needs("landlock")
    target = {"ssh key": world.home / ".ssh" / "id_ed25519", "run config": world.run / "config.yaml",
              "the project": ROOT / "README.md"}.get(what)
    code = f"print(open({str(target)!r}).read())" if target else f"import os\nprint(os.listdir({str(world.home)!r}))"
    result = hostile(world, code)
    assert SECRET not in result.stdout and ".bashrc" not in result.stdout


# ----------------------------------------------------------------------------------- the trainer's process
def test_cannot_read_the_trainers_environment(world):
    world.needs("landlock")
    # (in namespaces the trainer's pid does not exist for the code)
    errors = ("PermissionError", "FileNotFoundError") if world.namespaced else ("PermissionError",)
    result = hostile(world, f"print(open('/proc/{world.trainer}/environ').read())", errors)
    assert SECRET not in result.stdout and "PATH=" not in result.stdout
    hostile(world, "import os\nprint(os.listdir('/proc'))")  # nor list the processes


def test_cannot_signal_the_trainer(world):
    if not world.namespaced:
        world.needs("landlock(v6)") if "landlock(v6)" in world.layers else None
        if not any(layer.startswith("landlock(v") and int(layer[10:-1]) >= 6 for layer in world.layers):
            pytest.skip(f"signal scoping needs Landlock ABI 6 ({world.tool.sandbox_line})")
    before = world.signals()
    errors = ("PermissionError", "ProcessLookupError") if world.namespaced else ("PermissionError",)
    hostile(world, f"import os, signal\nos.kill({world.trainer}, signal.SIGUSR2)", errors)
    time.sleep(0.2)
    assert world.signals() == before


# ----------------------------------------------------------------------------------- the network
def test_cannot_connect_to_a_loopback_listener(world):
    world.needs("seccomp")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        hostile(world, f"import socket\nsocket.socket().connect(('127.0.0.1', {port}))")
        listener.settimeout(0.3)
        with pytest.raises(TimeoutError):
            listener.accept()


# ----------------------------------------------------------------------------------- the kernel
CALL = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\ndef check(result):\n    if result == -1:\n"
        "        errno = ctypes.get_errno()\n        raise OSError(errno, os.strerror(errno))\n    return result\n")
SYSCALLS = {  # harmless arguments; without the filter each gives a result or an error other than EPERM
    "ptrace": "check(libc.ptrace(2, os.getpid(), 0, 0))",  # PTRACE_PEEKDATA on itself: ESRCH
    "mount": "check(libc.mount(b'none', b'/nonexistent', b'tmpfs', 0, None))",  # ENOENT
    "unshare": "check(libc.unshare(0x10000000 | 0x00020000))",  # a user and a mount namespace: works
    "clone": "if check(libc.syscall({clone}, 0x10000000 | 17, 0, 0, 0, 0)) == 0:\n    os._exit(0)",  # CLONE_NEWUSER
    "bpf": "check(libc.syscall({bpf}, 9999, 0, 0))",  # an unknown command: EINVAL
    "perf_event_open": "check(libc.syscall({perf_event_open}, 0, 0, -1, -1, 0))",  # EFAULT
    "keyctl": "check(libc.syscall({keyctl}, 9999, 0, 0, 0, 0))",  # EOPNOTSUPP
    "io_uring_setup": "check(libc.syscall({io_uring_setup}, 1, 0))",  # EFAULT
    "personality": "check(libc.personality(0x0008))",  # PER_LINUX32: works
}


@pytest.mark.parametrize("name", SYSCALLS)
def test_risky_system_calls_are_refused(world, name):
    world.needs("seccomp")
    numbers = SYSCALL_NUMBERS.get(os.uname().machine)
    if numbers is None:
        pytest.skip(f"no system-call numbers for {os.uname().machine} in this test")
    result = hostile(world, CALL + SYSCALLS[name].format(**numbers))
    assert "[Errno 1]" in last_line(result.stderr)  # EPERM, from the filter


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
def test_no_file_outlives_the_call_in_a_shared_directory(world, where):
    world.needs("landlock")
    leak = Path(where) / f"rstar2-leak-{os.getpid()}-{world.mode}"
    code = f"open({str(leak)!r}, 'w').write('x')\nprint('written')"
    try:
        if where == "/dev/shm" and world.namespaced:  # the server's own /dev/shm, emptied after every call
            assert world.tool.run(code).stdout == "written\n"
            assert world.tool.run("import os\nprint(os.listdir('/dev/shm'))").stdout == "[]\n"
        else:
            hostile(world, code)
        assert not leak.exists()
    finally:
        leak.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------- what keeps working
LEGITIMATE = {  # name: (code, stdin, what it prints)
    "numpy and sympy": ("import numpy, sympy\nx = sympy.Symbol('x')\nprint(numpy.linalg.det(numpy.eye(3)), "
                        "sympy.solve(x**2 - 4, x))", "", "1.0 [-2, 2]\n"),
    "stdin": ("print(int(input()) * 2)", "21\n", "42\n"),
    "scratch files": ("import os, shutil, tempfile\nos.makedirs('a/b')\nopen('a/b/f.txt', 'w').write('hi')\n"
                      "os.rename('a/b/f.txt', 'a/g.txt')\nwith tempfile.NamedTemporaryFile('w+') as f:\n"
                      "    f.write('t')\n    f.seek(0)\n    t = f.read()\nprint(open('a/g.txt').read(), t, "
                      "sorted(os.listdir('a')))\nshutil.rmtree('a')", "", "hi t ['b', 'g.txt']\n"),
    "threads and fork": ("import os, threading\nthreading.Thread(target=print, args=('thread',)).start()\n"
                         "pid = os.fork()\nif pid == 0:\n    os._exit(3)\nprint(os.waitstatus_to_exitcode("
                         "os.waitpid(pid, 0)[1]))", "", "thread\n3\n"),
    "a Python subprocess": ("import subprocess, sys\nprint(subprocess.run([sys.executable, '-c', 'print(7)'], "
                            "capture_output=True, text=True).stdout, end='')", "", "7\n"),
    "multiprocessing": ("import multiprocessing as mp\nwith mp.Pool(2) as pool:\n    print(pool.map(abs, [-1, -2]))",
                        "", "[1, 2]\n"),
}


@pytest.mark.parametrize("name", LEGITIMATE)
def test_legitimate_calls_keep_working(world, name):
    code, stdin, shown = LEGITIMATE[name]
    if world.tool.sandbox == "fallback-root" and HIDDEN and name not in ("stdin", "scratch files"):
        pytest.skip("documented gap: the install is hidden from nobody and there is no mount namespace to show it")
    result = world.tool.run(code, stdin)
    if name == "multiprocessing" and world.layers and not world.namespaced:
        # documented: its locks need /dev/shm, which only a namespaced server gives a call (a private one)
        assert result.status == "error" and last_line(result.stderr).startswith("PermissionError"), result
        return
    assert (result.status, result.stdout) == ("ok", shown), result
