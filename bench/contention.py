"""Tiny SFT beside a busy program: tokens/s alone and with a one-core busy loop, per thread policy, in one run.

    .venv/bin/python bench/contention.py [--steps 60 --rounds 2 --pin --late 0 --policies old,passive,one,new]

Each run is the SFT command a user types, `sft.py configs/tiny/sft.yaml ... max_steps=60`, on the tiny model and
task (made once in a temporary folder, or `--data FILE --model DIR`). For each policy it runs SFT alone, then
again with a busy loop (`while True: pass` in another Python process, pinned to core 0 with `--pin`, else wherever
the scheduler puts it) started before the SFT (or `--late S` seconds after it), alternating the two for `--rounds`
rounds; throughput is the mean of the logged `perf/tokens_per_s` after the first logged interval (warm-up). The
ratio busy / alone is the result: a policy that holds up keeps most of its own idle speed (a loop that takes one of
C cores leaves (C - 1) / C of the machine).

Policies (plumbing/cpu_threads.py explains the choice):
- old: torch's default, one thread per usable core, and GNU OpenMP's default wait (spin 300,000 rounds before
  sleeping: GOMP_SPINCOUNT=300000, which is what an unset OMP_WAIT_POLICY means to it);
- passive: as many threads, but waiting threads sleep (OMP_WAIT_POLICY=PASSIVE);
- one: one thread (`torch_threads=1`), passive waiting;
- new: the shipped config, `torch_threads: 0`: as many threads as free cores when it starts, passive waiting.
The CPU seconds of each sft.py process (start-up included; the same work in every run) are printed too:
spinning threads burn CPU without doing work.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from plumbing.cpu_threads import WAIT_POLICY_VARIABLES, usable_cores  # noqa: E402

BUSY_LOOP = "while True:\n    pass"


def policies(cores: int) -> dict[str, tuple[list[str], dict]]:
    """name -> (sft.py overrides, environment changes; None removes a variable)."""
    unset = {v: None for v in WAIT_POLICY_VARIABLES}
    return {
        "old": ([f"torch_threads={cores}"], {**unset, "GOMP_SPINCOUNT": "300000"}),
        "passive": ([f"torch_threads={cores}"], {**unset, "OMP_WAIT_POLICY": "PASSIVE"}),
        "one": (["torch_threads=1"], unset),
        "new": ([], unset),
    }


def prepare(folder: Path) -> tuple[Path, Path]:
    """The tiny base model and a small SFT file (600 conversations: 60 steps of 8 need 480)."""
    run = [sys.executable, "-m", "tiny.model", str(folder / "base")], \
        [sys.executable, "-m", "tiny.task", str(folder / "data"), "--n-sft", "600", "--n-train", "16", "--n-test", "8"]
    for cmd in run:
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return folder / "base", folder / "data" / "sft.jsonl"


def sft_run(model: Path, data: Path, out: Path, steps: int, overrides: list[str], env_changes: dict,
            busy: bool, pin: bool, late: float) -> tuple[float, float, int]:
    """One SFT run: (tokens/s after warm-up, CPU seconds of the sft.py process, torch threads it reported)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({k: v for k, v in env_changes.items() if v is not None})
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
    def start_loop():
        return subprocess.Popen([sys.executable, "-c", BUSY_LOOP],
                                preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if pin else None)
    loop = start_loop() if busy and not late else None
    try:
        cmd = [sys.executable, "sft.py", "configs/tiny/sft.yaml", f"model_path={model}", f"data={data}",
               f"out_dir={out}", f"max_steps={steps}", "log_every=10", "save_every=0", "resume=never"] + overrides
        before = os.times()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if busy and late:
            time.sleep(late)
            loop = start_loop()
        stdout, stderr = proc.communicate()
        after = os.times()
    finally:
        if loop is not None:
            loop.kill()
            loop.wait()
    if proc.returncode != 0:
        raise SystemExit(f"sft.py failed:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["perf/tokens_per_s"] for r in rows[1:]] or [rows[0]["perf/tokens_per_s"]]
    threads = int(next(line.split()[1] for line in stdout.splitlines() if "torch thread" in line))
    cpu = (after.children_user + after.children_system) - (before.children_user + before.children_system)
    return statistics.mean(rates), cpu, threads


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pin", action="store_true", help="pin the busy loop to core 0")
    p.add_argument("--late", type=float, default=0.0, help="start the busy loop this many seconds after the SFT")
    p.add_argument("--policies", default="old,passive,one,new", help="comma-separated, from old,passive,one,new")
    p.add_argument("--model", default=None, help="a tiny base model folder (default: made here)")
    p.add_argument("--data", default=None, help="an SFT JSONL (default: made here)")
    a = p.parse_args()
    cores = len(usable_cores())
    table = policies(cores)
    names = a.policies.split(",")
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown policy {unknown}; choose from {', '.join(table)}")
    with tempfile.TemporaryDirectory(prefix="bench_contention_") as tmp:
        tmp = Path(tmp)
        model, data = (Path(a.model), Path(a.data)) if a.model and a.data else prepare(tmp)
        results = {n: {"alone": [], "busy": [], "threads": {}} for n in names}
        for r in range(a.rounds):
            for name in names:
                overrides, env_changes = table[name]
                for busy in (False, True):
                    start = time.perf_counter()
                    rate, cpu, threads = sft_run(model, data, tmp / f"{name}_{r}_{busy}", a.steps, overrides,
                                                 env_changes, busy, a.pin, a.late)
                    results[name]["alone" if not busy else "busy"].append((rate, cpu))
                    results[name]["threads"]["busy" if busy else "alone"] = threads
                    print(f"round {r + 1} {name:<8} {'busy' if busy else 'alone':<5} {rate:8,.0f} tok/s, "
                          f"{threads} thread(s) ({time.perf_counter() - start:.0f} s, {cpu:.1f} CPU s)", flush=True)
    print(f"\n{cores} usable cores; busy loop {'pinned to core 0' if a.pin else 'unpinned'}, started "
          f"{f'{a.late:.0f} s after' if a.late else 'before'} the SFT; {a.steps} SFT steps; "
          f"median of {a.rounds} rounds; load average now {os.getloadavg()[0]:.1f}")
    print(f"{'policy':<9}{'threads alone/busy':>19}{'alone tok/s':>13}{'busy tok/s':>12}{'busy / alone':>14}"
          f"{'CPU s alone':>13}{'CPU s busy':>12}")
    for name in names:
        res = results[name]
        alone = statistics.median(x for x, _ in res["alone"])
        busy = statistics.median(x for x, _ in res["busy"])
        threads = f"{res['threads']['alone']}/{res['threads']['busy']}"
        print(f"{name:<9}{threads:>19}{alone:>13,.0f}{busy:>12,.0f}{busy / alone:>14.2f}"
              f"{statistics.median(c for _, c in res['alone']):>13.1f}"
              f"{statistics.median(c for _, c in res['busy']):>12.1f}")


if __name__ == "__main__":
    main()
