"""The report's central ablation at tiny scale: GRPO-RoC against plain GRPO with the tool (its Figures 4 and 9).

The finding: with outcome-only rewards, plain GRPO keeps rewarding correct rollouts that contain failed tool calls,
so the tool-error rate inside correct rollouts plateaus (10-15% in the report), while GRPO-RoC keeps driving it
down. It can only show where a failed call is nearly free for the outcome (the model errs, reads the error, and is
right about as often as without it); where an error still costs the answer, the outcome reward alone pushes errors
out and RoC has nothing left to do. make tiny's setting is of that second kind, so the ablation builds its own
under --root (each step skipped when its output exists):
  model  tiny/model.py MODEL_ARGS (make tiny's 1M-parameter model)
  task   tiny/task.py with the tool's short error form: a failed call shows only its exception line
         (ERROR_FORMAT "last_line"), so the number a sloppy call printed before failing stays a short copy away
         from the answer; more sloppy and fewer fix traces than make tiny (SFT_MIX)
  SFT    configs/ablation/sft.yaml (make tiny's recipe at batch 4: this data needs more updates to learn copying)
  cost   eval.py configs/ablation/eval.yaml on the held-out level-1 problems at the RL temperature, and from its
         rollouts P(correct | a failed call) against P(correct | clean calls) (`error_cost`): the condition above
Then, from that SFT model and the same seeds, `train.py configs/ablation/rl.yaml` (make tiny's stage 1, with the
same tool rendering as the SFT data) runs three ways; everything else is equal:
  roc     GRPO-RoC as the report describes it: 2G rollouts per prompt, Resample-on-Correct down to G
          (positives sampled with weights favouring fewer tool errors and format problems, negatives uniformly)
  grpo    "GRPO with tool": G rollouts per prompt, all of them used, no resampling
  lowest  RoC with the public code's deterministic choice of the cleanest positives (roc_mode=lowest)
It draws one PNG per metric with the arms overlaid (mean over seeds, min-max spread shaded), writes a table of final
values (mean, standard deviation and spread over seeds) and checks the finding (`check_finding`, printed as
PASS/FAIL lines and stored in ablation.json):
  accuracy                    held-out accuracy (train.py's periodic eval: eval/accuracy, temperature 0.6)
  reward                      mean reward of each training step's sampled rollouts
  tool_error_rate_in_correct  failed calls / calls, in the reward-1 rollouts of each training step
  ..._run_mean                the same, averaged from step 1 (its final value: the mean over the whole run)
  response_tokens             mean response length of the training rollouts (tool text included)
  tool_calls                  tool calls per training rollout
  kept_tool_error_rate_in_correct   the same error rate over the positives the update used (after RoC): the gap to
                              tool_error_rate_in_correct is what the resampling filtered out (none for grpo)
Training-rollout curves are smoothed with a trailing mean over `--smooth` steps; "final" is the mean of the last
`--smooth` steps (the last eval for accuracy). Every step is a plain command (printed as it starts, its wall-clock
and CPU seconds logged to timings.jsonl) writing its own folder, so an interrupted ablation continues where it
stopped (sft.py and train.py resume from their checkpoints; finished steps are skipped).

    python -m tiny.ablation                            # the setting, then 3 arms x 3 seeds (about 40 min on 2 idle cores)
    python -m tiny.ablation --seeds 0 --arms roc grpo  # a pilot
    python -m tiny.ablation --report-only              # tables, plots and checks from finished runs
    python -m tiny.ablation --sft runs/tiny/sft/model --data runs/tiny/data --config configs/tiny/stage1.yaml \
        --root runs/ablation_tiny                 # the arms on make tiny's own setting instead
Outputs in --root: base/, data/, sft/, eval_sft/ (the setting), {arm}-seed{s}/ (train.py run folders),
ablation_{metric}.png, ablation.md, ablation.json, timings.jsonl.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from grpo_roc import ROC_SELECTORS

ARM_NAMES = {"sample": "roc", "off": "grpo"}  # the report's names for two RoC rules; any other arm is its rule's name


def roc_arms(modes) -> dict[str, list[str]]:
    """One arm per RoC rule (grpo_roc.ROC_SELECTORS, the report's two first): the rule, and G = 4 kept of 2G = 8
    rollouts per prompt; "off" keeps every rollout, so it samples only G. A rule added to ROC_SELECTORS is an arm."""
    ordered = sorted(modes, key=lambda mode: mode not in ARM_NAMES)  # (a stable sort: the table's order otherwise)
    return {ARM_NAMES.get(mode, mode): [f"roc_mode={mode}", f"rollouts_per_prompt={4 if mode == 'off' else 8}",
                                        "group_size=4"] for mode in ordered}


ARMS = roc_arms(ROC_SELECTORS)
DEFAULT_ARMS = ["roc", "grpo", "lowest"]  # the report's two rules and the public code's; --arms adds "uniform"
# The ablation's setting (module docstring). The tool's error form must be the same in the task's SFT data and in
# configs/ablation/rl.yaml (tool_error_format), so that RL shows the model the text SFT taught it to read.
ERROR_FORMAT = "last_line"
SFT_MIX = {"direct": 0.3, "tool": 0.3, "sloppy": 0.25, "fix": 0.15}  # SFT trace kinds (make tiny: 0.4/0.25/0.15/0.2)
MODEL_ARGS: list[str] = []  # tiny/model.py arguments (none: make tiny's 1M-parameter model)
# Environment of every command: one torch thread (the other core runs the code tool), which also makes the SFT
# model the same bytes on any machine with this torch build.
ENV = {"OMP_NUM_THREADS": "1"}
SETTING_EVAL = ["limit=100", "samples=4", "temperature=1.0"]  # eval.py: level-1 held-out, as RL samples
# (name in the outputs, metrics.jsonl key, smoothing: True = trailing mean over --smooth steps, False = none,
# RUN = cumulative mean from step 1, so its final value is the mean over the whole run: how fast errors went)
RUN = "run"
ERR = "rollout/tool_error_rate_in_correct"
METRICS = [("accuracy", "eval/accuracy", False),
           ("reward", "rollout/reward_mean", True),
           ("tool_error_rate_in_correct", ERR, True),
           ("tool_error_rate_in_correct_run_mean", ERR, RUN),
           ("response_tokens", "rollout/response_tokens_mean", True),
           ("tool_calls", "rollout/tool_calls_mean", True),
           ("kept_tool_error_rate_in_correct", "roc/tool_error_rate_in_correct", True)]
# The finding's windows (report Figures 4 and 9, at this scale): the first FIRST and the last LAST training steps.
FIRST, LAST = 5, 10
TIMINGS = "timings.jsonl"  # wall-clock and CPU seconds of every command tiny/ablation.py ran, in --root


# ----------------------------------------------------------------------------------- pure helpers
def error_cost(records: list[dict]) -> dict:
    """P(correct) by what the rollout's tool calls did, over eval.py trajectory records (dicts with "reward" and
    "tool_calls": [{"status", ...}]). Kinds: "clean" (calls made, all ok), "failed" (at least one failed call),
    split into "answered_after_failure" (the last call failed, the model answered anyway) and "fixed" (a later call
    succeeded); "no_call". Returns {kind: {"n", "correct", "p"}} (p is None where n is 0)."""
    counts = {kind: [0, 0] for kind in ("clean", "failed", "answered_after_failure", "fixed", "no_call")}
    for r in records:
        failed = [c["status"] != "ok" for c in r["tool_calls"]]
        kinds = (["no_call"] if not failed else ["clean"] if not any(failed) else
                 ["failed", "answered_after_failure" if failed[-1] else "fixed"])
        for kind in kinds:
            counts[kind][0] += 1
            counts[kind][1] += r["reward"] > 0
    return {k: {"n": n, "correct": c, "p": c / n if n else None} for k, (n, c) in counts.items()}


def curve(rows: list[dict], key: str, smooth: int) -> list[tuple[int, float]]:
    """(step, value) for every row that has the metric (NaN skipped), as a trailing mean over `smooth` points."""
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and r[key] == r[key]]
    if smooth <= 1:
        return pts
    return [(s, statistics.fmean(v for _, v in pts[max(0, i - smooth + 1):i + 1])) for i, (s, _) in enumerate(pts)]


def window_mean(rows: list[dict], key: str, first: int = 0, last: int = 0) -> float:
    """Mean of a metric over steps 1..first (first > 0) or over the last `last` steps of the run (NaN skipped)."""
    end = max(r["step"] for r in rows)
    steps = range(1, first + 1) if first else range(end - last + 1, end + 1)
    values = [v for s, v in curve(rows, key, 1) if s in steps]
    return statistics.fmean(values) if values else float("nan")


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def check_finding(runs: dict, first: int = FIRST, last: int = LAST, baseline: str = "grpo") -> list[dict]:
    """The report's finding as four checks on the arms' metrics. runs: {"roc": [rows of seed 0, ...], "grpo": [...]},
    rows being one run's metrics.jsonl lines (dicts with "step", ERR and, at eval steps, "eval/accuracy"); seeds
    are averaged with equal weight; `baseline` names the plain-GRPO arm ("grpo": G sampled, all kept; "uniform": 2G
    sampled, G kept at random). Returns [{"check", "value", "ok"}]:
    1. GRPO's error rate in correct rollouts over the last `last` steps is at least twice RoC's;
    2. every GRPO seed is above every RoC seed there;
    3. GRPO plateaus: its last-`last` rate is at least half its rate over the first `first` steps;
    4. RoC's final held-out accuracy is not below GRPO's by more than the seed spread (the larger standard
       deviation over seeds of the two arms)."""
    runs = {"roc": runs["roc"], "grpo": runs[baseline]}
    late = {arm: [window_mean(rows, ERR, last=last) for rows in runs[arm]] for arm in ("roc", "grpo")}
    early = [window_mean(rows, ERR, first=first) for rows in runs["grpo"]]
    acc = {arm: [curve(rows, "eval/accuracy", 1)[-1][1] for rows in runs[arm]] for arm in ("roc", "grpo")}
    roc, grpo, grpo_early = statistics.fmean(late["roc"]), statistics.fmean(late["grpo"]), statistics.fmean(early)
    (acc_roc, sd_roc), (acc_grpo, sd_grpo) = _mean_std(acc["roc"]), _mean_std(acc["grpo"])
    spread = max(sd_roc, sd_grpo)
    return [
        {"check": f"GRPO's err+ over the last {last} steps >= 2x RoC's",
         "value": f"{grpo:.3f} vs {roc:.3f} ({grpo / roc if roc else float('inf'):.1f}x)", "ok": grpo >= 2 * roc},
        {"check": f"every GRPO seed above every RoC seed (last {last} steps)",
         "value": f"GRPO min {min(late['grpo']):.3f}, RoC max {max(late['roc']):.3f}",
         "ok": min(late["grpo"]) > max(late["roc"])},
        {"check": f"GRPO plateaus: last {last} steps >= 1/2 of its first {first}",
         "value": f"{grpo:.3f} vs {grpo_early:.3f} ({grpo / grpo_early if grpo_early else float('nan'):.2f}x)",
         "ok": grpo >= 0.5 * grpo_early},
        {"check": "RoC's held-out accuracy not below GRPO's beyond the seed spread",
         "value": f"{acc_roc:.3f} vs {acc_grpo:.3f}, spread {spread:.3f}", "ok": acc_roc >= acc_grpo - spread},
    ]


def bootstrap_interval(per_seed: list[list[float]], draws: int = 2000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """A percentile bootstrap interval of an arm's mean over seeds, each seed's value the mean of its steps'
    values: seeds are drawn with replacement, then steps within each drawn seed (both sources of noise).
    per_seed: one list of step values (NaN-free) per seed. Returns (low, high)."""
    import random
    rng, means = random.Random(seed), []
    seeds = [v for v in per_seed if v]
    for _ in range(draws):
        picked = [rng.choices(seeds)[0] for _ in seeds]
        means.append(statistics.fmean(statistics.fmean(rng.choices(v, k=len(v))) for v in picked))
    means.sort()
    tail = (1 - level) / 2
    return means[int(tail * draws)], means[min(draws - 1, int((1 - tail) * draws))]


def window_values(rows: list[dict], key: str, first: int = 0, last: int = 0) -> list[float]:
    """A metric's values at steps 1..first (first > 0) or at the last `last` steps of the run (NaN skipped)."""
    end = max(r["step"] for r in rows)
    steps = range(1, first + 1) if first else range(end - last + 1, end + 1)
    return [v for s, v in curve(rows, key, 1) if s in steps]


