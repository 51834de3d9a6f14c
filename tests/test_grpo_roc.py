"""Executable spec of grpo_roc.py: penalties, equal-group dropping, Resample-on-Correct, advantages, the loss."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_roc import (
    ROC_SELECTORS, drop_equal_groups, format_penalty, group_advantages, penalty_total, policy_loss,
    resample_on_correct, roc_counts, sequence_mean_policy_loss, tool_error_penalty,
)

ROOT = Path(__file__).resolve().parents[1]
SELECTING = [mode for mode in ROC_SELECTORS if mode != "off"]  # the rules that choose G of 2G ("off" keeps all)


# ----------------------------------------------------------------------------------- penalties
@pytest.mark.spec
def test_penalties_on_the_reports_cases():
    assert tool_error_penalty(0, 0) == 0.5  # no tool call
    assert tool_error_penalty(1, 0) == 0.0  # one clean call
    assert tool_error_penalty(2, 1) == 0.5  # two calls, one failed
    assert tool_error_penalty(3, 3) == 1.0
    assert format_penalty(0, 3) == 1.0  # no complete answer block
    assert format_penalty(1, 3) == 0.0  # exactly one
    assert format_penalty(2, 4) == 0.25  # two answer blocks in 4 turns
    assert format_penalty(5, 2) == 1.0  # capped at 1
    assert penalty_total(2, 1, 2, 4) == 0.75
    assert penalty_total(1, 0, 1, 2) == 0.0


@pytest.mark.spec
@pytest.mark.parametrize("args", [(1, 2), (-1, 0), (2, -1)])
def test_tool_error_penalty_rejects_impossible_counts(args):
    with pytest.raises(ValueError):
        tool_error_penalty(*args)


@pytest.mark.spec
@pytest.mark.parametrize("args", [(-1, 3), (1, 0)])
def test_format_penalty_rejects_impossible_counts(args):
    with pytest.raises(ValueError):
        format_penalty(*args)


# ----------------------------------------------------------------------------------- dropping equal groups
@pytest.mark.spec
def test_drop_equal_groups_keeps_only_mixed_groups():
    rewards = [[1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 1, 1]]
    assert drop_equal_groups(rewards) == [1, 3]
    assert drop_equal_groups(torch.tensor(rewards)) == [1, 3]
    assert drop_equal_groups([[0, 0], [1, 1]]) == []


# ----------------------------------------------------------------------------------- RoC counts
@pytest.mark.spec
@pytest.mark.parametrize("n_total, n_pos, expected", [
    (8, 1, (1, 3)), (8, 3, (2, 2)), (8, 5, (2, 2)), (8, 7, (3, 1)), (8, 0, (0, 4)), (8, 8, (4, 0)),
    (32, 1, (1, 15)), (32, 2, (2, 14)), (32, 3, (2, 14)), (32, 16, (8, 8)), (32, 30, (14, 2)), (32, 31, (15, 1)),
    (32, 0, (0, 16)), (32, 32, (16, 0)),
])
def test_roc_counts_by_hand(n_total, n_pos, expected):
    # keep = G = n_total / 2; e.g. 32 with 3 positives: round(1.5) = 2 (ties to even) -> 2 positive, 14 negative;
    # 32 with 31: round(15.5) = 16, but at least min(2, 1) = 1 negative -> 15 / 1.
    assert roc_counts(n_pos, n_total - n_pos, n_total // 2) == expected


@pytest.mark.spec
def test_roc_counts_invariants_on_every_small_case():
    for n_total in range(1, 41):
        for keep in range(n_total + 1):
            for n_pos in range(n_total + 1):
                n_neg = n_total - n_pos
                p, q = roc_counts(n_pos, n_neg, keep)
                assert p + q == keep and 0 <= p <= n_pos and 0 <= q <= n_neg
                if keep >= 4:  # both minimums fit
                    assert p >= min(2, n_pos) and q >= min(2, n_neg)
                # proportional up to rounding, unless a minimum or the availability bound moved it
                target = keep * n_pos / n_total
                moved = p in (min(2, n_pos), keep - min(2, n_neg), n_pos, keep - n_neg)
                assert abs(p - target) <= 0.5 or moved, (n_total, keep, n_pos, p)


def _public_code_counts(n_pos, n_neg, keep):
    """The public code's count rule, written out independently: both counts rounded, then minimums of 2."""
    n = n_pos + n_neg
    neg, pos = round(n_neg * keep / n), round(n_pos * keep / n)
    if neg <= min(2, n_neg):
        neg = min(2, n_neg)
        pos = keep - neg
    if pos <= min(2, n_pos):
        pos = min(2, n_pos)
        neg = keep - pos
    return pos, neg


