"""tools/memory_plan.py: parameter counts against the real transformers models, the memory estimate by hand values, the
per-rank engine layout, and the dry-run plan that prints them."""
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import train
from tools.memory_plan import (GB, PUBLIC_CONFIGS, Shape, engine_layout, logprob_chunk_bytes, mask_bytes,
                         memory_per_gpu, micro_batch_rows, sft_memory_lines, sft_memory_per_gpu)

pytestmark = pytest.mark.spec  # the one-minute tier: make test-fast

TOY = Shape(layers=2, hidden=4, intermediate=8, heads=2, kv_heads=1, head_dim=2, vocab=10, tied=False)


@pytest.mark.parametrize("name", sorted(PUBLIC_CONFIGS))
def test_parameter_count_is_that_of_the_transformers_model(name):
    with torch.device("meta"):  # shapes only, no memory
        model = Qwen3ForCausalLM(Qwen3Config(**PUBLIC_CONFIGS[name]))
    assert Shape.from_config(PUBLIC_CONFIGS[name]).params == sum(p.numel() for p in model.parameters())


def test_qwen3_14b_by_hand():
    shape = Shape.from_config(PUBLIC_CONFIGS["qwen3-14b"])
    # q 5120x5120, k and v 5120x1024, o 5120x5120, MLP 3 x 5120x17408, two norms of 5120, q/k norms of 128
    assert shape.layer_params == 26_214_400 + 2 * 5_242_880 + 26_214_400 + 267_386_880 + 10_240 + 256
    assert shape.params == 40 * 330_311_936 + 2 * 151_936 * 5120 + 5120 == 14_768_307_200
    assert shape.kv_bytes_per_token == 40 * 2 * 8 * 128 * 2  # 160 KiB: K and V, 8 KV heads, bf16


