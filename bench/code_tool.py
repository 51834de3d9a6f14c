"""Benchmark: CodeTool's two backends against one `python -c` subprocess per call, side by side in one run; then
a hostile soak on each backend.

Workloads: (a) trivial `print(2+2)`; (b) import sympy and solve a quadratic. For each, calls per second and p50/p99
latency (from issuing a call to its result) with 1, 16 and 256 calls kept in flight, three ways: the plain
alternative, what most RL codebases do, `subprocess.run([sys.executable, "-c", code], timeout=...)` on a thread
pool of that size (no limits, no notebook semantics); CodeTool on the worker servers (backend "servers", Linux);
and CodeTool on its portable backend (backend "subprocess", a fresh interpreter per call with the tool's limits:
what macOS and Windows run). Each row alternates blocks of the three (3 rounds; full run: 5) and reports the median
of the rounds' ratios to the plain way, since a shared machine's speed drifts within a run. The soak sends N calls
(2,000; --quick: 500) to each backend, one in ten hostile (infinite loop, memory bomb, output flood), and reports
lost or hung calls and the honest calls' throughput.

Also, side by side: the trivial calls on a pool without light servers (every server preloads numpy and sympy), and
the CPU one call costs each way. And what the kernel layers cost (sandbox/landlock_seccomp.py): the same calls on tools
with Landlock and seccomp and on tools without them (kernel_layers=False), alternating blocks over the rounds as
above: trivial calls at 1 and 16 in flight, the sympy solve, an import of numpy and sympy from disk (a pool that
preloads neither: every file the import opens passes Landlock's checks), trivial calls on the subprocess backend;
then CPU and child page faults per trivial call, each way, and the time a forked child takes to enter the Landlock
domain (`--layers-only`: just this part). The plain side starts sys.executable, so that interpreter's start-up is the
baseline: install this project as the Makefile does (`editable_mode=compat`); setuptools' default editable mode adds
an import hook to every start, which would flatter CodeTool.
Run: `.venv/bin/python bench/code_tool.py [--quick] [--workers W] [--layers-only]`.
"""
import argparse
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sandbox import landlock_seccomp  # noqa: E402
from sandbox.code_sandbox import PRELOAD  # noqa: E402
from code_tool import CodeTool, default_workers  # noqa: E402

TRIVIAL = "print(2+2)"
SYMPY = "import sympy as sp\nx = sp.Symbol('x')\nprint(sp.solve(x**2 - 5*x + 6, x))"
HOSTILE = ["while True:\n    pass", "x = bytearray(4 * 1024**3)", "while True:\n    print('x' * 10000)"]
HOSTILE_STATUS = ["timeout", "memory", "output_limit"]
PLAIN_MEMORY_CAP = 32  # the plain alternative with sympy runs at most this many interpreters at once (~50 MB each;
# 256 would need ~13 GB, and with both cores busy from 16 in flight on, more at once cannot raise its throughput)


def summarize(latencies: list[float], wall: float) -> tuple[float, float, float]:
    """(calls per second, p50 ms, p99 ms)."""
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return len(latencies) / wall, q[49] * 1e3, q[98] * 1e3


def plain(code: str, in_flight: int, n: int) -> tuple[list[float], float]:
    """n calls of a fresh interpreter each, in_flight at a time on a thread pool: (latencies, wall seconds)."""
    def one(_):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        return time.perf_counter() - start
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=in_flight) as pool:
        latencies = list(pool.map(one, range(n)))
    return latencies, time.perf_counter() - start


def closed_loop(tool: CodeTool, calls: list[str], in_flight: int) -> tuple[list, list[float], float]:
    """Keep in_flight calls submitted (as a rollout would); returns (results, latencies, wall seconds)."""
    gate, results, latencies, lock = threading.Semaphore(in_flight), [None] * len(calls), [], threading.Lock()

    def finished(future, i, start):
        with lock:
            latencies.append(time.perf_counter() - start)
            results[i] = future.result()
        gate.release()
    start = time.perf_counter()
    for i, code in enumerate(calls):
        gate.acquire()
        tool.submit(code).add_done_callback(lambda f, i=i, t=time.perf_counter(): finished(f, i, t))
    for _ in range(in_flight):  # wait for the last ones
        gate.acquire()
    return results, latencies, time.perf_counter() - start


