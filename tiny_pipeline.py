"""The whole tiny pipeline on a CPU, as the sequence of commands a user would type (what `make tiny` runs).

    python tiny_pipeline.py                 # about 20 minutes on 2 cores; writes runs/tiny/summary.json
    python tiny_pipeline.py --quick         # a few steps of each entry point (CI's smoke run)

  1. tiny_model.py   a character-level tokenizer and a ~1M-parameter Qwen3 model (save_pretrained)
  2. tiny_task.py    the built-in task: RL problems (two levels), held-out test split, SFT conversations
  3. sft.py          non-reasoning SFT: format and tool use, not the policy
  4. train.py        RL stage 1 (level 1), stage 2 (longer budget, levels 1 and 2), stage 3 (the level-2 problems
                     the stage-2 policy did not solve k of k times, fresh optimizer) -- report section 6, scaled down
  5. eval.py         after SFT and after every stage, on the held-out split; stage 3's data comes from eval.py too
Each step is skipped when its output already exists, so an interrupted pipeline continues where it stopped
(train.py itself resumes from its last checkpoint). `--fresh` deletes the run folder first.

Every command runs with one torch thread (the tiny configs' `torch_threads: 1`), so the evaluation of a stage's
model runs beside the next stage's training (its output goes to runs/tiny/eval_<stage>.log), on the other core.
At the end a table says where the time went, written to summary.json as `phases`: per command its wall-clock and
CPU seconds (its processes and the tool's, from the operating system's accounting: on a busy machine the CPU
column is the steadier one), and inside each the parts the entry points log: SFT's training loop, each stage's
rollout / update / held-out evaluation seconds (metrics.jsonl), each evaluation's rollouts (results.json); the
rest of a command's wall time is its start-up (imports, model, tool workers) and its saving.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

STAGES = ["sft", "stage1", "stage2", "stage3"]
# --quick: overrides that make every entry point take a few steps (CI); the plumbing is the same.
QUICK = {
    "task": ["--n-train", "64", "--n-test", "8", "--n-sft", "96"],
    "sft": ["max_steps=4", "log_every=1"],
    "train": ["steps=2", "prompts_per_step=2", "rollouts_per_prompt=4", "group_size=2", "eval_every=0", "eval_limit=4",
              "save_every=1"],
    "eval": ["limit=4", "samples=2"],
}


class Commands:
    """Runs the pipeline's commands, in the foreground or beside the next one, and records for each its wall-clock
    seconds, its CPU seconds (the process and every process it waited for: tool workers, reward checks) and when
    it started, for the time table."""

    def __init__(self):
        self.start, self.phases, self.background, self.failures = time.perf_counter(), {}, [], []

    def run(self, name: str, cmd: list[str]) -> None:
        print("\n$ " + " ".join(cmd), flush=True)
        failure = self._wait(name, cmd, subprocess.Popen([sys.executable] + cmd), None, time.perf_counter())
        if failure:
            raise SystemExit(failure)

    def start_beside(self, name: str, cmd: list[str], log: Path) -> None:
        """Start `cmd` now and go on; its output goes to `log`. `join` waits for it."""
        print(f"\n$ {' '.join(cmd)}   (beside the next step; output in {log})", flush=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with log.open("w") as f:
            proc = subprocess.Popen([sys.executable] + cmd, stdout=f, stderr=subprocess.STDOUT)
        # A thread waits for it, so its wall time ends when it does, not when the next step does.
        waiter = threading.Thread(target=lambda: self.failures.append(self._wait(name, cmd, proc, log, started)))
        waiter.start()
        self.background.append(waiter)

    def join(self) -> None:
        for waiter in self.background:
            waiter.join()
        self.background = []
        failures, self.failures = [f for f in self.failures if f], []
        if failures:
            raise SystemExit("\n".join(failures))

    def _wait(self, name, cmd, proc, log, started) -> str | None:
        """Wait for `proc`, record its phase; the failure message, or None."""
        if hasattr(os, "wait4"):  # the CPU time of exactly this process and those it waited for
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode, cpu = os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime
        else:
            proc.wait()
            cpu = None
        self.phases[name] = {"wall_s": time.perf_counter() - started, "cpu_s": cpu,
                             "start_s": started - self.start, "beside_next": log is not None}
        if proc.returncode == 0:
            return None
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:]) if log else ""
        return f"{tail}\ncommand failed (exit {proc.returncode}): {' '.join(cmd)}"


def eval_command(root: Path, name: str, quick: bool) -> list[str]:
    """eval.py on the held-out split for one stage's model."""
    return ["eval.py", "configs/tiny/eval.yaml", f"model_path={root / name / 'model'}",
            f"out_dir={root / f'eval_{name}'}", f"benchmarks=[{root / 'data' / 'test.jsonl'}]"] \
        + (QUICK["eval"] if quick else [])


