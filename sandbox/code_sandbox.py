"""The sandbox side of the code tool (code_tool.py): the worker server, the call child it forks per
call, and the per-call interpreter of the portable subprocess backend.

A worker server is one long-lived Python (`python sandbox/code_sandbox.py --serve OPTIONS BASE`), started by
CodeTool, as init of its own namespaces where `unshare` works. It imports its modules once, builds
the Landlock ruleset and installs the seccomp filter (sandbox/landlock_seccomp.py), then answers one JSON
request line per call on stdin with one JSON reply line on stdout: it forks a call child in a fresh
directory under BASE, watches it from outside (wall clock, output bytes), kills whatever the call
left behind, empties BASE of what the call wrote, and describes the outcome. The child confines
itself (Landlock, setsid, rlimits, uid drop when root, fresh directory; the filter it inherits),
runs the code as a notebook cell and exits. In its own mount namespace the server first covers BASE
with a tmpfs of SCRATCH_MB, so the files of a call hold at most that much RAM, and /dev/shm with a
directory of it.

Under the subprocess backend, a new interpreter per call runs `run_once(CALL_DIR)`: it sets the same
limits on itself (where the platform has them), runs the code and exits. Both backends share
`execute`, `format_error` and `describe`, so the model reads the same text from either. This module
imports on any platform (without `resource` on Windows); the server needs Linux.

Cost model of the servers, since a call's price is a fork: the child pays a copy-on-write page fault
for every page of the server's memory it writes, and every handler a module registered with
os.register_at_fork runs in every child. Hence:
- This module imports only light standard-library modules. `threading` (and what imports it:
  subprocess, logging, concurrent.futures) must stay out of a server: its at-fork handler runs in
  every call. Those modules belong to the caller (code_tool.py); a test checks that a call sees none
  of them.
- The child does the least it can in Python: the server sets what a fork inherits (no_new_privs, the
  seccomp filter, the std streams' encodings) once and builds the Landlock ruleset, which the child
  enters with one system call; the child calls `_signal` directly (signal.signal converts its
  result to an enum); the caller, not the child, parses the code to find the expression a notebook
  echoes (building ast objects is costly here).
- The modules a server holds are also what a call can import in the "fallback-root" mode when the
  Python install is unreadable to nobody (see code_tool.py): there, only PRELOAD and this module's
  imports exist.

Run through CodeTool; tests: tests/test_code_tool.py.
"""
from __future__ import annotations

import _signal
import builtins
import contextlib
import ctypes
import gc
import json
import linecache
import os
import select
import shutil
import signal
import sys
import tempfile
import time
import traceback

try:  # imported by code_tool.py as part of the sandbox package
    from sandbox import landlock_seccomp
except ImportError:  # run as a script (the server, a one-shot call): this folder is sys.path[0]
    import landlock_seccomp

try:
    import resource  # POSIX
except ImportError:  # Windows: no rlimits
    resource = None

# ToolResult.status, one word each
STATUSES = ("ok", "error", "timeout", "memory", "output_limit", "crash")
CODE_NAME = "<code>"  # filename of the model's code in tracebacks; frames from elsewhere are hidden
MAX_FRAMES = 3  # innermost frames of the model's code shown in a traceback
NOBODY = 65534  # uid/gid a root caller's code runs as
FILE_LIMIT_MB = 64  # RLIMIT_FSIZE: largest file a call may write
SCRATCH_MB = 64  # tmpfs (RAM) holding a namespaced server's call directories: a call's files
SHM_NAME = "shm"  # the directory of a namespaced server's tmpfs that is the call's /dev/shm
CHOWN = ("chown", "fchown", "lchown", "fchownat")  # kept by a root server's filter (call dirs)
NPROC_LIMIT = 256  # RLIMIT_NPROC as nobody: processes + threads of that uid (a fork bomb stops)
PRELOAD = ("math", "cmath", "fractions", "decimal", "itertools", "functools", "collections", "re",
           "random", "json", "statistics", "heapq", "bisect", "string", "copy", "operator",
           "datetime", "typing", "numpy", "sympy")
WARMUP = ("import numpy.random, sympy\nsympy.solve(sympy.Symbol('x')**2 - 4)\n"
          "numpy.linalg.inv(numpy.eye(2))")
CHILD_GC_THRESHOLD = 50_000  # allocations between the call child's young collections (Python: 700)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC = 2, 4, 4096, 16384
CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
LINUX_CAPABILITY_VERSION_3 = 0x20080522
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform != "win32" else None


