"""The process pool behind reward.py's slow path: pre-started worker processes that run an equality check
(reward.py's CheckPool: Math-Verify) on (pred, gold) pairs, with a wall-clock bound per check. A check that does not
answer within its timeout scores 0 as "timeout"; its worker is killed and replaced in the background (about 1 s to
import sympy), so only a check that finds every worker busy or restarting waits longer. No signal.alarm, so any
thread may call it. Nothing starts at import, nor when a pool is made: its first `run` starts the workers.

Workers are fresh interpreters (never a fork of the caller, which may hold threads and CUDA state) that import the
worker loop and the check by module name, so the calling program itself is never run again in them: a script
without an `if __name__ == "__main__":` guard works, and so does a program read from stdin or -c. Only code that
lives in the caller's script (a custom `equal_fn` defined there) is loaded from that file, which then needs the
guard, as for multiprocessing's spawn."""
import json
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

WORKER_MEMORY_BYTES = 2 << 30  # address-space cap per worker; a runaway expansion fails with MemoryError -> 0


def _worker_loop(conn, equal_fn, memory_bytes: int) -> None:
    """Body of one worker process: answer (pred, gold) jobs until sent None or the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it closes the pool
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ImportError, ValueError, OSError):  # no such limit on this platform: the timeout still bounds the check
        pass
    equal_fn("1", "1")  # import sympy and friends before saying ready
    conn.send("ready")
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        if job is None:
            return
        try:
            result = bool(equal_fn(*job))
        except Exception:  # parser errors, RecursionError, MemoryError: not equivalent
            result = False
        conn.send(result)


# A worker is a fresh interpreter running this, argv = [sys.path (JSON), where _worker_loop is, where equal_fn is,
# the fd of its end of the pipe, memory_bytes]. "Where" is [module, file, qualified name]: a module is imported by
# name, so the caller's script is never run again; only code that lives in that script (file given) is loaded from
# it, under another name than "__main__" (as multiprocessing's spawn does), so its `if __name__ == "__main__":` part
# does not run.
_WORKER_BOOT = """
import importlib, importlib.util, json, sys
from multiprocessing.connection import Connection
sys.path[:] = json.loads(sys.argv[1])
def find(module, file, name):
    if file and module not in sys.modules:
        spec = importlib.util.spec_from_file_location(module, file)
        sys.modules[module] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module])
    found = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found