def eval_results(root: Path, name: str) -> dict:
    """The metrics of a stage's held-out evaluation (its results.json)."""
    return next(iter(json.loads((root / f"eval_{name}" / "results.json").read_text())["benchmarks"].values()))


def pipeline(root: Path, quick: bool, commands: Commands) -> dict:
    data = root / "data"
    if not (root / "base" / "config.json").is_file():
        commands.run("model", ["tiny_model.py", str(root / "base")])
    if not (data / "sft.jsonl").is_file():
        commands.run("task", ["tiny_task.py", str(data)] + (QUICK["task"] if quick else []))
    if not (root / "sft" / "model" / "config.json").is_file():
        commands.run("sft", ["sft.py", "configs/tiny/sft.yaml", f"model_path={root / 'base'}",
                             f"data={data / 'sft.jsonl'}", f"out_dir={root / 'sft'}"] + (QUICK["sft"] if quick else []))
    stage_data = {1: [data / "train_level1.jsonl"], 2: [data / "train_level1.jsonl", data / "train_level2.jsonl"],
                  3: [data / "stage3.jsonl"]}
    previous = "sft"
    for stage in (1, 2, 3):
        name = f"stage{stage}"
        # The previous model's held-out evaluation runs beside this stage (one torch thread each).
        if not (root / f"eval_{previous}" / "results.json").is_file():
            commands.start_beside(f"eval_{previous}", eval_command(root, previous, quick),
                                  root / f"eval_{previous}.log")
        if stage == 3 and not (data / "stage3.jsonl").is_file():
            # Stage 3's data: problems the stage-2 policy did not solve k of k times (report: 8 of 8).
            commands.run("unsolved_stage2", [
                "eval.py", "configs/tiny/eval.yaml", f"model_path={root / 'stage2' / 'model'}",
                f"out_dir={root / 'unsolved_stage2'}", f"benchmarks=[{data / 'train_level2.jsonl'}]", "samples=4",
                "temperature=1.0", f"unsolved_out={data / 'stage3.jsonl'}"]
                + (["limit=6", "samples=2"] if quick else ["limit=200"]))
        if not (root / name / "model" / "config.json").is_file():
            # Stage 2 carries stage 1's AdamW state; stage 3 starts a fresh optimizer (report section 6).
            extra = [f"optimizer_from={root / 'stage1'}"] if stage == 2 else []
            # Held-out curves during stage 1 only; every stage's final model is evaluated with eval.py.
            evals = [f"eval_data={data / 'test.jsonl'}"] if stage == 1 else []
            commands.run(name, ["train.py", f"configs/tiny/{name}.yaml", f"model_path={root / previous / 'model'}",
                                "data=[" + ",".join(map(str, stage_data[stage])) + "]", f"out_dir={root / name}"]
                         + evals + extra + (QUICK["train"] if quick else []))
        commands.join()
        previous = name
    if not (root / "eval_stage3" / "results.json").is_file():
        commands.run("eval_stage3", eval_command(root, "stage3", quick))
    return {s: eval_results(root, s) for s in STAGES}


def phase_parts(root: Path, name: str) -> dict:
    """Seconds inside a command, from what its entry point logged; the rest of its wall time is start-up and
    saving."""
    def rows(path):
        return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    if name == "sft":
        return {"training": sum(r.get("perf/seconds", 0.0) for r in rows(root / "sft" / "metrics.jsonl"))}
    if name.startswith("stage"):
        log = rows(root / name / "metrics.jsonl")
        parts = {k: sum(r.get(f"perf/{k}_s", 0.0) for r in log) for k in ("rollout", "update", "eval")}
        parts["reward_and_other"] = sum(r.get("perf/step_s", 0.0) for r in log) - parts["rollout"] - parts["update"]
        return parts
    if name.startswith("eval_") or name == "unsolved_stage2":
        results = root / name / "results.json"
        metrics = json.loads(results.read_text())["benchmarks"].values() if results.is_file() else []
        return {"rollouts_and_scoring": sum(m.get("seconds", 0.0) for m in metrics)}
    return {}