# --------------------------------------------------------------------- the code, as a notebook cell
def format_error(exc: BaseException) -> str:
    """A compact traceback: only frames of the model's code (none of ours or a library's), the
    innermost MAX_FRAMES of them, without 3.11's ^^^ marker lines; then the exception line, which
    matters most. SystemExit gets only its line ("SystemExit: 1"): Python prints no traceback for it
    either."""
    if isinstance(exc, SystemExit):
        return "".join(traceback.format_exception_only(type(exc), exc))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == CODE_NAME]
    lines = [f'  File "{CODE_NAME}", line {f.lineno}, in {f.name}\n'
             + (f"    {f.line}\n" if f.line else "") for f in frames[-MAX_FRAMES:]]
    if len(frames) > MAX_FRAMES:
        lines.insert(0, f"  [{len(frames) - MAX_FRAMES} more frames]\n")
    head = ["Traceback (most recent call last):\n"] if frames else []
    return "".join(head + lines + traceback.format_exception_only(type(exc), exc))


def execute(code: str, echo: list[int] | None) -> tuple[str, str]:
    """Run code in a fresh namespace as a notebook cell: its statements, then the expression at echo
    (echo_span), evaluated apart so that its value can be shown. Returns (status, repr of that
    value, or "" for None)."""
    # the source lines shown in tracebacks
    linecache.cache[CODE_NAME] = (len(code), None, code.splitlines(True), CODE_NAME)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    # the expression keeps its line number (blank lines before it) for tracebacks
    body, last = code, ""
    if echo:
        body, last = code[:echo[0]], "\n" * (echo[2] - 1) + code[echo[0]:echo[1]]
    try:
        exec(compile(body, CODE_NAME, "exec"), namespace)
        value = eval(compile(last, CODE_NAME, "eval"), namespace) if last else None
        return "ok", "" if value is None else repr(value)
    except SystemExit as exc:
        if exc.code in (None, 0):
            return "ok", ""
        status, error = "error", exc
    except MemoryError as exc:
        status, error = "memory", exc
    except BaseException as exc:  # all the code raises, KeyboardInterrupt included, is its error
        status, error = "error", exc
    with contextlib.suppress(BaseException):  # the code may have closed stderr; the status counts
        sys.stderr.write(format_error(error))
    return status, ""


def describe(reason: str | None, returncode: int | None, bufs: list, timeout: float,
             cap: int) -> dict:
    """The outcome as ToolResult fields, from why the call was killed (if it was), how it exited
    (returncode as subprocess reports it: the exit code, or -N for signal N; None if unknown) and
    its bytes (stdout, stderr, control: "status\\necho", the call child's last act)."""
    out, err, ctl = (bytes(b[:cap]).decode("utf-8", "replace") for b in bufs)
    word, _, echo = ctl.partition("\n")
    note = ""
    if reason == "timeout":
        status, note = reason, f"killed after {timeout:g} s"
    elif reason:
        status, note = reason, f"killed after {cap} bytes of output"
    elif word in STATUSES:
        status, note = word, echo if word == "crash" else ""
    elif returncode is not None and returncode < 0:
        sig = signal.Signals(-returncode)
        status = "timeout" if sig == getattr(signal, "SIGXCPU", None) else "crash"
        note = f"killed by {sig.name}"
    else:  # os._exit(n) or the control channel closed by the code: only the exit code is known
        status, note = ("ok", "") if returncode == 0 else ("error", f"exit code {returncode}")
    if status == "ok" and not out and echo:
        out = echo + "\n"
    if note:
        err += ("" if err.endswith("\n") or not err else "\n") + note + "\n"
    return {"status": status, "stdout": out, "stderr": err}


# -------------------------------------------------------------------------------------- confinement
def _limit(res: int, value: int) -> None:
    """Set soft = hard = value (never above the current hard limit, which only root could raise)."""
    hard = resource.getrlimit(res)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(res, (value, value))


def set_limits(request: dict, base_bytes: int | None) -> None:
    """Hard rlimits on this process and whatever it starts: address space memory_mb beyond
    base_bytes (none when base_bytes is None), file size, no core files, and CPU seconds (a
    backstop: the wall clock is enforced from outside, and kills first)."""
    if base_bytes is not None:
        _limit(resource.RLIMIT_AS, base_bytes + (request["memory_mb"] << 20))
    _limit(resource.RLIMIT_FSIZE, FILE_LIMIT_MB << 20)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_CPU, int(request["timeout"]) + 2)


