"""The report's RoC finding on a real LM: tiny/ablation.py's arms from `make smol`'s SFT model of SmolLM2-135M.

    python -m smol.ablation                        # 3 arms x 3 seeds (make smol-ablation; `make smol` first)
    python -m smol.ablation --seeds 0 --arms roc uniform   # a pilot
    python -m smol.ablation --report-only          # tables, plots and checks from finished runs

The arms start from runs/smol/sft/model and train RL stage 1 of configs/smollm2-135m/ on its training problems,
each with 8 rollouts sampled per prompt and 4 kept, so that they differ only in which 4 (roc_mode):
  roc      the report's Resample-on-Correct: positives drawn favouring fewer tool errors and format problems
  uniform  plain GRPO's down-sampling: the same counts, drawn uniformly (the finding's baseline)
  lowest   the public code's rule: the cleanest positives, deterministically
Each arm's final model is evaluated on the whole test split (eval.yaml), the transfer family reported alone.
The stage is shortened so that an arm takes at most about 20 minutes on 2 cores: 6 prompts a step (stage 1: 16),
15 steps, the finding's windows the first 5 and the last 10 steps (ARGS). Outputs in runs/smol_ablation.
"""
import sys

from tiny.ablation import main as ablate

CONFIGS = "configs/smollm2-135m"
ARGS = ["--sft", "runs/smol/sft/model", "--data", "runs/smol/data", "--train", "train.jsonl",
        "--config", f"{CONFIGS}/stage1.yaml", "--root", "runs/smol_ablation",
        "--arms", "roc", "uniform", "lowest", "--baseline", "uniform", "--steps", "15", "--first", "5", "--last", "10",
        "--eval-every", "0", "--eval-limit", "16", "--eval-samples", "1", "--smooth", "3",
        "--final-eval", f"{CONFIGS}/eval.yaml", "--transfer", "divisor_sum",
        "--override", "prompts_per_step=6", "save_every=3", "save_rollouts_every=15"]


def main(argv=None) -> None:
    """ARGS, then the command line's own arguments (a later --seeds, --arms or --root wins; --override replaces
    the list, so repeat ARGS' values with it)."""
    ablate(ARGS + list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
