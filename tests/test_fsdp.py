"""The FSDP weight hand-off, proven on CPU processes: two ranks over gloo with the policy sharded by Accelerate's
FSDP2 (launched with the real configs/accelerate file; tests/cpu_fsdp.py lets Accelerate run FSDP on CPUs), each
rank's sampler holding its own copy. What only GPUs can show (NCCL, bf16 kernels, vLLM's loader, memory) is left to
bench/gpu_smoke.py on a GPU machine."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from plumbing.data import write_jsonl
from samplers.hf import load_named_weights
from scripted_policy import say_problems
from tiny.model import build_tiny
from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "run_scripted_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
FSDP = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
        str(ROOT / "configs/accelerate/fsdp_1node_8gpu.yaml"), "--num_processes", "2", "--mixed_precision", "no"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    write_jsonl(root / "say.jsonl", say_problems(6))
    return root


def train_args(tiny, out, steps):
    # micro-batches of up to 2048 tokens (the tiny config's) hold one rank's kept rollouts (2 prompts x G = 4); the
    # clip is off (1e6), since the gradient norm's sum over shards runs in another order. The single process still
    # sums its gradient in another order (one micro-batch of both ranks' rollouts), so the runs agree to rounding.
    return ["configs/tiny/stage1.yaml", f"model_path={tiny / 'base'}", f"data=[{tiny / 'say.jsonl'}]",
            f"out_dir={out}", "prompts_per_step=4", "rollouts_per_prompt=8", "group_size=4", f"steps={steps}",
            "eval_data=null", "save_every=1", "max_response_tokens=96", "lr=1e-2", "warmup_steps=2",
            "torch_threads=1", "tool_workers=1", "grad_clip=1e6"]


def run(cmd, env):
    launch = cmd if cmd == [sys.executable] else cmd + ["--main_process_port", str(free_port())]
    return subprocess.run(launch + [str(SCRIPT)] + env.pop("ARGS"), env=env, cwd=ROOT, capture_output=True, text=True)


@pytest.fixture(scope="module")
def bf16_base(tiny):
    """The tiny base saved in bf16, as hub checkpoints are."""
    from transformers import AutoTokenizer
    AutoModelForCausalLM.from_pretrained(tiny / "base").to(torch.bfloat16).save_pretrained(tiny / "bf16")
    AutoTokenizer.from_pretrained(tiny / "base").save_pretrained(tiny / "bf16")
    return tiny / "bf16"


@pytest.fixture(scope="module")
def stage1(tiny, tmp_path_factory):
    """Three RL steps on one process (no FSDP) and on two FSDP ranks, from the same base model and data."""
    root = tmp_path_factory.mktemp("stage1")
    done = run([sys.executable], {**ENV, "ARGS": train_args(tiny, root / "one", 3)})
    assert done.returncode == 0, done.stderr[-3000:]
    done = run(FSDP, {**ENV, "CPU_FSDP": "1", "ARGS": train_args(tiny, root / "fsdp", 3)})
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "one", root / "fsdp"


def sampler_gap(reference: dict, run_dir: Path) -> float:
    """The largest difference between `reference` and the weights either rank's sampler holds."""
    gaps = []
    for rank in (0, 1):
        sampler = torch.load(run_dir / f"sampler{rank}.pt")
        assert sampler.keys() == reference.keys()
        gaps += [(sampler[name] - reference[name]).abs().max().item() for name in reference]
    return max(gaps)


def test_each_fsdp_rank_s_sampler_gets_exactly_the_weights_of_one_process(tiny, stage1):
    one, two = stage1
    assert (two / "checkpoint-3" / "pytorch_model_fsdp_0").is_dir()  # sharded checkpoints: FSDP really ran
    reference = torch.load(one / "sampler0.pt")  # one process, no FSDP: the sampler's copy of the trainer
    start = AutoModelForCausalLM.from_pretrained(tiny / "base").state_dict()
    assert max((reference[k] - start[k]).abs().max().item() for k in reference) > 1e-3  # training moved them
    saved = AutoModelForCausalLM.from_pretrained(two / "model").state_dict()  # Accelerate's full state dict
    assert sampler_gap(saved, two) == 0  # each rank's sampler: the gathered weights, bit for bit
    assert sampler_gap(reference, two) < 1e-5  # and those are one process's update, to rounding


