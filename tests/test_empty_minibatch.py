"""The one rule for an empty mini-batch (no kept rollout on any rank, e.g. every group of the step dropped as equal):
train.update_policy takes no optimizer step and no scheduler step for it, the first mini-batch of a step as any
other, so AdamW's weight decay and moments leave the weights untouched (bitwise)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import rollout
import schedule
import train
from plumbing import update_plan
from one_process import ONE
from protocol import chat_format
from tiny.model import build_tiny

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("empty_minibatch")
    build_tiny(root / "base", hidden=32, layers=2, heads=2)
    return root


def update(tiny, minibatch_of_slot: list[int], updates: int):
    """One update_policy call on the tiny model (AdamW with weight decay, a warm-up schedule) with four rollouts
    put in the given mini-batches (of `updates`); returns (weights after, optimizer steps taken, scheduler steps)."""
    from accelerate import Accelerator
    tok = AutoTokenizer.from_pretrained(tiny / "base")
    prompt = tok.encode(chat_format("compact", "").prompt("Say 7."), add_special_tokens=False)
    texts = ["</reason>\n<answer>\\boxed{7}</answer>", "Hmm. </reason>\n<answer>\\boxed{4}</answer>",
             "Sure: 7", "No"]
    trajs = [rollout.Trajectory("", prompt, ids, [1] * len(ids), logprobs=None)
             for ids in (tok.encode(t, add_special_tokens=False) for t in texts)]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny / "base")
    cfg = train.TrainConfig(micro_batch_size=2, max_tokens_per_micro_batch=0, lr=1e-2, grad_clip=1.0,
                            updates_per_step=updates)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: (t + 1) / 10)
    acc = Accelerator(cpu=True)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    slots = [s for s, m in enumerate(minibatch_of_slot) if m is not None]
    kept = {s: ((-1.0) ** s, minibatch_of_slot[s]) for s in slots}
    scores = schedule.gather_scores(ONE, slots, [trajs[s] for s in slots])
    work, _ = update_plan.update_work(ONE, scores, kept, {s: trajs[s] for s in slots}, updates, 0,
                                      cfg.micro_batch_size, "balanced", "padded")
    train.update_policy(acc, model, optimizer, scheduler, work, train.minibatch_normalisers(scores, kept, cfg), cfg,
                        tok.pad_token_id)
    steps = max((int(s["step"]) for s in optimizer.state_dict()["state"].values()), default=0)
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}, steps, \
        scheduler.scheduler.last_epoch if hasattr(scheduler, "scheduler") else scheduler.last_epoch


def test_an_empty_mini_batch_steps_neither_optimizer_nor_scheduler_and_leaves_weights_bitwise(tiny):
    """A step whose mini-batches are all empty (mini-batch 0 included) changes no weight, bit for bit, and takes
    no optimizer or scheduler step."""
    torch.manual_seed(0)
    before = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(tiny / "base").state_dict().items()}
    after, optimizer_steps, scheduler_steps = update(tiny, [None] * 4, updates=2)
    assert optimizer_steps == 0 and scheduler_steps == 0
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_an_empty_first_mini_batch_is_skipped_like_any_other_empty_mini_batch(tiny):
    """Mini-batch 0 empty, mini-batch 1 holding the rollouts, and mini-batch 1 empty, mini-batch 0 holding them:
    one optimizer step and one scheduler step each, and the same weights bit for bit as one mini-batch of them."""
    one, steps_one, sched_one = update(tiny, [0, 0, 0, 0], updates=1)
    first_empty, steps_a, sched_a = update(tiny, [1, 1, 1, 1], updates=2)
    last_empty, steps_b, sched_b = update(tiny, [0, 0, 0, 0], updates=2)
    assert (steps_one, sched_one) == (steps_a, sched_a) == (steps_b, sched_b) == (1, 1)
    assert any(not torch.equal(one[k], v) for k, v in
               AutoModelForCausalLM.from_pretrained(tiny / "base").state_dict().items())  # the update moved them
    for k in one:
        assert torch.equal(first_empty[k], one[k]) and torch.equal(last_empty[k], one[k]), k
