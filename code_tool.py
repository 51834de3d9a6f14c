"""The model's only tool, `execute_python_code_with_standard_io(code, input)` (rstar2-agent.md sections 2 and 5).

Each call runs `code` in a fresh interpreter state with `input` on stdin and returns what a notebook shows: stdout;
if nothing was printed and the code ends in a bare expression other than None, that value's repr (`x = 1` shows
nothing); on error the traceback, cut to the frames of the model's code. `ToolResult.render()` is the text the model
reads: the status word, a newline, then stdout and stderr cut in the middle ("ok\n4\n" for `print(2+2)`); with
`error_format="last_line"` a failed call shows only the exception line of its traceback.

Design (the report's separate code service, on one machine): the caller never forks. It starts W worker servers
(code_sandbox.py) with subprocess and talks JSON lines to all of them from one thread (_Pool). A server imports
numpy, sympy, ... once (PRELOAD), then forks a child per call (a "zygote": about 3 ms of CPU against 15-18 ms for a
new python, 0.5 s or more with sympy). Half the servers preload only the standard-library modules: a call whose code
imports nothing else (`needs_heavy`) goes to one of those, whose fork costs about half; heavy servers help with such
calls only where a core may be free (pick_lane). The caller parses the code once, to route it and to find the
expression a notebook echoes. The child drops to uid 65534 (nobody) when the server is root, sets hard rlimits
(address space, file size, core, CPU), chdirs to a fresh temporary directory (also $HOME and $TMPDIR), reads stdin
from a memfd and writes into pipes. The fork is the fresh state: builtins patched, chdir, closed descriptors,
os._exit or a segfault end with the child. The server enforces the wall-clock timeout from outside with SIGKILL (no
code can ignore or block it) and stops reading at max_output_bytes per stream, killing the call. When the call ends,
every process it left (setsid() grandchildren, double-forked daemons) is killed (SIGKILL: it runs no more code)
before the result goes back, and reaped; threads die with it. The result goes back as soon as the child has written
its status and closed its pipes, without waiting for the kernel to unmap it. code_sandbox.py's docstring says what a
call costs and why the server imports so little.

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
  and cannot import modules from a Python under /root beyond those the server holds (PRELOAD and code_sandbox's).
A server that dies or stops answering is replaced and the call it held reports "crash"; close(), garbage collection
and interpreter exit end every process the tool started (a caller killed with SIGKILL leaves servers that exit at
EOF on their stdin, after at most one call).

Not covered: this is not a security boundary against a determined attacker (no seccomp; the kernel is exposed). The
filesystem is NOT blocked: code can read world-readable files and write world-writable places (/tmp, /dev/shm),
where files outlive the call (each capped at code_sandbox.FILE_LIMIT_MB). memory_mb caps each process's address
space beyond the warm server's, not the sum over processes a call starts. Fork bombs stop at
code_sandbox.NPROC_LIMIT processes as nobody, and otherwise only at the timeout. CPU is shared between calls only by
the kernel scheduler.

Demo: `.venv/bin/python code_tool.py`. Tests: tests/test_code_tool.py. Benchmark: bench/code_tool.py.
"""
from __future__ import annotations

import ast
import contextlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import code_sandbox
from code_sandbox import PRELOAD, echo_span

REPLY_GRACE_S = 10.0  # the caller declares a server dead when no reply comes timeout + this many seconds after sending
READY_TIMEOUT_S = 120.0  # how long a starting server may take to import PRELOAD
LIGHT_HELP_AFTER_S = 0.1  # a light call running longer is "slow": heavy servers help when too few light ones are quick
ERROR_FORMATS = ("full", "last_line")  # how ToolResult.render() shows a failed call's stderr