def utf8_std_streams() -> None:
    """UTF-8 std streams whatever the locale: bad input bytes replaced, unencodable output escaped,
    so a call's output always goes back. (Also flushes: no stray output is inherited by a fork.)"""
    for stream, errors in ((sys.stdin, "replace"), (sys.stdout, "backslashreplace"),
                           (sys.stderr, "backslashreplace")):
        stream.reconfigure(encoding="utf-8", errors=errors)


def _vm_bytes() -> int:
    """This process's address-space size, from /proc (with os calls: cheaper in the server than a
    file object)."""
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    try:
        return int(os.read(fd, 100).split()[0]) * os.sysconf("SC_PAGE_SIZE")
    finally:
        os.close(fd)


# ----------------------------------------------------------------------- the call child of a server
def _child(request: dict, workdir: str, vm_bytes: int, fds: list[int], as_root: bool,
           namespaced: bool, confinement: landlock_seccomp.Confinement):
    """Body of the forked call child: confine, run the code, report on fd 3 ("status\\nechoed
    value"), _exit. Inherited from the server as they are: no_new_privs, the seccomp filter, and
    sys.stdin/stdout/stderr (fds 0-2, re-pointed here)."""
    try:
        confinement.restrict()  # Landlock, first: its ruleset's descriptor may be one dup2 replaces
        # After the server's gc.freeze() the collector counts no long-lived objects, so the first
        # collection that reaches the oldest generation would run a full one, most of it
        # copy-on-write faults. A short call allocates far fewer objects than this threshold and
        # never collects; a long one does.
        gc.set_threshold(CHILD_GC_THRESHOLD)
        if not namespaced:  # (in a PID namespace, the server's death ends every process in it)
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # dies with its server
        os.setsid()  # its own process group: killpg(0) reaches only the call's processes
        for target, fd in enumerate(fds):  # stdin memfd, stdout, stderr, control -> fds 0, 1, 2, 3
            os.dup2(fd, target)
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))  # the server's protocol pipes, memfds, ...
        os.chdir(workdir)
        set_limits(request, vm_bytes)  # memory_mb beyond the warm server
        if as_root:  # (for the caller's own uid, NPROC would count the caller's threads too)
            _limit(resource.RLIMIT_NPROC, NPROC_LIMIT)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
        _signal.signal(_signal.SIGTERM, _signal.SIG_DFL)  # (signal.signal would make an enum)
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
        tempfile.tempdir, sys.argv, sys.path[0] = workdir, [""], workdir
        if "numpy.random" in sys.modules:  # its global state is the server's (`random` reseeds)
            seed = int.from_bytes(os.urandom(4), "little")  # (seed(None) is slow)
            sys.modules["numpy.random"].seed(seed)
    except BaseException as exc:
        os.write(3, f"crash\nsandbox setup failed: {exc!r}".encode())
        os._exit(125)
    status, echo = execute(request["code"], request["echo"])
    record = f"{status}\n{echo}".encode("utf-8", "backslashreplace")
    for finish in (sys.stdout.flush, sys.stderr.flush, lambda: os.write(3, record)):
        with contextlib.suppress(BaseException):  # the code may have closed them (exit code tells)
            finish()
    os.closerange(1, 4)  # last word said: the server answers now, not once the kernel unmaps us
    os._exit(0 if status == "ok" else 1)


