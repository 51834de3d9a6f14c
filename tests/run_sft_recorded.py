"""`python tests/run_sft_recorded.py [sft.py args]`: sft.py's real entry point, recording on each rank what every
micro-batch trained and, under FSDP2, what each backward left on the rank. Writes OUT_DIR/record{RANK}.json:
`trained`: for each micro-batch row with a trained token, those tokens' ids (a conversation's trained part);
`backward`: after each backward of a sharded model, `fsdp_params` (FSDP's parameters), `unsharded_grads` (those
holding a gradient of the whole unsharded parameter: FSDPParam.unsharded_accumulated_grad, which FSDP2 keeps in the
reduce dtype while gradient sync is off, or the unsharded parameter's own .grad), `grads` (parameters whose .grad
is set) and `sharded_grads` (those whose .grad is a DTensor holding less than the whole parameter on this rank).
Under `accelerate launch`, CPU_FSDP=1 lets Accelerate's FSDP run on CPU processes (tests/cpu_fsdp.py);
FAULT=RANK:STEP:PHASE stops a rank in a phase of a step (`stop_in`)."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("CPU_FSDP") == "1":  # before sft imports Accelerator
    import cpu_fsdp
    cpu_fsdp.enable()

from accelerate.accelerator import Accelerator  # noqa: E402

import sft  # noqa: E402
from plumbing import accel  # noqa: E402
from plumbing.config import parse_cli  # noqa: E402

record = {"trained": [], "backward": []}
prepared = []


def fsdp_params(model) -> list:
    """Every FSDPParam of a model sharded by FSDP2 (torch's internal state, as accel.mixed_precision_policy reads)."""
    from torch.distributed.fsdp import FSDPModule
    found = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
            found += [p for group in filter(None, groups) for p in group.fsdp_params
                      if all(p is not q for q in found)]  # a group can be reached from more than one module
    return found


def grad_state(model) -> dict:
    from torch.distributed.tensor import DTensor
    held = [p for p in fsdp_params(model) if p.unsharded_accumulated_grad is not None
            or getattr(getattr(p, "_unsharded_param", None), "grad", None) is not None]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sharded = [g for g in grads if isinstance(g, DTensor) and g.to_local().numel() < g.numel()]
    return {"fsdp_params": len(fsdp_params(model)), "unsharded_grads": len(held), "grads": len(grads),
            "sharded_grads": len(sharded), "params": len(list(model.parameters()))}


real_loss, real_prepare, real_backward = sft.masked_lm_loss, Accelerator.prepare, Accelerator.backward


def recorded_loss(logits, labels):
    for row in labels:
        if (row != sft.IGNORE).any():
            record["trained"].append(row[row != sft.IGNORE].tolist())
    return real_loss(logits, labels)


def recorded_prepare(self, *objects, **kwargs):
    import torch
    out = real_prepare(self, *objects, **kwargs)
    prepared.extend(x for x in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(x, torch.nn.Module))
    return out


def recorded_backward(self, loss, **kwargs):
    real_backward(self, loss, **kwargs)
    model = prepared[0]
    if fsdp_params(model):
        record["backward"].append(grad_state(model))


def stop_in(spec: str, mark: Path) -> None:
    """FAULT=RANK:STEP:PHASE: rank RANK stops itself (SIGSTOP) as it enters PHASE of optimizer step STEP (from 1;
    accel.Peers.phase), after writing its pid to `mark`."""
    import signal
    rank, step, phase = spec.split(":")
    real = accel.Peers.phase

    def enter(self, what, where=None):
        real(self, what, where)
        if os.environ.get("RANK") == rank and (what, where) == (phase, f"step {step}"):
            mark.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
    accel.Peers.phase = enter


if __name__ == "__main__":
    if os.environ.get("FAULT"):
        stop_in(os.environ["FAULT"], Path(next(a for a in sys.argv[1:] if a.startswith("out_dir=")).split("=", 1)[1]
                                           + ".fault"))
    sft.masked_lm_loss, Accelerator.prepare, Accelerator.backward = recorded_loss, recorded_prepare, recorded_backward
    cfg = parse_cli(sft.SFTConfig, sys.argv[1:])

    def run():
        sft.train(cfg)
        (Path(cfg.out_dir) / f"record{os.environ.get('RANK', '0')}.json").write_text(json.dumps(record))
    accel.run_and_exit(run)  # as sft.py ends (plumbing/accel.py, point 4)