@pytest.mark.spec
@pytest.mark.parametrize("n_total", [8, 16, 32])
def test_roc_counts_match_the_public_code_when_keeping_half(n_total):
    for n_pos in range(1, n_total):
        assert roc_counts(n_pos, n_total - n_pos, n_total // 2) == _public_code_counts(n_pos, n_total - n_pos, n_total // 2)


def _public_code_rule(n_pos, n_neg, keep, minimum=2):
    """The public code's down-sampling counts, as its rule reads (both counts rounded on their own, the negatives'
    minimum tested first, each when the count is <= the minimum); None where its `len(choices) == keep` assertion
    would fail."""
    n = n_pos + n_neg
    neg, pos = round(n_neg * keep / n), round(n_pos * keep / n)
    if neg < minimum and pos < minimum:
        return None  # it keeps the whole group then (no down-sampling), not `keep` rollouts
    if neg <= min(minimum, n_neg):
        neg = min(minimum, n_neg)
        pos = keep - neg
    if pos <= min(minimum, n_pos):
        pos = min(minimum, n_pos)
        neg = keep - pos
    return (pos, neg) if pos + neg == keep else None


@pytest.mark.spec
@pytest.mark.parametrize("G", [4, 8, 16])
def test_roc_counts_equal_the_public_rule_for_even_group_sizes(G):
    for n_pos in range(1, 2 * G):
        assert roc_counts(n_pos, 2 * G - n_pos, G) == _public_code_rule(n_pos, 2 * G - n_pos, G)


@pytest.mark.spec
def test_roc_counts_for_odd_group_sizes_by_hand_and_where_the_public_rule_differs():
    # G = 5 from 10: the split rounded half to even, then the minimums of 2; always exactly G
    assert [roc_counts(p, 10 - p, 5) for p in range(1, 10)] == [
        (1, 4), (2, 3), (2, 3), (2, 3), (2, 3), (3, 2), (3, 2), (3, 2), (4, 1)]
    assert _public_code_rule(5, 5, 5) == (3, 2)  # the public code keeps 3 positives here
    assert _public_code_rule(7, 7, 7) is None  # 4 + 4 = 8 rollouts for G = 7: its assertion fails
    for G in [3, 5, 7, 9, 15]:
        for n_pos in range(1, 2 * G):
            n_neg = 2 * G - n_pos
            ours = roc_counts(n_pos, n_neg, G)
            assert sum(ours) == G
            if G >= 4:  # below 4 the two minimums of 2 cannot both hold (and the two rules settle it differently)
                assert ours[0] >= min(2, n_pos) and ours[1] >= min(2, n_neg)
            if G >= 4 and n_pos % 2 == 0:  # no half to round: both rules agree
                assert ours == _public_code_rule(n_pos, n_neg, G), (G, n_pos)
    # with an exact half to round they part: G = 7, 9 of 14 positive: 4 here (4.5 to even), 5 there
    assert roc_counts(9, 5, 7) == (4, 3) and _public_code_rule(9, 5, 7) == (5, 2)


# ----------------------------------------------------------------------------------- RoC selection
def _group(n_total, n_pos, seed=0):
    """Rewards with n_pos positives at shuffled places, and penalties from the grid {0, .25, .5, 1, 1.5}."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.zeros(n_total)
    rewards[torch.randperm(n_total, generator=g)[:n_pos]] = 1.0
    penalties = torch.tensor([0.0, 0.25, 0.5, 1.0, 1.5])[torch.randint(0, 5, (n_total,), generator=g)]
    return rewards.tolist(), penalties.tolist()


@pytest.mark.spec
@pytest.mark.parametrize("mode", SELECTING)
@pytest.mark.parametrize("n_total, n_pos", [(8, 1), (8, 3), (32, 1), (32, 3), (32, 16), (32, 31)])
def test_resample_on_correct_counts(mode, n_total, n_pos):
    rewards, penalties = _group(n_total, n_pos)
    keep = n_total // 2
    kept = resample_on_correct(rewards, penalties, keep, mode=mode, generator=torch.Generator().manual_seed(1))
    assert len(kept) == keep and kept == sorted(set(kept)) and all(0 <= i < n_total for i in kept)
    kept_pos = sum(rewards[i] > 0 for i in kept)
    assert (kept_pos, keep - kept_pos) == roc_counts(n_pos, n_total - n_pos, keep)
    assert kept_pos >= min(2, n_pos) and keep - kept_pos >= min(2, n_total - n_pos)


@pytest.mark.spec
@pytest.mark.parametrize("mode", SELECTING)
@pytest.mark.parametrize("reward", [0.0, 1.0])
def test_degenerate_groups_still_return_keep_indices(mode, reward):
    kept = resample_on_correct([reward] * 8, [0.5] * 8, 4, mode=mode, generator=torch.Generator().manual_seed(0))
    assert len(kept) == 4 and kept == sorted(set(kept))


@pytest.mark.spec
def test_off_keeps_every_rollout_and_only_with_keep_2g():
    assert {"sample", "lowest", "off"} <= set(ROC_SELECTORS)
    for rewards in ([1, 0, 0, 1, 1, 0], [1] * 6, [0] * 6):
        assert resample_on_correct(rewards, [0.5] * 6, 6, mode="off") == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="keeps every rollout: keep must be 6"):
        resample_on_correct([1, 0, 0, 1, 1, 0], [0.5] * 6, 3, mode="off")


def test_a_roc_rule_added_in_one_place_reaches_the_config_the_ablation_and_the_tests(tmp_path):
    """A rule added to grpo_roc.ROC_SELECTORS alone (here by a plugin loaded before anything reads the table) is a
    valid roc_mode, an arm of tiny/ablation.py, and runs through this file's tests of every selecting rule."""
    (tmp_path / "add_rule.py").write_text(
        "import grpo_roc\n"
        "def _select_newest(pos, pos_penalty, neg, n_pos_keep, n_neg_keep, generator):\n"
        "    return (pos[-n_pos_keep:] if n_pos_keep else []) + (neg[-n_neg_keep:] if n_neg_keep else [])\n"
        "grpo_roc.ROC_SELECTORS['newest'] = _select_newest\n")
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    probe = ("import add_rule\nfrom tiny import ablation\nfrom plumbing.train_config import TrainConfig, validate\n"
             "validate(TrainConfig(data=['x.jsonl'], roc_mode='newest', prompts_per_step=4), 1)\n"
             "print(ablation.ARMS['newest'])")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['roc_mode=newest', 'rollouts_per_prompt=8', 'group_size=4']"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "add_rule", "-k", "newest", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "test_grpo_roc.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "\n8 passed" in done.stdout, done.stdout  # 6 count cases and 2 degenerate groups, for the new rule


@pytest.mark.spec
def test_lowest_picks_the_lowest_penalties_and_the_first_negatives():
    #          0    1    2    3     4    5    6    7
    rewards = [1, 0, 1, 1, 0, 1, 0, 0]
    penalties = [1.0, 9.0, 0.5, 0.25, 0.0, 0.5, 0.0, 0.0]
    # 4 positives of 8, keep 4 -> 2 positives (0.25 at 3, then 0.5 at 2 beats 0.5 at 5 by rollout order),
    # 2 negatives: the first two in rollout order (1 and 4), whatever their penalties.
    assert roc_counts(4, 4, 4) == (2, 2)
    assert resample_on_correct(rewards, penalties, 4, mode="lowest") == [1, 2, 3, 4]


@pytest.mark.spec
def test_lowest_on_32_keeps_exactly_the_lowest_positive_penalties():
    rewards, penalties = _group(32, 16, seed=3)
    kept = resample_on_correct(rewards, penalties, 16, mode="lowest")
    kept_pos = [i for i in kept if rewards[i] > 0]
    all_pos = sorted((penalties[i], i) for i in range(32) if rewards[i] > 0)
    assert kept_pos == sorted(i for _, i in all_pos[:len(kept_pos)])
    assert [i for i in kept if rewards[i] == 0] == [i for i in range(32) if rewards[i] == 0][:16 - len(kept_pos)]


@pytest.mark.spec
def test_sample_is_reproducible_with_a_pinned_generator_and_varies_without():
    rewards, penalties = _group(32, 16, seed=5)
    draw = lambda seed: resample_on_correct(rewards, penalties, 16, generator=torch.Generator().manual_seed(seed))
    assert draw(7) == draw(7)
    assert len({tuple(draw(s)) for s in range(20)}) > 10


def _frequencies(rewards, penalties, keep, draws=4000, mode="sample"):
    g = torch.Generator().manual_seed(0)
    counts = [0] * len(rewards)
    for _ in range(draws):
        for i in resample_on_correct(rewards, penalties, keep, mode=mode, generator=g):
            counts[i] += 1
    return [c / draws for c in counts]


@pytest.mark.spec
def test_sample_picks_one_of_two_positives_in_the_ratio_of_the_weights():
    # 2 positives, 4 negatives, keep 3 -> 1 positive (keep < 4: the proportional count stands), 2 negatives.
    rewards, penalties = [1, 1, 0, 0, 0, 0], [0.25, 0.5, 0, 0, 0, 0]
    assert roc_counts(2, 4, 3) == (1, 2)
    freq = _frequencies(rewards, penalties, 3)
    w1, w2 = 1 / 0.25, 1 / 0.5  # eps = 1e-6 is invisible at this scale
    assert abs(freq[0] - w1 / (w1 + w2)) < 0.03 and abs(freq[1] - w2 / (w1 + w2)) < 0.03
    assert all(abs(f - 0.5) < 0.03 for f in freq[2:])  # negatives uniform: 2 of 4


@pytest.mark.spec
def test_sample_two_of_three_positives_without_replacement():
    # 32 rollouts with 3 positives -> 2 positives kept; P(i left out) = sum over first draws j != i of
    # w_j / W * w_k / (W - w_j) with k the third one.
    rewards = [1, 1, 1] + [0] * 29
    penalties = [0.25, 0.5, 1.0] + [0.0] * 29
    w = [4.0, 2.0, 1.0]
    W = sum(w)

    def p_left_out(i):
        j, k = [x for x in range(3) if x != i]
        return w[j] / W * w[k] / (W - w[j]) + w[k] / W * w[j] / (W - w[k])

    freq = _frequencies(rewards, penalties, 16)
    for i in range(3):
        assert abs((1 - freq[i]) - p_left_out(i)) < 0.03
    assert all(abs(f - 14 / 29) < 0.04 for f in freq[3:])


@pytest.mark.spec
def test_sample_takes_clean_positives_first():
    # a clean positive (p_total = 0) has weight 1e6, so it is kept over a p_total = 0.5 one every time
    freq = _frequencies([1, 1, 0, 0, 0, 0], [0.5, 0.0, 0, 0, 0, 0], 3, draws=500)
    assert freq[1] == 1.0 and freq[0] == 0.0


@pytest.mark.spec
def test_uniform_keeps_roc_counts_but_does_not_prefer_clean_positives():
    # the case above where "sample" keeps the clean positive every time: here each positive half the time
    freq = _frequencies([1, 1, 0, 0, 0, 0], [0.5, 0.0, 0, 0, 0, 0], 3, draws=2000, mode="uniform")
    assert abs(freq[0] - 0.5) < 0.05 and abs(freq[1] - 0.5) < 0.05 and freq[0] + freq[1] == 1.0
    assert all(abs(f - 0.5) < 0.05 for f in freq[2:])  # 2 of 4 negatives


@pytest.mark.spec
def test_resample_on_correct_rejects_bad_input():
    with pytest.raises(ValueError, match="lowest.*sample"):
        resample_on_correct([1, 0], [0, 0], 1, mode="top")
    with pytest.raises(ValueError):
        resample_on_correct([1, 0], [0, 0], 3)
    with pytest.raises(ValueError):
        resample_on_correct([1, 0], [0], 1)
    with pytest.raises(ValueError):
        resample_on_correct([1, 0], [-1, 0], 1)


# ----------------------------------------------------------------------------------- advantages
@pytest.mark.spec
def test_group_advantages_by_hand():
    # group 1: [1, 0, 0, 0]: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    # group 2: [1, 1, 0, 0]: mean 0.5, std sqrt(4 * 0.25 / 3) = 1 / sqrt(3); group 3 all equal -> 0
    adv = group_advantages([1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1], group_size=4)
    s = 1 / math.sqrt(3) + 1e-6
    expected = [0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001,
                0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s, 0, 0, 0, 0]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)
    assert adv.dtype == torch.float32 and adv.shape == (12,)