def ours(tool: CodeTool, code: str, in_flight: int, n: int) -> tuple[list[float], float]:
    results, latencies, wall = closed_loop(tool, [code] * n, in_flight)
    assert all(r.ok for r in results), [r for r in results if not r.ok][:1]
    return latencies, wall


def side_by_side(runners: dict, rounds: int, baseline: str = "plain") -> tuple[dict, dict]:
    """Blocks of each side (name -> a function that runs one block and returns (latencies, wall seconds)), in a
    rotating order, `rounds` times (this shared machine's speed drifts within a run; each round compares like
    with like). Returns ({side: (calls/s, p50, p99) over all rounds}, {side: the rounds' throughput ratios to the
    baseline side})."""
    sides = {name: ([], 0.0) for name in runners}
    ratios = {name: [] for name in runners if name != baseline}
    names = list(runners)
    for r in range(rounds):
        rates = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            latencies, wall = runners[name]()
            rates[name] = len(latencies) / wall
            sides[name] = (sides[name][0] + latencies, sides[name][1] + wall)
        for name in ratios:
            ratios[name].append(rates[name] / rates[baseline])
    return {name: summarize(*value) for name, value in sides.items()}, ratios


def tree_cpu(pid: int) -> float:
    """CPU seconds of a process, its reaped children, and (recursively) its live children, from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total = sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                total += sum(tree_cpu(int(c)) for c in f.read().split())
    except OSError:  # it ended meanwhile
        return 0.0
    return total


def cpu_per_call(tool: CodeTool, portable: CodeTool, n: int) -> dict:
    """CPU ms per trivial call at 16 in flight: the plain interpreter; CodeTool's servers with their call children
    and its caller side; the subprocess backend's interpreters and its caller side. All of it is spent on the
    same cores, so it bounds the throughput."""
    def spent(who):
        r = resource.getrusage(who)
        return r.ru_utime + r.ru_stime
    before = spent(resource.RUSAGE_CHILDREN)
    plain(TRIVIAL, 16, n // 4)
    cpu = {"plain": (spent(resource.RUSAGE_CHILDREN) - before) / (n // 4) * 1e3}
    pids = tool.pids()
    servers, caller = sum(map(tree_cpu, pids)), spent(resource.RUSAGE_SELF)
    ours(tool, TRIVIAL, 16, n)
    cpu["servers"] = (sum(map(tree_cpu, pids)) - servers) / n * 1e3
    cpu["servers caller"] = (spent(resource.RUSAGE_SELF) - caller) / n * 1e3
    children, caller = spent(resource.RUSAGE_CHILDREN), spent(resource.RUSAGE_SELF)
    ours(portable, TRIVIAL, 16, n // 4)  # (its interpreters are reaped, so they count as children)
    cpu["subprocess"] = (spent(resource.RUSAGE_CHILDREN) - children) / (n // 4) * 1e3
    cpu["subprocess caller"] = (spent(resource.RUSAGE_SELF) - caller) / (n // 4) * 1e3
    return cpu


FAULTS = "import resource\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)"  # the call child's so far


def child_faults(extra: tuple[str, ...], n: int = 50, kernel_layers: bool = True) -> float:
    """Mean page faults a trivial call's child has taken by its last line (fork, confinement, compile, run), on a
    one-server pool of the light preload plus `extra`: what a module in a server costs every call it forks."""
    light = tuple(m for m in PRELOAD if m in sys.stdlib_module_names) + extra
    with CodeTool(workers=1, preload=light, kernel_layers=kernel_layers) as tool:
        return statistics.mean(int(r.stdout) for r in tool.run_batch([(FAULTS, "")] * n))


def servers_cpu(tool: CodeTool, code: str, in_flight: int, n: int) -> float:
    """CPU ms per call on the servers (their call children included) and in the caller."""
    pids, caller = tool.pids(), resource.getrusage(resource.RUSAGE_SELF)
    before = sum(map(tree_cpu, pids)) + caller.ru_utime + caller.ru_stime
    ours(tool, code, in_flight, n)
    caller = resource.getrusage(resource.RUSAGE_SELF)
    return (sum(map(tree_cpu, pids)) + caller.ru_utime + caller.ru_stime - before) / n * 1e3


LAYERS_WORKLOADS = (  # (name, code, backend, light-only preload, in flight, calls per block at full scale)
    ("(a) print(2+2)", TRIVIAL, "servers", False, 1, 400), ("(a) print(2+2)", TRIVIAL, "servers", False, 16, 1000),
    ("(b) sympy solve", SYMPY, "servers", False, 16, 400),
    ("(c) import numpy, sympy from disk", "import numpy, sympy", "servers", True, 2, 12),
    ("(a) print(2+2), subprocess", TRIVIAL, "subprocess", False, 16, 160),
)


def entry_cost(n: int = 300) -> tuple[float, float]:
    """Microseconds a forked child spends entering the Landlock domain (Confinement.restrict, all a call child does
    for it) and the page faults that takes, each the mean over n forks of this process, minus a child that does
    nothing in its place."""
    confinement = landlock_seccomp.Confinement(landlock_seccomp.landlock_abi(), False, (tempfile.gettempdir(),))
    spent = {}
    for enter in (False, True):
        read, write = os.pipe()
        total = faults = 0.0
        for _ in range(n):
            if (pid := os.fork()) == 0:
                before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
                if enter:
                    confinement.restrict()
                took = time.perf_counter() - start
                os.write(write, f"{took} {resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}\n".encode())
                os._exit(0)
            os.waitpid(pid, 0)
            took, fault = os.read(read, 100).split()
            total, faults = total + float(took), faults + int(fault)
        os.close(read)
        os.close(write)
        spent[enter] = (total / n * 1e6, faults / n)
    return spent[True][0] - spent[False][0], spent[True][1] - spent[False][1]


def layers_cost(workers: int, scale: float, rounds: int) -> None:
    """What Landlock and seccomp cost: each workload on a tool with the kernel layers and one without
    (kernel_layers=False), alternating in one run; then CPU and page faults per trivial call, each way."""
    tools, rows = {}, []
    with contextlib.ExitStack() as stack:
        for backend, light in dict.fromkeys((w[2], w[3]) for w in LAYERS_WORKLOADS):
            for layers in (True, False):
                tools[backend, light, layers] = stack.enter_context(CodeTool(
                    workers=workers, timeout=30.0, backend=backend, preload=("math",) if light else PRELOAD,
                    kernel_layers=layers))
        on = tools["servers", False, True]
        print(f"\nkernel layers: {on.layers or 'none here'} ({on.sandbox_line.split(' (')[0]}) against none")
        for tool in tools.values():
            tool.run_batch([(TRIVIAL, "")] * workers)
        for name, code, backend, light, in_flight, n in LAYERS_WORKLOADS:
            size = max(int(n * scale / rounds), 2 * in_flight)
            runners = {side: (lambda t=tools[backend, light, side == "with"]: ours(t, code, in_flight, size))
                       for side in ("without", "with")}
            rows.append((name, in_flight, *side_by_side(runners, rounds, baseline="without")))
        cpu = {True: [], False: []}
        for layers in (True, False) * rounds:  # alternating; the median of each side
            cpu[layers].append(servers_cpu(tools["servers", False, layers], TRIVIAL, 16, int(1000 * scale / rounds)))
        cpu = {layers: statistics.median(spent) for layers, spent in cpu.items()}
    print(f"{'workload':<34} {'in flight':>9} | {'with: calls/s':>13} {'p50 ms':>7} {'p99 ms':>7} | "
          f"{'without':>8} {'p50 ms':>7} {'p99 ms':>7} | with / without: median of {rounds} rounds (range)")
    for name, in_flight, summary, ratios in rows:
        (w_rate, w50, w99), (o_rate, o50, o99) = summary["with"], summary["without"]
        r = ratios["with"]
        print(f"{name:<34} {in_flight:>9} | {w_rate:>13.1f} {w50:>7.1f} {w99:>7.1f} | {o_rate:>8.1f} {o50:>7.1f} "
              f"{o99:>7.1f} | {statistics.median(r):.3f}x ({min(r):.3f}-{max(r):.3f})")
    faults = {layers: child_faults((), kernel_layers=layers) for layers in (True, False)}
    print(f"CPU per trivial call at 16 in flight (servers, their call children and the caller): with {cpu[True]:.2f} "
          f"ms, without {cpu[False]:.2f} ms ({cpu[True] / cpu[False] - 1:+.1%}); page faults of a trivial call's "
          f"child: with {faults[True]:.0f}, without {faults[False]:.0f}")
    if landlock_seccomp.landlock_abi():
        micros, faults = entry_cost()
        print(f"A forked child entering the Landlock domain (its one system call): {micros:.0f} us, {faults:.1f} "
              "page faults more than a child that does not")


def soak(tool: CodeTool, n: int, in_flight: int) -> dict:
    """n calls, every tenth hostile; lost = an honest call without its right answer, hung = no result in time."""
    calls = [HOSTILE[(i // 10) % 3] if i % 10 == 9 else f"print({i} * {i})" for i in range(n)]
    results, _, wall = closed_loop(tool, calls, in_flight)
    honest = [(i, r) for i, r in enumerate(results) if i % 10 != 9]
    hostile = [(i, r) for i, r in enumerate(results) if i % 10 == 9]
    return {"calls": n, "wall_s": wall, "hung": sum(r is None for r in results),
            "lost": sum(r is None or r.stdout != f"{i * i}\n" for i, r in honest),
            "hostile_wrong_status": sum(r is None or r.status != HOSTILE_STATUS[(i // 10) % 3] for i, r in hostile),
            "honest_per_s": len(honest) / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, about two minutes")
    parser.add_argument("--workers", type=int, default=default_workers())
    parser.add_argument("--layers-only", action="store_true", help="only what Landlock and seccomp cost")
    args = parser.parse_args()
    scale, plain_cap = (0.25, 16) if args.quick else (1.0, PLAIN_MEMORY_CAP)
    rounds = 3 if args.quick else 5
    print(f"cores: {os.cpu_count()}, workers: {args.workers}, python: {sys.version.split()[0]}, quick: {args.quick}, "
          f"load average at start: {os.getloadavg()[0]:.1f} (other work on the machine slows both sides)")
    if args.layers_only:
        layers_cost(args.workers, scale, rounds)
        return
    rows = []
    with CodeTool(workers=args.workers, timeout=10.0) as tool, \
            CodeTool(workers=args.workers, timeout=10.0, backend="subprocess") as portable:
        print(f"sandbox: {tool.sandbox}, light servers (standard-library preload): {tool.light_workers} of "
              f"{tool.workers}; subprocess backend: {portable.workers} calls at once")
        tool.run_batch([(SYMPY, "")] * args.workers * 2)  # warm the servers' first-call paths
        portable.run_batch([(SYMPY, "")] * 2)  # and the page cache for sympy's files
        for name, code, plain_n, our_n in (("(a) print(2+2)", TRIVIAL, 160, 1000), ("(b) sympy solve", SYMPY, 24, 400)):
            for in_flight in (1, 16, 256):
                plain_flight = in_flight if code == TRIVIAL else min(in_flight, plain_cap)
                sizes = (max(int(plain_n * scale / rounds), plain_flight if in_flight > 1 else 4),
                         max(int(our_n * scale / rounds), 2 * in_flight if in_flight > 1 else 20))
                runners = {"plain": lambda: plain(code, plain_flight, sizes[0]),
                           "servers": lambda: ours(tool, code, in_flight, sizes[1]),
                           "subprocess": lambda: ours(portable, code, plain_flight, sizes[0])}
                rows.append((name, in_flight, plain_flight, *side_by_side(runners, rounds)))
                print(f"  done {name} at {in_flight} in flight", file=sys.stderr)
        cpu = cpu_per_call(tool, portable, int(2000 * scale))
    print(f"\n{'':<26} | {'plain: python -c':^24} | {'CodeTool, servers':^24} | {'CodeTool, subprocess':^24} | "
          f"ratio to plain: median of {rounds} rounds (range)")
    print(f"{'workload':<16} {'in flight':>9} | " + " | ".join([f"{'calls/s':>8} {'p50 ms':>7} {'p99 ms':>7}"] * 3)
          + f" | {'servers':>15} {'subprocess':>15}")
    for name, in_flight, plain_flight, summary, ratios in rows:
        flight = f"{in_flight}" if plain_flight == in_flight else f"{in_flight} ({plain_flight}*)"
        cells = [f"{rate:>8.1f} {p50:>7.1f} {p99:>7.1f}" for rate, p50, p99 in summary.values()]
        spans = [f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})" for r in ratios.values()]
        print(f"{name:<16} {flight:>9} | " + " | ".join(cells) + " | " + " ".join(f"{x:>15}" for x in spans))
    # The light servers' share, side by side: the same trivial calls on a pool where every server preloads numpy/sympy.
    with CodeTool(workers=args.workers, timeout=10.0, light_workers=0) as heavy_only:
        heavy_only.run_batch([(TRIVIAL, "")] * args.workers * 2)
        for in_flight in (1, 16):
            rate, p50, p99 = summarize(*ours(heavy_only, TRIVIAL, in_flight, max(int(1000 * scale), 20)))
            light = next(r[3]["servers"] for r in rows if r[0] == "(a) print(2+2)" and r[1] == in_flight)
            print(f"(a) without light servers, {in_flight:>3} in flight: {rate:.1f} calls/s, p50 {p50:.1f} ms, "
                  f"p99 {p99:.1f} ms; with them: {light[0]:.1f} calls/s, p99 {light[2]:.1f} ms "
                  f"({light[0] / rate:.2f}x the throughput)")
    cores = os.cpu_count() or 1
    servers_ms, portable_ms = cpu["servers"] + cpu["servers caller"], cpu["subprocess"] + cpu["subprocess caller"]
    print(f"CPU per trivial call at 16 in flight: plain interpreter {cpu['plain']:.1f} ms; CodeTool on servers "
          f"{servers_ms:.2f} ms (servers and their call children {cpu['servers']:.2f}, caller "
          f"{cpu['servers caller']:.2f}); CodeTool on the subprocess backend {portable_ms:.1f} ms (interpreters "
          f"{cpu['subprocess']:.1f}, caller {cpu['subprocess caller']:.2f}). On {cores} cores that caps them at "
          f"~{cores * 1e3 / cpu['plain']:.0f}, ~{cores * 1e3 / servers_ms:.0f} and ~{cores * 1e3 / portable_ms:.0f} "
          f"calls/s; subprocess backend / servers: {portable_ms / servers_ms:.1f}x the CPU per call")
    base = child_faults(())
    print(f"Page faults of a trivial call's child on a light server: {base:.0f}; with `threading` in the server too "
          f"(its at-fork handler, which sandbox/code_sandbox.py keeps out): +{child_faults(('threading',)) - base:.0f}")
    if any(r[1] != r[2] for r in rows):
        print(f"* the plain alternative with sympy ran at most {plain_cap} interpreters at once (~50 MB each); "
              "with every core busy its throughput cannot rise with more")
    layers_cost(args.workers, scale, rounds)
    for backend in ("servers", "subprocess"):
        n = int(2000 * scale) if backend == "servers" else int(500 * scale)  # (the portable one is slower)
        with CodeTool(workers=args.workers, timeout=1.0, backend=backend) as tool:
            report = soak(tool, n, in_flight=256)
        print(f"\nsoak, {backend}: {report['calls']} calls (1 in 10 hostile: loop / 4 GB bomb / print flood; "
              f"timeout 1 s) in {report['wall_s']:.1f} s: lost {report['lost']}, hung {report['hung']}, hostile "
              f"with the wrong status {report['hostile_wrong_status']}, honest calls {report['honest_per_s']:.0f}/s")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
