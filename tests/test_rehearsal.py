"""The real recipe, rehearsed on the CPU with real parts: configs/qwen3-0.6b/ (sft.yaml, stage1.yaml, eval.yaml) with
size overrides only (steps, batch, budgets, workers), through tools/convert_data.py -> sft.py -> train.py -> eval.py, on
- Qwen3-Base's vocabulary and generation config (tools/qwen_vocab.py: eos and pad <|endoftext|>, no BOS, the added tokens
  at their ids) and a small Qwen3 of it saved in bf16, as a hub checkpoint is (tests/rehearsal.py says how it is
  made and why it is taught to answer first);
- rows in the exact layouts of DAPO-Math-17k and NuminaMath-TIR, written as parquet;
- FSDP2 over two CPU processes (gloo) with mixed_precision bf16 and gradient checkpointing, for SFT and RL;
- the sampler: where vLLM imports (`make test-vllm`, .venv-vllm), its CPU build in bf16 for stage 1's rollouts (one
  engine per rank) and for the evaluation, as the configs say; elsewhere (`make test`) HFSampler, which under FSDP
  samples from its own copy in the checkpoint's dtype, bf16. Both run in CI.
It checks the properties the GPU run depends on and the tiny pipeline cannot show: the weights change as fp32
masters do, every model/ comes back in bf16, the hand-off passes with bf16 on both sides and still stops a stale
sampler, RL shows each tool reply token for token as SFT trained it, and the update's peak memory at this vocabulary
is what tools/memory_plan.py says. The vLLM flag beyond sizes: vllm_enforce_eager=true (no torch.compile on the CPU).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import vllm  # noqa: F401
    SAMPLER = "vllm"
except ImportError as e:
    if os.environ.get("RSTAR2_REQUIRE_VLLM") == "1":
        raise ImportError(f"RSTAR2_REQUIRE_VLLM=1 but vLLM does not import: {e}") from e
    SAMPLER = "hf"  # the same recipe with HFSampler; `make test-vllm` runs it with the engine

import safetensors.torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from tools import convert_data  # noqa: E402
import rehearsal  # noqa: E402
from plumbing.data import load_conversations, load_problems  # noqa: E402
from tools.memory_plan import GB, Shape, memory_per_gpu  # noqa: E402
from protocol import chat_format, encode, tool_response_turn  # noqa: E402
from sft import IGNORE, build_labels  # noqa: E402
from ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "CPU_FSDP": "1"}


def fsdp() -> list[str]:
    """Two CPU processes under the real FSDP2 config, bf16 compute (as the configs set it)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(ROOT / "configs/accelerate/fsdp_1node_8gpu.yaml"), "--num_processes", "2", "--mixed_precision", "bf16",
            "--main_process_port", str(free_port())]
