"""The model's only tool, `execute_python_code_with_standard_io(code, input)` (rstar2-agent.md sections 2 and 5).

Each call runs `code` in a fresh interpreter state with `input` on stdin and returns what a notebook shows: stdout;
if nothing was printed and the code ends in a bare expression other than None, that value's repr (`x = 1` shows
nothing); on error the traceback, cut to the frames of the model's code. `ToolResult.render()` is the text the model
reads: the status word, a newline, then stdout and stderr cut in the middle ("ok\n4\n" for `print(2+2)`).

Design (the report's separate code service, on one machine): the caller never forks. It starts W worker servers
with subprocess and talks JSON lines to each from one thread. A server imports numpy, sympy, ... once (PRELOAD),
then forks a child per call (a "zygote": a few ms against 20 ms for a new python, 0.5 s or more with sympy). Half
the servers preload only the standard-library modules: a call whose code imports nothing else (`needs_heavy`) forks
from one of those, which costs about half as much as forking a server that holds numpy and sympy. The
child drops to uid 65534 (nobody) when the server is root, sets hard rlimits (address space, file size, core, CPU),
chdirs to a fresh temporary directory (also $HOME and $TMPDIR), reads stdin from a memfd and writes into pipes. The
fork is the fresh state: builtins patched, chdir, closed descriptors, os._exit or a segfault end with the child.
The server enforces the wall-clock timeout from outside with SIGKILL (no code can ignore or block it) and stops
reading at max_output_bytes per stream, killing the call. When the call ends, every process it left (setsid()
grandchildren, double-forked daemons) is killed and reaped before the result goes back; threads die with it.

Sandbox levels (`CodeTool.sandbox`):
- "namespaces" (util-linux `unshare` works, root or not): each server is init of its own PID, mount and network
  namespace (`unshare --pid --fork --kill-child --mount-proc --net`, plus `--user --map-current-user`, hence no
  capabilities, when not root). The call cannot name the caller's pid, kill(-1) from the server removes all leftovers,
  killing the server ends the namespace, and there is no network (not even loopback). As root the server also covers
  directories nobody cannot enter on the way to the Python install (e.g. /root, 0700) with a tmpfs in its private
  mount namespace and binds the install back, so the unprivileged child can still import modules lazily.
- "fallback" (no usable unshare, e.g. a container without CAP_SYS_ADMIN or user namespaces): same fork, rlimits and
  uid drop; leftovers found by walking /proc below the server (a child subreaper). Network NOT blocked. A non-root
  caller's code runs as the caller's uid and could signal its other processes; a root caller's code runs as nobody
  and cannot import modules from a Python under /root beyond those already loaded.
A server that dies or stops answering is replaced and the call it held reports "crash"; close(), garbage collection
and interpreter exit end every process the tool started (a caller killed with SIGKILL leaves servers that exit at
EOF on their stdin, after at most one call).

Not covered: this is not a security boundary against a determined attacker (no seccomp; the kernel is exposed). The
filesystem is NOT blocked: code can read world-readable files and write world-writable places (/tmp, /dev/shm),
where files outlive the call (each capped at FILE_LIMIT_MB). memory_mb caps each process's address space beyond the
warm server's, not the sum over processes a call starts. Fork bombs stop at NPROC_LIMIT processes as nobody, and
otherwise only at the timeout. CPU is shared between calls only by the kernel scheduler.

Demo: `.venv/bin/python code_tool.py`. Tests: tests/test_code_tool.py. Benchmark: bench/code_tool.py.
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import ctypes
import gc
import json
import linecache
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field

STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "crash")  # ToolResult.status, one word each
CODE_NAME = "<code>"  # filename of the model's code in tracebacks; frames from elsewhere are hidden
MAX_FRAMES = 3  # innermost frames of the model's code shown in a traceback
NOBODY = 65534  # uid/gid a root caller's code runs as
FILE_LIMIT_MB = 64  # RLIMIT_FSIZE: largest file a call may write
NPROC_LIMIT = 256  # RLIMIT_NPROC when running as nobody: processes + threads of that uid at once (a fork bomb stops)
REPLY_GRACE_S = 10.0  # the caller declares a server dead when no reply comes timeout + this many seconds after sending
READY_TIMEOUT_S = 120.0  # how long a starting server may take to import PRELOAD
PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "re", "random", "json",
           "statistics", "heapq", "bisect", "string", "copy", "operator", "datetime", "typing", "numpy", "sympy")
WARMUP = "import numpy.random, sympy\nsympy.solve(sympy.Symbol('x')**2 - 4)\nnumpy.linalg.inv(numpy.eye(2))"
CHILD_GC_THRESHOLD = 50_000  # allocations between the call child's young-generation collections (Python: 700)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC = 2, 4, 4096, 16384
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class ToolResult:
    status: str  # one of STATUSES
    stdout: str = ""  # what the code printed (decoded with replacement), or the echoed value of its last expression
    stderr: str = ""  # what it wrote to stderr, then the compact traceback or the reason it was stopped
    elapsed: float = 0.0  # seconds from fork to exit on the server (queueing not included)
    max_chars: int = field(default=1000, repr=False)  # render()'s default cut, the tool's max_output_chars

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def render(self, max_chars: int | None = None) -> str:
        """Text the model sees: the status word on the first line, then stdout, then stderr, the body cut in the
        middle to max_chars. `print(2+2)` renders as "ok\\n4\\n"; a failure as "error\\n...ZeroDivisionError: x\\n"."""
        body = self.stdout
        if self.stderr:
            body += ("" if body.endswith("\n") or not body else "\n") + self.stderr
        return self.status + "\n" + cut_middle(body, self.max_chars if max_chars is None else max_chars)


def cut_middle(text: str, max_chars: int) -> str:
    """Keep the first and last max_chars/2 characters, with a marker saying how many were cut between them."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    return f"{text[:head]}\n...[{len(text) - max_chars} chars cut]...\n{text[len(text) - (max_chars - head):]}"


