"""The sampler-trainer mismatch: how far the sampler's probabilities are from the trainer's, and two corrections.

Beyond the report (docs/method.md §9): the sampler (vLLM in bf16, our decode loop) never computes exactly the
trainer's probabilities, so rollouts come from pi_sampler while the loss treats them as drawn from pi_old.
- Measured on the sampled tokens every step (metrics `mismatch/*`, docs/metrics.md): `mismatch_sums` (token-level
  mean |log ratio|, k3 estimate of KL, share of tokens outside a ratio band), `sequence_log_ratios` and
  `sequence_mismatch` (each rollout's importance weight, their largest log and effective sample size).
- Corrected when asked (off by default, as in the report and its public code), as per-token weights that multiply
  each token's loss in grpo_roc's `policy_loss`: `truncated_is_weights`, token-level truncated importance sampling
  min(pi_old / pi_sampler, C) (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training"); and `sequence_mask_weights`, which drops a rollout whose geometric-mean ratio over its tokens leaves a
  band (verl's geometric rejection sampling in its "rollout correction"; Liu et al. 2025, "When Speed Kills
  Stability"; TRL's `vllm_importance_sampling_correction` masks on the product over tokens instead).

Left out: sequence-level importance weights as a correction (only measured here), and removing a masked rollout's
tokens from the loss normaliser (verl does; this code keeps the normaliser, as TRL does). Pure functions of
(N, T) tensors, as grpo_roc.py's: no ranks, logging or config objects.

Run `python mismatch.py` for a toy example; tests are in tests/test_mismatch.py.
"""
import torch

from grpo_roc import MAX_LOG_RATIO

# A token's ratio r_t = pi_old(x_t) / pi_sampler(x_t) outside [1/MISMATCH_RATIO_BAND, MISMATCH_RATIO_BAND] counts in
# `ratio_outside_frac` (2: the token is twice or half as likely under one as under the other).
MISMATCH_RATIO_BAND = 2.0


def _mismatch_log_ratio(trainer_logp, sampler_logp, loss_mask):
    """log r = log pi_old - log pi_sampler (N, T) in float64, 0 where loss_mask is 0 (padding, tool text)."""
    mask = loss_mask.bool()
    diff = trainer_logp.detach().double() - sampler_logp.detach().double()
    return torch.where(mask, diff, torch.zeros_like(diff)), mask


@torch.no_grad()
def mismatch_sums(trainer_logp, sampler_logp, loss_mask) -> dict:
    """Token-level gap between the trainer and the sampler on the tokens the sampler drew, as {name: (sum, count)}
    (a caller adds these over micro-batches and ranks, then divides).

    trainer_logp, sampler_logp: (N, T) log-probs of the same sampled tokens, after temperature, under the trainer's
    policy before the update (pi_old) and under the sampler; loss_mask: (N, T), 1 on sampled tokens.
    logp_abs_diff_mean: mean |log pi_old - log pi_sampler|. k3_kl: the k3 estimate of KL(sampler || trainer).
    ratio_outside_frac: share of tokens whose ratio lies outside [1/2, 2] (MISMATCH_RATIO_BAND)."""
    log_r, mask = _mismatch_log_ratio(trainer_logp, sampler_logp, loss_mask)
    n = float(mask.sum())
    clamped = log_r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    # k3_t = (r_t - 1) - log r_t, r_t = pi_old / pi_sampler on tokens drawn from the sampler: >= 0 for every token,
    # and its mean is an unbiased estimate of KL(sampler || trainer) (Schulman 2020; verl logs it as k3_kl)
    k3 = torch.expm1(clamped) - clamped
    outside = (log_r.abs() > torch.log(torch.tensor(MISMATCH_RATIO_BAND, dtype=torch.float64))) & mask
    return {"logp_abs_diff_mean": (float(log_r.abs().sum()), n), "k3_kl": (float(k3.sum()), n),
            "ratio_outside_frac": (float(outside.sum()), n)}


@torch.no_grad()
def sequence_log_ratios(trainer_logp, sampler_logp, loss_mask) -> torch.Tensor:
    """(N,) log w_i = sum_t mask_it (log pi_old - log pi_sampler): the log of each rollout's sequence-level
    importance weight pi_old(o_i) / pi_sampler(o_i) (tool text is not the policy's, so not in it). Same shapes as
    `mismatch_sums`."""
    log_r, _ = _mismatch_log_ratio(trainer_logp, sampler_logp, loss_mask)
    return log_r.sum(dim=1)