@pytest.mark.spec
def test_group_advantages_rejects_bad_group_size():
    with pytest.raises(ValueError):
        group_advantages([1, 0, 1], group_size=2)
    with pytest.raises(ValueError):
        group_advantages([1, 0], group_size=1)


# ----------------------------------------------------------------------------------- policy loss
@pytest.mark.spec
def test_policy_loss_on_a_2x3_example_by_hand():
    old = torch.zeros(2, 3, dtype=torch.float64)
    ratios = torch.tensor([[1.0, 1.5, 0.5], [0.5, 1.0, 7.0]], dtype=torch.float64)
    logp = ratios.log().requires_grad_()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, m = policy_loss(logp, old, adv, mask)
    # row 1 (A = 1): -min(1, 1) = -1; -min(1.5, 1.28) = -1.28; -min(0.5, 0.8) = -0.5
    # row 2 (A = -1): -min(-0.5, -0.8) = 0.8; -min(-1, -1) = 1; masked. Sum -0.98 over 5 tokens.
    assert loss.item() == pytest.approx(-0.98 / 5, abs=1e-12)
    assert m["clip_frac_high"] == pytest.approx(1 / 5) and m["clip_frac_low"] == pytest.approx(1 / 5)
    assert m["ratio_mean"] == pytest.approx((1 + 1.5 + 0.5 + 0.5 + 1) / 5)
    k3 = lambda r: (r - 1) - math.log(r)
    assert m["approx_kl"] == pytest.approx((k3(1.5) + 2 * k3(0.5)) / 5)
    assert m["dual_clip_frac"] == 0.0
    loss.backward()
    # d/dlogp of -ratio * A is -A * ratio on unclipped tokens, 0 on clipped and masked ones; all / 5
    expected = torch.tensor([[-1.0, 0.0, -0.5], [0.0, 1.0, 0.0]], dtype=torch.float64) / 5
    assert torch.allclose(logp.grad, expected, atol=1e-12)