def needs_heavy(code: str) -> bool:
    """Whether a call should go to a server with the third-party PRELOAD modules (numpy, sympy): True when the code
    imports anything outside the standard library, or imports dynamically. Code that does not parse is light (it
    fails at once anywhere). A wrong guess only costs time: a light server imports what the code asks for."""
    if "__import__" in code or "importlib" in code:
        return True
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(name.split(".")[0] not in sys.stdlib_module_names for name in names):
            return True
    return False


def default_workers() -> int:
    """Four servers per core: calls that sleep, or burn a core until their timeout, leave the others work to do;
    each warm server holds about 70 MB (numpy + sympy)."""
    return 4 * (os.cpu_count() or 1)


# ----------------------------------------------------------------------------------- the call child (runs model code)
def format_error(exc: BaseException) -> str:
    """A compact traceback: only frames of the model's code (none of ours or a library's), the innermost
    MAX_FRAMES of them, without 3.11's ^^^ marker lines; then the exception line, which matters most.
    SystemExit gets only its line ("SystemExit: 1"): Python prints no traceback for it either."""
    if isinstance(exc, SystemExit):
        return "".join(traceback.format_exception_only(type(exc), exc))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == CODE_NAME]
    lines = [f'  File "{CODE_NAME}", line {f.lineno}, in {f.name}\n' + (f"    {f.line}\n" if f.line else "")
             for f in frames[-MAX_FRAMES:]]
    if len(frames) > MAX_FRAMES:
        lines.insert(0, f"  [{len(frames) - MAX_FRAMES} more frames]\n")
    head = ["Traceback (most recent call last):\n"] if frames else []
    return "".join(head + lines + traceback.format_exception_only(type(exc), exc))


def execute(code: str) -> tuple[str, str]:
    """Run code in a fresh namespace as a notebook cell; returns (status, repr of the last expression or "")."""
    linecache.cache[CODE_NAME] = (len(code), None, code.splitlines(True), CODE_NAME)  # source lines in tracebacks
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        tree = ast.parse(code, CODE_NAME)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, CODE_NAME, "exec"), namespace)
        value = eval(compile(ast.Expression(last.value), CODE_NAME, "eval"), namespace) if last else None
        return "ok", "" if value is None else repr(value)
    except SystemExit as exc:
        if exc.code in (None, 0):
            return "ok", ""
        status, error = "error", exc
    except MemoryError as exc:
        status, error = "memory", exc
    except BaseException as exc:  # everything the code raises, KeyboardInterrupt included, is the code's error
        status, error = "error", exc
    with contextlib.suppress(BaseException):  # the code may have closed stderr; the status still goes back
        sys.stderr.write(format_error(error))
    return status, ""


