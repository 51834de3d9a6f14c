"""A micro-batch of the RL update as tensors, and the policy's log-probs of its tokens (train.py's phases 7-8).

update_plan.py plans each micro-batch as rows of rollouts (`MicroBatch`); this file lays them out:
- padded (`pad_batch`: one rollout a row, right-padded to the longest, with an attention mask), when micro-batches
  are cut by rollout count (max_tokens_per_micro_batch = 0);
- packed (`pack_batch`: the rollouts of a row end to end, positions restarting at each one and no attention mask,
  so transformers keeps each sequence to itself), when they are cut by tokens;
- a filler (update_plan.filler_row), a two-token sequence that trains nothing, where a rank has nothing for a slot.
Either way `token_logprobs` hands back one (n, L-1) row per rollout, aligned with its next-token targets, with the
loss mask (`target_mask`: 1 exactly on the tokens the policy sampled) and the sampler's log-probs
(`sampler_logprobs`) in the same layout, so the loss never sees how the rows were laid out.
"""
import torch

from plumbing.logprobs import sampled_logprobs
from plumbing.update_plan import FILLER_TOKENS, MicroBatch, filler_row


def make_batch(micro: MicroBatch, pad_id: int, measured: bool, budget: int,
               device="cpu") -> tuple[dict, torch.Tensor, int]:
    """(batch, advantages (n,), n) on `device` for one micro-batch slot (update_plan.MicroBatch of TrainRows): packed
    as planned when the micro-batches are cut by tokens (budget > 0), padded otherwise; a slot without rows becomes
    a filler (update_plan.filler_row), so a rank with nothing to train there still joins every collective. n counts
    the real rollouts (0 for a filler)."""
    n = len(micro.items())
    if not n:
        micro = MicroBatch([[filler_row(pad_id, measured)]], FILLER_TOKENS)
    real = micro.items()
    batch = pack_batch(micro, pad_id) if budget else pad_batch(real, pad_id)
    if measured:
        batch["sampler_logp"] = sampler_logprobs(real, batch["loss_mask"].shape[1])
    adv = torch.tensor([t.advantage for t in real], dtype=torch.float)
    return {k: v.to(device) for k, v in batch.items()}, adv.to(device), n


def target_mask(trajs, width: int) -> torch.Tensor:
    """(n, width) loss mask aligned with each sequence's next-token targets: row i, column t is 1 exactly where
    token t + 1 of sequence i is one the policy sampled (0 on prompt, tool text and past the sequence's end)."""
    mask = torch.zeros((len(trajs), width))
    for i, t in enumerate(trajs):
        p = len(t.prompt_ids)
        mask[i, p - 1:p - 1 + len(t.response_ids)] = torch.tensor(t.loss_mask, dtype=torch.float)
    return mask


def pad_batch(trajs, pad_id: int) -> dict:
    """Right-padded tensors for a micro-batch of n trajectories.
    input_ids, attention_mask: (n, L) with L = longest prompt + response; loss_mask: (n, L-1), aligned with the
    next-token targets input_ids[:, 1:], 1 exactly where the target is a token the policy sampled."""
    seqs = [t.prompt_ids + t.response_ids for t in trajs]
    L = max(len(s) for s in seqs)
    ids = torch.full((len(trajs), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(trajs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        attn[i, :len(s)] = 1
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": target_mask(trajs, L - 1)}


def pack_batch(micro: MicroBatch, pad_id: int) -> dict:
    """Packed tensors for a micro-batch of n trajectories laid out in rows (update_plan.MicroBatch): input_ids and
    position_ids (rows, width), positions restarting at 0 for every sequence and no attention mask, so the model
    keeps each sequence to itself (transformers' packed-sequence support: a new block wherever a position does not
    follow the one before it); a row's padding is a block of its own. unpack (n, L-1): where in the flattened
    (rows x width) next-token log-probs each sequence's lie, so token_logprobs hands back pad_batch's (n, L-1)
    layout; loss_mask as there. Sequences are numbered row by row (MicroBatch.items)."""
    trajs = micro.items()
    L = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    ids = torch.full((len(micro.rows), micro.width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(micro.rows), micro.width), dtype=torch.long)
    unpack = torch.zeros((len(trajs), L - 1), dtype=torch.long)
    i = 0
    for r, members in enumerate(micro.rows):
        at = 0
        for t in members:
            seq = t.prompt_ids + t.response_ids
            n = len(seq)
            ids[r, at:at + n] = torch.tensor(seq)
            pos[r, at:at + n] = torch.arange(n)
            unpack[i, :n - 1] = r * micro.width + at + torch.arange(n - 1)  # position t predicts token t + 1
            at, i = at + n, i + 1
        pos[r, at:] = torch.arange(micro.width - at)
    return {"input_ids": ids, "position_ids": pos, "unpack": unpack, "loss_mask": target_mask(trajs, L - 1)}


def sampler_logprobs(trajs, width: int) -> torch.Tensor | None:
    """The sampler's log-probs (Trajectory.logprobs, after temperature) in pad_batch's (n, width = L-1) layout,
    aligned with loss_mask; 0 on prompt, tool text (the sampler drew none of it) and padding. None when a
    trajectory carries none (a sampler that gives no log-probs)."""
    if any(getattr(t, "logprobs", None) is None for t in trajs):
        return None
    out = torch.zeros((len(trajs), width))
    for i, t in enumerate(trajs):
        p = len(t.prompt_ids)
        out[i, p - 1:p - 1 + len(t.logprobs)] = torch.tensor(t.logprobs, dtype=torch.float)
    return out


def token_logprobs(model, batch: dict, temperature: float) -> torch.Tensor:
    """log pi(x_t | x_<t) of every next token: (n, L-1), fp32, for a padded or a packed batch (the same layout
    either way). Logits are divided by the sampling temperature so the numbers are those of the distribution the
    rollouts were drawn from (verl does the same). Computed in chunks of positions (plumbing/logprobs.py): no fp32
    log-softmax over the vocabulary is kept, only the logits. No KV cache: a cache would turn packing's mask off."""
    ids = batch["input_ids"]
    if "position_ids" in batch:
        logits = model(input_ids=ids, position_ids=batch["position_ids"], use_cache=False).logits  # (rows, w, V)
    else:
        logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits  # (n, L, V)
    # position t predicts token t+1; the last position's target (the first token, rolled over) is never used
    targets = torch.roll(ids, -1, dims=1)
    logp = sampled_logprobs(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), temperature)
    if "unpack" in batch:
        return logp[batch["unpack"]]  # (n, L-1): each packed sequence's own, in pad_batch's layout
    return logp.view(ids.shape)[:, :-1]