def _loop_loss(logp, old, adv, mask, clip_low, clip_high, dual_clip, denominator, per_sequence=False):
    """Plain Python per-token reference."""
    total = 0.0
    for i in range(logp.shape[0]):
        row, n_i = 0.0, 0
        for t in range(logp.shape[1]):
            if not mask[i][t]:
                continue
            r, a = math.exp(float(logp[i][t] - old[i][t])), float(adv[i])
            term = -min(r * a, min(max(r, 1 - clip_low), 1 + clip_high) * a)
            if dual_clip is not None and a < 0:
                term = min(term, -dual_clip * a)
            row, n_i = row + term, n_i + 1
        total += row / max(n_i, 1) if per_sequence else row
    return total / denominator


def _random_batch(N=6, T=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(N, T, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(N, T, generator=g, dtype=torch.float64) * 0.8  # ratios well past both clips
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    mask = (torch.rand(N, T, generator=g) < 0.7).long()
    mask[0] = 0  # one fully masked rollout
    return logp, old, adv, mask


@pytest.mark.spec
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_policy_loss_matches_a_per_token_loop(dual_clip):
    logp, old, adv, mask = _random_batch()
    loss, m = policy_loss(logp, old, adv, mask, dual_clip=dual_clip)
    ref = _loop_loss(logp, old, adv, mask, 0.2, 0.28, dual_clip, int(mask.sum()))
    assert abs(loss.item() - ref) < 1e-6
    loss, _ = policy_loss(logp, old, adv, mask, normaliser=100, dual_clip=dual_clip)
    assert abs(loss.item() - _loop_loss(logp, old, adv, mask, 0.2, 0.28, dual_clip, 100)) < 1e-6
    assert m["clip_frac_low"] > 0 and m["clip_frac_high"] > 0
    assert set(m) == {"clip_frac_low", "clip_frac_high", "dual_clip_frac", "ratio_mean", "approx_kl"}
    assert all(type(v) is float for v in m.values())


@pytest.mark.spec
def test_sequence_mean_policy_loss_matches_a_loop_and_differs_from_token_mean():
    logp, old, adv, mask = _random_batch(seed=1)
    loss, _ = sequence_mean_policy_loss(logp, old, adv, mask)
    assert abs(loss.item() - _loop_loss(logp, old, adv, mask, 0.2, 0.28, None, 6, per_sequence=True)) < 1e-6
    assert abs(loss.item() - policy_loss(logp, old, adv, mask)[0].item()) > 1e-3
    same_length = torch.ones_like(mask)  # with equal lengths the two aggregations agree
    assert torch.allclose(sequence_mean_policy_loss(logp, old, adv, same_length)[0],
                          policy_loss(logp, old, adv, same_length)[0])


@pytest.mark.spec
def test_dual_clip_caps_the_loss_for_negative_advantages():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(5.0), math.log(2.0)]])
    adv = torch.tensor([-1.0])
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 2), dual_clip=3.0)
    # token 1: -min(-5, -1.28) = 5, capped at 3; token 2: 2 (below the cap)
    assert loss.item() == pytest.approx((3.0 + 2.0) / 2)
    assert m["dual_clip_frac"] == 0.5
    assert policy_loss(logp, old, adv, torch.ones(1, 2))[0].item() == pytest.approx((5.0 + 2.0) / 2)
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, torch.ones(1, 2), dual_clip=1.0)