def _limit(res: int, value: int) -> None:
    """Set soft = hard = value (never above the current hard limit, which only root could raise)."""
    hard = resource.getrlimit(res)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(res, (value, value))


def _child(request: dict, workdir: str, vm_bytes: int, fds: list[int], as_root: bool):
    """Body of the forked call child: confine, run the code, report on fd 3 ("status\\nechoed value"), _exit."""
    try:
        # After the server's gc.freeze() the collector counts no long-lived objects, so the first collection that
        # reaches the oldest generation runs a full one: 2 ms of a 3 ms trivial call, most of it copy-on-write
        # faults. A short call allocates far fewer objects than this threshold and never collects; a long one does.
        gc.set_threshold(CHILD_GC_THRESHOLD)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with its server even outside a PID namespace
        os.setsid()  # its own process group: killpg(0) reaches only the call's processes
        for target, fd in enumerate(fds):  # stdin memfd, stdout, stderr, control pipe -> fds 0, 1, 2, 3
            os.dup2(fd, target)
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))  # the server's protocol pipes, memfds, ...
        os.chdir(workdir)
        _limit(resource.RLIMIT_AS, vm_bytes + (request["memory_mb"] << 20))  # memory_mb beyond the warm server
        _limit(resource.RLIMIT_FSIZE, FILE_LIMIT_MB << 20)
        _limit(resource.RLIMIT_CORE, 0)
        _limit(resource.RLIMIT_CPU, int(request["timeout"]) + 2)  # backstop; the server's wall clock kills first
        if as_root:  # (for the caller's own uid, NPROC would count the caller's threads too)
            _limit(resource.RLIMIT_NPROC, NPROC_LIMIT)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
        _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # setuid binaries cannot give the code privileges back
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        tempfile.tempdir, sys.argv, sys.path[0] = workdir, [""], workdir
        sys.stdin = sys.__stdin__ = open(0, "r", encoding="utf-8", errors="replace", closefd=False)
        sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
        if "numpy.random" in sys.modules:  # its global RandomState was copied from the server (`random` reseeds)
            sys.modules["numpy.random"].seed(int.from_bytes(os.urandom(4), "little"))  # seed(None) costs 0.7 ms
    except BaseException as exc:
        os.write(3, f"crash\nsandbox setup failed: {exc!r}".encode())
        os._exit(125)
    status, echo = execute(request["code"])
    record = f"{status}\n{echo}".encode("utf-8", "backslashreplace")
    for finish in (sys.stdout.flush, sys.stderr.flush, lambda: os.write(3, record)):
        with contextlib.suppress(BaseException):  # the code may have closed them; the exit code still tells ok/error
            finish()
    os._exit(0 if status == "ok" else 1)


