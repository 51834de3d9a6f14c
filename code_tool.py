"""The model's only tool, `execute_python_code_with_standard_io(code, input)` (report §2 and §3).

Each call runs `code` in a fresh interpreter state with `input` on stdin and returns what a notebook
shows: stdout; if nothing was printed and the code ends in a bare expression other than None, that
value's repr (`x = 1` shows nothing); on error the traceback, cut to the frames of the model's code.
`ToolResult.render()` is the text the model reads (protocol.render_result): the status word, a newline,
then stdout and stderr cut in the middle ("ok\\n4\\n" for `print(2+2)`); with `error_format="last_line"` a
failed call shows only the exception line of its traceback. The caller parses the code once, to
route it and to find the expression a notebook echoes.

Two backends behind one interface (`submit`, `run`, `run_batch`, a context manager, the same `ToolResult`s,
timeouts and output caps); `backend="auto"` picks "servers" where os.fork, os.pidfd_open and os.memfd_create work
(Linux), else "subprocess":
- "servers" (Linux): the report's separate code service, on one machine: W worker servers (sandbox/code_sandbox.py)
  import numpy, sympy, ... once and fork a child per call; the caller talks to all of them from one thread (_Pool).
  Half preload only the standard library, for calls that import nothing else (`needs_heavy`).
- "subprocess" (any platform): a new interpreter per call, watched by one of W threads of the caller
  (_Subprocesses); less isolated, and the tool says so once on stderr when it is chosen.

Sandbox modes (`CodeTool.sandbox`; `CodeTool.sandbox_line` says it in one line, e.g.
"namespaces+landlock(v7)+seccomp"; train.py and eval.py print it and save it as sandbox.txt in their run folder):
"namespaces" (each server in its own PID, mount and network namespace), "fallback-root" and "fallback-user"
(servers without a usable `unshare`), "subprocess". Every mode has the timeout, the output cap, a fresh directory
per call and an environment with only PATH, PYTHONPATH and LD_LIBRARY_PATH; every Linux mode adds Landlock and
seccomp where the kernel has them (sandbox/landlock_seccomp.py). `require_isolation=True` refuses to start unless
the mode is "namespaces" with both kernel layers. What each mode protects, and what none does: the sandbox's full
specification, sandbox/README.md.

Demo: `.venv/bin/python code_tool.py [subprocess]`. Tests: tests/test_code_tool.py, and the hostile calls per mode,
as root and as nobody, tests/test_code_tool_boundary.py. Benchmark: bench/code_tool.py.
"""
from __future__ import annotations

import ast
import contextlib
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from protocol import ERROR_FORMATS, render_result
from sandbox import code_sandbox
from sandbox import landlock_seccomp
from sandbox.code_sandbox import PRELOAD, SCRATCH_MB

BACKENDS = ("auto", "servers", "subprocess")  # CodeTool(backend=...), config field tool_backend
REPLY_GRACE_S = 10.0  # a server is dead when no reply comes this long after the call's timeout
READY_TIMEOUT_S = 120.0  # how long a starting server may take to import PRELOAD
LIGHT_HELP_AFTER_S = 0.1  # a light call running longer is "slow": heavy servers may then help
POLL_S = 0.005  # subprocess backend: how often the running calls' deadlines and outputs are checked
ENV_KEPT = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "SYSTEMROOT")  # the caller's, kept for calls
SANDBOX_PY = os.path.abspath(code_sandbox.__file__)
# a subprocess-backend call: imported, not run as a script, so that its compiled bytecode is reused
RUN_ONCE = (f"import sys; sys.path[0] = {os.path.dirname(SANDBOX_PY)!r}; import code_sandbox; "
            "code_sandbox.run_once(sys.argv[1])")


@dataclass
class ToolResult:
    status: str  # one of code_sandbox.STATUSES
    stdout: str = ""  # what the code printed (bad bytes replaced), or its echoed last expression
    stderr: str = ""  # what it wrote to stderr, then the compact traceback or why it was stopped
    elapsed: float = 0.0  # seconds the call ran (servers: from the fork; subprocess: from Popen)
    max_chars: int = field(default=1000, repr=False)  # render()'s default cut: max_output_chars
    error_format: str = field(default="full", repr=False)  # render()'s default: the tool's error_format

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def render(self, max_chars: int | None = None, error_format: str | None = None) -> str:
        """Text the model sees: the status word on the first line, then stdout, then stderr, cut in the middle to
        max_chars (protocol.render_result, with the markup: "ok\\n4\\n" for `print(2+2)`)."""
        return render_result(self, max_chars, error_format)