@pytest.mark.spec
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_huge_log_ratios_give_a_finite_loss_and_gradient(dual_clip):
    """exp(100) overflows float32: without the clamp the dual-clipped gradient is 0 * inf = NaN."""
    old = torch.zeros(2, 3)
    logp = torch.tensor([[100.0, 0.1, -100.0], [100.0, -0.1, -100.0]], requires_grad=True)
    adv = torch.tensor([-1.0, 1.0])
    loss, m = policy_loss(logp, old, adv, torch.ones(2, 3), dual_clip=dual_clip)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and all(math.isfinite(v) for v in m.values())
    # the ordinary tokens keep their gradient: -A * ratio / 6 (inside the clip range)
    assert logp.grad[0, 1].item() == pytest.approx(math.exp(0.1) / 6, rel=1e-5)
    assert logp.grad[1, 1].item() == pytest.approx(-math.exp(-0.1) / 6, rel=1e-5)
    assert (logp.grad[:, [0, 2]] == 0).all()  # past the clamp: no gradient through the ratio
    # row 0 (A = -1): e^20 (capped at -c * A = 3 by the dual clip), e^0.1, and 0.8 (the low clip of e^-20);
    # row 1 (A = 1): -1.28 (the high clip of e^20), -e^-0.1, -e^-20
    big = math.exp(20.0) if dual_clip is None else 3.0
    expected = (big + math.exp(0.1) + 0.8 - 1.28 - math.exp(-0.1) - math.exp(-20.0)) / 6
    assert loss.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.spec
