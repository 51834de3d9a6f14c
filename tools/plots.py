"""Curves of a run's metrics.jsonl as PNG (train.py writes one at the end of each stage)."""
import json
from pathlib import Path

MAIN_CURVES = ["rollout/reward_mean", "eval/accuracy", "rollout/tool_error_rate_in_correct",
               "rollout/response_tokens_mean", "rollout/tool_calls_mean", "rollout/truncated_frac"]


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    """The report's diagnostics over steps, one panel each (written at the end of a stage)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    keys = MAIN_CURVES
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, key in zip(axes.flat, keys):
        pts = [(r["step"], r[key]) for r in rows if key in r and r[key] == r[key]]
        if pts:
            ax.plot(*zip(*pts), marker="." if len(pts) < 30 else None)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