@dataclass
class ToolResult:
    status: str  # one of code_sandbox.STATUSES
    stdout: str = ""  # what the code printed (decoded with replacement), or the echoed value of its last expression
    stderr: str = ""  # what it wrote to stderr, then the compact traceback or the reason it was stopped
    elapsed: float = 0.0  # seconds from fork to the child's last word or exit, on the server (no queueing)
    max_chars: int = field(default=1000, repr=False)  # render()'s default cut, the tool's max_output_chars
    error_format: str = field(default="full", repr=False)  # render()'s default, the tool's error_format

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def render(self, max_chars: int | None = None, error_format: str | None = None) -> str:
        """Text the model sees: the status word on the first line, then stdout, then stderr, the body cut in the
        middle to max_chars. `print(2+2)` renders as "ok\\n4\\n"; a failure as "error\\n...ZeroDivisionError: x\\n".
        error_format (ERROR_FORMATS): "full" shows a failed call's stderr whole (the compact traceback); "last_line"
        only its last line, the exception ("NameError: name 'x' is not defined"), as agent setups that cut
        tracebacks to save context do. A successful call's stderr is always shown whole."""
        error_format = error_format or self.error_format
        if error_format not in ERROR_FORMATS:
            raise ValueError(f"error_format must be one of {ERROR_FORMATS}, got {error_format!r}")
        stderr = self.stderr
        if error_format == "last_line" and not self.ok:
            stderr = last_line(stderr)
        body = self.stdout
        if stderr:
            body += ("" if body.endswith("\n") or not body else "\n") + stderr
        return self.status + "\n" + cut_middle(body, self.max_chars if max_chars is None else max_chars)


def last_line(text: str) -> str:
    """The last non-blank line of text, with its newline ("" when there is none)."""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] + "\n" if lines else ""


def cut_middle(text: str, max_chars: int) -> str:
    """Keep the first and last max_chars/2 characters, with a marker saying how many were cut between them."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    return f"{text[:head]}\n...[{len(text) - max_chars} chars cut]...\n{text[len(text) - (max_chars - head):]}"


def parse(code: str) -> ast.Module | None:
    """The code's syntax tree, or None where it does not parse: the call child then compiles it and reports the
    SyntaxError (or the ValueError of a null byte, the RecursionError of deep nesting) as the code's error."""
    try:
        return ast.parse(code)
    except Exception:
        return None


def needs_heavy(code: str, tree: ast.Module | None) -> bool:
    """Whether a call should go to a server with the third-party PRELOAD modules (numpy, sympy): True when the code
    imports anything outside the standard library, or imports dynamically. tree: parse(code); code that does not
    parse is light (it fails at once anywhere). A wrong guess only costs time: a light server imports what it must."""
    if "__import__" in code or "importlib" in code:
        return True
    for node in ast.walk(tree) if tree else ():
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(name.split(".")[0] not in sys.stdlib_module_names for name in names):
            return True
    return False


def default_workers() -> int:
    """Four servers per core: calls that sleep, or burn a core until their timeout, leave the others work to do;
    each warm server holds about 70 MB (numpy + sympy)."""
    return 4 * (os.cpu_count() or 1)


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
    """A worker server exited, broke the protocol or stopped answering."""


