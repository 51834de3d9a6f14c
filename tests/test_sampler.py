"""sampler.py: HFSampler on the tiny model (stops, log-probs, budgets, weights) and VLLMSampler against a fake
engine shaped like vLLM's (vLLM itself is not installable here)."""
import ast
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from protocol import IM_END
from sampler import HFSampler, VLLMSampler, model_checksum
from tiny_model import build_tiny

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


def test_hf_sampler_regroups_stragglers_without_changing_the_contract(tiny, monkeypatch):
    """Four of five rows use up a 2-token budget; the fifth continues alone in a new call, and its log-probs
    (partly from a re-read context) still match a fresh forward pass."""
    _, tok, model = tiny
    widths = []
    real_generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: widths.append(kw["input_ids"].shape) or real_generate(**kw))
    sampler = HFSampler(model, tok, batch_size=8, stop_ids=[])  # no stop id: every row runs its budget out
    prompts = prompts_of(tok, ["a", "b", "c", "d", "the long one"])
    torch.manual_seed(0)
    out = sampler.generate(prompts, [2, 2, 2, 2, 30], temperature=1.0)
    assert [len(c.token_ids) for c in out] == [2, 2, 2, 2, 30] and not any(c.stopped for c in out)
    assert [w[0] for w in widths] == [5, 1] and widths[1][1] == len(prompts[4]) + 2
    ids = torch.tensor([prompts[4] + out[4].token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompts[4]) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out[4].token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out[4].logprobs), expected, atol=1e-4)


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


def test_hf_sampler_greedy(tiny):
    _, tok, model = tiny
    sampler = HFSampler(model, tok)
    p = prompts_of(tok, ["hello"])
    a, b = sampler.generate(p, [10], temperature=0.0)[0], sampler.generate(p, [10], temperature=0.0)[0]
    assert a.token_ids == b.token_ids
    with torch.no_grad():
        first = model(torch.tensor(p)).logits[0, -1]
    assert a.token_ids[0] == int(first.argmax())


def test_update_weights_and_checksum(tiny):
    path, tok, model = tiny
    colocated = HFSampler(model, tok)
    colocated.update_weights(model)  # same object: nothing to copy
    assert colocated.weights_checksum() == model_checksum(model)
    separate = HFSampler(AutoModelForCausalLM.from_pretrained(path), tok)
    trainer = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        trainer.model.norm.weight.add_(0.01)  # an "optimizer step"
    assert separate.weights_checksum() != model_checksum(trainer)
    separate.update_weights(trainer)
    assert separate.weights_checksum() == model_checksum(trainer)


# ------------------------------------------------------------------------------------------------ VLLMSampler
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


class FakeLLM:
    """Shaped like vllm.LLM: each request emits 7, 8, 9, ... then <|im_end|> (id 3) if max_tokens allows."""
    instances = []

    def __init__(self, **kwargs):
        self.kwargs, self.log, self.model = kwargs, [], None
        FakeLLM.instances.append(self)

    def get_tokenizer(self):
        return types.SimpleNamespace(convert_tokens_to_ids=lambda t: {IM_END: 3}[t])

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.log.append(("generate", prompts, sampling_params))
        outs = []
        for r, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            script = [7 + k for k in range(len(prompt["prompt_token_ids"]))] + sp.stop_token_ids
            ids = script[:sp.max_tokens]
            stopped = ids[-1] in sp.stop_token_ids
            lps = [{t: Logprob(-0.1 * (k + 1), rank=1)} for k, t in enumerate(ids)]
            outs.append(FakeRequestOutput(str(r), prompt["prompt_token_ids"], [FakeCompletionOutput(
                0, "", ids, None, lps, "stop" if stopped else "length", ids[-1] if stopped else None)]))
        return outs

    def sleep(self, level=1):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tuple(tags)))

    def apply_model(self, func):
        return [func(self.model)]

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeLLM, FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.instances = []
    return module


def test_vllm_sampler_builds_the_engine_and_requests(fake_vllm, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    sampler = VLLMSampler("some/model", tensor_parallel_size=2, gpu_memory_utilization=0.4, seed=5)
    (llm,) = FakeLLM.instances
    assert llm.kwargs["model"] == "some/model" and llm.kwargs["tensor_parallel_size"] == 2
    assert llm.kwargs["enable_sleep_mode"] is True and llm.kwargs["logprobs_mode"] == "processed_logprobs"
    assert llm.kwargs["seed"] == 5 and llm.kwargs["gpu_memory_utilization"] == 0.4
    import os
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    out = sampler.generate([[1, 2], [4, 5, 6]], [10, 2], temperature=0.6, top_p=0.9)
    _, prompts, params = llm.log[0]
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [4, 5, 6]}]
    assert [p.max_tokens for p in params] == [10, 2] and all(p.stop_token_ids == [3] for p in params)
    assert all(p.logprobs == 0 and p.temperature == 0.6 and p.top_p == 0.9 and p.n == 1 for p in params)
    assert out[0].token_ids == [7, 8, 3] and out[0].stopped and out[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert out[1].token_ids == [7, 8] and not out[1].stopped
    tokenizer = types.SimpleNamespace(convert_tokens_to_ids=lambda t: {IM_END: 99}[t])
    assert VLLMSampler("some/model", tokenizer).im_end_id == 99  # the trainer passes its tokenizer


def test_vllm_sampler_sleeps_and_loads_new_weights(fake_vllm, tiny):
    path, tok, model = tiny
    llm = FakeLLM()
    llm.model = FakeEngineModel(AutoModelForCausalLM.from_pretrained(path))
    sampler = VLLMSampler(llm=llm)
    assert sampler.im_end_id == 3
    trainer = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        trainer.lm_head.weight.mul_(1.5)  # tied with the embeddings
    sampler.sleep()
    sampler.update_weights(trainer)
    assert sampler.weights_checksum() == model_checksum(trainer)
    assert torch.equal(llm.model.inner.model.embed_tokens.weight, trainer.model.embed_tokens.weight)
    assert llm.log == [("sleep", 1), ("wake_up", ("weights",)), ("reset_prefix_cache",), ("wake_up", ("kv_cache",))]
    sampler.sleep()
    sampler.generate([[1]], [4])  # generating wakes everything first
    assert llm.log[-2] == ("wake_up", ("weights", "kv_cache")) and llm.log[-1][0] == "generate"


def test_sampler_module_does_not_import_vllm_at_load():
    """vLLM is imported only inside VLLMSampler's methods, so CPU users never need it."""
    tree = ast.parse((ROOT / "sampler.py").read_text())
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    names = [a.name for node in top_level for a in node.names] + [getattr(n, "module", None) or "" for n in top_level]
    assert not any(name.split(".")[0] == "vllm" for name in names)
    inner = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "vllm"]
    assert len(inner) == 2  # LLM in __init__, SamplingParams in generate