# the configs' sampler is vLLM; without it, HFSampler (its batch: all rollouts of a step at once)
SAMPLER_ARGS = ["vllm_enforce_eager=true"] if SAMPLER == "vllm" else ["sampler=hf"]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def launch(cmd: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def moved(a: dict, b: dict) -> float:
    """The fraction of weight elements that differ between two state dicts (compared in fp32)."""
    changed = sum(int((a[k].float() != b[k].float()).sum()) for k in b)
    return changed / sum(t.numel() for t in b.values())


def saved_dtypes(model_dir: Path) -> tuple[set, str]:
    tensors = safetensors.torch.load_file(model_dir / "model.safetensors")
    return {t.dtype for t in tensors.values()}, json.loads((model_dir / "config.json").read_text())["dtype"]


# ---------------------------------------------------------------------------------------------- the recipe, in order
@pytest.fixture(scope="module")
def recipe(tmp_path_factory, qwen_tokenizer_dir):
    """Every stage of the recipe once; the tests below read what each left behind."""
    root = tmp_path_factory.mktemp("rehearsal")
    data = {"dapo": rehearsal.write_parquet(root / "dapo-math-17k.parquet", rehearsal.dapo_rows()),
            "tir": rehearsal.write_parquet(root / "train-00000-of-00001.parquet", rehearsal.tir_rows())}
    for kind in ("dapo", "tir"):
        convert_data.main([kind, str(data[kind]), str(root / f"{kind}.jsonl"), "--tool-workers", "1"])
    base = rehearsal.base_model(root / "base")
    # SFT: FSDP2 over two processes, bf16 compute, gradient checkpointing (configs/qwen3-0.6b/sft.yaml)
    launch(fsdp() + ["tests/run_sft_masters.py", "configs/qwen3-0.6b/sft.yaml", f"model_path={base}",
                   f"data={root / 'tir.jsonl'}", f"out_dir={root / 'sft'}", "max_steps=2", "batch_size=2",
                   "micro_batch_size=1"])
    # RL stage 1: the same, one sampler (bf16) per rank
    launch(fsdp() + ["tests/run_rehearsal_train.py", "configs/qwen3-0.6b/stage1.yaml",
                   f"model_path={root / 'sft' / 'model'}", f"data=[{root / 'dapo.jsonl'}]",
                   f"out_dir={root / 'stage1'}", "steps=2", "prompts_per_step=2", "rollouts_per_prompt=4",
                   "group_size=4", "max_response_tokens=160", "tool_workers=1", "eval_limit=1", "eval_samples=1",
                   *SAMPLER_ARGS])
    # evaluation: the sampler (bf16) on the four shipped benchmarks, one problem each
    launch([sys.executable, "eval.py", "configs/qwen3-0.6b/eval.yaml", f"model_path={root / 'stage1' / 'model'}",
            f"out_dir={root / 'eval'}", "samples=2", "limit=1", "max_response_tokens=160", "tool_workers=1", *SAMPLER_ARGS])
    return root


def test_the_public_rows_convert_as_the_real_sets_would(recipe):
    problems = load_problems(recipe / "dapo.jsonl")  # the instruction stripped, repeats dropped
    assert [(p["problem"], p["answer"]) for p in problems] == [(q, str(a)) for q, a, _ in rehearsal.PROBLEMS]
    conversations = load_conversations(recipe / "tir.jsonl")
    assert [c[0]["content"] for c in conversations] == [r["problem"] for r in rehearsal.tir_rows()[:2]]
    assert [m["content"] for m in conversations[0] if m["role"] == "tool"] == ["ok\n55\n", "ok\n55\n"]


def test_sft_trains_fp32_masters_under_fsdp2_bf16_and_saves_bf16(recipe):
    """The real SFT config (mixed_precision bf16) with gradient checkpointing, FSDP2 over two ranks: the trained
    weights are fp32 and nearly every one moved from the bf16 checkpoint's values (a bf16 model moved 7.8% at this
    lr); model/ is bf16, as the input was, with Qwen3-Base's tokenizer and eos."""
    start = AutoModelForCausalLM.from_pretrained(recipe / "base", dtype=torch.float32).state_dict()
    masters = torch.load(recipe / "sft" / "masters.pt")
    assert {t.dtype for t in masters.values()} == {torch.float32}
    assert moved(masters, start) > 0.99
    assert saved_dtypes(recipe / "sft" / "model") == ({torch.bfloat16}, "bfloat16")
    config = (recipe / "sft" / "config.yaml").read_text()
    assert "gradient_checkpointing: true" in config and "mixed_precision: bf16" in config
    tok = AutoTokenizer.from_pretrained(recipe / "sft" / "model")
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|endoftext|>", "<|endoftext|>", None)
    assert list((recipe / "sft").rglob("events.out.tfevents.*"))  # the config's tracker ran


def test_stage1_hands_bf16_weights_over_trains_fp32_masters_and_saves_bf16(recipe):
    """Two RL steps, FSDP2 bf16 against two bf16 vLLM engines: the hand-off check passed at the start and after each
    step (a failure stops the run), the groups had signal, the masters moved, model/ is bf16."""
    rows = [json.loads(line) for line in (recipe / "stage1" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # some group had both rewards; with group_size = rollouts_per_prompt RoC keeps them all: a real gradient
    assert min(r["roc/equal_group_frac"] for r in rows) < 1 and max(r["loss/grad_norm"] for r in rows) > 0
    assert all(r["rollout/tool_calls_mean"] > 0 for r in rows)
    start = AutoModelForCausalLM.from_pretrained(recipe / "sft" / "model", dtype=torch.float32).state_dict()
    masters = torch.load(recipe / "stage1" / "masters.pt")
    assert {t.dtype for t in masters.values()} == {torch.float32}
    layers = {k: v for k, v in masters.items() if ".layers." in k}
    assert moved(layers, {k: start[k] for k in layers}) > 0.95  # nearly every weight of every layer (99.0-99.6%)
    # (embedding rows of tokens the model all but never predicts get gradients below AdamW's eps: 3-48% moved)
    # lr 1e-6: the steps are below bf16's resolution; a trainer holding bf16 weights would have kept almost none
    assert moved({k: v.bfloat16() for k, v in masters.items()}, start) < 0.01 * moved(masters, start)
    assert saved_dtypes(recipe / "stage1" / "model") == ({torch.bfloat16}, "bfloat16")


def test_rl_shows_each_tool_reply_token_for_token_as_sft_trains_it(recipe):
    """Every tool reply the rollouts appended, against the SFT encoding of a conversation with that reply."""
    tok, fmt = AutoTokenizer.from_pretrained(recipe / "sft" / "model"), chat_format("default")
    turns = [t for r in (0, 1) for t in json.loads((recipe / "stage1" / f"rank{r}.json").read_text())["tool_turns"]]
    assert turns
    for turn in turns:
        messages = rehearsal.taught_conversations()[0]
        messages[2] = {"role": "tool", "content": turn["response"]}
        ids, labels = build_labels(tok, fmt.render_messages(messages))
        segments = fmt.render_messages(messages)
        start = sum(len(encode(tok, text)) for text, _ in segments[:2])
        sft_turn = ids[start:start + len(encode(tok, segments[2][0]))]
        assert all(lab == IGNORE for lab in labels[start:start + len(sft_turn)])
        assert turn["ids"] == sft_turn == encode(tok, tool_response_turn(turn["response"]))


def test_the_update_s_peak_memory_is_the_memory_plan_s(recipe):
    """Measured on each rank at the second update (AdamW state allocated): the trainer's tensors plus the profiler's
    peak above them, against memory_per_gpu for the same shape, shards and micro-batch, within 15%. At V = 151,936
    the logits are most of it."""
    shape = Shape.from_config(json.loads((recipe / "sft" / "model" / "config.json").read_text()))
    for r in (0, 1):
        last = json.loads((recipe / "stage1" / f"rank{r}.json").read_text())["update"][-1]
        measured = last["start_bytes"] + last["peak_above_start"]
        plan = memory_per_gpu(shape, shard=2, fsdp=True, micro_batch=last["sequences"], seq_tokens=last["length"],
                              gradient_checkpointing=True, sampler="vllm", gpu_gb=141.0)
        trainer = plan["update_peak"] - plan["engine_asleep"] - plan["process"]  # a CPU rank has neither
        assert measured == pytest.approx(trainer * GB, rel=0.15), (measured / GB, plan)


def test_eval_runs_the_real_eval_config_on_the_engine(recipe):
    results = json.loads((recipe / "eval" / "results.json").read_text())["benchmarks"]
    assert sorted(results) == ["aime24", "aime25", "hmmt25", "math500"]
    records = [json.loads(line) for line in (recipe / "eval" / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 8 and any(r["tool_calls"] for r in records)


def bf16_sampler(path: Path, tok):
    """The run's sampler on the model at `path`, computing in bf16: a vLLM engine, or HFSampler on a bf16 copy."""
    if SAMPLER == "vllm":
        from samplers.vllm_engine import VLLMSampler
        return VLLMSampler(str(path), tok, seed=0, dtype="bfloat16", enforce_eager=True,
                           kv_cache_memory_bytes=256 << 20)
    from samplers.hf import HFSampler
    return HFSampler(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), tok)


def test_a_bf16_sampler_passes_the_hand_off_and_a_stale_one_is_stopped(recipe):
    """The SFT model in a bf16 sampler against the trainer's fp32 masters computing under bf16 autocast (what
    mixed_precision=bf16 does): within the tolerance of the coarser side; after one AdamW step at the report's lr
    (1e-6) the sampler that missed it is stopped by the check's second rule, the one that got it passes."""
    from plumbing.handoff import check_handoff, handoff_tolerance, sequence_logprobs
    path = recipe / "sft" / "model"
    tok, fmt = AutoTokenizer.from_pretrained(path), chat_format("default")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    probe = encode(tok, fmt.prompt(rehearsal.PROBLEMS[0][0]))[:256]

    def trainer():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return sequence_logprobs(model, probe)

    engine = bf16_sampler(path, tok)
    try:
        tolerance = handoff_tolerance(engine.dtype, torch.bfloat16)
        assert engine.dtype == torch.bfloat16 and tolerance == 0.1
        first = (torch.tensor(engine.score(probe)), trainer())
        assert check_handoff(*first, tolerance) is None
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
        ids, labels = build_labels(tok, fmt.render_messages(rehearsal.taught_conversations()[0]))
        model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels])).loss.backward()
        optimizer.step()
        stale = check_handoff(torch.tensor(engine.score(probe)), trainer(), tolerance, first)
        assert stale is not None and "still generating from the old weights" in stale
        engine.update_weights(model)
        assert check_handoff(torch.tensor(engine.score(probe)), trainer(), tolerance, first) is None
    finally:
        if hasattr(engine, "close"):
            engine.close()
