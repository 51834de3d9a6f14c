"""samplers/reference.py: the sampler contract of samplers/interface.py, checked on the tiny model (stops and budgets, log-probs
after temperature against a forward pass, greedy decoding equal to HFSampler's, score and update_weights, a rollout
end to end, and eval.py's `sampler=reference`)."""
import math
from concurrent.futures import Future

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from code_tool import ToolResult
from protocol import IM_END, chat_format
from rollout import rollout
from samplers.hf import HFSampler
from samplers.reference import ReferenceSampler
from tiny.model import build_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), hidden=32, layers=2, heads=2)
    return path, AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


def prompts_of(tok, texts):
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_stops_right_after_im_end_or_at_its_budget(tiny):
    _, tok, model = tiny
    im_end = tok.convert_tokens_to_ids(IM_END)
    prompts = prompts_of(tok, ["a", "bb ccc", "d" * 30, "e", "ff"])
    budgets = [300, 300, 300, 3, 1]
    torch.manual_seed(0)
    out = ReferenceSampler(model, tok).generate(prompts, budgets, temperature=2.0)
    for c, budget in zip(out, budgets):
        assert len(c.logprobs) == len(c.token_ids) <= budget and (im_end in c.token_ids) == c.stopped
        assert c.token_ids.index(im_end) == len(c.token_ids) - 1 if c.stopped else len(c.token_ids) == budget
    assert any(c.stopped for c in out) and len(out[4].token_ids) == 1 and not out[4].stopped


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_logprobs_are_the_model_s_log_softmax_after_temperature(tiny, temperature):
    """logprob_t == log_softmax(logits_t / T)[token_t], from one forward pass over prompt + completion."""
    _, tok, model = tiny
    prompts = prompts_of(tok, ["Compute 12*34.", "x"])
    torch.manual_seed(1)
    out = ReferenceSampler(model, tok).generate(prompts, [25, 25], temperature=temperature)
    for p, c in zip(prompts, out):
        with torch.no_grad():
            logits = model(torch.tensor([p + c.token_ids])).logits[0, len(p) - 1:-1]  # the logits of each token
        expected = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=0, atol=1e-5)
    with torch.no_grad():  # the first token by hand: its logit, minus the log-sum-exp of all of them, at T
        z = model(torch.tensor([prompts[1]])).logits[0, -1] / temperature
    assert out[1].logprobs[0] == pytest.approx((z[out[1].token_ids[0]] - z.logsumexp(-1)).item(), abs=1e-5)


def test_greedy_is_the_argmax_and_equals_hf_sampler(tiny):
    _, tok, model = tiny
    prompts = prompts_of(tok, ["hello", "2+2=", "a longer prompt than the others"])
    ref = ReferenceSampler(model, tok).generate(prompts, [20, 5, 30], temperature=0.0)
    hf = HFSampler(model, tok).generate(prompts, [20, 5, 30], temperature=0.0)
    assert [c.token_ids for c in ref] == [c.token_ids for c in hf] and [len(c.token_ids) for c in ref] == [20, 5, 30]
    for a, b in zip(ref, hf):  # both at temperature 1 when greedy
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    with torch.no_grad():
        assert ref[0].token_ids[0] == int(model(torch.tensor(prompts[:1])).logits[0, -1].argmax())


def test_score_is_a_forward_pass_and_update_weights_loads_the_trainer_s(tiny):
    path, tok, _ = tiny
    ids = prompts_of(tok, ["Compute 12*34 with Python, then answer."])[0]
    sampler = ReferenceSampler(AutoModelForCausalLM.from_pretrained(path), tok)
    trainer = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        trainer.model.norm.weight.add_(0.05)  # an "optimizer step"
        logits = trainer(torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (torch.tensor(sampler.score(ids)) - expected).abs().mean() > 1e-3  # the old weights
    sampler.update_weights(trainer)
    torch.testing.assert_close(torch.tensor(sampler.score(ids)), expected, rtol=0, atol=1e-5)
    sampler.update_weights((name, t * 0) for name, t in trainer.state_dict().items())  # (name, tensor) pairs
    assert sampler.score(ids) == pytest.approx([-math.log(trainer.config.vocab_size)] * (len(ids) - 1))  # uniform
    assert sampler.dtype == torch.float32


class OkTool:
    def submit(self, code, stdin=""):
        future = Future()
        future.set_result(ToolResult("ok", "4\n"))
        return future


def test_a_rollout_runs_on_it_end_to_end(tiny):
    """rollout.rollout drives it through add / step (TurnSampler): every sampled token keeps its log-prob."""
    _, tok, model = tiny
    fmt = chat_format()
    torch.manual_seed(0)
    model.train()  # the trainer's object: in eval mode while sampling, its flag back afterwards
    trajs = rollout(["Compute 12*34."] * 3, ReferenceSampler(model, tok), OkTool(), tok, fmt,
                    max_response_tokens=48, max_turns=2, temperature=1.0)
    assert len(trajs) == 3 and model.training
    model.eval()
    for t in trajs:
        assert t.end_reason in ("answer", "length", "max_turns") and 0 < len(t.response_ids) <= 48
        assert len(t.response_ids) == len(t.loss_mask) == len(t.logprobs)
        sampled = [lp for lp, m in zip(t.logprobs, t.loss_mask) if m]
        assert sampled and all(lp < 0 for lp in sampled)
        assert tok.decode(t.prompt_ids) == fmt.prompt("Compute 12*34.")


def test_eval_builds_it_for_sampler_reference(tiny):
    import eval as ev
    path, tok, model = tiny
    cfg = ev.EvalConfig(model_path=str(path), sampler="reference")
    ev.check_config(cfg)  # accepted
    sampler, tokenizer = ev.load_model(cfg)
    assert isinstance(sampler, ReferenceSampler) and sampler.stops == [tok.convert_tokens_to_ids(IM_END)]
    prompt = prompts_of(tokenizer, ["hello"])
    greedy = ReferenceSampler(model, tok).generate(prompt, [8], temperature=0.0)[0]
    assert sampler.generate(prompt, [8], temperature=0.0)[0].token_ids == greedy.token_ids  # the same weights