def test_memory_terms_by_hand():
    assert TOY.layer_params == 4 * 8 + 4 * 4 + 3 * 4 * 8 + 2 * 4 + 2 * 2 == 156
    assert TOY.params == 2 * 156 + 2 * 10 * 4 + 4 == 396
    m = {k: v * GB for k, v in memory_per_gpu(TOY, shard=2, fsdp=True, micro_batch=1, seq_tokens=5,
                                              gradient_checkpointing=True, sampler="hf", gpu_gb=1.0,
                                              hf_slots=3).items()}
    expected = {
        "weights": 4 * 396 / 2, "grads": 4 * 396 / 2, "adamw": 8 * 396 / 2,
        "gathered": 2 * (2 * 10 * 4 + 2 * 156),           # bf16 embedding + output layer + two layers
        "activations": 2 * 5 * 4 * 2 + 2 * 5 * (12 * 4 + 4 * 8) * 2,  # layer inputs + one layer and its gradients
        "logits": 2 * 5 * 10 + 2 * 4 * 5 * 10,           # FSDP2's bf16 logits; one fp32 chunk (all 5 tokens) x 2
        "sampler_weights": 2 * 396,                       # HFSampler's own bf16 copy under FSDP
        "kv_cache": 3 * 5 * (2 * 2 * 1 * 2 * 2),          # slots x tokens x (layers, K and V, kv heads, head dim, bf16)
        "process": 0.6e9,                                 # one process: the CUDA context (no NCCL)
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key
    assert m["rollout_peak"] == pytest.approx(792 + 1584 + 792 + 240 + 0.6e9)
    assert m["update_peak"] == pytest.approx(792 + 792 + 1584 + 784 + 1680 + 500 + 792 + 0.6e9)


def test_the_logits_term_counts_one_chunk_of_logprobs_py():
    from plumbing import logprobs
    from tools.memory_plan import LOGPROB_CHUNK_ELEMENTS, logprob_chunk_bytes
    assert LOGPROB_CHUNK_ELEMENTS == logprobs.CHUNK_ELEMENTS
    assert logprob_chunk_bytes(12_288, 151_936) == 2 * 4 * logprobs.chunk_positions(151_936) * 151_936  # 134 MB
    assert logprob_chunk_bytes(3, 151_936) == 2 * 4 * 3 * 151_936  # fewer tokens than a chunk
    shape = Shape.from_config(PUBLIC_CONFIGS["qwen3-0.6b"])
    args = dict(shard=1, micro_batch=2, seq_tokens=6144, gradient_checkpointing=True, sampler="vllm", gpu_gb=141.0)
    fsdp, ddp = (memory_per_gpu(shape, fsdp=f, **args)["logits"] * GB for f in (True, False))
    chunk = logprob_chunk_bytes(12_288, 151_936)
    assert fsdp == pytest.approx(2 * 12_288 * 151_936 + chunk)  # FSDP2's bf16 logits
    assert ddp == pytest.approx(6 * 12_288 * 151_936 + chunk)  # + the fp32 copy of Accelerate's autocast


def test_qwen3_0_6b_on_one_h200_by_vllm_s_rules():
    """configs/qwen3-0.6b/stage1.yaml on one H200 (150.7 GB as its driver reports it), vLLM at 0.5, by hand: the
    engine takes 0.5 x 150.7 GB whatever the trainer holds, and its KV cache gets that share less its bf16 weights,
    its profile run (16,384 tokens through the MLP, the sampler on 1,024 rows) and its CUDA graphs."""
    P = 596_049_920  # Qwen3-0.6B: 28 x 15,730,944 + 151,936 x 1,024 (tied) + 1,024
    m = memory_per_gpu(Shape.from_config(PUBLIC_CONFIGS["qwen3-0.6b"]), shard=1, fsdp=True, micro_batch=2,
                       seq_tokens=6_144, gradient_checkpointing=True, sampler="vllm", gpu_gb=150.7, world=1,
                       engine_fraction=0.5)
    profile = (16_384 * 3 * 3_072 * 2 + 3 * 1_024 * 151_936 * 4) / 1e9  # 0.30 GB MLP + 1.87 GB sampler logits
    kv = 75.35 - 2 * P / 1e9 - profile - 1.0
    assert m["engine_budget"] == pytest.approx(75.35) and m["sampler_weights"] == pytest.approx(1.19209984)
    assert m["engine_profile"] == pytest.approx(profile) and m["kv_cache"] == pytest.approx(kv)
    assert m["kv_cache_tokens"] == pytest.approx(kv * 1e9 / (28 * 2 * 8 * 128 * 2))  # 114,688 B per token
    assert round(m["kv_cache_tokens"]) == 618_974
    assert m["rollout_peak"] == pytest.approx(12 * P / 1e9 + 75.35 + 0.6)  # fp32 weights + AdamW + engine + CUDA
    assert m["update_peak"] == pytest.approx(16 * P / 1e9 + m["gathered"] + m["activations"]
                                             + (2 * 12_288 * 151_936 + logprob_chunk_bytes(12_288, 151_936)) / 1e9  # bf16 logits, 2 chunks
                                             + 0.5 + 0.6)  # engine asleep: 0.5 GB


def test_qwen3_14b_on_64_gpus_by_vllm_s_rules():
    """Stage 2-3 of the report's recipe (14,336 tokens a sequence), 8 nodes of 8 H200s: FSDP within a node, NCCL
    buffers, the engine's bf16 weights (29.5 GB) inside its 75.35 GB; and the same on 80 GB GPUs (85.5 GB)."""
    P = 14_768_307_200
    shape = Shape.from_config(PUBLIC_CONFIGS["qwen3-14b"])
    plan = dict(shard=8, fsdp=True, micro_batch=1, seq_tokens=14_336, gradient_checkpointing=True, sampler="vllm",
                world=64, engine_fraction=0.5)
    m = memory_per_gpu(shape, gpu_gb=150.7, **plan)
    profile = (16_384 * 3 * 17_408 * 2 + 3 * 1_024 * 151_936 * 4) / 1e9  # 1.71 GB MLP + 1.87 GB sampler logits
    assert m["sampler_weights"] == pytest.approx(2 * P / 1e9) and m["engine_profile"] == pytest.approx(profile)
    assert m["kv_cache"] == pytest.approx(75.35 - 29.5366144 - profile - 1.0)
    assert round(m["kv_cache_tokens"]) == 251_679  # 163,840 B per token: ~17 rollouts of 14,336 tokens at once
    assert m["process"] == pytest.approx(0.6 + 1.0)  # the CUDA context and NCCL's buffers
    assert m["rollout_peak"] == pytest.approx(12 * P / 8 / 1e9 + 75.35 + 1.6)
    assert m["update_peak"] < m["rollout_peak"] < 150.7
    small = memory_per_gpu(shape, gpu_gb=85.5, **plan)  # H100 80GB: 81,559 MiB
    assert small["kv_cache"] == pytest.approx(0.5 * 85.5 - 29.5366144 - profile - 1.0)
    assert round(small["kv_cache_tokens"]) == 52_705 < 4 * 14_336  # under 4 full rollouts at a time
    assert small["update_peak"] < small["rollout_peak"] < 85.5 < small["rollout_peak"] + 20  # 19 GB to spare


def test_the_sleep_mode_setting_keeps_the_engine_resident_in_the_update_s_peak(capsys):
    """vllm_enable_sleep_mode=false: the engine's whole share (75.35 GB on an H200) stays through the update, where
    asleep it keeps 0.5 GB; CUDA graphs kept on the GPU while asleep add theirs (1.0 GB). The 14B plan then says
    the update does not fit."""
    shape = Shape.from_config(PUBLIC_CONFIGS["qwen3-14b"])
    plan = dict(shard=8, fsdp=True, micro_batch=1, seq_tokens=14_336, gradient_checkpointing=True, sampler="vllm",
                world=64, engine_fraction=0.5, gpu_gb=150.7)
    asleep, awake = memory_per_gpu(shape, **plan), memory_per_gpu(shape, engine_sleeps=False, **plan)
    graphs_kept = memory_per_gpu(shape, engine_graphs_offloaded=False, **plan)
    assert awake["update_peak"] - asleep["update_peak"] == pytest.approx(75.35 - 0.5)
    assert graphs_kept["update_peak"] - asleep["update_peak"] == pytest.approx(1.0)
    assert awake["rollout_peak"] == asleep["rollout_peak"]
    train.main(["configs/qwen3-14b/stage1.yaml", "dry_run=true", "world_size=64", "vllm_enable_sleep_mode=false",
                "attn_implementation=flash_attention_2"])
    out = capsys.readouterr().out
    assert "engine awake 75.3 (vllm_enable_sleep_mode=false)" in out and "= 171.9 of 150.7 GB  OVER" in out
    assert "no sleep (vllm_enable_sleep_mode=false): the engine keeps its weights" in out


def test_each_rank_has_its_own_device_on_its_node_and_its_own_seed():
    layout = engine_layout(world=16, gpus_per_node=8, seed=5)
    assert [(e["node"], e["device"]) for e in layout[7:10]] == [(0, "cuda:7"), (1, "cuda:0"), (1, "cuda:1")]
    assert len({(e["node"], e["device"]) for e in layout}) == 16 and len({e["seed"] for e in layout}) == 16
    assert layout[9]["seed"] == 14 and {e["tp"] for e in layout} == {1}


def test_dry_run_prints_engines_and_memory_for_64_gpus(capsys):
    flash = "attn_implementation=flash_attention_2"  # one row, no mask (sdpa's: the next test)
    train.main(["configs/qwen3-14b/stage1.yaml", "dry_run=true", "world_size=64", flash])
    out = capsys.readouterr().out
    assert "rank 63: node 7 cuda:7 seed 63" in out and "TP 1" in out
    assert "14.77B parameters" in out and "FSDP over 8 GPUs" in out
    assert "engine 75.3 (0.5 x 150.7: weights 29.5" in out and "= 251,679 tokens)" in out
    assert "= 99.1 of 150.7 GB" in out and "= 97.0 of 150.7 GB" in out and "OVER" not in out
    train.main(["configs/qwen3-14b/stage1.yaml", "dry_run=true", "world_size=64", "gpu_memory_gb=40", flash])
    out = capsys.readouterr().out
    assert "= 97.0 of 40 GB  OVER: does not fit" in out  # the update
    assert "KV CACHE TOO SMALL" in out  # half of 40 GB does not even hold the engine's 29.5 GB of weights


def test_sft_terms_by_hand():
    """SFT under FSDP2 over 2 GPUs, every micro-batch reduce-scattered: sharded fp32 state, no full gradient."""
    m = {k: v * GB for k, v in sft_memory_per_gpu(TOY, shard=2, micro_batch=1, seq_tokens=5,
                                                  gradient_checkpointing=True).items()}
    expected = {
        "weights": 4 * 396 / 2, "grads": 4 * 396 / 2, "adamw": 8 * 396 / 2,  # all sharded: 792 B, not 1,584
        "gathered": 2 * (2 * 10 * 4 + 2 * 156),
        "activations": 2 * 5 * 4 * 2 + 2 * 5 * (12 * 4 + 4 * 8) * 2,
        "logits": 14 * 5 * 10,                 # bf16 logits + fp32 log-softmax + two fp32 gradients
        "reduce_scatter": (2 + 4) * 156,       # a decoder layer (156) outweighs the output group (10 x 4 + 4)
        "process": 0.6e9,
    }
    assert m.keys() == expected.keys() | {"peak"}
    for key, value in expected.items():
        assert m[key] == pytest.approx(value), key
    assert m["peak"] == pytest.approx(792 + 792 + 1584 + 784 + 1680 + 700 + 936 + 0.6e9)


def test_the_sft_logits_term_is_what_masked_lm_loss_holds():
    """SFT_LOGITS_BYTES against torch.profiler's allocation records of sft.masked_lm_loss's forward and backward
    on bf16 logits (FSDP2's), the largest running sum per token and vocabulary entry (12 B if sft.py let go of
    the bf16 logits before its backward)."""
    import sft
    from tools.memory_plan import SFT_LOGITS_BYTES
    T, V, H = 64, 4096, 16
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, T, H, generator=g).requires_grad_()
    weight = torch.randn(V, H, generator=g).bfloat16()
    labels = torch.randint(V, (1, T), generator=g)

    def step():  # as sft.py's loop: its `logits` variable holds the bf16 logits through the backward
        logits = h.bfloat16() @ weight.T
        sft.masked_lm_loss(logits, labels).backward()

    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    running = peak = 0
    records = prof.profiler.kineto_results.events()
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in records if e.name() == "[memory]"):
        running += nbytes
        peak = max(peak, running)
    assert SFT_LOGITS_BYTES - 0.5 < peak / (T * V) <= SFT_LOGITS_BYTES