def window_table(runs: dict, first: int = FIRST, last: int = LAST, held_out: dict | None = None) -> dict:
    """Per arm, the finding's numbers: the tool-error rate inside correct rollouts over the last `last` steps (mean
    over seeds, min and max over seeds, a bootstrap interval), over the first `first` steps, the response tokens
    over the last `last` steps, and (held_out: {arm: [{"pass@1", "transfer"} of each seed]}) held-out pass@1."""
    table = {}
    for arm, per_seed in runs.items():
        late = [window_values(rows, ERR, last=last) for rows in per_seed]
        late_means = [statistics.fmean(v) for v in late if v]
        row = {"err_in_correct_last": statistics.fmean(late_means) if late_means else float("nan"),
               "err_in_correct_last_min": min(late_means, default=float("nan")),
               "err_in_correct_last_max": max(late_means, default=float("nan")),
               "err_in_correct_last_ci": bootstrap_interval(late) if late_means else (float("nan"),) * 2,
               "err_in_correct_first": statistics.fmean(window_mean(rows, ERR, first=first) for rows in per_seed),
               "response_tokens_last": statistics.fmean(window_mean(rows, "rollout/response_tokens_mean", last=last)
                                                        for rows in per_seed),
               "seeds": len(per_seed)}
        for name in ("pass@1", "transfer"):
            values = [h[name] for h in (held_out or {}).get(arm, []) if h.get(name) is not None]
            if values:
                row[f"held_out_{name}"] = statistics.fmean(values)
                row[f"held_out_{name}_range"] = (min(values), max(values))
        table[arm] = row
    return table


