"""Tests that fail when the algorithm's sign is wrong: a negated loss or negated advantages.

1. One update through train.update_policy (a real Accelerator, the tiny model) raises the log-probability of the
   rollouts with a positive advantage and lowers that of the ones with a negative advantage.
2. A few RL steps through train.main raise the mean reward on a task the model can learn in seconds: every problem
   asks for 7, and the policy writes the whole answer turn except one digit, which it samples from the model
   itself (DigitSampler). The reward is 1 when that digit is 7, so the expected reward of the policy is exactly the
   model's probability of "7" among the ten digits at that position, which the test reads before and after.
   Everything else is the real trainer: rewards, dropping equal groups, RoC, advantages, the clipped loss, AdamW.
"""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rollout
import train
from plumbing import rl_stage
from plumbing import batches
from plumbing.data import write_jsonl
from grpo_roc import group_advantages
from protocol import IM_END, chat_format
from plumbing.handoff import sequence_logprobs
from one_process import one_process_work
from samplers.interface import Completion, TurnSampler
from tiny.model import build_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PREFIX = "</reason>\n<answer>\\boxed{"  # the answer turn up to the sampled digit
DIGITS = "0123456789"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("learning")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    return root


def Trajectory(prompt_ids, response_ids):
    """A rollout of one turn the policy sampled whole (every response token under the loss mask)."""
    return rollout.Trajectory("", prompt_ids, response_ids, [1] * len(response_ids), logprobs=None)


def response_logprobs(model, trajs, pad_id):
    """Sum of log pi over each rollout's sampled tokens: (n,)."""
    batch = batches.pad_batch(trajs, pad_id)
    with torch.no_grad():
        logp = batches.token_logprobs(model, batch, temperature=1.0)
    return (logp * batch["loss_mask"]).sum(dim=1)


@pytest.mark.spec
def test_one_update_raises_positive_and_lowers_negative_rollouts(tiny):
    from accelerate import Accelerator
    tok = AutoTokenizer.from_pretrained(tiny / "base")
    fmt = chat_format("compact", "")
    prompt = tok.encode(fmt.prompt("Say 7."), add_special_tokens=False)
    # a group of G = 4 with rewards 1, 0, 1, 0 and different texts (no two rollouts share their tokens after the
    # prompt, so no gradient cancels between them)
    texts = [PREFIX + "7}</answer>", "Hmm." + PREFIX + "4}</answer>", "Sure:" + PREFIX + "7}</answer>",
             "No" + PREFIX + "1}</answer>"]
    trajs = [Trajectory(prompt, tok.encode(t, add_special_tokens=False) + [tok.convert_tokens_to_ids(IM_END)])
             for t in texts]
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0]), 4).tolist()  # +-0.866
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny / "base")
    before = response_logprobs(model, trajs, tok.pad_token_id)
    cfg = train.TrainConfig(micro_batch_size=2, lr=1e-3, grad_clip=1.0)  # two micro-batches, one optimizer step
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0)
    acc = Accelerator(cpu=True)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    work, _, normalisers = one_process_work(list(zip(trajs, adv)), cfg)
    train.update_policy(acc, model, optimizer, scheduler, work, normalisers, cfg, tok.pad_token_id)
    change = (response_logprobs(model, trajs, tok.pad_token_id) - before).tolist()
    assert change[0] > 0.01 and change[2] > 0.01, change  # A > 0: more likely
    assert change[1] < -0.01 and change[3] < -0.01, change  # A < 0: less likely


class DigitSampler(TurnSampler):
    """Writes `PREFIX d}</answer><|im_end|>` with the digit d sampled from the model (softmax over the ten digit
    tokens at that position, at the requested temperature, from the global torch RNG the trainer seeds)."""

    def __init__(self, model, tokenizer):
        self.model, self.tok, self.dtype = model, tokenizer, next(model.parameters()).dtype
        self.prefix = tokenizer.encode(PREFIX, add_special_tokens=False)
        im_end = tokenizer.convert_tokens_to_ids(IM_END)
        self.suffix = tokenizer.encode("}</answer>", add_special_tokens=False) + [im_end]
        self.digit_ids = tokenizer.convert_tokens_to_ids(list(DIGITS))

    def digit_probs(self, prompts) -> torch.Tensor:
        """(n, 10): the model's distribution over the ten digits after prompt + PREFIX."""
        rows = [list(p) + self.prefix for p in prompts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[self.tok.pad_token_id] * (width - len(r)) + r for r in rows])  # left-padded
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            logits = self.model(input_ids=ids, attention_mask=mask).logits[:, -1, self.digit_ids]
        return torch.softmax(logits.float(), dim=-1)

    def generate(self, prompts, max_new_tokens, temperature=1.0, top_p=1.0):
        probs = self.digit_probs(prompts) ** (1.0 / temperature)
        picks = torch.multinomial(probs / probs.sum(dim=-1, keepdim=True), 1).flatten().tolist()
        turns = [self.prefix + [self.digit_ids[d]] + self.suffix for d in picks]
        return [Completion(t[:budget], None, len(t) <= budget) for t, budget in zip(turns, max_new_tokens)]

    def update_weights(self, model) -> None:
        self.model = model

    def score(self, token_ids) -> list[float]:
        return sequence_logprobs(self.model, token_ids).tolist()


def expected_reward(model_dir, tok) -> float:
    """P(digit = 7) at the answer position of the training prompt: the policy's exact expected reward."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = tok.encode(chat_format("compact", "").prompt("Say 7."), add_special_tokens=False)
    return DigitSampler(model, tok).digit_probs([prompt])[0, DIGITS.index("7")].item()


def test_a_few_rl_steps_raise_the_reward(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(rl_stage, "make_sampler", lambda cfg, model, tokenizer: DigitSampler(model, tokenizer))
    write_jsonl(tmp_path / "seven.jsonl", [{"problem": "Say 7.", "answer": "7"}] * 4)
    out = tmp_path / "run"
    train.main(["configs/tiny/stage1.yaml", f"model_path={tiny / 'base'}", f"data=[{tmp_path / 'seven.jsonl'}]",
                f"out_dir={out}", "eval_data=null", "steps=8", "prompts_per_step=4", "rollouts_per_prompt=8",
                "group_size=4", "micro_batch_size=16", "lr=1e-2", "warmup_steps=1", "save_every=8"])
    tok = AutoTokenizer.from_pretrained(tiny / "base")
    before, after = expected_reward(tiny / "base", tok), expected_reward(out / "model", tok)
    rewards = [json.loads(line)["rollout/reward_mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert before < 0.2 and after > 0.6, (before, after, rewards)
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2, rewards
