"""Which sandbox this machine gives the code tool (code_tool.py), and saying so: the mode (worker servers in their
own namespaces, servers without them, or a new interpreter per call), the kernel layers it adds (Landlock, seccomp:
sandbox/landlock_seccomp.py), the one line that tells the user what the model's code can reach, and the refusal
when `require_isolation` asks for more than the machine has. What each mode protects: sandbox/README.md."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace

from sandbox import code_sandbox, landlock_seccomp
from sandbox.code_sandbox import SCRATCH_MB

BACKENDS = ("auto", "servers", "subprocess")  # CodeTool(backend=...), config field tool_backend
SANDBOX_PY = os.path.abspath(code_sandbox.__file__)


@dataclass(frozen=True)
class Sandbox:
    """Where a CodeTool runs the model's code on this machine (the module docstring's modes)."""
    mode: str  # namespaces | fallback-root | fallback-user | subprocess
    prefix: tuple = ()  # the command each server starts under (unshare ...); () without namespaces
    scratch_mb: int = 0  # call directories on a tmpfs of this size; 0: on disk, capped per file
    why: str = ""  # why a less isolated mode is used
    landlock: int = 0  # the Landlock ABI each call confines itself with (0: none)
    seccomp: bool = False  # whether each call runs under the seccomp filter

    @property
    def name(self) -> str:
        """The mode and its kernel layers: "namespaces+landlock(v7)+seccomp", "subprocess", ..."""
        return "+".join(filter(None, [self.mode, landlock_seccomp.describe(self.landlock, self.seccomp)]))

    def line(self) -> str:
        """One line for the user: the mode, its layers, and what the model's code can reach here."""
        root = hasattr(os, "geteuid") and os.geteuid() == 0
        spaced = self.mode == "namespaces"
        who = {"fallback-root": "nobody", "fallback-user": "your user"}.get(
            self.mode, ("root" if self.mode == "subprocess" else "nobody") if root else "your user")
        text = [] if spaced or self.mode == "subprocess" else ["no namespaces"]
        text.append(("a new Python per call, slower: " if self.mode == "subprocess" else "") + f"code runs as {who}"
                    + (" in its own PID, mount and network namespaces" if spaced else ""))
        files = {"nobody": "world-writable files writable", "root": "every file writable"}.get(who, "your files writable")
        text.append("reads only the Python install and system libraries, writes only its call directory"
                    if self.landlock else files)
        if not spaced:
            text.append("no sockets" if self.seccomp else "no TCP (UDP OPEN)" if self.landlock >= 4 else "network OPEN")
        yours = f"your processes (the {'caller' if self.mode == 'subprocess' else 'trainer'} too)"
        if spaced:
            text.append("no network, the caller's processes out of reach")
        elif self.landlock >= 6:
            text.append("no signals to other processes, nor their /proc")
        elif self.landlock:
            text.append("no /proc of other processes" + ("" if who == "nobody" else f"; {yours} within reach of signals"))
        else:
            text.append("other users' processes visible" if who == "nobody" else f"{yours} and their environments within reach")
        text.append("ptrace, mount, bpf and other risky system calls refused" if self.seccomp else "no seccomp")
        text.append(f"call files on a {self.scratch_mb} MB tmpfs" if self.scratch_mb else
                    "call files on disk, capped per file")
        why = f"; {self.why}" if self.why else ""
        return f"code tool sandbox: {self.name} ({'; '.join(text)}){why}"

    def isolated(self) -> str:
        """Why this is not the full set require_isolation asks for ("" when it is): namespaces, Landlock and
        seccomp."""
        missing = [("namespaces" if self.mode != "namespaces" else ""), ("" if self.landlock else "landlock"),
                   ("" if self.seccomp else "seccomp")]
        return ", ".join(filter(None, missing))


class SandboxError(ValueError):
    """The sandbox asked for (backend, require_isolation) is not available here."""


_PROBED: Sandbox | None = None  # the servers' sandbox on this machine, probed once per process
_ANNOUNCED: set[str] = set()  # sandbox lines already printed by this process


def servers_missing() -> str:
    """Why the worker servers cannot run here ("" where they can): they need os.fork, os.pidfd_open
    and os.memfd_create (Linux 5.3 or later)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return f"no worker servers on {sys.platform}"
    try:
        os.close(os.pidfd_open(os.getpid()))
        os.close(os.memfd_create("probe"))
    except (AttributeError, OSError) as exc:
        return f"no worker servers here (os.pidfd_open, os.memfd_create: {exc})"
    return ""


def probe_servers() -> Sandbox:
    """The servers' sandbox here: "namespaces" if `unshare` runs a server as init of new PID, mount
    and network namespaces (tried once per process), else "fallback-root" or "fallback-user"."""
    global _PROBED
    if _PROBED is None:
        user = [] if os.geteuid() == 0 else ["--user", "--map-current-user"]
        cmd = (shutil.which("unshare") or "unshare", *user, "--pid", "--fork", "--kill-child",
               "--mount-proc", "--net")
        fallback = "fallback-root" if os.geteuid() == 0 else "fallback-user"
        base = tempfile.mkdtemp(prefix="codetool-probe-")
        try:
            done = subprocess.run([*cmd, sys.executable, SANDBOX_PY, "--probe", base],
                                  capture_output=True, text=True, timeout=30)
            found = json.loads(done.stdout) if done.returncode == 0 else {}
            if found.get("pid") == 1:
                error = found["scratch_error"]
                why = f"no tmpfs for the call files: {error}" if error else ""
                _PROBED = Sandbox("namespaces", cmd, 0 if error else SCRATCH_MB, why)
            else:
                error = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
                _PROBED = Sandbox(fallback, why=f"unshare failed: {error}")
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            _PROBED = Sandbox(fallback, why=f"unshare failed: {exc}")
        finally:
            shutil.rmtree(base, ignore_errors=True)
    return _PROBED


def choose_sandbox(backend: str = "auto", require_isolation: bool = False, layers: bool = True) -> Sandbox:
    """The sandbox a CodeTool(backend=backend) gets on this machine: the mode, and on Linux the kernel
    layers it has (sandbox/landlock_seccomp.py; layers=False: none, to measure their cost). Raises
    SandboxError (one line) for an unknown backend, "servers" where they cannot run, and
    require_isolation without all of namespaces, Landlock and seccomp."""
    if backend not in BACKENDS:
        raise SandboxError(f"tool_backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    missing = servers_missing()
    if backend == "servers" and missing:
        raise SandboxError(f"tool_backend=servers: {missing}; use auto or subprocess")
    if backend == "subprocess" or missing:
        sandbox = Sandbox("subprocess", why=missing or "chosen with tool_backend=subprocess")
    else:
        sandbox = probe_servers()
    if layers and sys.platform.startswith("linux"):
        sandbox = replace(sandbox, landlock=landlock_seccomp.landlock_abi(),
                          seccomp=landlock_seccomp.seccomp_available())
    if require_isolation and (lacking := sandbox.isolated()):
        why = f"{sandbox.why}; " if sandbox.why else ""
        raise SandboxError(f"tool_require_isolation is set, but the code tool's sandbox here is {sandbox.name} "
                           f"({why}no {lacking}), not namespaces+landlock+seccomp")
    return sandbox


def announce(sandbox: Sandbox) -> str:
    """Print the sandbox's line on stderr, once per process; return it."""
    line = sandbox.line()
    if line not in _ANNOUNCED:
        _ANNOUNCED.add(line)
        print(line, file=sys.stderr, flush=True)
    return line