def test_a_skipped_gather_is_caught_by_the_hand_off_check(tiny, tmp_path):
    out = tmp_path / "skipped"
    done = run(FSDP, {**ENV, "CPU_FSDP": "1", "SKIP_GATHER": "1", "ARGS": train_args(tiny, out, 2)})
    assert done.returncode != 0
    assert "hand-off error at the start: the sampler's log-probs differ from the trainer's by" in done.stderr
    assert not (out / "metrics.jsonl").exists()  # stopped before the first rollout


def test_the_loader_refuses_a_shard_or_a_missing_weight(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny / "base")
    weights = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    shard = {**weights, "model.layers.0.mlp.up_proj.weight": weights["model.layers.0.mlp.up_proj.weight"][:64]}
    with pytest.raises(ValueError, match=r"up_proj.weight arrived with shape \(64, 32\), the sampler's is "
                                         r"\(128, 32\) \(a shard instead of the gathered parameter\?\)"):
        load_named_weights(model, shard.items())
    with pytest.raises(ValueError, match="1 weights never arrived, e.g. model.norm.weight"):
        load_named_weights(model, [(k, v) for k, v in weights.items() if k != "model.norm.weight"])
    with pytest.raises(ValueError, match="has no weight 'extra'"):
        load_named_weights(model, [("extra", torch.zeros(1))])
    load_named_weights(model, ((k, v) for k, v in weights.items() if k != "lm_head.weight"))  # tied: once is enough
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_gathered_weights_send_a_tied_weight_under_each_name_in_the_sampler_s_dtype(tiny):
    """Every state_dict key once (the tied output layer too, which vLLM's reload loads by that name), floats cast to
    the sampler's dtype before the (FSDP) gather; None keeps them as stored."""
    from plumbing.handoff import gathered_weights
    model = AutoModelForCausalLM.from_pretrained(tiny / "base")
    sent = list(gathered_weights(model, "cpu", torch.bfloat16))
    names = [name for name, _ in sent]
    assert sorted(names) == sorted(model.state_dict()) and len(names) == len(set(names))
    weights = dict(sent)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert torch.equal(weights["lm_head.weight"], model.model.embed_tokens.weight.to(torch.bfloat16))
    assert {t.dtype for _, t in gathered_weights(model, "cpu")} == {torch.float32}