# ----------------------------------------------------------------------------------- the worker server
def _descendants(root: int) -> list[int]:
    """Pids below root, from /proc (used where the server is not a PID namespace's init)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
        except (ValueError, OSError, IndexError):
            continue
    found, stack = [], [root]
    while stack:
        kids = children.get(stack.pop(), [])
        found += kids
        stack += kids
    return found


def kill_descendants() -> None:
    """SIGKILL and reap every process below this server: the call child and whatever it left behind."""
    while True:
        for pid in [-1] if os.getpid() == 1 else _descendants(os.getpid()):  # kill(-1) from init: all but itself
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.001)
        except ChildProcessError:  # no children left; orphans reparent to us (init or subreaper), so none anywhere
            return


def _watch(pid: int, reads: list[int], deadline: float, cap: int) -> tuple[str | None, int, list[bytearray]]:
    """Collect the call's pipes until its child exits, the deadline passes or a stream passes cap bytes; then
    kill everything the call left and drain the pipes. Returns (reason it was killed or None, wait status, bytes)."""
    pidfd, poller, bufs, reason = os.pidfd_open(pid), select.poll(), [bytearray() for _ in reads], None
    for fd in reads + [pidfd]:
        poller.register(fd, select.POLLIN)
    while reason is None:
        left = deadline - time.monotonic()
        events = poller.poll(left * 1000 + 1) if left > 0 else []
        if left <= 0:
            reason = "timeout"
        elif any(fd == pidfd for fd, _ in events):
            break
        for fd, _ in events:
            buf = bufs[reads.index(fd)]
            buf += (chunk := os.read(fd, 1 << 16))
            if not chunk:
                poller.unregister(fd)
            elif len(buf) > cap:
                reason = "output_limit"
    if reason:
        os.kill(pid, signal.SIGKILL)
    wait_status = os.waitpid(pid, 0)[1]
    os.close(pidfd)
    kill_descendants()
    for fd, buf in zip(reads, bufs):  # every writer is dead now; non-blocking in case one escaped anyway
        os.set_blocking(fd, False)
        try:
            while len(buf) <= cap and (chunk := os.read(fd, 1 << 16)):
                buf += chunk
        except BlockingIOError:
            pass
        os.close(fd)
    return reason or ("output_limit" if max(map(len, bufs)) > cap else None), wait_status, bufs


def describe(reason: str | None, wait_status: int, bufs: list[bytearray], timeout: float, cap: int) -> dict:
    """The outcome as ToolResult fields, from why we killed the call (if we did), how it exited, and its bytes
    (stdout, stderr, control: "status\\necho" written by the child's runner as its last act)."""
    out, err, ctl = (bytes(b[:cap]).decode("utf-8", "replace") for b in bufs)
    word, _, echo = ctl.partition("\n")
    note = ""
    if reason == "timeout":
        status, note = reason, f"killed after {timeout:g} s"
    elif reason:
        status, note = reason, f"killed after {cap} bytes of output"
    elif word in STATUSES:
        status, note = word, echo if word == "crash" else ""
    elif os.WIFSIGNALED(wait_status):
        sig = signal.Signals(os.WTERMSIG(wait_status))
        status, note = ("timeout" if sig == signal.SIGXCPU else "crash"), f"killed by {sig.name}"
    else:  # os._exit(n) or fd 3 closed by the code: only the exit code is known
        code = os.WEXITSTATUS(wait_status)
        status, note = ("ok", "") if code == 0 else ("error", f"exit code {code}")
    if status == "ok" and not out and echo:
        out = echo + "\n"
    if note:
        err += ("" if err.endswith("\n") or not err else "\n") + note + "\n"
    return {"status": status, "stdout": out, "stderr": err}


def serve_call(request: dict, base: str, as_root: bool) -> dict:
    """Fork one call child in a fresh directory, watch it, and describe the outcome as ToolResult fields."""
    workdir = tempfile.mkdtemp(prefix="call-", dir=base)
    os.environ.update(HOME=workdir, TMPDIR=workdir)  # here, not in the child: no copy-on-write faults
    if as_root:
        os.chown(workdir, NOBODY, NOBODY)
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, request["stdin"].encode("utf-8", "surrogatepass"))
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, control
    vm_bytes = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    start = time.monotonic()
    if (pid := os.fork()) == 0:
        try:
            _child(request, workdir, vm_bytes, [stdin_fd] + [w for _, w in pipes], as_root)
        finally:
            os._exit(125)  # whatever happens, a child never returns into the server loop
    for fd in [stdin_fd] + [w for _, w in pipes]:
        os.close(fd)
    reason, wait_status, bufs = _watch(pid, [r for r, _ in pipes], start + request["timeout"], request["max_bytes"])
    elapsed = time.monotonic() - start
    try:
        os.rmdir(workdir)  # the common case: the code wrote no files
    except OSError:
        shutil.rmtree(workdir, ignore_errors=True)
    return {**describe(reason, wait_status, bufs, request["timeout"], request["max_bytes"]), "elapsed": elapsed}


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    args = [None if a is None else a.encode() for a in (source, target, fstype, data)]
    if _libc.mount(*args[:3], flags, args[3]) != 0:
        raise OSError(ctypes.get_errno(), f"mount {source} on {target}")