class _Server:
    """One worker server process and its pipes, driven by the pool (_Pool). Its state: "starting" (the ready line is
    due by `deadline`), "idle", "busy" (on `future`, whose answer is due by `deadline`, since `since`), "failed"
    (a send failed; the pool's thread restarts it) or "down" (to start again at `deadline`)."""

    def __init__(self, cmd: list[str], env: dict, namespaced: bool, kind: str = "heavy"):
        self.cmd, self.env, self.namespaced, self.kind = cmd, env, namespaced, kind  # kind: which calls it takes
        self.proc, self.buf, self.base = None, b"", None
        self.state, self.future, self.deadline, self.since, self.error = "down", None, 0.0, 0.0, None

    def start(self) -> None:
        # tmpfs when there is one: on ext4 with discard, creating and removing a directory cost 3 ms per call
        self.base = tempfile.mkdtemp(prefix="codetool-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
        os.chmod(self.base, 0o711)  # nobody may enter its own call directory but not list the others
        self.proc = subprocess.Popen([*self.cmd, self.base], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.env, start_new_session=True)  # a Ctrl-C to the caller stays here
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


def pick_lane(kind: str, queued: dict[str, int], idle_light: int, light_ages: list[float], cores: int,
              help_after: float) -> str | None:
    """The queue an idle server of this kind takes its next call from, if any. A light server takes light calls; a
    heavy one takes heavy calls first, and light calls only when no light server is idle and fewer than `cores`
    light servers are on calls younger than help_after seconds (light_ages: how long each busy light server has been
    on its call). A heavy server's fork costs a trivial call about twice the CPU of a light one, so it helps only
    where a core may be free: enough quick light servers keep every core busy at half the price."""
    if kind == "heavy" and queued["heavy"]:
        return "heavy"
    quick = sum(age < help_after for age in light_ages)
    if queued["light"] and (kind == "light" or (idle_light == 0 and quick < cores)):
        return "light"
    return None


class _Pool:
    """The servers and the calls queued for them, driven by one thread (run()): it reads every answer, hands the
    next calls out, enforces reply deadlines and restarts dead servers. submit() gives a call straight to an idle
    server from the caller's thread. (A thread per server cost the caller 0.47-0.52 ms of CPU per call at 16 in
    flight against 0.35-0.38 for this, most of it thread switches and GIL hand-offs.)"""

    def __init__(self, servers: list[_Server], limits: dict, max_chars: int, help_after: float, cores: int,
                 error_format: str = "full"):
        self.servers, self.limits, self.max_chars, self.error_format = servers, limits, max_chars, error_format
        self.help_after, self.cores = help_after, cores
        self.lock, self.queues, self.closed = threading.Lock(), {"light": deque(), "heavy": deque()}, False
        self.wake_r, self.wake_w = os.pipe()  # close(), failed sends and waiting light calls wake the thread
        os.set_blocking(self.wake_w, False)
        self.sleep_until = 0.0  # when the thread wakes at the latest
        self.thread = threading.Thread(target=self.run, daemon=True, name="code-tool")

    def _hand_out(self) -> list[tuple[_Server, dict]]:
        """Under the lock: give queued calls to idle servers (light servers first), marking them busy."""
        given, now = [], time.monotonic()
        for server in sorted(self.servers, key=lambda s: s.kind != "light"):
            while server.state == "idle":
                light = [s for s in self.servers if s.kind == "light"]
                lane = pick_lane(server.kind, {k: len(q) for k, q in self.queues.items()},
                                 sum(s.state == "idle" for s in light if s is not server),
                                 [now - s.since for s in light if s.state == "busy"], self.cores, self.help_after)
                if lane is None:
                    break
                request, future = self.queues[lane].popleft()
                if future.set_running_or_notify_cancel():
                    server.state, server.future, server.since = "busy", future, now
                    server.deadline = now + self.limits["timeout"] + REPLY_GRACE_S
                    given.append((server, request))
        return given

    def _send(self, given: list[tuple[_Server, dict]]) -> None:
        """Outside the lock: send each call to its server; a failed send leaves the restart to the pool's thread."""
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
            # a light call left waiting with a heavy server idle: the thread must wake when a light call turns slow
            helps = [s.since + self.help_after for s in self.servers if s.kind == "light" and s.state == "busy"]
            wake = lane == "light" and self.queues["light"] and min(helps, default=0.0) < self.sleep_until and \
                any(s.kind == "heavy" and s.state == "idle" for s in self.servers)
        self._send(given)
        if wake:
            self._wake()

    def _wake(self) -> None:
        with self.lock, contextlib.suppress(BlockingIOError):  # (a full pipe wakes the thread anyway)
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
        """The pool's thread: the server died or hung; its call fails, a new server starts in its slot."""
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
            for fd in [fd for fd, s in by_fd.items() if s.proc is None or s.proc.stdout.fileno() != fd]:
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
                    due += [s.since + self.help_after for s in self.servers if s.kind == "light" and s.state == "busy"]
                wait = min([1.0] + [t - now for t in due if t > now])  # the next deadline or help time (1 s at most)
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
                    if future is not None and not reply.get("ready"):  # (callbacks run here, outside the lock)
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

    def close(self) -> None:
        """Refuse new calls, fail the queued and running ones, and end every server (close(), GC or exit)."""
        with self.lock:
            self.closed = True
            queued = [future for queue in self.queues.values() for _, future in queue]
            for queue in self.queues.values():
                queue.clear()
        for future in queued:  # (the running ones are the pool thread's to fail, as it stops)
            if future.set_running_or_notify_cancel():
                self._crash(future, "code tool closed before the call ran\n")
        if self.thread.is_alive():
            self._wake()
            if self.thread is not threading.current_thread():  # (from a callback, it ends after this round)
                self.thread.join()
        else:  # never started (start-up failed)
            for server in self.servers:
                server.stop()
            self._close_wake()


class CodeTool:
    """A pool of warm worker servers for `execute_python_code_with_standard_io` calls; see the module docstring.

    workers: servers, i.e. calls running at once (default_workers()); timeout: wall-clock seconds per call;
    memory_mb: address space a call may add to the warm interpreter's; max_output_chars: ToolResult.render()'s
    default cut; error_format: its default error form (ERROR_FORMATS: "full" traceback or "last_line");
    max_output_bytes: bytes read per stream before the call is killed as "output_limit"; preload:
    modules each server imports once; light_workers: how many servers preload only its standard-library part
    (default half of them, when preload has more than that and workers >= 2). Calls that import nothing beyond the
    standard library (`needs_heavy`) go to those: forking a server without numpy and sympy costs about half. Heavy
    servers help with them only while fewer light servers than cores are on quick calls (see pick_lane)."""

    def __init__(self, workers: int | None = None, timeout: float = 4.0, memory_mb: int = 512,
                 max_output_chars: int = 1000, max_output_bytes: int = 1 << 20, preload: tuple = PRELOAD,
                 light_workers: int | None = None, error_format: str = "full"):
        if error_format not in ERROR_FORMATS:
            raise ValueError(f"error_format must be one of {ERROR_FORMATS}, got {error_format!r}")
        self.workers = workers or default_workers()
        self.sandbox, prefix = sandbox_prefix()
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")}  # no secrets
        env.update(LANG="C.UTF-8", HOME="/tmp", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        light = [m for m in preload if m in sys.stdlib_module_names]
        wanted = self.workers // 2 if light_workers is None else light_workers
        self.light_workers = 0 if len(light) == len(preload) else max(0, min(self.workers - 1, wanted))
        serve = [*prefix, sys.executable, os.path.abspath(code_sandbox.__file__), "--serve"]
        servers = [_Server(serve + [",".join(light if i < self.light_workers else preload)], env,
                           self.sandbox == "namespaces", "light" if i < self.light_workers else "heavy")
                   for i in range(self.workers)]
        limits = {"timeout": timeout, "memory_mb": memory_mb, "max_bytes": max_output_bytes}
        # the pool and its thread hold no reference to self, so garbage collection can close it
        self._pool = _Pool(servers, limits, max_output_chars, LIGHT_HELP_AFTER_S, os.cpu_count() or 1,
                           error_format)
        self._finalizer = weakref.finalize(self, self._pool.close)
        try:
            for server in servers:
                server.start()
            for server in servers:
                server.wait_ready()
        except (WorkerDied, OSError) as exc:
            self.close()
            raise RuntimeError(f"code tool worker failed to start: {exc}") from exc
        self._pool.thread.start()

    def submit(self, code: str, stdin: str = "") -> Future:
        """Queue one call; the Future resolves to its ToolResult (it never raises, nor waits past timeout + grace)."""
        future: Future = Future()
        tree = parse(code)  # once, here: for the lane and for the notebook echo (the call child only compiles)
        lane = "heavy" if not self.light_workers or needs_heavy(code, tree) else "light"
        self._pool.submit(lane, {"code": code, "stdin": stdin, "echo": echo_span(code, tree)}, future)
        return future

    def run(self, code: str, stdin: str = "") -> ToolResult:
        return self.submit(code, stdin).result()

    def run_batch(self, calls: list[tuple[str, str]]) -> list[ToolResult]:
        """Run (code, stdin) pairs concurrently on the pool; results in the order of calls."""
        return [f.result() for f in [self.submit(code, stdin) for code, stdin in calls]]

    def server_pids(self) -> list[int]:
        """Pids of the worker servers as the caller sees them (the unshare processes where namespaced)."""
        return [s.proc.pid for s in self._pool.servers if s.proc is not None]

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> CodeTool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    with CodeTool(workers=2, timeout=2.0) as tool:
        print(f"sandbox: {tool.sandbox}, workers: {tool.workers}")
        demos = [("print(2+2)", ""), ("import sympy as sp\nx = sp.Symbol('x')\nsp.solve(x**2 - 5*x + 6, x)", ""),
                 ("n = int(input())\nprint(sum(range(n + 1)))", "100"), ("x = 1\n1 / (x - 1)", ""),
                 ("while True: pass", ""), ("import os\nos.getuid()", "")]
        for (code, stdin), result in zip(demos, tool.run_batch(demos)):
            print(f"--- {code!r} ({result.elapsed * 1e3:.1f} ms)\n{result.render()}")
