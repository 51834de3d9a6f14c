"""`python tests/run_sft_masters.py [sft.py args]`: sft.py's real entry point, which also writes the weights it trained
(the full state dict, gathered under FSDP, in the dtype training kept them in) to OUT_DIR/masters.pt just before it
saves model/. For tests of what the optimizer did to the weights, before model/ casts them to the input's dtype.
Under `accelerate launch`, CPU_FSDP=1 lets Accelerate's FSDP run on CPU processes (tests/cpu_fsdp.py)."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("CPU_FSDP") == "1":  # before sft imports Accelerator
    import cpu_fsdp
    cpu_fsdp.enable()

import torch  # noqa: E402

import sft  # noqa: E402
from plumbing import accel  # noqa: E402
from plumbing.config import parse_cli  # noqa: E402

real_save = sft.save_model


def save_with_masters(acc, model, tokenizer, out, *rest):
    state = acc.get_state_dict(model)  # every rank joins (FSDP gathers)
    if acc.is_main_process:
        torch.save({k: v.detach().clone() for k, v in state.items()}, Path(out).parent / "masters.pt")
    real_save(acc, model, tokenizer, out, *rest)


if __name__ == "__main__":
    sft.save_model = save_with_masters
    accel.run_and_exit(lambda: sft.train(parse_cli(sft.SFTConfig, sys.argv[1:])))  # as sft.py ends
