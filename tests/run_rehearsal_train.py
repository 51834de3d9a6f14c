"""`accelerate launch ... tests/run_rehearsal_train.py [train.py args]`: train.py's real entry point, sampler and
all, which also records what tests/test_rehearsal.py checks, per rank r in OUT_DIR/rank{r}.json:
- "update": for each policy update, the trainer's own tensors at its start (its parameters' local shards, their
  gradients, the AdamW state), the peak of tensor memory above that during the update (torch.profiler with
  profile_memory=True: every tensor allocation and free in the process, summed in time order; torch's CPU allocator
  has no peak counter), and the largest micro-batch it ran (sequences, padded length);
- "tool_turns": each tool call of the rollouts, the text the model was shown and the ids the rollout appended;
and, on the main process, OUT_DIR/masters.pt: the trained weights as training holds them, just before model/ is
saved in the input's dtype. CPU_FSDP=1 lets Accelerate's FSDP run on CPU processes (tests/cpu_fsdp.py)."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("CPU_FSDP") == "1":
    import cpu_fsdp
    cpu_fsdp.enable()

import torch  # noqa: E402

import train  # noqa: E402
from plumbing import accel  # noqa: E402

RECORD = {"update": [], "tool_turns": []}
SHAPES = []


def own_bytes(model, optimizer) -> int:
    """Bytes of the trainer's parameters (local shards under FSDP), gradients and optimizer state, each storage once."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    storages = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def measured_update(real):
    def update_policy(accelerator, model, optimizer, *args, **kwargs):
        start, SHAPES[:] = own_bytes(model, optimizer), []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            out = real(accelerator, model, optimizer, *args, **kwargs)
        running, peak = 0, 0
        # every allocation and free, in time order (the raw "[memory]" records: prof.events() folds those made
        # inside an op into it, and its children's again into each parent)
        records = prof.profiler.kineto_results.events()
        for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in records if e.name() == "[memory]"):
            running += nbytes
            peak = max(peak, running)
        n, length = max(SHAPES, key=lambda s: s[0] * s[1])
        RECORD["update"].append({"start_bytes": start, "peak_above_start": peak, "sequences": n, "length": length})
        return out
    return update_policy


def recorded_logprobs(real):
    def token_logprobs(model, batch, temperature):
        SHAPES.append(tuple(batch["input_ids"].shape))
        return real(model, batch, temperature)
    return token_logprobs


def recorded_rollout(real):
    def rollout(*args, **kwargs):
        trajs = real(*args, **kwargs)
        for t in trajs:  # each run of mask-0 ids is one tool reply, in the order of the calls
            runs, current = [], []
            for i, m in zip(t.response_ids, t.loss_mask):
                if m == 0:
                    current.append(i)
                elif current:
                    runs, current = runs + [current], []
            runs += [current] if current else []
            for call, ids in zip(t.tool_calls, runs):
                RECORD["tool_turns"].append({"response": call.response, "status": call.status, "ids": ids})
        return trajs
    return rollout


def save_with_masters(real):
    def save_model(acc, model, tokenizer, out, *rest):
        state = acc.get_state_dict(model)  # every rank joins (FSDP gathers)
        if acc.is_main_process:
            torch.save({k: v.detach().clone() for k, v in state.items()}, Path(out).parent / "masters.pt")
        real(acc, model, tokenizer, out, *rest)
    return save_model


if __name__ == "__main__":
    train.update_policy = measured_update(train.update_policy)
    train.token_logprobs = recorded_logprobs(train.token_logprobs)
    train.rollout = recorded_rollout(train.rollout)
    train.save_model = save_with_masters(train.save_model)
    out = Path(next(a for a in sys.argv[1:] if a.startswith("out_dir=")).split("=", 1)[1])

    def run():
        train.main(sys.argv[1:])
        (out / f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(RECORD))
    accel.run_and_exit(run)  # as train.py ends (plumbing/accel.py, point 4)