def sequence_mismatch(log_weights) -> dict:
    """Sequence-level gap over ALL the step's rollouts: log_weights: (N,) from `sequence_log_ratios`.
    seq_log_ratio_max: max_i |log w_i|. seq_ess_frac: the effective sample size of the weights w_i over N,
    (sum w)^2 / (N sum w^2) (Kong 1992), in (0, 1]: 1 when every weight is the same, 1/N when one dominates.
    NaN for both when N = 0."""
    log_w = torch.as_tensor(log_weights, dtype=torch.float64).flatten()
    if log_w.numel() == 0:
        return {"seq_log_ratio_max": float("nan"), "seq_ess_frac": float("nan")}
    # w_i / w_max = exp(log w_i - max log w): the ratio is unchanged by a common factor and nothing overflows
    w = torch.exp(log_w - log_w.max())
    return {"seq_log_ratio_max": float(log_w.abs().max()),
            "seq_ess_frac": float(w.sum() ** 2 / (log_w.numel() * (w ** 2).sum()))}


def truncated_is_weights(trainer_logp, sampler_logp, loss_mask, cap: float = 2.0) -> torch.Tensor:
    """Token-level truncated importance sampling (Yao et al. 2025; verl's `rollout_is: token`): the (N, T) weight
    w_t = min(pi_old(x_t) / pi_sampler(x_t), cap) of each sampled token's loss, 0 where loss_mask is 0.
    Same shapes as `mismatch_sums`. A weight above 1 trusts a token the sampler under-sampled more, up to `cap`."""
    log_r, mask = _mismatch_log_ratio(trainer_logp, sampler_logp, loss_mask)
    # w_t = min(exp(log pi_old_t - log pi_sampler_t), C)
    w = torch.exp(log_r.clamp(max=MAX_LOG_RATIO)).clamp(max=cap)
    return torch.where(mask, w, torch.zeros_like(w)).to(trainer_logp.dtype)


def sequence_mask_weights(trainer_logp, sampler_logp, loss_mask, low: float = 0.999,
                          high: float = 1.001) -> torch.Tensor:
    """Sequence-level masking by the geometric-mean ratio (verl's geometric rejection sampling, `seq_mean_k1`):
    rollout i keeps weight 1 on its sampled tokens when g_i = exp(mean_t log(pi_old / pi_sampler)) lies in
    [low, high] (by default verl's geometric preset, 0.999 to 1.001), else all its tokens get 0. The mean over
    tokens, not the sum (the log of the product), so a long rollout is not dropped for its length alone. Same shapes
    as `mismatch_sums`; returns (N, T)."""
    log_r, mask = _mismatch_log_ratio(trainer_logp, sampler_logp, loss_mask)
    # log g_i = sum_t mask_it log r_it / sum_t mask_it   (a rollout without sampled tokens has g = 1)
    log_g = log_r.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    keep = (log_g >= torch.log(torch.tensor(low, dtype=torch.float64))) & \
           (log_g <= torch.log(torch.tensor(high, dtype=torch.float64)))  # (N,)
    return (mask & keep.unsqueeze(1)).to(trainer_logp.dtype)


# Corrections (config `mismatch_correction`, picked at train.update_policy's one call site): name -> the per-token
# loss weights; None: no correction (the report's loss).
CORRECTIONS = {"off": None, "tis": truncated_is_weights, "seq_mask": sequence_mask_weights}


# ----------------------------------------------------------------------------------- demo
if __name__ == "__main__":
    torch.manual_seed(0)
    N, T = 4, 6
    old_logp = -torch.rand(N, T)  # the trainer's log-probs of the sampled tokens
    sampler_logp = old_logp + 0.05 * torch.randn(N, T)  # an engine that rounds differently from the trainer
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]] * N)  # 0s: a tool response inside the rollout
    gap = {k: round(total / count, 5) for k, (total, count) in mismatch_sums(old_logp, sampler_logp, mask).items()}
    print("gap to the sampler:", gap, sequence_mismatch(sequence_log_ratios(old_logp, sampler_logp, mask)))
    print("tis weights, row 0:", [round(w, 3) for w in truncated_is_weights(old_logp, sampler_logp, mask)[0].tolist()])
    print("seq_mask weights, column 0:", sequence_mask_weights(old_logp, sampler_logp, mask, 0.99, 1.01)[:, 0].tolist())