def expose_python_to_nobody() -> None:
    """Root, in the server's private mount namespace: cover each directory nobody cannot enter on the way to the
    Python install (e.g. /root, mode 0700) with a tmpfs and bind the install back, so imports work after the uid drop.
    This also hides the rest of that directory (root's keys, caches) from the code."""
    roots = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, *sys.path) if p and os.path.isdir(p)})
    hidden: dict[str, list[str]] = {}
    for path in [p for p in roots if not any(p.startswith(q + "/") for q in roots)]:
        parts = path.split("/")
        closed = [d for d in ("/".join(parts[:i]) for i in range(2, len(parts) + 1)) if not os.stat(d).st_mode & 1]
        if closed:  # the first ancestor without the execute bit for "other"
            hidden.setdefault(closed[0], []).append(path)
    for top, paths in hidden.items():
        keep = [os.open(p, os.O_PATH) for p in paths]  # handles to the originals before the tmpfs covers them
        _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for path, fd in zip(paths, keep):
            os.makedirs(path, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
            os.close(fd)


def serve(preload: list[str], base: str) -> None:
    """Worker server main: warm up, then answer each JSON request line with one JSON reply line, until EOF.
    base: the directory (made by the caller, which removes it) that holds one fresh directory per call."""
    proto_in, proto_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # a stray print can never corrupt the protocol
    os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _libc.prctl(PR_SET_DUMPABLE, 0)  # a same-uid call child cannot ptrace its server
    as_root, namespaced = os.geteuid() == 0, os.getpid() == 1
    if not namespaced:  # (as a namespace's init, signals without a handler cannot reach us from the calls)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # close(): unwind through the finally below
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of a call reparent to us, where kill_descendants finds them
    if as_root and namespaced:
        try:
            expose_python_to_nobody()
        except OSError as exc:  # imports not preloaded may then fail for the call; everything else holds
            print(f"code_tool: cannot expose the Python install to uid {NOBODY}: {exc}", file=sys.stderr)
    for name in preload:
        with contextlib.suppress(Exception):
            __import__(name)
    if {"numpy", "sympy"} <= set(preload):
        exec(WARMUP, {})  # lazy imports and caches filled once, here, not in every call
    gc.freeze()  # the warm heap stays out of the children's collections: fewer copy-on-write faults
    try:
        proto_out.write(b'{"ready": true}\n')
        proto_out.flush()
        for line in proto_in:
            proto_out.write(json.dumps(serve_call(json.loads(line), base, as_root)).encode() + b"\n")
            proto_out.flush()
    finally:
        kill_descendants()
        shutil.rmtree(base, ignore_errors=True)


# ----------------------------------------------------------------------------------- the caller side
_SANDBOX: tuple[str, list[str]] | None = None


def sandbox_prefix() -> tuple[str, list[str]]:
    """("namespaces", unshare command) if that works here (tried once per process), else ("fallback", [])."""
    global _SANDBOX
    if _SANDBOX is None:
        _SANDBOX = ("fallback", [])
        user = [] if os.geteuid() == 0 else ["--user", "--map-current-user"]
        cmd = [shutil.which("unshare") or "unshare", *user, "--pid", "--fork", "--kill-child", "--mount-proc", "--net"]
        try:
            probe = subprocess.run([*cmd, sys.executable, "-c", "import os; print(os.getpid())"],
                                   capture_output=True, text=True, timeout=30)
            if probe.returncode == 0 and probe.stdout.strip() == "1":
                _SANDBOX = ("namespaces", cmd)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return _SANDBOX


class WorkerDied(Exception):
    """A worker server exited, broke the protocol, stopped answering or was retired by close()."""


class _Server:
    """One worker server process and the pipe protocol to it; driven by one caller thread, retired by close()."""

    def __init__(self, cmd: list[str], env: dict, namespaced: bool, kind: str = "heavy"):
        self.cmd, self.env, self.namespaced, self.kind = cmd, env, namespaced, kind  # kind: which calls it takes
        self.proc, self.buf, self.retired, self.lock = None, b"", False, threading.Lock()

    def start(self) -> None:
        with self.lock:
            if self.retired:
                raise WorkerDied("code tool closed")
            # tmpfs when there is one: on ext4 with discard, creating and removing a directory cost 3 ms per call
            self.base = tempfile.mkdtemp(prefix="codetool-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
            os.chmod(self.base, 0o711)  # nobody may enter its own call directory but not list the others
            self.proc = subprocess.Popen([*self.cmd, self.base], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         env=self.env, start_new_session=True)  # a Ctrl-C to the caller stays here
            self.buf = b""

    def receive(self, deadline: float) -> dict:
        fd, poller = self.proc.stdout.fileno(), select.poll()
        poller.register(fd, select.POLLIN)
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000 + 1):
                raise WorkerDied("no reply in time")
            if not (chunk := os.read(fd, 1 << 20)):
                raise WorkerDied(f"exited with {self.proc.wait()}")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def call(self, request: dict, wait: float) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise WorkerDied(f"cannot send: {exc}") from exc
        return self.receive(time.monotonic() + wait)

    def stop(self, retire: bool = False) -> None:
        """End the server and all below it (SIGKILL to unshare takes the namespace down); retire: never restart."""
        with self.lock:
            self.retired |= retire
            if self.proc is None:
                return
            if not self.namespaced and self.proc.poll() is None:
                self.proc.terminate()  # the server kills its call's process tree on the way out
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(2)
            self.proc.kill()
            self.proc.wait()  # pipes close when the Popen is dropped (closing here could race the reading thread)
            shutil.rmtree(self.base, ignore_errors=True)


class _JobBoard:
    """Queued calls in two lanes. A "light" server (standard-library preload: half the fork cost) takes light calls;
    a "heavy" server (numpy, sympy, ...) takes heavy calls first, and light ones only while no light server is idle,
    so every server stays busy under any mix and a light call waits for a heavy server only when it must."""

    def __init__(self):
        self.cv, self.lanes, self.idle_light, self.closed = threading.Condition(), {"light": [], "heavy": []}, 0, False

    def put(self, lane: str, job) -> None:
        with self.cv:
            if self.closed:
                raise RuntimeError("CodeTool is closed")
            self.lanes[lane].append(job)
            self.cv.notify_all()

    def take(self, kind: str):
        """The next job for a server of this kind; None once closed."""
        with self.cv:
            self.idle_light += kind == "light"
            try:
                while not self.closed:
                    if kind == "heavy" and self.lanes["heavy"]:
                        return self.lanes["heavy"].pop(0)
                    if self.lanes["light"] and (kind == "light" or self.idle_light == 0):
                        return self.lanes["light"].pop(0)
                    self.cv.wait()
                return None
            finally:
                self.idle_light -= kind == "light"
                self.cv.notify_all()  # a heavy server may now take a light call that no idle light server will

    def close(self) -> list:
        """Refuse new calls, wake every server thread, and return the calls still queued."""
        with self.cv:
            self.closed = True
            left = self.lanes["light"] + self.lanes["heavy"]
            self.lanes = {"light": [], "heavy": []}
            self.cv.notify_all()
            return left


def _serve_jobs(server: _Server, jobs: _JobBoard, limits: dict, max_chars: int) -> None:
    """One caller thread per server: take a job, run it there, resolve its future; replace the server if it died."""
    while (job := jobs.take(server.kind)) is not None:
        code, stdin, future = job
        if not future.set_running_or_notify_cancel():
            continue
        try:
            reply = server.call({"code": code, "stdin": stdin, **limits}, limits["timeout"] + REPLY_GRACE_S)
            future.set_result(ToolResult(**reply, max_chars=max_chars))
            continue
        except Exception as exc:  # died, hung or closed mid-call: this call fails, the slot gets a new server
            future.set_result(ToolResult("crash", "", f"worker failed: {exc}\n", 0.0, max_chars))
        server.stop()
        while not server.retired:
            try:
                server.start()
                server.receive(time.monotonic() + READY_TIMEOUT_S)
                break
            except Exception:
                server.stop()
                time.sleep(0.5)


def _shutdown(servers: list[_Server], jobs: _JobBoard) -> None:
    """Fail the calls still queued, stop the threads and end every server (close(), GC or interpreter exit)."""
    for server in servers:
        server.retired = True
    for _, _, future in jobs.close():  # submit() refuses from now on
        if future.set_running_or_notify_cancel():
            future.set_result(ToolResult("crash", "", "code tool closed before the call ran\n"))
    for server in servers:
        server.stop(retire=True)


class CodeTool:
    """A pool of warm worker servers for `execute_python_code_with_standard_io` calls; see the module docstring.

    workers: servers, i.e. calls running at once (default_workers()); timeout: wall-clock seconds per call;
    memory_mb: address space a call may add to the warm interpreter's; max_output_chars: ToolResult.render()'s
    default cut; max_output_bytes: bytes read per stream before the call is killed as "output_limit"; preload:
    modules each server imports once; light_workers: how many servers preload only its standard-library part
    (default half of them, when preload has more than that and workers >= 2). Calls that import nothing beyond the
    standard library (`needs_heavy`) go to those first: forking a server without numpy and sympy costs about half."""

    def __init__(self, workers: int | None = None, timeout: float = 4.0, memory_mb: int = 512,
                 max_output_chars: int = 1000, max_output_bytes: int = 1 << 20, preload: tuple = PRELOAD,
                 light_workers: int | None = None):
        self.workers = workers or default_workers()
        self.sandbox, prefix = sandbox_prefix()
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")}  # no secrets
        env.update(LANG="C.UTF-8", HOME="/tmp", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        light = [m for m in preload if m in sys.stdlib_module_names]
        wanted = self.workers // 2 if light_workers is None else light_workers
        self.light_workers = 0 if len(light) == len(preload) else max(0, min(self.workers - 1, wanted))
        serve = [*prefix, sys.executable, os.path.abspath(__file__), "--serve"]
        self._jobs = _JobBoard()
        self._servers = [_Server(serve + [",".join(light if i < self.light_workers else preload)], env,
                                 self.sandbox == "namespaces", "light" if i < self.light_workers else "heavy")
                         for i in range(self.workers)]
        self._finalizer = weakref.finalize(self, _shutdown, self._servers, self._jobs)
        try:
            for server in self._servers:
                server.start()
            for server in self._servers:
                server.receive(time.monotonic() + READY_TIMEOUT_S)
        except (WorkerDied, OSError) as exc:
            self.close()
            raise RuntimeError(f"code tool worker failed to start: {exc}") from exc
        limits = {"timeout": timeout, "memory_mb": memory_mb, "max_bytes": max_output_bytes}
        for server in self._servers:  # the threads hold no reference to self, so garbage collection can close it
            threading.Thread(target=_serve_jobs, args=(server, self._jobs, limits, max_output_chars), daemon=True,
                             name="code-tool").start()

    def submit(self, code: str, stdin: str = "") -> Future:
        """Queue one call; the Future resolves to its ToolResult (it never raises, nor waits past timeout + grace)."""
        future: Future = Future()
        self._jobs.put("heavy" if not self.light_workers or needs_heavy(code) else "light", (code, stdin, future))
        return future

    def run(self, code: str, stdin: str = "") -> ToolResult:
        return self.submit(code, stdin).result()

    def run_batch(self, calls: list[tuple[str, str]]) -> list[ToolResult]:
        """Run (code, stdin) pairs concurrently on the pool; results in the order of calls."""
        return [f.result() for f in [self.submit(code, stdin) for code, stdin in calls]]

    def server_pids(self) -> list[int]:
        """Pids of the worker servers as the caller sees them (the unshare processes where namespaced)."""
        return [s.proc.pid for s in self._servers if s.proc is not None]

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> CodeTool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve([m for m in sys.argv[2].split(",") if m], sys.argv[3])
    else:
        with CodeTool(workers=2, timeout=2.0) as tool:
            print(f"sandbox: {tool.sandbox}, workers: {tool.workers}")
            demos = [("print(2+2)", ""), ("import sympy as sp\nx = sp.Symbol('x')\nsp.solve(x**2 - 5*x + 6, x)", ""),
                     ("n = int(input())\nprint(sum(range(n + 1)))", "100"), ("x = 1\n1 / (x - 1)", ""),
                     ("while True: pass", ""), ("import os\nos.getuid()", "")]
            for (code, stdin), result in zip(demos, tool.run_batch(demos)):
                print(f"--- {code!r} ({result.elapsed * 1e3:.1f} ms)\n{result.render()}")
