"""`python tests/run_teardown.py train|eval ARGS...` (under torchrun): train.py's or eval.py's entry point with a
scripted sampler whose `close` tears the process group down gracefully, as vLLM 0.32's engine shutdown does
(`destroy_process_group` on the default group); CRASH=1 makes its rollouts raise, an error inside the entry point.
Each rank writes $PROBE_DIR/rank{R}.json as things happen: the list, in order, of "close" (the sampler closed) and
"end failed=F group_up=G" (`accel.end_process_group` ran: on an error path or not, with a group still up or not)."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist  # noqa: E402

from plumbing import accel, rl_stage  # noqa: E402
from scripted_policy import ScriptedSampler  # noqa: E402

EVENTS = []


def note(what: str) -> None:
    EVENTS.append(what)
    path = Path(os.environ["PROBE_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    path.write_text(json.dumps(EVENTS))


class GroupClosingSampler(ScriptedSampler):
    """The scripted policy, with vLLM's way of closing: the launcher's group destroyed gracefully."""

    def generate(self, *args, **kwargs):
        if os.environ.get("CRASH") == "1":
            raise RuntimeError("scripted crash in a rollout")
        return super().generate(*args, **kwargs)

    def close(self) -> None:
        note("close")
        if dist.is_initialized():
            dist.destroy_process_group()


def end_process_group(failed: bool = False, real=accel.end_process_group) -> None:
    note(f"end failed={failed} group_up={dist.is_initialized()}")
    real(failed)


if __name__ == "__main__":
    entry, args = sys.argv[1], sys.argv[2:]
    accel.end_process_group = end_process_group
    if entry == "train":
        import train
        rl_stage.make_sampler = lambda cfg, model, tokenizer: GroupClosingSampler(model, tokenizer)
        accel.run_and_exit(lambda: train.main(args))
    else:
        import eval as ev
        from transformers import AutoTokenizer
        ev.load_model = lambda cfg: (GroupClosingSampler(None, tok := AutoTokenizer.from_pretrained(cfg.model_path)),
                                     tok)
        accel.run_and_exit(lambda: ev.main(args))
