"""`python tests/run_accel.py MODE OUT_DIR`, launched on 2 CPU processes: what accel.make_accelerator gives a run.

MODE policy: a tiny Qwen3 prepared by the Accelerator that sft.py and train.py build (plumbing/accel.py; under an FSDP launch
through tests/cpu_fsdp.py), or by Accelerate's own default (MODE default-policy), one forward/backward in bf16 over
gloo; each rank writes rank{R}.json with the FSDP2 policy of the prepared model and the dtype of its gradients.
MODE timeout: the process group's timeout, seen at work: rank 1 joins an all_reduce 20 s late and rank 0 writes
how long it waited and what it got (accel.make_accelerator(timeout_s=3)).
MODE reshard: two tiny Qwen3s prepared together, tiny_model's (tied embeddings) and one with an untied lm_head (as
Qwen3-14B has); for each, what every rank holds gathered (accel.gathered_parameters) after a no-grad forward, after
accel.reshard, after a second no-grad forward and reshard (are the logits the same), and after a forward/backward."""
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from plumbing import accel  # noqa: E402

def timeout(out: Path, rank: int) -> None:
    acc = accel.make_accelerator(mixed_precision="no", report_to=None, out_dir=str(out), timeout_s=3)
    x = torch.ones(1)
    torch.distributed.barrier()
    if rank == 1:
        time.sleep(12)
    t0, error = time.perf_counter(), None
    try:
        torch.distributed.all_reduce(x)
    except Exception as e:  # noqa: BLE001 (gloo raises RuntimeError or DistBackendError, by version)
        error = f"{type(e).__name__}: {e}"
    (out / f"rank{rank}.json").write_text(json.dumps({"waited_s": time.perf_counter() - t0, "error": error}))
    # The group is broken (a peer timed out): end the process at once. os._exit runs no C++ destructor, so the
    # worker threads cannot abort the exit the way a group left alive at a normal exit can (plumbing/accel.py, point 4).
    os._exit(0)


def reshard(out: Path, rank: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from tiny import model as tiny_model
    acc = accel.make_accelerator(mixed_precision="bf16", report_to=None, out_dir=str(out), timeout_s=60)
    torch.manual_seed(0)
    tied = tiny_model.build_model(tiny_model.build_tokenizer(), hidden=32, layers=2, heads=2)
    untied = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          vocab_size=64, tie_word_embeddings=False))
    record = {}
    for name, model in (("tied", tied), ("untied", untied)):
        model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))  # as train.py does
        ids = torch.randint(0, 64, (1, 8))
        seen = {}
        with torch.no_grad():
            first = model(input_ids=ids).logits.float()
        seen["after_forward"] = accel.gathered_parameters(model)
        accel.reshard(model)
        seen["after_reshard"] = accel.gathered_parameters(model)
        with torch.no_grad():
            again = model(input_ids=ids).logits.float()
        accel.reshard(model)
        seen["after_second_reshard"] = accel.gathered_parameters(model)
        seen["same_logits"] = torch.equal(first, again)
        acc.backward(model(input_ids=ids, labels=ids).loss)
        seen["after_backward"] = accel.gathered_parameters(model)
        seen["grads"] = sum(p.grad is not None for p in model.parameters())
        record[name] = seen
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def policy(mode: str, out: Path, rank: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    if mode == "default-policy":
        import accelerate
        acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    else:
        acc = accel.make_accelerator(mixed_precision="bf16", report_to=None, out_dir=str(out), timeout_s=60)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    ids = torch.randint(0, 64, (2, 8))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    policy = {k: [str(d) for d in v] for k, v in accel.mixed_precision_policy(model).items()}
    grads = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    params = sorted({str(p.dtype) for p in model.parameters()})
    (out / f"rank{rank}.json").write_text(json.dumps({"policy": policy, "grads": grads, "params": params,
                                                     "distributed_type": str(acc.distributed_type)}))


if __name__ == "__main__":
    if os.environ.get("CPU_FSDP") == "1":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import cpu_fsdp
        cpu_fsdp.enable()
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ.get("RANK", 0))
    run = {"timeout": timeout, "reshard": reshard}.get(mode, lambda out, rank: policy(mode, out, rank))
    accel.run_and_exit(lambda: run(out, rank))  # as the entry points end (plumbing/accel.py, point 4)
