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
  import numpy, sympy, ... once and fork a child per call; the caller talks to all of them from one thread.
  Half preload only the standard library, for calls that import nothing else (`needs_heavy`).
- "subprocess" (any platform): a new interpreter per call, watched by one of W threads of the caller; less
  isolated, and the tool says so once on stderr when it is chosen.
This file is the tool's contract and how one call travels (parse it once, pick its lane, queue it, get a
`ToolResult`); the backends' machinery (servers, their pool, the subprocesses) is plumbing/tool_backends.py, and
which sandbox this machine allows, with its one-line description, plumbing/tool_sandbox.py.

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
import json
import os
import re
import sys
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

from plumbing.tool_backends import LIGHT_HELP_AFTER_S, Pool, Server, Subprocesses, WorkerDied
# the tool's sandbox, chosen and described in plumbing/tool_sandbox.py, is part of its interface
from plumbing.tool_sandbox import BACKENDS, SANDBOX_PY, Sandbox, SandboxError, announce, choose_sandbox  # noqa: F401
from protocol import ERROR_FORMATS, render_result
from sandbox import landlock_seccomp
from sandbox.code_sandbox import PRELOAD

ENV_KEPT = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "SYSTEMROOT")  # the caller's, kept for calls


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
        result = partial(ToolResult, max_chars=max_output_chars, error_format=error_format)  # how a backend answers
        if self.backend == "subprocess":
            self.light_workers = 0
            layers = {"landlock": sandbox.landlock, "seccomp": sandbox.seccomp,  # found once, here
                      "roots": landlock_seccomp.import_roots(preload) if sandbox.landlock else []}
            self._backend = Subprocesses(self.workers, limits, result, env, layers)
        else:
            light = [m for m in preload if m in sys.stdlib_module_names]
            wanted = self.workers // 2 if light_workers is None else light_workers
            self.light_workers = 0 if len(light) == len(preload) else \
                max(0, min(self.workers - 1, wanted))
            self._backend = self._pool(sandbox, env, (tuple(light), preload), limits, result)
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

    def _pool(self, sandbox: Sandbox, env: dict, preloads: tuple, limits: dict, result) -> Pool:
        """The servers (not started yet): the first light_workers preload preloads[0] (the standard
        library's part), the others preloads[1]; calls on any of them may import all of preloads[1]."""
        servers = []
        for i in range(self.workers):
            kind = "light" if i < self.light_workers else "heavy"
            options = {"preload": preloads[kind == "heavy"], "offer": preloads[1],
                       "scratch_mb": sandbox.scratch_mb, "landlock": sandbox.landlock,
                       "seccomp": sandbox.seccomp}
            serve = [*sandbox.prefix, sys.executable, SANDBOX_PY, "--serve", json.dumps(options)]
            servers.append(Server(serve, env, sandbox.mode == "namespaces", kind))
        return Pool(servers, limits, result, LIGHT_HELP_AFTER_S, os.cpu_count() or 1)

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
