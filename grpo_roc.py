"""GRPO-RoC: the data selection and the loss of rStar2-Agent, as pure functions.

Implements the GRPO-RoC algorithm of the report (Shang et al. 2025, "rStar2-Agent: Agentic Reasoning Technical
Report", arXiv 2508.20722, §2; in our words: docs/method.md, section 3):

1. `drop_equal_groups`: a prompt whose 2G rollouts all have the same reward gives no signal and is dropped.
2. `resample_on_correct` (RoC): one group of 2G rollouts down to G. Counts are proportional to the
   positive/negative split, with at least min(2, available) of each and exactly G in total (rule in
   `roc_counts`). Negatives are taken uniformly; positives without replacement with weight
   1 / (p_total + ROC_WEIGHT_EPS), so clean successes are preferred. p_total = p_err + p_format
   (`tool_error_penalty`, `format_penalty`, `penalty_total`).
3. `group_advantages`: A_i = (r_i - mean) / (std + 1e-6) per group of G, std unbiased (n - 1).
   `select_step` is the first two on one step's scores (phases 4-5 of train.py, which computes phase 6 with
   `group_advantages` beside them): every rank computes both alike from the gathered numbers of every rollout, so
   a group's rollouts need not have been sampled on one rank.
4. `policy_loss`: token-level clipped surrogate (DAPO-style, clip 0.2 / 0.28, which binds only with more than one
   optimizer step per RL step: see `policy_loss`), summed over all unmasked
   tokens and divided by the token count of the whole optimizer step (`normaliser`), so micro-batches and
   data-parallel ranks add up to exactly the big-batch gradient. verl's current `agg_loss` does the same (it
   divides by the step's token count over all ranks and multiplies by the data-parallel size); its legacy path,
   which counts each micro-batch's own tokens, only approximates it; TRL's `dapo` loss divides by a count gathered
   over processes. `sequence_mean_policy_loss` is the original GRPO aggregation, for ablations (its `normaliser`
   counts sequences). Both take optional per-token weights, the mismatch corrections of mismatch.py.

Report vs public code (docs/method.md §8), as offered here:
- RoC selection: mode="sample" (report, default) or mode="lowest" (public code: positives by lowest
  penalty, ties by rollout order; negatives the first k in rollout order); mode="off" keeps all 2G (plain GRPO,
  an ablation). Counts: Python's round (ties to even) as the public code uses, so "sample" and "lowest" keep the
  public code's counts when keep = 2G / 2 with G even (G >= 4). For odd G the public code rounds both counts
  separately, which can miss G (it then fails an assertion), and settles exact halves by which minimum it tests
  first (`roc_counts` has the details).
- Optional dual clip (verl's c = 3.0 for A < 0, not in the report): dual_clip=None (off) by default.
- What counts as a failed call and how many turns p_format divides by are the caller's counts; the public
  code's p_format divides by the turns after the first (pass num_turns - 1 to mimic it; the public code
  returns 1 where that count is 0, this function raises).

Left out on purpose, as in the report's recipe: no KL penalty and hence no reference
model (it would cost a second model in memory and a forward pass per step, and it ties the policy to the SFT
model the RL stage is meant to move away from); no entropy bonus (the asymmetric clip-higher bound 0.28 is what
keeps exploration here; an entropy bonus would be one more coefficient to tune). Not here either: the
sampler-trainer mismatch metrics and corrections (mismatch.py), and ranks, logging or config objects (train.py).

Run `python grpo_roc.py` for a toy walk-through; tests are in tests/test_grpo_roc.py.
"""
import torch

# Weight of a positive rollout in RoC sampling is 1 / (p_total + ROC_WEIGHT_EPS). The report writes 1 / p_total,
# which is infinite for a clean rollout (p_total = 0: tool calls all succeeded and exactly one answer block).
# A small eps keeps that limit: a clean rollout weighs 1e6, a penalised one 1 / p_total (100 even for p = 0.01,
# one failed call in a hundred), so clean rollouts are taken first, uniformly among themselves, while the
# arithmetic stays finite. Weights are float64, where 1e6 against 0.5 loses nothing.
ROC_WEIGHT_EPS = 1e-6
NO_TOOL_CALL_PENALTY = 0.5  # p_err of a rollout that made no tool call (a mild push toward using the tool)
# |log ratio| is clamped to this before exp(), as verl does (verl/trainer/ppo/core_algos.py, compute_policy_loss,
# +-20). In float32 exp() overflows to inf above about 88.7: with the dual clip active the gradient is then
# 0 * inf = NaN, without it the loss is inf. A token past the clamp gets no gradient through its ratio (as in
# verl); every ratio within e^-20 .. e^20 is computed as before.
MAX_LOG_RATIO = 20.0