def parse(code: str) -> ast.Module | None:
    """The code's syntax tree, or None where it does not parse: the call child then compiles it and
    reports the SyntaxError (or the ValueError of a null byte, the RecursionError of deep nesting)
    as the code's error."""
    try:
        return ast.parse(code)
    except Exception:
        return None


def needs_heavy(code: str, tree: ast.Module | None) -> bool:
    """Whether a call should go to a server with the third-party PRELOAD modules (numpy, sympy):
    True when the code imports anything outside the standard library, or imports dynamically. tree:
    parse(code); code that does not parse is light (it fails at once anywhere). A wrong guess only
    costs time: a light server imports what it must."""
    if "__import__" in code or "importlib" in code:
        return True
    for node in ast.walk(tree) if tree else ():
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        if any(name.split(".")[0] not in sys.stdlib_module_names for name in names):
            return True
    return False


def echo_span(code: str, tree: ast.Module | None) -> list[int] | None:
    """Where the expression a notebook echoes sits in code: [start, end, line] (character offsets
    and line number) when the last top-level statement is a bare expression, else None. tree:
    ast.parse(code), None where code does not parse (the child compiles it and reports the
    SyntaxError). Runs in the caller, which parses anyway."""
    if tree is None or not tree.body or not isinstance(last := tree.body[-1], ast.Expr):
        return None
    # where each line starts, as Python counts lines
    starts = [0] + [m.end() for m in re.finditer(r"\r\n?|\n", code)]

    def offset(line: int, byte_col: int) -> int:  # ast's columns count UTF-8 bytes
        begin = starts[line - 1]
        return begin + len(code[begin:begin + byte_col].encode()[:byte_col].decode())
    start, end = offset(last.lineno, last.col_offset), offset(last.end_lineno, last.end_col_offset)
    return [start, end, last.lineno]


def default_workers() -> int:
    """Four servers per core: calls that sleep, or burn a core until their timeout, leave the others
    work to do; each warm server holds about 70 MB (numpy + sympy)."""
    return 4 * (os.cpu_count() or 1)


# --------------------------------------------------------------------- which sandbox, and saying so
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


# ------------------------------------------------------------------------------ the servers backend
class WorkerDied(Exception):
    """A worker server exited, broke the protocol or stopped answering."""


class _Server:
    """One worker server process and its pipes, driven by the pool (_Pool). Its state: "starting"
    (the ready line is due by `deadline`), "idle", "busy" (on `future`, whose answer is due by
    `deadline`, since `since`), "failed" (a send failed; the pool's thread restarts it) or "down"
    (to start again at `deadline`)."""

    def __init__(self, cmd: list[str], env: dict, namespaced: bool, kind: str = "heavy"):
        self.cmd, self.env, self.namespaced = cmd, env, namespaced
        self.kind = kind  # which calls it takes: "light" or "heavy"
        self.proc, self.buf, self.base = None, b"", None
        self.state, self.future, self.error = "down", None, None
        self.deadline, self.since = 0.0, 0.0

    def start(self) -> None:
        # the call directories' parent: covered by a tmpfs where the server has a mount namespace
        self.base = tempfile.mkdtemp(prefix="codetool-")
        os.chmod(self.base, 0o711)  # nobody may enter its call directory, not list the others
        self.proc = subprocess.Popen([*self.cmd, self.base], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=self.env,
                                     start_new_session=True)  # a Ctrl-C to the caller stays here
        self.buf, self.state, self.deadline = b"", "starting", time.monotonic() + READY_TIMEOUT_S

    def send(self, request: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:
            raise WorkerDied(f"cannot send: {exc}") from exc

    def read(self) -> list[dict]:
        """The whole lines the server wrote since the last read; call when its pipe is readable."""
        if not (chunk := os.read(self.proc.stdout.fileno(), 1 << 20)):
            raise WorkerDied(f"exited with {self.proc.wait()}")
        *lines, self.buf = (self.buf + chunk).split(b"\n")
        try:
            return [json.loads(line) for line in lines]
        except ValueError as exc:
            raise WorkerDied(f"broke the protocol: {exc}") from exc

    def wait_ready(self) -> None:
        """Block until the ready line (at start-up, before the pool's thread runs)."""
        poller = select.poll()
        poller.register(self.proc.stdout.fileno(), select.POLLIN)
        while self.state == "starting":
            if (left := self.deadline - time.monotonic()) <= 0 or not poller.poll(left * 1000 + 1):
                raise WorkerDied("not ready in time")
            if any(reply.get("ready") for reply in self.read()):
                self.state = "idle"

    def stop(self) -> None:
        """End the server and all below it (SIGKILL to unshare takes the namespace down)."""
        if self.proc is not None:
            if not self.namespaced and self.proc.poll() is None:
                self.proc.terminate()  # the server kills its call's process tree on the way out
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(2)
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError):
                    pipe.close()
            shutil.rmtree(self.base, ignore_errors=True)
        self.proc, self.state = None, "down"