def test_the_hand_off_gathers_sharded_weights_outside_autograd(monkeypatch):
    """gathered_weights on a DTensor parameter that requires grad (FSDP2's, here on a one-process gloo group): the
    cast and the all-gather run under no_grad, so neither keeps an autograd graph, and the values are the whole
    parameter's."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from plumbing.handoff import gathered_weights
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = dist.device_mesh.init_device_mesh("cpu", (1,))
        layer = torch.nn.Linear(4, 3, bias=False)
        whole = layer.weight.detach().clone()
        layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
        seen, full_tensor = [], DTensor.full_tensor

        def recorded(self, **kwargs):
            out = full_tensor(self, **kwargs)
            seen.append((torch.is_grad_enabled(), self.grad_fn is None, out.grad_fn is None))
            return out
        monkeypatch.setattr(DTensor, "full_tensor", recorded)
        sent = dict(gathered_weights(layer, "cpu", torch.bfloat16))
    finally:
        dist.destroy_process_group()
    assert seen == [(False, True, True)]  # no grad mode, no graph on the cast shard nor on the gathered tensor
    assert torch.equal(sent["weight"], whole.to(torch.bfloat16)) and not sent["weight"].requires_grad


def test_sft_under_fsdp_saves_the_whole_model_of_one_process(tiny, tmp_path):
    """sft.py's save under FSDP2 (it wrote DTensor shards through save_pretrained and failed): two ranks with
    micro-batch 4 match one rank accumulating two micro-batches (as tests/test_sft.py checks for DDP)."""
    from tiny.task import write_task
    data = write_task(tmp_path / "data", n_train=4, n_test=2, n_sft=16, workers=1)["sft"]
    args = [f"model_path={tiny / 'base'}", f"data={data}", "max_steps=2", "lr=3e-3", "batch_size=8",
            "micro_batch_size=4", "log_every=1", "system_prompt=compact", "user_instruction="]
    one, two = tmp_path / "one", tmp_path / "two"
    done = subprocess.run([sys.executable, "sft.py", f"out_dir={one}"] + args, cwd=ROOT, env=ENV,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run(FSDP + ["--main_process_port", str(free_port()), "tests/cpu_fsdp.py", "sft.py", f"out_dir={two}"]
                          + args, cwd=ROOT, env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = (AutoModelForCausalLM.from_pretrained(p / "model").state_dict() for p in (one, two))
    start = AutoModelForCausalLM.from_pretrained(tiny / "base").state_dict()
    assert a.keys() == b.keys() and max((a[n] - start[n]).abs().max().item() for n in a) > 1e-3
    assert all((a[n] - b[n]).abs().max() <= 2e-6 for n in a)


# FSDP2 with bf16 compute, as the real configs run (mixed_precision: bf16)
FSDP_BF16 = FSDP[:-1] + ["bf16"]


def saved_dtypes(model_dir: Path) -> tuple[set, str]:
    """The dtypes of model.safetensors' tensors and config.json's `dtype`."""
    import json
    import safetensors.torch
    tensors = safetensors.torch.load_file(model_dir / "model.safetensors")
    return {t.dtype for t in tensors.values()}, json.loads((model_dir / "config.json").read_text())["dtype"]


def test_bf16_compute_passes_the_hand_off_against_an_fp32_sampler(tiny, tmp_path):
    """An fp32 checkpoint gives each rank's sampler an fp32 copy while the trainer's forward runs in bf16: the
    tolerance is the coarser side's, bf16 (before: fp32's, and the run stopped with "hand-off error at the start").
    The model's logits are made trained-sized (embeddings x 20: a random model's are near 0, where bf16 rounding
    hardly shows). The stage's model/ is fp32, as its input was."""
    sharp = AutoModelForCausalLM.from_pretrained(tiny / "base")
    with torch.no_grad():
        sharp.model.embed_tokens.weight.mul_(20)
    sharp.save_pretrained(tmp_path / "sharp")
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(tiny / "base").save_pretrained(tmp_path / "sharp")
    out = tmp_path / "run"
    args = train_args(tiny, out, 2) + [f"model_path={tmp_path / 'sharp'}", "mixed_precision=bf16"]
    done = run(FSDP_BF16, {**ENV, "CPU_FSDP": "1", "ARGS": args})
    assert done.returncode == 0, done.stderr[-3000:]
    assert saved_dtypes(out / "model") == ({torch.float32}, "float32")


@pytest.mark.parametrize("launch", ["one process", "fsdp2"])
def test_a_bf16_checkpoint_s_stage_saves_model_in_bf16(tiny, bf16_base, tmp_path, launch):
    """train.py trains fp32 masters (checkpoint-*/ keeps them) and writes model/ in the dtype it started from
    (before: the fp32 masters, twice the bytes every engine of the next stage reads)."""
    out = tmp_path / "run"
    args = train_args(tiny, out, 1) + [f"model_path={bf16_base}", "mixed_precision=bf16"]
    if launch == "fsdp2":
        done = run(FSDP_BF16, {**ENV, "CPU_FSDP": "1", "ARGS": args})
    else:
        done = run([sys.executable], {**ENV, "ARGS": args})
    assert done.returncode == 0, done.stderr[-3000:]
    assert saved_dtypes(out / "model") == ({torch.bfloat16}, "bfloat16")
    trained = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    start = AutoModelForCausalLM.from_pretrained(bf16_base).state_dict()
    assert any(not torch.equal(trained[k], start[k]) for k in start)  # lr 1e-2: the step shows even in bf16


def test_a_skipped_gather_is_still_caught_under_bf16_compute(tiny, tmp_path):
    """The bf16 tolerance (0.1) is wide, but a sampler left with other weights is still stopped: at the start by
    the gap, or after the first step because its log-probs did not move while the trainer's did."""
    out = tmp_path / "skipped"
    done = run(FSDP_BF16, {**ENV, "CPU_FSDP": "1", "SKIP_GATHER": "1",
                           "ARGS": train_args(tiny, out, 2) + ["mixed_precision=bf16"]})
    assert done.returncode != 0
    assert "hand-off error" in done.stderr, done.stderr[-2000:]
    assert not (out / "model").exists()
