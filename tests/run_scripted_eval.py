"""`python tests/run_scripted_eval.py [eval.py args]`: eval.py's real entry point with a scripted policy, for tests
that start it under torchrun. The model folder gives the tokenizer only; the answers come from `VariedSampler`.

SEEN_DIR=DIR: each rank writes DIR/rank{R}.jsonl, one line per first-turn prompt it played: the problem and the
torch seed of that moment (which problems each rank played, and with which seed). CRASH_ON=TEXT: the rank that
meets a prompt containing TEXT raises (a crash partway through an evaluation)."""
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import eval as ev  # noqa: E402
from plumbing import accel  # noqa: E402
from scripted_policy import ScriptedSampler  # noqa: E402


class VariedSampler(ScriptedSampler):
    """ScriptedSampler's answers (copy 0 and 2 right, 1 right through the tool, 3 wrong), with the first N % 3
    copies of problem "Say N." wrong as well: per-problem accuracies differ, so a sample summarized under the wrong
    problem changes the metrics. Deterministic: nothing depends on chance, timing or which rank plays it."""

    def _turn(self, text: str, copy: int) -> str:
        n = int(re.findall(r"Say (\d+)\.", text)[0])
        if "<tool_response>" not in text:
            if os.environ.get("SEEN_DIR"):
                rank = os.environ.get("RANK", "0")
                with open(Path(os.environ["SEEN_DIR"]) / f"rank{rank}.jsonl", "a") as f:
                    f.write(json.dumps({"problem": n, "copy": copy, "seed": torch.initial_seed()}) + "\n")
            if os.environ.get("CRASH_ON") and os.environ["CRASH_ON"] in text:
                raise RuntimeError(f"scripted crash on {os.environ['CRASH_ON']!r}")
            if copy % 4 < n % 3:
                return f"</reason>\n<answer>\\boxed{{{n + 1}}}</answer>"
        return super()._turn(text, copy)


if __name__ == "__main__":
    from transformers import AutoTokenizer
    ev.load_model = lambda cfg: (VariedSampler(None, tok := AutoTokenizer.from_pretrained(cfg.model_path)), tok)
    accel.run_and_exit(lambda: ev.main(sys.argv[1:]))  # as eval.py ends (plumbing/accel.py, point 4)