def test_sft_of_qwen3_14b_on_8_gpus_by_hand():
    """configs/qwen3-14b/sft.yaml on nodes of 8 H200s: 1 x 8,192 tokens a micro-batch, checkpointing."""
    P = 14_768_307_200
    m = sft_memory_per_gpu(Shape.from_config(PUBLIC_CONFIGS["qwen3-14b"]), shard=8, micro_batch=1,
                           seq_tokens=8192, gradient_checkpointing=True, world=64)
    assert m["grads"] == pytest.approx(4 * P / 8 / 1e9)  # 7.4 GB; a whole fp32 gradient would be 59.1 GB
    assert m["logits"] == pytest.approx(14 * 8192 * 151_936 / 1e9)  # 17.4 GB
    assert m["reduce_scatter"] == pytest.approx(6 * (151_936 * 5120 + 5120) / 1e9)  # lm_head + norm: 4.7 GB
    assert m["gathered"] == pytest.approx(2 * (2 * 151_936 * 5120 + 2 * 330_311_936) / 1e9)
    assert m["peak"] == pytest.approx(16 * P / 8 / 1e9 + m["gathered"] + m["activations"] + m["logits"]
                                      + m["reduce_scatter"] + 1.6)
    assert round(m["peak"], 1) == 65.3


def test_sft_memory_lines_for_the_14b_config():
    from plumbing.config import load_config
    from sft import SFTConfig
    cfg = load_config(SFTConfig, ["configs/qwen3-14b/sft.yaml"])
    out = "\n".join(sft_memory_lines(cfg, 64, model_shape="qwen3-14b"))
    assert "FSDP2 over 8 GPUs" in out and "micro-batch 1 x 8,192 = 8,192 tokens" in out
    assert "gradients 7.4 + AdamW 14.8" in out and "logits 17.4 + reduce-scatter 4.7" in out
    assert out.endswith("= 65.3 of 150.7 GB")
    small = "\n".join(sft_memory_lines(cfg, 1, model_shape="qwen3-14b", gpu_gb=85.5))  # unsharded on one GPU
    assert "FSDP2 over 1 GPUs" in small and small.endswith("OVER: does not fit")
    assert "no estimate" in sft_memory_lines(cfg, 8)[0]  # no config.json, no model_shape