def test_clamp_leaves_every_ordinary_ratio_unchanged():
    logp, old, adv, mask = _random_batch(N=8, T=12, seed=5)
    logp = old + (logp - old) * 4  # log ratios up to about +-10: e^10 is far past every clip, below the clamp
    assert (logp - old)[mask == 1].abs().max() > 5
    for dual_clip in (None, 3.0):
        loss, _ = policy_loss(logp, old, adv, mask, dual_clip=dual_clip)
        assert loss.item() == pytest.approx(_loop_loss(logp, old, adv, mask, 0.2, 0.28, dual_clip,
                                                       int(mask.sum())), rel=1e-9)


@pytest.mark.spec
def test_masked_positions_get_zero_gradient_even_with_garbage_values():
    logp, old, adv, mask = _random_batch(seed=2)
    logp, old = logp.clone(), old.clone()
    logp[mask == 0] = float("inf")  # what padding might hold
    old[mask == 0] = float("nan")
    logp.requires_grad_()
    loss, m = policy_loss(logp, old, adv, mask, dual_clip=3.0)
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in m.values())
    assert (logp.grad[mask == 0] == 0).all() and (logp.grad[mask == 1] != 0).any()


@pytest.mark.spec
def test_empty_mask_gives_zero_loss_not_nan():
    logp, old, adv, _ = _random_batch()
    loss, m = policy_loss(logp, old, adv, torch.zeros_like(logp))
    assert loss.item() == 0.0 and m["ratio_mean"] == 0.0