def window_markdown(table: dict, first: int, last: int) -> str:
    lines = [f"| arm | seeds | err in correct, last {last} steps: mean [min, max] (95% bootstrap) | first {first} steps "
             f"| response tokens, last {last} | held-out pass@1 [min, max] | transfer pass@1 |",
             "|---|---|---|---|---|---|---|"]
    for arm, r in table.items():
        low, high = r["err_in_correct_last_ci"]
        held = (f"{r['held_out_pass@1']:.3f} [{r['held_out_pass@1_range'][0]:.3f}, {r['held_out_pass@1_range'][1]:.3f}]"
                if "held_out_pass@1" in r else "-")
        transfer = f"{r['held_out_transfer']:.3f}" if "held_out_transfer" in r else "-"
        lines.append(f"| {arm} | {r['seeds']} | {r['err_in_correct_last']:.3f} [{r['err_in_correct_last_min']:.3f}, "
                     f"{r['err_in_correct_last_max']:.3f}] ({low:.3f}-{high:.3f}) | {r['err_in_correct_first']:.3f} "
                     f"| {r['response_tokens_last']:.0f} | {held} | {transfer} |")
    return "\n".join(lines) + "\n"


def summarize(curves: dict) -> dict:
    """curves[arm][metric] = list over seeds of [(step, value)] -> {arm: {metric: {mean, std, min, max, seeds}}},
    from each seed's last point (already a trailing mean where smoothed)."""
    table = {}
    for arm, per_metric in curves.items():
        table[arm] = {}
        for name, seeds in per_metric.items():
            finals = [c[-1][1] for c in seeds if c]
            table[arm][name] = {"mean": statistics.fmean(finals) if finals else float("nan"),
                                "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                                "min": min(finals, default=float("nan")), "max": max(finals, default=float("nan")),
                                "seeds": finals}
    return table