@pytest.mark.parametrize("config, sent", [("configs/qwen3-14b/stage1.yaml", "sends every weight"),
                                          ("configs/qwen3-8b-lora/stage1.yaml", "adapted layers merged")])
def test_the_plan_says_the_engine_starts_from_dummy_weights_and_what_each_hand_off_sends(config, sent, capsys):
    """Every vLLM training config: no checkpoint read by the engine (the hand-off at the start sends every weight),
    and after each level-2 sleep every weight again, LoRA's frozen ones included."""
    train.main([config, "dry_run=true"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("engine weights"))
    assert "vLLM's dummy weights at start (no checkpoint read)" in line and sent in line and "no host RAM" in line


def test_the_attention_mask_by_hand():
    """sdpa: a bool entry kept, and torch's bf16 additive copy at each layer's call, kept for the backward (one layer
    with checkpointing, all without); eager: its additive mask and each kept layer's scores; flash: none."""
    args = dict(rows=2, width=10, fsdp=True)
    assert mask_bytes(TOY, "sdpa", "rows", gradient_checkpointing=True, **args) == 2 * 10 * 10 * (1 + 2)
    assert mask_bytes(TOY, "sdpa", "rows", gradient_checkpointing=False, **args) == 2 * 10 * 10 * (1 + 2 * 2)
    assert mask_bytes(TOY, "eager", "rows", gradient_checkpointing=True, **args) == 2 * 10 * 10 * (2 + 2 * (2 + 4))
    for attention, layout in [("flash_attention_2", "one_row"), ("flash_attention_2", "padded"),
                              ("sdpa", "one_row"), ("flex_attention", "rows")]:
        assert mask_bytes(TOY, attention, layout, gradient_checkpointing=True, **args) == 0
    # the widest micro-batch each layout forms (update_plan.row_widths: up to twice the longest rollout)
    assert micro_batch_rows("rows", 10_240, 49_152, 4) == (2, 20_480)
    assert micro_batch_rows("rows", 10_240, 16_384, 4) == (1, 16_384)
    assert micro_batch_rows("padded", 10_240, 0, 4) == (4, 10_240)
    assert micro_batch_rows("one_row", 10_240, 49_152, 4) == (1, 49_152)


def test_the_dry_run_counts_the_mask_of_sdpa_s_layout_and_none_under_flash(capsys):
    """configs/qwen3-14b stage 1 (rollouts of 2,048 + 8,192 tokens, 49,152 a micro-batch, checkpointing): under sdpa
    rows up to 20,480 wide, two a micro-batch, a 2 x 20,480^2 mask at 3 B an entry (2.5 GB); flash: one row, none."""
    out = {}
    for name in ("sdpa", "flash_attention_2"):
        train.main(["configs/qwen3-14b/stage1.yaml", "dry_run=true", "world_size=64", f"attn_implementation={name}"])
        out[name] = capsys.readouterr().out
    mask = 2 * 20_480 ** 2 * 3 / 1e9
    assert f"sdpa mask {mask:.1f} (2 x 20,480^2) + " in out["sdpa"] and "= 99.6 of 150.7 GB" in out["sdpa"]
    assert "attention              sdpa; micro-batch layout rows" in out["sdpa"]
    assert " mask " not in out["flash_attention_2"] and "= 97.0 of 150.7 GB" in out["flash_attention_2"]
    assert "attention              flash_attention_2; micro-batch layout one_row" in out["flash_attention_2"]
