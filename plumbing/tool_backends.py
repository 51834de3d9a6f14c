"""The code tool's two backends (code_tool.py's `CodeTool` builds one and hands it each call): the worker servers
(`Pool` of `Server`s, sandbox/code_sandbox.py's `--serve`, each forking a child per call, driven from one thread of
the caller) and the portable one (`Subprocesses`: a new interpreter per call, watched by the caller's threads).
Both take a call as {"code", "stdin", "echo"} with a Future, resolve it to what `result(**fields)` makes of the
call's status, stdout, stderr and elapsed seconds (a code_tool.ToolResult), never raise into it, and end every
process they started on `close()`. How the servers work and what they cost: sandbox/README.md."""
from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future

from plumbing.tool_sandbox import SANDBOX_PY
from sandbox import code_sandbox

REPLY_GRACE_S = 10.0  # a server is dead when no reply comes this long after the call's timeout
READY_TIMEOUT_S = 120.0  # how long a starting server may take to import PRELOAD
LIGHT_HELP_AFTER_S = 0.1  # a light call running longer is "slow": heavy servers may then help
POLL_S = 0.005  # subprocess backend: how often the running calls' deadlines and outputs are checked
# a subprocess-backend call: imported, not run as a script, so that its compiled bytecode is reused
RUN_ONCE = (f"import sys; sys.path[0] = {os.path.dirname(SANDBOX_PY)!r}; import code_sandbox; "
            "code_sandbox.run_once(sys.argv[1])")


class WorkerDied(Exception):
    """A worker server exited, broke the protocol or stopped answering."""


class Server:
    """One worker server process and its pipes, driven by the pool (Pool). Its state: "starting"
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


class Pool:
    """The servers and the calls queued for them, driven by one thread (run()): it reads every
    answer, hands the next calls out, enforces reply deadlines and restarts dead servers. submit()
    gives a call straight to an idle server from the caller's thread. One thread for all servers,
    not one each: fewer thread switches and GIL hand-offs in the caller per call."""

    def __init__(self, servers: list[Server], limits: dict, result, help_after: float, cores: int):
        self.servers, self.limits, self.result = servers, limits, result  # result(**fields) -> a ToolResult
        self.help_after, self.cores = help_after, cores
        self.lock, self.closed = threading.Lock(), False
        self.queues = {"light": deque(), "heavy": deque()}
        self.wake_r, self.wake_w = os.pipe()  # close(), failed sends, waiting light calls wake it
        os.set_blocking(self.wake_w, False)
        self.sleep_until = 0.0  # when the thread wakes at the latest
        self.thread = threading.Thread(target=self.run, daemon=True, name="code-tool")

    def _hand_out(self) -> list[tuple[Server, dict]]:
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

    def _send(self, given: list[tuple[Server, dict]]) -> None:
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
            future.set_result(self.result(status="crash", stderr=why))

    def _restart(self, server: Server, exc: Exception) -> None:
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
                        future.set_result(self.result(**reply))
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


class Subprocesses:
    """The portable backend: each call is a new interpreter running RUN_ONCE on a fresh CALL_DIR,
    started by one of `workers` daemon threads of the caller, which then waits for its exit. The
    call's stdin, stdout and stderr are files in CALL_DIR (no pipe can block, and any platform can
    read their sizes); one more thread (guard) kills the calls that pass their deadline or output
    cap. Then the call's process group is killed (POSIX) and the outcome described as the servers
    do (code_sandbox.describe)."""

    def __init__(self, workers: int, limits: dict, result, env: dict, layers: dict | None = None):
        self.limits, self.result, self.env = limits, result, env  # result(**fields) -> a ToolResult
        self.layers = layers or {"landlock": 0, "seccomp": False, "roots": []}  # each call's confinement
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

    def call(self, request: dict):
        """Run one call in a fresh directory, removed afterwards; never raises."""
        call_dir = tempfile.mkdtemp(prefix="codetool-")
        try:
            fields = self.run_in(call_dir, request)
        except OSError as exc:  # no interpreter, no disk space, ...
            fields = {"status": "crash", "stdout": "", "stderr": f"code tool failed: {exc}\n"}
        finally:
            shutil.rmtree(call_dir, ignore_errors=True)
        return self.result(**fields)

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