# -------------------------------------------------------------------------------- the worker server
def _descendants(root: int) -> list[int]:
    """Pids below root, from /proc (used where the server is not a PID namespace's init)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(name))
        except (ValueError, OSError, IndexError):
            continue
    found, stack = [], [root]
    while stack:
        kids = children.get(stack.pop(), [])
        found += kids
        stack += kids
    return found


def kill_descendants(reap: bool = True) -> None:
    """SIGKILL every process below this server (the call child and whatever it left behind); reap:
    and wait until every one is gone. (A process with SIGKILL pending runs no more of its code.)"""
    while True:
        # kill(-1) from a PID namespace's init reaches every process in it but the init
        for pid in [-1] if os.getpid() == 1 else _descendants(os.getpid()):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not reap:
            return
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.001)
        except ChildProcessError:  # none left; orphans reparent to us (init or subreaper)
            return


def _watch(pid: int, reads: list[int], deadline: float,
           cap: int) -> tuple[str | None, int | None, list]:
    """Collect the call's pipes until the call is done, the deadline passes or a stream passes cap
    bytes. Done: its child wrote its status record and closed every pipe (the common case), or it
    exited. Then kill everything the call left and drain the pipes; reap here, unless the child was
    done before its exit: then the wait status is None and serve_call reaps after answering (the
    caller need not wait for the kernel to unmap the child). Returns (reason it was killed or None,
    wait status or None, bytes)."""
    pidfd, poller, reason = os.pidfd_open(pid), select.poll(), None
    bufs = [bytearray() for _ in reads]
    for fd in reads + [pidfd]:
        poller.register(fd, select.POLLIN)
    open_reads, done_early = set(reads), False
    while reason is None and not done_early:
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
                open_reads.discard(fd)
            elif len(buf) > cap:
                reason = "output_limit"
        word = bufs[2].partition(b"\n")[0].decode("utf-8", "replace")
        done_early = not open_reads and word in STATUSES
    wait_status = None
    if done_early:
        kill_descendants(reap=False)
    else:
        if reason:
            os.kill(pid, signal.SIGKILL)
        wait_status = os.waitpid(pid, 0)[1]
        kill_descendants()
        for fd, buf in zip(reads, bufs):  # every writer is dead; non-blocking in case one escaped
            os.set_blocking(fd, False)
            with contextlib.suppress(BlockingIOError):
                while len(buf) <= cap and (chunk := os.read(fd, 1 << 16)):
                    buf += chunk
    for fd in reads + [pidfd]:
        os.close(fd)
    return reason or ("output_limit" if max(map(len, bufs)) > cap else None), wait_status, bufs


def serve_call(request: dict, base: str, as_root: bool, namespaced: bool, answer,
               confinement: landlock_seccomp.Confinement, shm: str | None) -> None:
    """Fork one call child in a fresh directory under base, watch it, empty base (and shm, the
    private /dev/shm) of what the call wrote, answer(the outcome as ToolResult fields), then reap
    what is left to reap. Every process of the call is killed before the answer."""
    workdir = tempfile.mkdtemp(prefix="call-", dir=base)
    os.environ.update(HOME=workdir, TMPDIR=workdir)  # here, not in the child: fewer page faults
    if as_root:
        os.chown(workdir, NOBODY, NOBODY)
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, request["stdin"].encode("utf-8", "surrogatepass"))
    os.lseek(stdin_fd, 0, os.SEEK_SET)
    pipes = [os.pipe() for _ in range(3)]  # stdout, stderr, control
    vm_bytes = _vm_bytes()
    start = time.monotonic()
    if (pid := os.fork()) == 0:
        try:
            fds = [stdin_fd] + [w for _, w in pipes]
            _child(request, workdir, vm_bytes, fds, as_root, namespaced, confinement)
        finally:
            os._exit(125)  # whatever happens, a child never returns into the server loop
    for fd in [stdin_fd] + [w for _, w in pipes]:
        os.close(fd)
    deadline, cap = start + request["timeout"], request["max_bytes"]
    reason, wait_status, bufs = _watch(pid, [r for r, _ in pipes], deadline, cap)
    elapsed = time.monotonic() - start
    try:
        os.rmdir(workdir)  # the common case: the code wrote no files
    except OSError:
        shutil.rmtree(workdir, ignore_errors=True)
    if confinement.ruleset is not None:  # Landlock lets the call write anywhere below base
        empty(base, keep=SHM_NAME if shm else "")
    if shm:
        empty(shm)
    returncode = None if wait_status is None else os.waitstatus_to_exitcode(wait_status)
    answer({**describe(reason, returncode, bufs, request["timeout"], cap), "elapsed": elapsed})
    if wait_status is None:  # killed while it was exiting: reap it (once unmapped) and the rest
        os.waitpid(pid, 0)
        kill_descendants()


def empty(directory: str, keep: str = "") -> None:
    """Remove everything in directory but the entry named keep (one listdir when there is nothing)."""
    for name in os.listdir(directory):
        if name != keep:
            path = os.path.join(directory, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    args = [None if a is None else a.encode() for a in (source, target, fstype, data)]
    if _libc.mount(*args[:3], flags, args[3]) != 0:
        raise OSError(ctypes.get_errno(), f"mount {source} on {target}")


def private_scratch(base: str, size_mb: int) -> str | None:
    """Cover base with a tmpfs of size_mb, in this process's own mount namespace: the call
    directories, and so a call's files there, hold at most size_mb of RAM in all (writes past it
    fail with ENOSPC). A directory of it covers /dev/shm there, so that POSIX semaphores (the locks
    and queues of multiprocessing) work in a call; returns "/dev/shm" then, else None. Not root:
    first enter a user namespace of our own (our uid and gid mapped to themselves), whose
    capabilities allow the mounts, then drop them all, so no call can unmount them. Call while
    single-threaded and still dumpable."""
    as_root = os.geteuid() == 0
    if not as_root:
        uid, gid = os.getuid(), os.getgid()
        if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER | CLONE_NEWNS)")
        maps = {"setgroups": "deny", "uid_map": f"{uid} {uid} 1", "gid_map": f"{gid} {gid} 1"}
        for name, text in maps.items():
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    os.makedirs(base, exist_ok=True)
    _mount("tmpfs", base, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode=0711")
    shm = None
    if os.path.isdir("/dev/shm"):
        os.mkdir(private := os.path.join(base, SHM_NAME))
        os.chmod(private, 0o1777)  # (nobody writes there when we are root)
        _mount(private, "/dev/shm", None, MS_BIND, None)
        shm = "/dev/shm"
    if not as_root:
        header, data = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0), (ctypes.c_uint32 * 6)()
        if _libc.capset(header, data) != 0:  # effective, permitted and inheritable sets all empty
            raise OSError(ctypes.get_errno(), "capset")
    return shm


def expose_python_to_nobody() -> None:
    """Root, in the server's private mount namespace: cover each directory nobody cannot enter on
    the way to the Python install (e.g. /root, mode 0700) with a tmpfs and bind the install back, so
    imports work after the uid drop. This also hides the rest of that directory (root's keys,
    caches) from the code."""
    places = (sys.prefix, sys.base_prefix, *sys.path)
    roots = sorted({os.path.realpath(p) for p in places if p and os.path.isdir(p)})
    hidden: dict[str, list[str]] = {}
    for path in [p for p in roots if not any(p.startswith(q + "/") for q in roots)]:
        parts = path.split("/")
        ancestors = ["/".join(parts[:i]) for i in range(2, len(parts) + 1)]
        closed = [d for d in ancestors if not os.stat(d).st_mode & 1]
        if closed:  # the first ancestor without the execute bit for "other"
            hidden.setdefault(closed[0], []).append(path)
    for top, paths in hidden.items():
        keep = [os.open(p, os.O_PATH) for p in paths]  # the originals, before the tmpfs covers them
        _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for path, fd in zip(paths, keep):
            os.makedirs(path, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
            os.close(fd)


def serve(options: dict, base: str) -> None:
    """Worker server main: warm up, then answer each JSON request line with one JSON reply line,
    until EOF. base: the directory (made by the caller, which removes it) that holds one fresh
    directory per call. options (from code_tool): preload, the modules to import; offer, the
    modules a call may import (read access beneath their import roots); scratch_mb > 0: cover base
    with a tmpfs of that size first, in the server's own mount namespace, and /dev/shm with a
    directory of it; landlock, the Landlock ABI each call confines itself with (0: none); seccomp,
    a filter on the server, which every call child inherits."""
    proto_in, proto_out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # a stray print can never corrupt the protocol
    os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    as_root, namespaced = os.geteuid() == 0, os.getpid() == 1
    if as_root and namespaced:
        try:
            expose_python_to_nobody()
        except OSError as exc:  # imports not preloaded may then fail for the call; all else holds
            print(f"code_tool: cannot expose the Python install to uid {NOBODY}: {exc}",
                  file=sys.stderr)
    shm = private_scratch(base, options["scratch_mb"]) if options["scratch_mb"] else None
    _libc.prctl(PR_SET_DUMPABLE, 0)  # a same-uid call child cannot ptrace its server
    if not namespaced:  # (a namespace's init gets no signal it has no handler for from the calls)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # close(): unwind through the finally
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1)  # a call's orphans reparent to us: kill_descendants
    for name in options["preload"]:
        with contextlib.suppress(Exception):
            __import__(name)
    if {"numpy", "sympy"} <= set(options["preload"]):
        exec(WARMUP, {})  # lazy imports and caches filled once, here, not in every call
    # What every call child inherits, set once here: no new privileges (setuid binaries give the
    # code none) and the seccomp filter; the Landlock ruleset, which a child enters with one system
    # call (sandbox/landlock_seccomp.py); the std streams (the child points fds 0-2 at its pipes): new ones
    # would cost every child.
    confinement = landlock_seccomp.Confinement(
        options["landlock"], options["seccomp"], (base, shm) if shm else (base,),
        tuple(landlock_seccomp.import_roots(options["offer"])), keep=CHOWN if as_root else ())
    confinement.filter_self()
    try_confinement(confinement)
    utf8_std_streams()
    gc.freeze()  # the warm heap stays out of the children's collections: fewer copy-on-write faults
    try:
        def answer(reply: dict) -> None:
            proto_out.write(json.dumps(reply).encode() + b"\n")
            proto_out.flush()
        answer({"ready": True})
        for line in proto_in:
            serve_call(json.loads(line), base, as_root, namespaced, answer, confinement, shm)
    finally:
        kill_descendants()
        shutil.rmtree(base, ignore_errors=True)


def try_confinement(confinement: landlock_seccomp.Confinement) -> None:
    """Enter the Landlock domain once in a throwaway child: where the kernel refuses it, the
    server stops at start with the reason on stderr (CodeTool then fails to start), rather than
    every call crashing."""
    if (pid := os.fork()) == 0:
        try:
            confinement.restrict()
            os._exit(0)
        except BaseException as exc:
            with contextlib.suppress(BaseException):
                os.write(2, f"code_tool: cannot confine a call here: {exc}\n".encode())
            os._exit(1)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        sys.exit(1)


def probe(base: str) -> None:
    """Run by code_tool's sandbox probe under unshare: print this process's pid (1 in a new PID
    namespace) and why private_scratch fails here ("" when it works)."""
    try:
        private_scratch(base, 1)
        error = ""
    except OSError as exc:
        error = str(exc)
    print(json.dumps({"pid": os.getpid(), "scratch_error": error}))


# --------------------------------------------------------------------------- the subprocess backend
def run_once(call_dir: str) -> None:
    """A call under the subprocess backend (code_tool.RUN_ONCE): this fresh interpreter is the call
    child. The caller wrote CALL_DIR/request.json, opened stdin, stdout and stderr on files in
    CALL_DIR and made CALL_DIR/work the working directory ($HOME, $TMPDIR); this sets the limits
    (here, not in a preexec_fn, which is unsafe in a threaded caller) and, on Linux, the Landlock
    domain (CALL_DIR/work writable; the import roots the caller found read) and the seccomp filter
    the request names, runs the code and writes the status record to CALL_DIR/status (opened before
    the Landlock domain closes it)."""
    with open(os.path.join(call_dir, "request.json"), encoding="utf-8") as f:
        request = json.load(f)
    workdir = os.path.join(call_dir, "work")
    status_file = open(os.path.join(call_dir, "status"), "wb")
    if resource is not None:  # POSIX; memory only where the address space can be read (Linux)
        set_limits(request, _vm_bytes() if sys.platform.startswith("linux") else None)
    tempfile.tempdir, sys.argv, sys.path[0] = workdir, [""], workdir
    utf8_std_streams()
    if sys.platform.startswith("linux"):
        try:
            confinement = landlock_seccomp.Confinement(request["landlock"], request["seccomp"],
                                                       (workdir,), tuple(request["roots"]))
            confinement.filter_self()
            confinement.restrict()
            if confinement.ruleset is not None:
                os.close(confinement.ruleset)
        except OSError as exc:
            status_file.write(f"crash\nsandbox setup failed: {exc!r}".encode())
            status_file.close()
            os._exit(125)
    status, echo = execute(request["code"], request["echo"])
    for flush in (sys.stdout.flush, sys.stderr.flush):
        with contextlib.suppress(BaseException):  # the code may have closed them
            flush()
    with contextlib.suppress(OSError), status_file:
        status_file.write(f"{status}\n{echo}".encode("utf-8", "backslashreplace"))
    os._exit(0 if status == "ok" else 1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"] and len(sys.argv) == 4:
        serve(json.loads(sys.argv[2]), sys.argv[3])
    elif sys.argv[1:2] == ["--probe"] and len(sys.argv) == 3:
        probe(sys.argv[2])
    else:
        sys.exit("usage: sandbox/code_sandbox.py --serve OPTIONS_JSON BASE_DIR | --probe DIR  "
                 "(started by code_tool.CodeTool)")