def markdown(table: dict) -> str:
    names = [m for m, _, _ in METRICS]
    lines = ["| arm | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for arm, row in table.items():
        cells = [f"{row[n]['mean']:.3f} ± {row[n]['std']:.3f} [{row[n]['min']:.3f}, {row[n]['max']:.3f}]"
                 for n in names]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nmean ± standard deviation over seeds [min, max]; final values (see tiny/ablation.py)\n"


def cost_lines(cost: dict) -> str:
    """error_cost's result as one line per kind."""
    def p(v):
        return "-" if v["p"] is None else f"{v['p']:.3f}"
    return "\n".join(f"  P(correct | {kind}) = {p(v)} ({v['correct']}/{v['n']})" for kind, v in cost.items())


# ----------------------------------------------------------------------------------- running things
def run(cmd: list[str], name: str, log: Path) -> None:
    """Run `python cmd...`; append its wall-clock and CPU seconds (user + system, of itself and every child it
    waited for: the code tool's servers, the reward checker) to `log` as a JSON line {"name", "wall_s", "cpu_s"}."""
    print("\n$ " + " ".join(cmd), flush=True)
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable] + cmd, check=True, env=os.environ | ENV)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    with open(log, "a") as f:
        f.write(json.dumps({"name": name, "wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(cpu, 1)})
                + "\n")


def build_setting(root: Path) -> None:
    """The ablation's own base model, task, SFT model and the SFT model's held-out rollouts, under root (each step
    skipped when its output exists)."""
    data, sft, log = root / "data", root / "sft", root / TIMINGS
    if not (root / "base" / "config.json").is_file():
        run(["-m", "tiny.model", str(root / "base")] + MODEL_ARGS, "base", log)
    if not (data / "sft.jsonl").is_file():
        run(["-m", "tiny.task", str(data), "--error-format", ERROR_FORMAT]
            + [arg for kind, frac in SFT_MIX.items() for arg in (f"--{kind}", str(frac))], "data", log)
    if not (sft / "model" / "config.json").is_file():
        run(["sft.py", "configs/ablation/sft.yaml", f"model_path={root / 'base'}", f"data={data / 'sft.jsonl'}",
             f"out_dir={sft}"], "sft", log)
    if not (root / "eval_sft" / "results.json").is_file():
        run(["eval.py", "configs/ablation/eval.yaml", f"model_path={sft / 'model'}", f"out_dir={root / 'eval_sft'}",
             f"benchmarks=[{data / 'test.jsonl'}]"] + SETTING_EVAL, "eval_sft", log)


def read_error_cost(root: Path) -> dict | None:
    """error_cost of the SFT model's held-out rollouts (root/eval_sft), None when there are none."""
    path = root / "eval_sft" / "trajectories.jsonl"
    return error_cost([json.loads(line) for line in path.read_text().splitlines()]) if path.is_file() else None


def run_arm(arm: str, seed: int, args) -> Path:
    """One train.py run (skipped when its model already exists); returns its folder."""
    out = Path(args.root) / f"{arm}-seed{seed}"
    if (out / "model" / "config.json").is_file():
        return out
    cmd = ["train.py", args.config, f"model_path={args.sft}", f"data=[{args.data}/{args.train}]",
           f"out_dir={out}", f"seed={seed}", f"steps={args.steps}", f"eval_data={args.data}/test.jsonl",
           f"eval_every={args.eval_every}", f"eval_limit={args.eval_limit}", f"eval_samples={args.eval_samples}",
           f"save_every={args.eval_every}"] + ARMS[arm] + args.override
    run(cmd, out.name, Path(args.root) / TIMINGS)
    return out


def evaluate_arm(out: Path, args) -> None:
    """eval.py `--final-eval` (a config) on the arm's final model over the task's test split, into out/eval
    (skipped when its results exist)."""
    if args.final_eval and not (out / "eval" / "results.json").is_file():
        run(["eval.py", args.final_eval, f"model_path={out / 'model'}", f"out_dir={out / 'eval'}",
             f"benchmarks=[{args.data}/test.jsonl]"], f"{out.name}/eval", Path(args.root) / TIMINGS)


def read_held_out(root: Path, arms, seeds, data: Path, transfer: str | None) -> dict:
    """{arm: [{"pass@1", "transfer"} per seed]} from each arm's out/eval (eval.py's trajectories; `transfer`: a
    test-row `family` whose pass@1 is reported alone); arms without evaluations are left out."""
    if not (data / "test.jsonl").is_file():
        return {}
    families = [json.loads(line).get("family") for line in (data / "test.jsonl").read_text().splitlines()]
    held = {}
    for arm in arms:
        for seed in seeds:
            path = root / f"{arm}-seed{seed}" / "eval" / "trajectories.jsonl"
            if not path.is_file():
                continue
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            moved = [r["reward"] for r in rows if families[r["problem_index"]] == transfer]
            held.setdefault(arm, []).append({"pass@1": statistics.fmean(r["reward"] for r in rows),
                                             "transfer": statistics.fmean(moved) if moved else None})
    return held


def plot(curves: dict, root: Path) -> list[Path]:
    """One PNG per metric: each arm's mean over seeds (at the steps every seed has), min-max over seeds shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for name, _, _ in METRICS:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for arm, per_metric in curves.items():
            seeds = [dict(c) for c in per_metric[name] if c]
            steps = sorted(set.intersection(*(set(s) for s in seeds))) if seeds else []
            if not steps:
                continue
            values = [[s[t] for s in seeds] for t in steps]
            mean = [statistics.fmean(v) for v in values]
            line, = ax.plot(steps, mean, label=f"{arm} ({len(seeds)} seeds)", marker="o" if len(steps) < 8 else None)
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                            alpha=0.2)
        ax.set_title(name.replace("_", " "), fontsize=10)
        ax.set_xlabel("RL step")
        if ax.lines:
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths.append(root / f"ablation_{name}.png")
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    return paths


def read_runs(root: Path, arms, seeds) -> dict:
    """{arm: [metrics.jsonl rows of each seed]}."""
    return {arm: [[json.loads(line) for line in (root / f"{arm}-seed{seed}" / "metrics.jsonl").read_text().splitlines()]
                  for seed in seeds] for arm in arms}


def collect(runs: dict, smooth: int) -> dict:
    curves = {}
    for arm, per_seed in runs.items():
        curves[arm] = {name: [] for name, _, _ in METRICS}
        for rows in per_seed:
            for name, key, smoothed in METRICS:
                window = len(rows) if smoothed == RUN else smooth if smoothed else 1
                curves[arm][name].append(curve(rows, key, window))
    return curves


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="runs/ablation")
    p.add_argument("--sft", default=None, help="start every arm from this SFT checkpoint (default: build the setting)")
    p.add_argument("--data", default=None, help="task folder with the training file and test.jsonl (with --sft)")
    p.add_argument("--train", default="train_level1.jsonl", help="the training problems' file in --data")
    p.add_argument("--config", default="configs/ablation/rl.yaml")
    p.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    p.add_argument("--baseline", default="grpo", choices=list(ARMS),
                   help="the plain-GRPO arm the finding compares RoC with (uniform: 2G sampled, G kept at random)")
    p.add_argument("--first", type=int, default=FIRST, help="the finding's early window, in steps")
    p.add_argument("--last", type=int, default=LAST, help="the finding's late window, in steps")
    p.add_argument("--final-eval", default=None, help="an eval.py config: each arm's final model on test.jsonl")
    p.add_argument("--transfer", default=None, help="a test-row family reported alone (with --final-eval)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-limit", type=int, default=100, help="first N held-out problems (100: level 1)")
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--smooth", type=int, default=5)
    p.add_argument("--override", nargs="*", default=[], help="extra train.py key=value for every arm")
    p.add_argument("--report-only", action="store_true", help="only read the finished runs and write the outputs")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    if (args.sft is None) != (args.data is None):
        raise SystemExit("give --sft and --data together (or neither, to build the ablation's own setting)")
    if args.sft is None:
        args.sft, args.data = str(root / "sft" / "model"), str(root / "data")
        if not args.report_only:
            build_setting(root)
    if not args.report_only:
        for seed in args.seeds:  # seed-major: a stopped ablation already has every arm for the first seeds
            for arm in args.arms:
                evaluate_arm(run_arm(arm, seed, args), args)
    cost = read_error_cost(root)
    runs = read_runs(root, args.arms, args.seeds)
    table = summarize(collect(runs, args.smooth))
    pngs = plot(collect(runs, args.smooth), root)
    checks = (check_finding(runs, args.first, args.last, args.baseline)
              if {"roc", args.baseline} <= set(args.arms) else [])
    windows = window_table(runs, args.first, args.last,
                           read_held_out(root, args.arms, args.seeds, Path(args.data), args.transfer))
    (root / "ablation.json").write_text(json.dumps({"args": vars(args), "final": table, "windows": windows,
                                                    "sft_error_cost": cost, "finding": checks}, indent=1))
    (root / "ablation.md").write_text(markdown(table) + "\n" + window_markdown(windows, args.first, args.last))
    print("\n" + markdown(table) + "\n" + window_markdown(windows, args.first, args.last))
    if cost:
        print("SFT model, held-out level 1 at the RL temperature:\n" + cost_lines(cost))
    for c in checks:
        print(f"[{'PASS' if c['ok'] else 'FAIL'}] {c['check']}: {c['value']}")
    if (root / TIMINGS).is_file():
        spent = [json.loads(line) for line in (root / TIMINGS).read_text().splitlines()]
        print(f"{len(spent)} commands: {sum(t['wall_s'] for t in spent) / 60:.1f} min wall clock, "
              f"{sum(t['cpu_s'] for t in spent) / 60:.1f} min CPU ({root / TIMINGS})")
    print("wrote " + ", ".join(str(x) for x in pngs + [root / "ablation.md", root / "ablation.json"]))


if __name__ == "__main__":
    main()