def pick_lane(kind: str, queued: dict[str, int], idle_light: int, light_ages: list[float],
              cores: int, help_after: float) -> str | None:
    """The queue an idle server of this kind takes its next call from, if any. A light server takes
    light calls; a heavy one takes heavy calls first, and light calls only when no light server is
    idle and fewer than `cores` light servers are on calls younger than help_after seconds
    (light_ages: how long each busy light server has been on its call). A heavy server's fork costs
    a trivial call about twice the CPU of a light one, so it helps only where a core may be free:
    enough quick light servers keep every core busy at half the price."""
    if kind == "heavy" and queued["heavy"]:
        return "heavy"
    quick = sum(age < help_after for age in light_ages)
    if queued["light"] and (kind == "light" or (idle_light == 0 and quick < cores)):
        return "light"
    return None


class _Pool:
    """The servers and the calls queued for them, driven by one thread (run()): it reads every
    answer, hands the next calls out, enforces reply deadlines and restarts dead servers. submit()
    gives a call straight to an idle server from the caller's thread. One thread for all servers,
    not one each: fewer thread switches and GIL hand-offs in the caller per call."""

    def __init__(self, servers: list[_Server], limits: dict, max_chars: int, help_after: float,
                 cores: int, error_format: str = "full"):
        self.servers, self.limits, self.max_chars = servers, limits, max_chars
        self.error_format = error_format
        self.help_after, self.cores = help_after, cores
        self.lock, self.closed = threading.Lock(), False
        self.queues = {"light": deque(), "heavy": deque()}
        self.wake_r, self.wake_w = os.pipe()  # close(), failed sends, waiting light calls wake it
        os.set_blocking(self.wake_w, False)
        self.sleep_until = 0.0  # when the thread wakes at the latest
        self.thread = threading.Thread(target=self.run, daemon=True, name="code-tool")

    def _hand_out(self) -> list[tuple[_Server, dict]]:
        """Under the lock: give queued calls to idle servers (light servers first), marking them
        busy."""
        given, now = [], time.monotonic()
        for server in sorted(self.servers, key=lambda s: s.kind != "light"):
            while server.state == "idle":
                light = [s for s in self.servers if s.kind == "light"]
                lane = pick_lane(server.kind, {k: len(q) for k, q in self.queues.items()},
                                 sum(s.state == "idle" for s in light if s is not server),
                                 [now - s.since for s in light if s.state == "busy"], self.cores,
                                 self.help_after)
                if lane is None:
                    break
                request, future = self.queues[lane].popleft()
                if future.set_running_or_notify_cancel():
                    server.state, server.future, server.since = "busy", future, now
                    server.deadline = now + self.limits["timeout"] + REPLY_GRACE_S
                    given.append((server, request))
        return given

    def _send(self, given: list[tuple[_Server, dict]]) -> None:
        """Outside the lock: send each call to its server; a failed send leaves the restart to the
        pool's thread."""
        for server, request in given:
            try:
                server.send({**request, **self.limits})
            except WorkerDied as exc:
                with self.lock:
                    server.state, server.error = "failed", exc
                self._wake()

    def submit(self, lane: str, request: dict, future: Future) -> None:
        with self.lock:
            if self.closed:
                raise RuntimeError("CodeTool is closed")
            self.queues[lane].append((request, future))
            given = self._hand_out()
            # a light call left waiting with a heavy server idle: the thread must wake when a light
            # call turns slow
            helps = [s.since + self.help_after for s in self.servers
                     if s.kind == "light" and s.state == "busy"]
            heavy_idle = any(s.kind == "heavy" and s.state == "idle" for s in self.servers)
            wake = lane == "light" and self.queues["light"] and heavy_idle and \
                min(helps, default=0.0) < self.sleep_until
        self._send(given)
        if wake:
            self._wake()

    def _wake(self) -> None:
        with self.lock, contextlib.suppress(BlockingIOError):  # (a full pipe wakes it anyway)
            if self.wake_w is not None:  # (None: the thread has ended)
                os.write(self.wake_w, b"x")

    def _close_wake(self) -> None:
        with self.lock:
            os.close(self.wake_r)
            os.close(self.wake_w)
            self.wake_r = self.wake_w = None

    def _crash(self, future: Future | None, why: str) -> None:
        if future is not None and not future.done():
            future.set_result(ToolResult("crash", "", why, 0.0, self.max_chars, self.error_format))

    def _restart(self, server: _Server, exc: Exception) -> None:
        """The pool's thread: the server died or hung; its call fails, a new server starts in its
        slot."""
        with self.lock:
            future, server.future = server.future, None
        self._crash(future, f"worker failed: {exc}\n")
        server.stop()
        try:
            server.start()
        except OSError:
            server.deadline = time.monotonic() + 0.5  # try again soon (state "down")

    def run(self) -> None:
        poller, by_fd = select.poll(), {}
        poller.register(self.wake_r, select.POLLIN)
        while True:
            gone = [fd for fd, s in by_fd.items() if s.proc is None or s.proc.stdout.fileno() != fd]
            for fd in gone:
                poller.unregister(fd)
                del by_fd[fd]
            for server in self.servers:
                if server.proc is not None and server.proc.stdout.fileno() not in by_fd:
                    by_fd[server.proc.stdout.fileno()] = server
                    poller.register(server.proc.stdout.fileno(), select.POLLIN)
            with self.lock:
                if self.closed:
                    break
                given = self._hand_out()
                now = time.monotonic()
                due = [s.deadline for s in self.servers if s.state in ("starting", "busy", "down")]
                if self.queues["light"]:  # when a heavy server may start helping
                    due += [s.since + self.help_after for s in self.servers
                            if s.kind == "light" and s.state == "busy"]
                # the next deadline or help time (1 s at most)
                wait = min([1.0] + [t - now for t in due if t > now])
                self.sleep_until = now + wait
            self._send(given)
            for fd, _ in poller.poll(wait * 1000):
                if fd == self.wake_r:
                    os.read(self.wake_r, 4096)
                    continue
                server = by_fd[fd]
                try:
                    replies = server.read()
                except WorkerDied as exc:
                    self._restart(server, exc)
                    continue
                for reply in replies:
                    with self.lock:
                        future, server.future = server.future, None
                        server.state = "idle"
                    # (callbacks run here, outside the lock)
                    if future is not None and not reply.get("ready"):
                        future.set_result(ToolResult(**reply, max_chars=self.max_chars,
                                                      error_format=self.error_format))
            now = time.monotonic()
            for server in self.servers:
                if server.state == "failed":
                    self._restart(server, server.error)
                elif server.state in ("busy", "starting") and now > server.deadline:
                    self._restart(server, WorkerDied("no reply in time"))
                elif server.state == "down" and now > server.deadline:
                    self._restart(server, WorkerDied("down"))
        for server in self.servers:  # closed: the calls still running fail, every server ends
            with self.lock:
                future, server.future = server.future, None
            self._crash(future, "code tool closed during the call\n")
            server.stop()
        self._close_wake()

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.servers if s.proc is not None]

    def close(self) -> None:
        """Refuse new calls, fail the queued and running ones, and end every server (close(), GC or
        exit)."""
        with self.lock:
            self.closed = True
            queued = [future for lane in self.queues.values() for _, future in lane]
            for lane in self.queues.values():
                lane.clear()
        for future in queued:  # (the running ones are the pool thread's to fail, as it stops)
            if future.set_running_or_notify_cancel():
                self._crash(future, "code tool closed before the call ran\n")
        if self.thread.is_alive():
            self._wake()
            if self.thread is not threading.current_thread():  # (a callback: ends after this round)
                self.thread.join()
        else:  # never started (start-up failed)
            for server in self.servers:
                server.stop()
            self._close_wake()