# ----------------------------------------------------------------------------------- RoC penalties
def tool_error_penalty(num_calls: int, num_failed: int) -> float:
    """p_err: 0.5 with no calls, else the fraction of calls that failed (bad JSON, unknown tool, error, timeout)."""
    if num_calls < 0 or not 0 <= num_failed <= max(num_calls, 0):
        raise ValueError(f"need 0 <= num_failed <= num_calls, got {num_failed=} {num_calls=}")
    if num_calls == 0:
        return NO_TOOL_CALL_PENALTY
    # p_err = failed / calls
    return num_failed / num_calls


def format_penalty(num_answers: int, num_turns: int) -> float:
    """p_format: 1 with no complete <answer>...</answer>, else min(1, (answers - 1) / assistant_turns)."""
    if num_answers < 0 or (num_answers > 0 and num_turns < 1):
        raise ValueError(f"need num_answers >= 0 and num_turns >= 1 when answers > 0, got {num_answers=} {num_turns=}")
    if num_answers == 0:
        return 1.0
    # p_format = min(1, (answers - 1) / turns)
    return min(1.0, (num_answers - 1) / num_turns)


def penalty_total(num_calls: int, num_failed: int, num_answers: int, num_turns: int) -> float:
    """p_total = p_err + p_format, in [0, 2]; 0 is a clean rollout."""
    return tool_error_penalty(num_calls, num_failed) + format_penalty(num_answers, num_turns)