def time_table(root: Path, phases: dict, wall: float) -> tuple[dict, str]:
    """phases with their parts and start-up added, and the table printed at the end."""
    lines = [f"{'command':<16}{'wall s':>7}{'CPU s':>7}  inside (wall s)"]
    phases = dict(sorted(phases.items(), key=lambda item: item[1]["start_s"]))
    for name, p in phases.items():
        p["parts"] = {k: round(v, 1) for k, v in phase_parts(root, name).items()}
        if p["parts"]:
            p["parts"]["startup_and_save"] = round(p["wall_s"] - sum(p["parts"].values()), 1)
        p["wall_s"], p["start_s"] = round(p["wall_s"], 1), round(p["start_s"], 1)
        p["cpu_s"] = None if p["cpu_s"] is None else round(p["cpu_s"], 1)
        cpu = "-" if p["cpu_s"] is None else f"{p['cpu_s']:.0f}"
        inside = ", ".join(f"{k} {v:.0f}" for k, v in p["parts"].items())
        lines.append(f"{name:<16}{p['wall_s']:>7.0f}{cpu:>7}  {inside}" + ("  (beside the next stage)"
                                                                             if p["beside_next"] else ""))
    startups = sum(p["parts"].get("startup_and_save", 0.0) for p in phases.values() if not p["beside_next"])
    lines.append(f"{'all':<16}{wall:>7.0f}{'':>7}  start-ups and saving outside the evaluations beside training: "
                 f"{startups:.0f} s" + ("; the rows add up to more: evaluations ran beside training"
                                          if any(p["beside_next"] for p in phases.values()) else ""))
    return phases, "\n".join(lines)


def summarize(results: dict, wall: float) -> dict:
    summary = {f"{s}_accuracy": results[s]["pass@1"] for s in STAGES}
    summary["tool_error_rate_in_correct"] = {s: results[s]["tool_error_rate_in_correct"] for s in STAGES}
    summary["mean_response_tokens"] = {s: results[s]["response_tokens_mean"] for s in STAGES}
    summary["tool_calls_mean"] = {s: results[s]["tool_calls_mean"] for s in STAGES}
    summary["gain_points"] = 100 * (summary["stage3_accuracy"] - summary["sft_accuracy"])
    summary["wall_seconds"] = round(wall, 1)
    return summary


def table(results: dict) -> str:
    rows = ["stage    pass@1  pass@k  tool_calls  tool_err  tool_err_in_correct  resp_tokens  truncated"]
    for s in STAGES:
        r = results[s]
        fmt = lambda v: "   -" if v is None else f"{v:.3f}"  # noqa: E731
        rows.append(f"{s:<8} {r['pass@1']:.3f}   {r.get('pass@k', float('nan')):.3f}   {r['tool_calls_mean']:9.2f}"
                    f"   {fmt(r['tool_error_rate'])}   {fmt(r['tool_error_rate_in_correct']):>18}"
                    f"  {r['response_tokens_mean']:11.1f}  {r['truncated_frac']:9.3f}")
    return "\n".join(rows)


def plot_stages(results: dict, png) -> None:
    """The held-out metrics after each stage (the pipeline's plot): pass@1, tool-error rate in correct rollouts,
    tool calls per rollout and response length; the per-step curves of each RL stage are in its curves.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [("pass@1", "held-out pass@1"), ("tool_error_rate_in_correct", "tool-error rate in correct rollouts"),
              ("tool_calls_mean", "tool calls per rollout"), ("response_tokens_mean", "response tokens")]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.2))
    for ax, (key, title) in zip(axes, panels):
        values = [results[s][key] if results[s][key] is not None else float("nan") for s in STAGES]
        ax.plot(STAGES, values, marker="o")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="runs/tiny", help="run folder (default runs/tiny)")
    parser.add_argument("--quick", action="store_true", help="a few steps of each entry point")
    parser.add_argument("--fresh", action="store_true", help="delete the run folder first")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if args.fresh:
        shutil.rmtree(root, ignore_errors=True)
    commands = Commands()
    results = pipeline(root, args.quick, commands)
    wall = time.perf_counter() - commands.start
    summary = summarize(results, wall)
    summary["phases"], times = time_table(root, commands.phases, wall)
    (root / "summary.json").write_text(json.dumps(summary, indent=1))
    plot_stages(results, root / "summary.png")
    print("\n" + table(results))
    print("\nwhere the time went (this run's commands; a step skipped because its output existed is not listed)\n"
          + times)
    print(f"\nsft -> stage3: {100 * summary['sft_accuracy']:.1f}% -> {100 * summary['stage3_accuracy']:.1f}% "
          f"({summary['gain_points']:+.1f} points) in {summary['wall_seconds']:.0f} s; wrote {root / 'summary.json'} and "
          f"{root / 'summary.png'}")


if __name__ == "__main__":
    main()