find(*json.loads(sys.argv[2]))(Connection(int(sys.argv[4])), find(*json.loads(sys.argv[3])), int(sys.argv[5]))
"""
_WORKER_ENV = "REWARD_CHECK_WORKER"  # set inside workers: a worker never starts workers of its own


def _where(fn) -> list[str]:
    """[module, file, qualified name] by which a fresh interpreter finds the module-level function `fn`."""
    if "<" in fn.__qualname__:
        raise RuntimeError(f"reward check workers cannot import {fn.__qualname__}: use a module-level function")
    if fn.__module__ != "__main__":
        return [fn.__module__, "", fn.__qualname__]
    main = sys.modules["__main__"]
    if getattr(main, "__spec__", None) is not None:  # python -m package.module
        return [main.__spec__.name, "", fn.__qualname__]
    file = getattr(main, "__file__", None)
    if not file or not os.path.isfile(file):
        raise RuntimeError(f"reward check workers cannot import {fn.__qualname__}: it lives in a program read from "
                           f"stdin, -c or a notebook; define it in a module file (for reward.py: import it)")
    return ["__main_script__", os.path.abspath(file), fn.__qualname__]


@dataclass(eq=False)
class _Worker:
    process: subprocess.Popen
    conn: object  # multiprocessing Connection to the worker
    generation: int  # the pool's generation it was started in (close() starts a new one)
    ready: bool = False


class CheckPool:
    """Pre-started worker processes that run `equal_fn(pred, gold)`; one that overruns `timeout_s` is killed and
    replaced. `equal_fn` must be a module-level function (workers import it by name).

    Thread-safe: each call takes an idle worker, so up to `workers` checks run at once. Started lazily by the first
    `run`; `close()` stops every worker (a later `run` starts them again). Each worker is stopped exactly once, by
    whoever takes it out of the live set: a check that timed out, or close(); a check whose worker close() took
    only closes its end of the pipe.
    """

    def __init__(self, workers: int, timeout_s: float, equal_fn, startup_s: float = 300.0,
                 memory_bytes: int = WORKER_MEMORY_BYTES):
        self.workers, self.timeout_s, self.startup_s = workers, timeout_s, startup_s
        self._memory_bytes = memory_bytes
        self._places = [json.dumps(_where(_worker_loop)), json.dumps(_where(equal_fn))]
        self._idle: queue.Queue = queue.Queue()
        self._live: set = set()  # started and not yet stopped; idle or busy with a check
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()  # one start() spawns the workers, concurrent first calls wait for it
        self._generation = 0  # bumped by close(): a worker of an older generation is never put back to work

    def _spawn(self, generation: int) -> None:
        """Start one worker; if close() came in between, stop it again at once."""
        parent, child = mp.Pipe()
        paths = [path or os.getcwd() for path in sys.path]
        command = [sys.executable, "-c", _WORKER_BOOT, json.dumps(paths), *self._places, str(child.fileno()),
                   str(self._memory_bytes)]
        try:
            process = subprocess.Popen(command, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL,
                                       env={**os.environ, _WORKER_ENV: "1"})
        except OSError:
            parent.close()
            raise
        finally:
            child.close()
        worker = _Worker(process, parent, generation)
        with self._lock:
            current = generation == self._generation
            if current:
                self._live.add(worker)
                self._idle.put(worker)
        if not current:
            self._stop(worker)

    def start(self) -> None:
        """Start the workers if none is running (returns at once; they import sympy in the background)."""
        if os.environ.get(_WORKER_ENV):
            raise RuntimeError("a reward check worker may not start workers: the program that imports reward.py's "
                               "code checks answers at import; put that under `if __name__ == \"__main__\":`")
        with self._start_lock:
            with self._lock:
                if self._live:
                    return
                generation = self._generation
            for _ in range(self.workers):
                self._spawn(generation)

    @staticmethod
    def _stop(worker: _Worker) -> None:
        """Kill and reap the worker's process and close our end of its pipe; called once per worker."""
        worker.process.kill()
        worker.process.wait()
        worker.conn.close()

    def _replace(self, worker: _Worker) -> None:
        self._stop(worker)
        if worker.generation == self._generation:  # not after close(); _spawn checks again under the lock
            self._spawn(worker.generation)

    def _release(self, worker: _Worker, healthy: bool) -> None:
        """After a check: a healthy worker goes back to the idle queue; a hung, crashed or unready one is stopped
        and replaced in the background (reaping a big process takes a while, the caller should not wait). If close()
        took the worker meanwhile, it has stopped the process; only our end of the pipe is left to close."""
        with self._lock:
            live = worker in self._live
            if live and healthy:
                self._idle.put(worker)
                return
            self._live.discard(worker)
        if live:
            threading.Thread(target=self._replace, args=(worker,), daemon=True).start()
        else:
            worker.conn.close()

    def run(self, pred: str, gold: str) -> tuple[bool, str]:
        """(equal, status) with status "slow" (answered), "timeout" (ran out of time) or "crash" (worker died)."""
        self.start()
        try:
            worker = self._idle.get(timeout=self.startup_s + self.timeout_s)
        except queue.Empty:
            return False, "timeout"  # every worker busy or stuck starting for a long time
        if not worker.ready:  # a fresh worker says "ready" once its imports are done (not charged to this check)
            problem = self._wait_ready(worker)
            if problem:  # a broken install or a stalled machine, not a hostile answer: say so, never score 0 forever
                self._release(worker, healthy=False)
                raise RuntimeError(f"reward check worker {problem}")
        try:
            worker.conn.send((pred, gold))
            if worker.conn.poll(self.timeout_s):
                equal = bool(worker.conn.recv())
                self._release(worker, healthy=True)
                return equal, "slow"
            status = "timeout"
        except (EOFError, OSError):
            status = "crash"
        self._release(worker, healthy=False)
        return False, status

    def _wait_ready(self, worker: _Worker) -> str | None:
        """Wait for a fresh worker's "ready" while its process lives (imports take seconds, and much longer on a
        loaded machine), at most startup_s; None when it is ready, else what went wrong."""
        deadline = time.monotonic() + self.startup_s
        try:
            while time.monotonic() < deadline:
                if worker.conn.poll(min(1.0, max(deadline - time.monotonic(), 0.0))):
                    worker.ready = worker.conn.recv() == "ready"
                    return None if worker.ready else "sent something other than 'ready'"
                if worker.process.poll() is not None:
                    break
        except (EOFError, OSError):
            pass
        if worker.process.poll() is None:
            return (f"did not start: still importing after {self.startup_s:g} s (an overloaded machine? raise "
                    f"CheckPool(startup_s=...))")
        return ("did not start: it exited before it was ready (is math-verify installed? can a fresh Python "
                "import reward.py?); see its traceback above")

    def close(self) -> None:
        """Stop every worker now: ask the idle ones to exit, give them half a second, then SIGKILL what is left.
        A busy worker's check ends as a crash; its caller closes its end of the pipe."""
        with self._lock:
            self._generation += 1
            workers, self._live = list(self._live), set()
        idle, newer = [], []  # newer: started by a run() that came after this close() began
        while True:
            try:
                worker = self._idle.get_nowait()
            except queue.Empty:
                break
            (idle if worker in workers else newer).append(worker)
        for worker in newer:
            self._idle.put(worker)
        for worker in idle:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in workers:
            try:
                worker.process.wait(timeout=0.5 if worker in idle else 0)
            except subprocess.TimeoutExpired:
                pass
            worker.process.kill()
            worker.process.wait()
        for worker in idle:
            worker.conn.close()