@pytest.mark.spec
def test_global_token_normaliser_makes_micro_batches_and_ranks_exact():
    logp, old, adv, mask = _random_batch(N=8, T=11, seed=4)
    big = logp.clone().requires_grad_()
    policy_loss(big, old, adv, mask)[0].backward()

    total = int(mask.sum())  # over the whole optimizer step
    split = logp.clone().requires_grad_()
    ranks = [[slice(0, 3), slice(3, 4)], [slice(4, 6), slice(6, 8)]]  # 2 ranks x 2 uneven micro-batches
    rank_grads = []
    for micro_batches in ranks:
        split.grad = None
        for s in micro_batches:  # gradient accumulation on one rank
            policy_loss(split[s], old[s], adv[s], mask[s], normaliser=total)[0].backward()
        rank_grads.append(split.grad.clone())
    assert torch.allclose(sum(rank_grads), big.grad, atol=1e-12)

    # per-micro-batch normalisation (mean of micro-batch means) is not the same gradient
    approx = logp.clone().requires_grad_()
    for s in [s for mbs in ranks for s in mbs]:
        (policy_loss(approx[s], old[s], adv[s], mask[s])[0] / 4).backward()
    assert not torch.allclose(approx.grad, big.grad, atol=1e-6)


# ----------------------------------------------------------------------------------- demo
def test_demo_runs_and_walks_through_every_stage():
    out = subprocess.run([sys.executable, str(ROOT / "grpo_roc.py")], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for word in ("rewards", "penalties", "kept, lowest", "kept, sample", "advantages", "loss", "True"):
        assert word in out.stdout
