"""The report's central ablation at tiny scale: GRPO-RoC against plain GRPO with the tool (its Figures 4 and 9).

From one SFT checkpoint and the same seeds, `train.py` runs stage 1 three ways; everything else is equal:
  roc     GRPO-RoC as the report describes it: 2G rollouts per prompt, Resample-on-Correct down to G
          (positives sampled with weights favouring fewer tool errors and format problems, negatives uniformly)
  grpo    "GRPO with tool": G rollouts per prompt, all of them used, no resampling
  lowest  RoC with the public code's deterministic choice of the cleanest positives (roc_mode=lowest)
Then it draws one PNG per metric with the arms overlaid (mean over seeds, min-max spread shaded) and writes a table of
final values (mean, standard deviation and spread over seeds):
  accuracy                    held-out accuracy (train.py's periodic eval: eval/accuracy, temperature 0.6)
  tool_error_rate_in_correct  failed calls / calls, in the reward-1 rollouts of each training step
  ..._run_mean                the same, averaged from step 1 (its final value: the mean over the whole run)
  response_tokens             mean response length of the training rollouts (tool text included)
  tool_calls                  tool calls per training rollout
  kept_tool_error_rate_in_correct   the same error rate over the positives the update used (after RoC): the gap to
                              tool_error_rate_in_correct is what the resampling filtered out (none for grpo)
Training-rollout curves are smoothed with a trailing mean over `--smooth` steps; "final" is the mean of the last
`--smooth` steps (the last eval for accuracy). Every run is a plain train.py invocation (printed as it starts) in
its own folder, so an interrupted ablation continues where it stopped (train.py resumes; finished runs are skipped).

    python ablation.py                            # needs runs/tiny/sft/model and runs/tiny/data (make tiny)
    python ablation.py --seeds 0 1 2 --steps 30 --root runs/ablation
Outputs in --root: {arm}-seed{s}/ (train.py run folders), ablation_{metric}.png, ablation.md, ablation.json.
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ARMS = {
    "roc": ["roc_mode=sample", "rollouts_per_prompt=8", "group_size=4"],
    "grpo": ["roc_mode=off", "rollouts_per_prompt=4", "group_size=4"],
    "lowest": ["roc_mode=lowest", "rollouts_per_prompt=8", "group_size=4"],
}
# (name in the outputs, metrics.jsonl key, smoothing: True = trailing mean over --smooth steps, False = none,
# RUN = cumulative mean from step 1, so its final value is the mean over the whole run: how fast errors went)
RUN = "run"
METRICS = [("accuracy", "eval/accuracy", False),
           ("tool_error_rate_in_correct", "rollout/tool_error_rate_in_correct", True),
           ("tool_error_rate_in_correct_run_mean", "rollout/tool_error_rate_in_correct", RUN),
           ("response_tokens", "rollout/response_tokens_mean", True),
           ("tool_calls", "rollout/tool_calls_mean", True),
           ("kept_tool_error_rate_in_correct", "roc/tool_error_rate_in_correct", True)]


def run_arm(arm: str, seed: int, args) -> Path:
    """One train.py run (skipped when its model already exists); returns its folder."""
    out = Path(args.root) / f"{arm}-seed{seed}"
    if (out / "model" / "config.json").is_file():
        return out
    cmd = [sys.executable, "train.py", args.config, f"model_path={args.sft}", f"data=[{args.data}]",
           f"out_dir={out}", f"seed={seed}", f"steps={args.steps}", f"eval_data={args.eval_data}",
           f"eval_every={args.eval_every}", f"eval_limit={args.eval_limit}", f"eval_samples={args.eval_samples}",
           f"save_every={args.eval_every}"] + ARMS[arm] + args.override
    print("\n$ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return out


def curve(rows: list[dict], key: str, smooth: int) -> list[tuple[int, float]]:
    """(step, value) for every row that has the metric (NaN skipped), as a trailing mean over `smooth` points."""
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None and r[key] == r[key]]
    if smooth <= 1:
        return pts
    return [(s, statistics.fmean(v for _, v in pts[max(0, i - smooth + 1):i + 1])) for i, (s, _) in enumerate(pts)]


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
    return "\n".join(lines) + "\n\nmean ± standard deviation over seeds [min, max]; final values (see ablation.py)\n"


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


def collect(root: Path, arms, seeds, smooth: int) -> dict:
    curves = {}
    for arm in arms:
        curves[arm] = {name: [] for name, _, _ in METRICS}
        for seed in seeds:
            log = root / f"{arm}-seed{seed}" / "metrics.jsonl"
            rows = [json.loads(line) for line in log.read_text().splitlines()]
            for name, key, smoothed in METRICS:
                window = len(rows) if smoothed == RUN else smooth if smoothed else 1
                curves[arm][name].append(curve(rows, key, window))
    return curves


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="runs/ablation")
    p.add_argument("--sft", default="runs/tiny/sft/model", help="the SFT checkpoint every arm starts from")
    p.add_argument("--data", default="runs/tiny/data/train_level1.jsonl")
    p.add_argument("--eval-data", default="runs/tiny/data/test.jsonl")
    p.add_argument("--config", default="configs/tiny/stage1.yaml")
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-limit", type=int, default=100, help="first N held-out problems (100: level 1)")
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--smooth", type=int, default=5)
    p.add_argument("--override", nargs="*", default=[], help="extra train.py key=value for every arm")
    p.add_argument("--report-only", action="store_true", help="only read the finished runs and write the outputs")
    args = p.parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        for seed in args.seeds:  # seed-major: a stopped ablation already has every arm for the first seeds
            for arm in args.arms:
                run_arm(arm, seed, args)
    curves = collect(root, args.arms, args.seeds, args.smooth)
    table = summarize(curves)
    pngs = plot(curves, root)
    (root / "ablation.json").write_text(json.dumps({"args": vars(args), "final": table}, indent=1))
    (root / "ablation.md").write_text(markdown(table))
    print("\n" + markdown(table))
    print("wrote " + ", ".join(str(x) for x in pngs + [root / "ablation.md", root / "ablation.json"]))


if __name__ == "__main__":
    main()