# --------------------------------------------------------------------------- the subprocess backend
def over(paths: list[str], cap: int) -> bool:
    """Whether a file of paths holds more than cap bytes."""
    with contextlib.suppress(OSError):
        return max(os.path.getsize(p) for p in paths) > cap
    return False


def head(path: str, size: int) -> bytes:
    """The first size bytes of a file (b"" if there is none)."""
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except FileNotFoundError:
        return b""


class _Subprocesses:
    """The portable backend: each call is a new interpreter running RUN_ONCE on a fresh CALL_DIR,
    started by one of `workers` daemon threads of the caller, which then waits for its exit. The
    call's stdin, stdout and stderr are files in CALL_DIR (no pipe can block, and any platform can
    read their sizes); one more thread (guard) kills the calls that pass their deadline or output
    cap. Then the call's process group is killed (POSIX) and the outcome described as the servers
    do (code_sandbox.describe)."""

    def __init__(self, workers: int, limits: dict, max_chars: int, env: dict,
                 error_format: str = "full", layers: dict | None = None):
        self.limits, self.max_chars, self.env = limits, max_chars, env
        self.layers = layers or {"landlock": 0, "seccomp": False, "roots": []}  # each call's confinement
        self.error_format = error_format
        self.lock, self.closed = threading.Lock(), False
        self.running = {}  # Popen -> {"deadline", "outputs" (paths), "reason" it was killed for}
        self.changed = threading.Condition(self.lock)  # a call started, or the backend closed
        self.queue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self.work, daemon=True, name="code-tool")
                        for _ in range(workers)]
        guard = threading.Thread(target=self.guard, daemon=True, name="code-tool-guard")
        for thread in self.threads + [guard]:
            thread.start()

    def submit(self, lane: str, request: dict, future: Future) -> None:
        """Queue one call (lane: unused, every call starts a fresh interpreter)."""
        with self.lock:
            if self.closed:
                raise RuntimeError("CodeTool is closed")
        self.queue.put((request, future))

    def work(self) -> None:
        while (item := self.queue.get()) is not None:
            request, future = item
            if future.set_running_or_notify_cancel():
                future.set_result(self.call(request))

    def call(self, request: dict) -> ToolResult:
        """Run one call in a fresh directory, removed afterwards; never raises."""
        call_dir = tempfile.mkdtemp(prefix="codetool-")
        try:
            fields = self.run_in(call_dir, request)
        except OSError as exc:  # no interpreter, no disk space, ...
            fields = {"status": "crash", "stdout": "", "stderr": f"code tool failed: {exc}\n"}
        finally:
            shutil.rmtree(call_dir, ignore_errors=True)
        return ToolResult(**fields, max_chars=self.max_chars, error_format=self.error_format)

    def run_in(self, call_dir: str, request: dict) -> dict:
        path = {name: os.path.join(call_dir, name)
                for name in ("request.json", "stdin", "stdout", "stderr", "status", "work")}
        os.mkdir(path["work"])
        with open(path["request.json"], "w", encoding="utf-8") as f:
            json.dump({"code": request["code"], "echo": request["echo"], **self.limits, **self.layers}, f)
        with open(path["stdin"], "wb") as f:
            f.write(request["stdin"].encode("utf-8", "surrogatepass"))
        work = path["work"]
        env = {**self.env, "HOME": work, "TMPDIR": work, "TEMP": work, "TMP": work}
        timeout, cap = self.limits["timeout"], self.limits["max_bytes"]
        with open(path["stdin"], "rb") as stdin, open(path["stdout"], "wb") as stdout, \
                open(path["stderr"], "wb") as stderr, self.lock:
            if self.closed:
                return {"status": "crash", "stdout": "",
                        "stderr": "code tool closed before the call ran\n"}
            start = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-c", RUN_ONCE, call_dir], stdin=stdin,
                                    stdout=stdout, stderr=stderr, cwd=work, env=env,
                                    start_new_session=True)  # (POSIX: its own process group)
            self.running[proc] = {"deadline": start + timeout, "reason": None,
                                  "outputs": [path["stdout"], path["stderr"]]}
            self.changed.notify()
        proc.wait()
        elapsed = time.monotonic() - start
        self.kill(proc)  # what it left in its group
        with self.lock:
            reason = self.running.pop(proc)["reason"]
        bufs = [head(path[name], cap + 1) for name in ("stdout", "stderr", "status")]
        if reason is None and max(len(b) for b in bufs[:2]) > cap:
            reason = "output_limit"
        if reason == "closed":
            return {"status": "crash", "stdout": "", "stderr": "code tool closed during the call\n",
                    "elapsed": elapsed}
        return {**code_sandbox.describe(reason, proc.returncode, bufs, timeout, cap),
                "elapsed": elapsed}

    def guard(self) -> None:
        """Every POLL_S while calls run: kill each call past its deadline or its output cap, noting
        why (its thread, waiting for the exit, takes it from there)."""
        with self.lock:
            while not self.closed:
                if not self.running:
                    self.changed.wait()
                    continue
                self.changed.wait(POLL_S)
                now = time.monotonic()
                for proc, call in self.running.items():
                    if call["reason"] is None and now >= call["deadline"]:
                        call["reason"] = "timeout"
                    elif call["reason"] is None and over(call["outputs"], self.limits["max_bytes"]):
                        call["reason"] = "output_limit"
                    else:
                        continue
                    self.kill(proc)

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        """SIGKILL the call's process group: the interpreter and what it started without leaving the
        group (a group outlives its leader while a member lives, and its id is not reused before).
        Windows: the interpreter only."""
        with contextlib.suppress(OSError):
            if hasattr(os, "killpg"):
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()

    def pids(self) -> list[int]:
        with self.lock:
            return [proc.pid for proc in self.running]

    def close(self) -> None:
        """Refuse new calls, kill the running ones; queued ones end as "crash" without running."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            for proc, call in self.running.items():
                call["reason"] = "closed"
                self.kill(proc)
            self.changed.notify()
        for _ in self.threads:
            self.queue.put(None)


# ----------------------------------------------------------------------------------------- the tool
class CodeTool:
    """`execute_python_code_with_standard_io` calls on one of two backends; see the module
    docstring.

    workers: calls running at once (default_workers()); timeout: wall-clock seconds per call;
    memory_mb: address space a call may add to the interpreter's (servers: a warm one; subprocess: a
    fresh one); max_output_chars: ToolResult.render()'s default cut; error_format: its default
    form of a failed call (ERROR_FORMATS: the "full" traceback or its "last_line"); max_output_bytes: bytes read
    per stream before the call is killed as "output_limit"; preload: modules each server imports
    once; light_workers: how many servers preload only its standard-library part (default half of
    them, when preload has more than that and workers >= 2). Calls that import nothing beyond the
    standard library (`needs_heavy`) go to those: forking a server without numpy and sympy costs
    about half. Heavy servers help with them only while fewer light servers than cores are on quick
    calls (see pick_lane). backend: "auto", "servers" or "subprocess" (BACKENDS); require_isolation:
    refuse to start (SandboxError) without all of namespaces, Landlock and seccomp; kernel_layers=False:
    no Landlock and no seccomp (to measure what they cost; the sandbox line says so)."""

    def __init__(self, workers: int | None = None, timeout: float = 4.0, memory_mb: int = 512,
                 max_output_chars: int = 1000, max_output_bytes: int = 1 << 20,
                 preload: tuple = PRELOAD, light_workers: int | None = None, backend: str = "auto",
                 require_isolation: bool = False, error_format: str = "full", kernel_layers: bool = True):
        if error_format not in ERROR_FORMATS:
            raise ValueError(f"error_format must be one of {ERROR_FORMATS}, got {error_format!r}")
        self.workers, self.timeout = workers or default_workers(), timeout
        sandbox = choose_sandbox(backend, require_isolation, kernel_layers)
        self.sandbox, self.sandbox_line = sandbox.mode, sandbox.line()
        self.layers = landlock_seccomp.describe(sandbox.landlock, sandbox.seccomp)  # "" where none
        self.backend = "subprocess" if sandbox.mode == "subprocess" else "servers"
        if sandbox.mode != "namespaces":
            announce(sandbox)
        env = {k: v for k, v in os.environ.items() if k in ENV_KEPT}  # no secrets
        env.update(LANG="C.UTF-8", HOME="/tmp", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   MKL_NUM_THREADS="1")
        limits = {"timeout": timeout, "memory_mb": memory_mb, "max_bytes": max_output_bytes}
        if self.backend == "subprocess":
            self.light_workers = 0
            layers = {"landlock": sandbox.landlock, "seccomp": sandbox.seccomp,  # found once, here
                      "roots": landlock_seccomp.import_roots(preload) if sandbox.landlock else []}
            self._backend = _Subprocesses(self.workers, limits, max_output_chars, env, error_format,
                                          layers)
        else:
            light = [m for m in preload if m in sys.stdlib_module_names]
            wanted = self.workers // 2 if light_workers is None else light_workers
            self.light_workers = 0 if len(light) == len(preload) else \
                max(0, min(self.workers - 1, wanted))
            self._backend = self._pool(sandbox, env, (tuple(light), preload), limits,
                                       max_output_chars, error_format)
        # the backend and its threads hold no reference to self, so garbage collection can close it
        self._finalizer = weakref.finalize(self, self._backend.close)
        if self.backend == "servers":
            try:
                for server in self._backend.servers:
                    server.start()
                for server in self._backend.servers:
                    server.wait_ready()
            except (WorkerDied, OSError) as exc:
                self.close()
                raise RuntimeError(f"code tool worker failed to start: {exc}") from exc
            self._backend.thread.start()

    def _pool(self, sandbox: Sandbox, env: dict, preloads: tuple, limits: dict,
              max_chars: int, error_format: str) -> _Pool:
        """The servers (not started yet): the first light_workers preload preloads[0] (the standard
        library's part), the others preloads[1]; calls on any of them may import all of preloads[1]."""
        servers = []
        for i in range(self.workers):
            kind = "light" if i < self.light_workers else "heavy"
            options = {"preload": preloads[kind == "heavy"], "offer": preloads[1],
                       "scratch_mb": sandbox.scratch_mb, "landlock": sandbox.landlock,
                       "seccomp": sandbox.seccomp}
            serve = [*sandbox.prefix, sys.executable, SANDBOX_PY, "--serve", json.dumps(options)]
            servers.append(_Server(serve, env, sandbox.mode == "namespaces", kind))
        return _Pool(servers, limits, max_chars, LIGHT_HELP_AFTER_S, os.cpu_count() or 1, error_format)

    def submit(self, code: str, stdin: str = "") -> Future:
        """Queue one call; the Future resolves to its ToolResult (it never raises, nor waits past
        timeout + grace)."""
        future: Future = Future()
        tree = parse(code)  # once, here: the lane and the notebook echo (the child only compiles)
        lane = "heavy" if not self.light_workers or needs_heavy(code, tree) else "light"
        self._backend.submit(lane, {"code": code, "stdin": stdin, "echo": echo_span(code, tree)},
                             future)
        return future

    def run(self, code: str, stdin: str = "") -> ToolResult:
        return self.submit(code, stdin).result()

    def run_batch(self, calls: list[tuple[str, str]]) -> list[ToolResult]:
        """Run (code, stdin) pairs concurrently; results in the order of calls."""
        return [f.result() for f in [self.submit(code, stdin) for code, stdin in calls]]

    def pids(self) -> list[int]:
        """The processes the tool runs now, as the caller sees them: its servers (the unshare
        processes where namespaced), or the running calls' interpreters (subprocess backend)."""
        return self._backend.pids()

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> CodeTool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    backend = sys.argv[1] if len(sys.argv) > 1 else "auto"
    with CodeTool(workers=2, timeout=2.0, backend=backend) as tool:
        print(f"{tool.sandbox_line}\nbackend: {tool.backend}, workers: {tool.workers}")
        demos = [("print(2+2)", ""),
                 ("import sympy as sp\nx = sp.Symbol('x')\nsp.solve(x**2 - 5*x + 6, x)", ""),
                 ("n = int(input())\nprint(sum(range(n + 1)))", "100"), ("x = 1\n1 / (x - 1)", ""),
                 ("while True: pass", ""), ("import os\nos.getuid()", "")]
        for (code, stdin), result in zip(demos, tool.run_batch(demos)):
            print(f"--- {code!r} ({result.elapsed * 1e3:.1f} ms)\n{result.render()}")