# ----------------------------------------------------------------------------------- group filtering and RoC
def drop_equal_groups(rewards) -> list[int]:
    """Indices of the groups that carry signal. rewards: (B, 2G) nested list or tensor. A group whose rewards are
    all equal (all right or all wrong) has zero advantage everywhere, so it is dropped (no refill)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)  # (B, 2G)
    has_signal = (rewards != rewards[:, :1]).any(dim=1)  # (B,)
    return has_signal.nonzero().flatten().tolist()


def roc_counts(n_pos: int, n_neg: int, keep: int) -> tuple[int, int]:
    """(positives kept, negatives kept) for one group; they sum to exactly `keep`.

    n_pos_keep = round(keep * n_pos / (n_pos + n_neg)) with Python's round (ties to even, as the public code),
    then clamped to [min(2, n_pos), keep - min(2, n_neg)] (the minimum-of-2 rule; skipped when keep < 4 makes
    the two minimums incompatible), then to [keep - n_neg, n_pos] (what is available). n_neg_keep = keep - n_pos_keep.
    A degenerate group (all positive or all negative) keeps `keep` of the one kind it has.

    Against the public code (rStar2-Agent's down-sampling, kept 2G -> G): it rounds the two counts separately,
    then applies the minimums of 2, negatives first (each when its count is <= 2). For even G >= 4 the counts
    agree with these. For odd G and an odd number of positives both counts end in .5 and the rules part: 5 of 10
    positive, keep 5: here round(2.5) = 2 positives (ties to even), there round(2.5) = 2 negatives, which is
    <= 2, so 3 positives; 7 of 14, keep 7, gives 4 + 4 = 8 there, and its assertion fails. This rule always sums
    to G, for every G, so it is kept for odd G too.
    """
    if not 0 <= keep <= n_pos + n_neg:
        raise ValueError(f"keep must be in [0, {n_pos + n_neg}], got {keep}")
    if keep == 0:
        return 0, 0
    # n_pos_keep = round(keep * n_pos / n_total)
    n = round(keep * n_pos / (n_pos + n_neg))
    low, high = min(2, n_pos), keep - min(2, n_neg)
    if low <= high:
        n = min(max(n, low), high)
    n = min(max(n, keep - n_neg), n_pos)
    return n, keep - n


def _select_sample(pos, pos_penalty, neg, n_pos_keep, n_neg_keep, generator):
    """Report rule: positives without replacement with P proportional to 1 / (p_total + eps); negatives uniform."""
    chosen = []
    if n_pos_keep > 0:
        # w_i = 1 / (p_i + eps); torch.multinomial without replacement draws one at a time from what is left
        weights = 1.0 / (torch.tensor(pos_penalty, dtype=torch.float64) + ROC_WEIGHT_EPS)
        chosen += [pos[i] for i in torch.multinomial(weights, n_pos_keep, replacement=False, generator=generator)]
    if n_neg_keep > 0:
        chosen += [neg[i] for i in torch.randperm(len(neg), generator=generator)[:n_neg_keep]]
    return chosen


def _select_lowest(pos, pos_penalty, neg, n_pos_keep, n_neg_keep, generator):
    """Public code rule: positives in order of lowest penalty (ties by rollout order); the first negatives."""
    by_penalty = sorted(range(len(pos)), key=lambda i: (pos_penalty[i], pos[i]))
    return [pos[i] for i in by_penalty[:n_pos_keep]] + neg[:n_neg_keep]


def _select_all(pos, pos_penalty, neg, n_pos_keep, n_neg_keep, generator):
    """No RoC (plain GRPO, an ablation): every rollout of the group, so keep must be 2G."""
    if (n_pos_keep, n_neg_keep) != (len(pos), len(neg)):
        raise ValueError(f"RoC mode off keeps every rollout: keep must be {len(pos) + len(neg)}")
    return pos + neg


def _select_uniform(pos, pos_penalty, neg, n_pos_keep, n_neg_keep, generator):
    """Plain GRPO's down-sampling (an ablation): RoC's counts, positives and negatives both uniformly at random, so
    the only difference from "sample" is that clean positives are not preferred."""
    return ([pos[i] for i in torch.randperm(len(pos), generator=generator)[:n_pos_keep]]
            + [neg[i] for i in torch.randperm(len(neg), generator=generator)[:n_neg_keep]])


ROC_SELECTORS = {"sample": _select_sample, "lowest": _select_lowest, "off": _select_all, "uniform": _select_uniform}


def resample_on_correct(rewards, penalties, keep: int, mode: str = "sample", generator=None) -> list[int]:
    """Resample-on-Correct for ONE group: the indices (sorted ascending) of the `keep` (= G) rollouts kept.

    rewards: (2G,) 0/1 list or tensor; a rollout is positive when its reward is > 0.
    penalties: (2G,) p_total per rollout (only the positives' are used). generator: torch.Generator for mode="sample".
    mode: a key of ROC_SELECTORS ("sample": report; "lowest": public code; "off": all of them, keep = 2G;
    "uniform": RoC's counts drawn at random, plain GRPO's down-sampling).
    """
    if mode not in ROC_SELECTORS:
        raise ValueError(f"unknown RoC mode {mode!r}; valid modes: {sorted(ROC_SELECTORS)}")
    rewards = torch.as_tensor(rewards, dtype=torch.float64).flatten().tolist()
    penalties = torch.as_tensor(penalties, dtype=torch.float64).flatten().tolist()
    if len(rewards) != len(penalties):
        raise ValueError(f"rewards and penalties differ in length: {len(rewards)} vs {len(penalties)}")
    pos = [i for i, r in enumerate(rewards) if r > 0]
    neg = [i for i, r in enumerate(rewards) if r <= 0]
    pos_penalty = [penalties[i] for i in pos]
    if any(p < 0 for p in pos_penalty):
        raise ValueError(f"penalties must be >= 0, got {pos_penalty}")
    n_pos_keep, n_neg_keep = roc_counts(len(pos), len(neg), keep)
    chosen = ROC_SELECTORS[mode](pos, pos_penalty, neg, n_pos_keep, n_neg_keep, generator)
    return sorted(int(i) for i in chosen)


# ----------------------------------------------------------------------------------- advantages
def group_advantages(rewards, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(N,) rewards, consecutive groups of `group_size` (= G) -> (N,) advantages, one per rollout."""
    rewards = torch.as_tensor(rewards)
    rewards = rewards.float() if not rewards.is_floating_point() else rewards
    if group_size < 2 or rewards.numel() % group_size != 0:
        raise ValueError(f"need group_size >= 2 dividing N = {rewards.numel()}, got {group_size}")
    grouped = rewards.reshape(-1, group_size)  # (B, G)
    # mean_b = (1/G) sum_i r_bi ; std_b = sqrt(sum_i (r_bi - mean_b)^2 / (G - 1))   (unbiased)
    mean, std = grouped.mean(dim=1, keepdim=True), grouped.std(dim=1, unbiased=True, keepdim=True)
    # A_bi = (r_bi - mean_b) / (std_b + eps)
    return ((grouped - mean) / (std + eps)).reshape(-1)


def select_step(rewards, penalties, keep: int, mode: str, generators: list) -> tuple[list[int], list[list[int]]]:
    """Phases 4-5 on one step's scores: (the groups with signal, the indices RoC keeps in each).

    rewards, penalties: (B, 2G) per rollout of the step's groups, in step order. generators: one torch.Generator
    per group (for mode="sample"; seeded by the group's position in the step, so the choice does not depend on
    where a group was sampled). A pure function of its arguments: every rank that calls it gets the same answer."""
    groups = drop_equal_groups(rewards) if len(rewards) else []
    kept = [resample_on_correct(rewards[g], penalties[g], keep, mode=mode, generator=generators[g]) for g in groups]
    return groups, kept


# ----------------------------------------------------------------------------------- policy loss
def _token_loss(logp, old_logp, advantages, loss_mask, clip_low, clip_high, dual_clip, is_weights=None):
    """Per-token clipped surrogate loss (N, T), exactly 0 where loss_mask is 0, and the (N, T) log-ratio.
    is_weights: (N, T) mismatch-correction weights multiplying each token's loss, or None (no correction)."""
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (verl uses 3.0), got {dual_clip}")
    mask = loss_mask.bool()  # (N, T)
    # log ratio_t = clamp(logp_t - old_logp_t, -MAX_LOG_RATIO, MAX_LOG_RATIO), 0 where masked (so garbage there
    # cannot reach exp() or the grad)
    log_ratio = torch.where(mask, logp - old_logp, torch.zeros_like(logp)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1): every token of rollout i gets A_i
    # l_t = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)
    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv)
    if dual_clip is not None:
        # dual clip, A < 0 only: l_t = min(l_t, -c * A) bounds the loss when ratio_t > c
        loss = torch.where(adv < 0, torch.minimum(loss, -dual_clip * adv), loss)
    if is_weights is not None:
        # l_t = w_t * l_t: the correction's weight, a constant (no gradient flows through it)
        loss = is_weights.detach().to(loss.dtype) * loss
    return torch.where(mask, loss, torch.zeros_like(loss)), log_ratio


@torch.no_grad()
def _loss_metrics(log_ratio, advantages, loss_mask, clip_low, clip_high, dual_clip) -> dict:
    """Plain-float diagnostics, averaged over the masked tokens of this call."""
    mask = loss_mask.bool()
    n = max(int(mask.sum()), 1)
    ratio, adv = torch.exp(log_ratio), advantages.unsqueeze(1)

    def frac(active):  # fraction of masked tokens where `active` holds
        return float((active & mask).sum()) / n

    # k3 = (ratio - 1) - log ratio, ratio = p_new / p_old on tokens sampled from old: an unbiased, always >= 0
    # estimate of KL(old || new) (Schulman, "Approximating KL divergence", 2020)
    k3 = (ratio - 1.0) - log_ratio
    return {
        "clip_frac_low": frac((adv < 0) & (ratio < 1.0 - clip_low)),
        "clip_frac_high": frac((adv > 0) & (ratio > 1.0 + clip_high)),
        "dual_clip_frac": frac((adv < 0) & (ratio > dual_clip)) if dual_clip is not None else 0.0,
        "ratio_mean": float((ratio * mask).sum()) / n,
        "approx_kl": float((k3 * mask).sum()) / n,
    }


def policy_loss(logp, old_logp, advantages, loss_mask, clip_low=0.2, clip_high=0.28, normaliser=None,
                dual_clip=None, is_weights=None) -> tuple[torch.Tensor, dict]:
    """Token-level GRPO loss (DAPO-style aggregation) and its metrics.

    logp, old_logp: (N, T) log-probs of the sampled tokens under the current / the rollout policy.
    advantages: (N,). loss_mask: (N, T), 1 on tokens the policy sampled, 0 on prompt, tool output and padding.
    normaliser: unmasked tokens in the whole optimizer step (all micro-batches, all ranks); None -> this mask's sum.
      Then the gradients of all micro-batches and ranks, summed, equal the one-big-batch gradient (DDP averages
      over ranks instead of summing, so a DDP caller multiplies this loss by the world size).
    is_weights: (N, T) weights of a mismatch correction (mismatch.py: `truncated_is_weights`,
      `sequence_mask_weights`), each multiplying its token's loss; the normaliser stays the same. None: no
      correction (the report's loss).
    Returns (scalar loss, {"clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean", "approx_kl"}).

    The clip binds only where logp has moved away from old_logp. With one optimizer step per RL step (every shipped
    config: updates_per_step 1) the caller's old_logp is logp itself, detached, so the ratio is 1 at every token,
    the loss's gradient is -A / normaliser per token, and clip_low, clip_high and dual_clip change nothing: the
    update is plain on-policy policy gradient. They act from the second optimizer step of an RL step on.
    """
    token_loss, log_ratio = _token_loss(logp, old_logp, advantages, loss_mask, clip_low, clip_high, dual_clip,
                                        is_weights)
    denominator = max(float(loss_mask.sum()) if normaliser is None else float(normaliser), 1.0)
    # L = sum_{i,t} mask_it * l_it / num_tokens
    loss = token_loss.sum() / denominator
    return loss, _loss_metrics(log_ratio, advantages, loss_mask, clip_low, clip_high, dual_clip)


def sequence_mean_policy_loss(logp, old_logp, advantages, loss_mask, clip_low=0.2, clip_high=0.28,
                              normaliser=None, dual_clip=None, is_weights=None) -> tuple[torch.Tensor, dict]:
    """Original GRPO aggregation (ablation): mean over each sequence's tokens, then over sequences.

    Same shapes as `policy_loss`; normaliser: rollouts in the whole optimizer step (None -> N here).
    Long sequences weigh less per token than under `policy_loss`, the bias DAPO removed.
    """
    token_loss, log_ratio = _token_loss(logp, old_logp, advantages, loss_mask, clip_low, clip_high, dual_clip,
                                        is_weights)
    tokens_per_seq = loss_mask.sum(dim=1).clamp(min=1).to(token_loss.dtype)  # (N,)
    denominator = max(token_loss.shape[0] if normaliser is None else normaliser, 1)
    # L = sum_i [ (1/|o_i|) sum_t mask_it * l_it ] / num_sequences
    loss = (token_loss.sum(dim=1) / tokens_per_seq).sum() / denominator
    return loss, _loss_metrics(log_ratio, advantages, loss_mask, clip_low, clip_high, dual_clip)


# Loss aggregation, for ablations (config `loss_agg`, picked at train.update_policy's one call site): name -> (loss
# function, what its `normaliser` counts over the whole mini-batch: sampled tokens, or rollouts).
LOSSES = {"token": (policy_loss, "tokens"), "sequence": (sequence_mean_policy_loss, "sequences")}


# ----------------------------------------------------------------------------------- demo
if __name__ == "__main__":
    torch.manual_seed(0)
    G = 4
    rewards = [1, 0, 1, 1, 0, 0, 1, 0]  # 2G = 8 rollouts of one prompt
    # (calls, failed, answers, turns) per rollout
    stats = [(2, 0, 1, 3), (1, 1, 1, 2), (0, 0, 1, 1), (3, 2, 2, 4), (2, 0, 0, 3), (1, 0, 1, 2), (2, 1, 1, 3), (0, 0, 0, 1)]
    penalties = [penalty_total(*s) for s in stats]
    print("rewards   ", rewards)
    print("penalties ", [round(p, 3) for p in penalties])
    print("groups with signal:", drop_equal_groups([rewards, [1] * 8]), "(a second, all-correct group is dropped)")
    print("RoC counts (pos, neg):", roc_counts(rewards.count(1), rewards.count(0), G))
    print("kept, lowest:", resample_on_correct(rewards, penalties, G, mode="lowest"))
    kept = resample_on_correct(rewards, penalties, G, mode="sample", generator=torch.Generator().manual_seed(0))
    print("kept, sample:", kept)
    kept_rewards = torch.tensor([rewards[i] for i in kept], dtype=torch.float32)
    adv = group_advantages(kept_rewards, G)
    print("advantages: ", [round(a, 4) for a in adv.tolist()])
    T = 6
    old_logp = -torch.rand(G, T)
    logp = (old_logp + 0.3 * torch.randn(G, T)).requires_grad_()
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]] * G)  # 0s: a tool response inside the rollout
    loss, metrics = policy_loss(logp, old_logp, adv, mask)
    loss.backward()
    print(f"loss: {loss.item():.4f}", {k: round(v, 4) for k, v in metrics.items()})
    print("grad on masked tokens is zero:", bool((logp.grad[mask == 0] == 0).all()))
