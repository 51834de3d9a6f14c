"""LoRA against full fine-tuning on the tiny task: the RL stages from the same SFT model, same seeds, side by side.

    python -m tiny.pipeline --seeds 0-2 --root runs/full &            # the two run side by side: each one's
    python -m tiny.pipeline --lora --seeds 0-2 --root runs/lora &     # step seconds see the same machine
    python bench/lora_tiny.py runs/full runs/lora

Reads the two roots' seed folders (tiny/pipeline.py writes them) and prints, per way of training:
- held-out pass@1 after SFT and after each RL stage (mean, min and max over the seeds), and stage 1's gain over SFT;
- the parameters that train and the bytes of AdamW's state (stage 1's last checkpoint: exp_avg and exp_avg_sq);
- the median seconds of an RL step and of its update, per stage, over every step of every seed.
It checks that each seed's SFT model is the same file in both roots (the RL stages start from the same weights).
Nothing is timed here: the seconds are what the runs logged (perf/step_s, perf/update_s in metrics.jsonl).
"""
import argparse
import hashlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STAGES = ("sft", "stage1", "stage2", "stage3")


def seeds(root: Path) -> dict[int, Path]:
    return {int(p.name[4:]): p for p in sorted(root.glob("seed*")) if (p / "summary.json").is_file()}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def optimizer_bytes(run: Path) -> tuple[int, int]:
    """(parameters with AdamW state, bytes of that state) in the run's latest checkpoint."""
    folder = run / (run / "latest").read_text().strip()
    state = torch.load(folder / "optimizer.bin", weights_only=False)["state"]
    params = sum(s["exp_avg"].numel() for s in state.values())
    return params, sum(t.numel() * t.element_size() for s in state.values() for k, t in s.items() if k != "step")


def step_seconds(runs: list[Path], key: str) -> float:
    values = [json.loads(line).get(key) for run in runs for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(v for v in values if v is not None)


def summarize(root: Path) -> dict:
    found = seeds(root)
    summaries = {s: json.loads((p / "summary.json").read_text()) for s, p in found.items()}
    acc = {stage: [summaries[s][f"{stage}_accuracy"] for s in found] for stage in STAGES}
    gain = [100 * (summaries[s]["stage1_accuracy"] - summaries[s]["sft_accuracy"]) for s in found]
    params, state = optimizer_bytes(found[min(found)] / "stage1")
    seconds = {stage: (step_seconds([p / stage for p in found.values()], "perf/step_s"),
                       step_seconds([p / stage for p in found.values()], "perf/update_s")) for stage in STAGES[1:]}
    sft = {s: digest(p / "sft" / "model" / "model.safetensors") for s, p in found.items()}
    return {"seeds": sorted(found), "acc": acc, "gain": gain, "params": params, "state": state, "seconds": seconds,
            "sft": sft}


def spread(values: list[float], scale: float = 1.0, fmt: str = ".3f") -> str:
    return (f"{statistics.mean(values) * scale:{fmt}} [{min(values) * scale:{fmt}}, {max(values) * scale:{fmt}}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("full", type=Path, help="the root of `python -m tiny.pipeline --seeds ...`")
    parser.add_argument("lora", type=Path, help="the root of `python -m tiny.pipeline --lora --seeds ...`")
    args = parser.parse_args()
    ways = {"full": summarize(args.full), "lora": summarize(args.lora)}
    common = sorted(set(ways["full"]["seeds"]) & set(ways["lora"]["seeds"]))
    same = all(ways["full"]["sft"][s] == ways["lora"]["sft"][s] for s in common)
    print(f"seeds {common}; the same SFT model in both roots at every seed: {same}")
    print(f"{'':<24}{'full fine-tuning':>28}{'LoRA':>28}")
    for stage in STAGES:
        print(f"{'pass@1 ' + stage:<24}" + "".join(f"{spread(ways[w]['acc'][stage]):>28}" for w in ways))
    print(f"{'stage 1 gain, points':<24}" + "".join(f"{spread(ways[w]['gain'], 1, '+.1f'):>28}" for w in ways))
    print(f"{'trained parameters':<24}" + "".join(f"{ways[w]['params']:>28,}" for w in ways))
    print(f"{'AdamW state, bytes':<24}" + "".join(f"{ways[w]['state']:>28,}" for w in ways))
    for stage in STAGES[1:]:
        print(f"{stage + ' step / update s':<24}" + "".join(
            f"{ways[w]['seconds'][stage][0]:>19.2f} / {ways[w]['seconds'][stage][1]:5.2f}" for w in ways))
    ratio = ways["full"]["seconds"]["stage1"][1] / ways["lora"]["seconds"]["stage1"][1]
    print(f"means [min, max] over seeds; step seconds are medians over every step (both roots run side by side); "
          f"stage 1's update: full / LoRA = {ratio:.2f}x; AdamW state: {ways['full']['state'] / ways['lora']['state']:.1f}x")


if __name__ == "__main__":
    main()
