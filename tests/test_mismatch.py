"""Executable spec of mismatch.py: the sampler-trainer gap by hand, and what the two corrections do to the loss."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_roc import policy_loss, sequence_mean_policy_loss
from mismatch import (mismatch_sums, sequence_log_ratios, sequence_mask_weights, sequence_mismatch,
                      truncated_is_weights)

ROOT = Path(__file__).resolve().parents[1]


def _mismatch_example():
    """Two rollouts, three token slots; the ratios pi_old / pi_sampler are written out, the last slot of rollout
    2 is tool text (mask 0) with a garbage sampler value."""
    ratios = torch.tensor([[1.0, 3.0, 0.4], [1.25, 0.8, 1.0]], dtype=torch.float64)
    sampler = -torch.tensor([[1.0, 2.0, 0.5], [0.7, 0.3, 0.0]], dtype=torch.float64)
    trainer = sampler + ratios.log()
    sampler[1, 2] = 123.0  # under the mask: must change nothing
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return trainer, sampler, mask


@pytest.mark.spec
def test_mismatch_sums_by_hand():
    trainer, sampler, mask = _mismatch_example()
    sums = mismatch_sums(trainer, sampler, mask)
    logs = [0.0, math.log(3.0), math.log(0.4), math.log(1.25), math.log(0.8)]
    assert set(sums) == {"logp_abs_diff_mean", "k3_kl", "ratio_outside_frac"}
    assert all(count == 5 for _, count in sums.values())
    assert sums["logp_abs_diff_mean"][0] == pytest.approx(sum(abs(x) for x in logs), abs=1e-12)
    # k3 = (r - 1) - log r per token: 0, 2 - log 3, -0.6 - log 0.4, 0.25 - log 1.25, -0.2 - log 0.8
    k3 = [(math.exp(x) - 1) - x for x in logs]
    assert sums["k3_kl"][0] == pytest.approx(sum(k3), abs=1e-12) and min(k3) >= 0
    assert sums["ratio_outside_frac"] == (2.0, 5.0)  # 3 and 0.4 lie outside [1/2, 2]; 1.25 and 0.8 inside


@pytest.mark.spec
def test_sequence_log_ratios_and_their_effective_sample_size_by_hand():
    trainer, sampler, mask = _mismatch_example()
    log_w = sequence_log_ratios(trainer, sampler, mask)
    # w_1 = 1 * 3 * 0.4 = 1.2; w_2 = 1.25 * 0.8 = 1 (the masked slot is not a token of the policy)
    assert log_w.tolist() == pytest.approx([math.log(1.2), 0.0], abs=1e-12)
    seq = sequence_mismatch(log_w)
    assert seq["seq_log_ratio_max"] == pytest.approx(math.log(1.2))
    # ESS / N = (1.2 + 1)^2 / (2 * (1.44 + 1)) = 4.84 / 4.88
    assert seq["seq_ess_frac"] == pytest.approx(4.84 / 4.88, abs=1e-12)
    assert sequence_mismatch([0.0, 0.0, 0.0])["seq_ess_frac"] == 1.0
    assert sequence_mismatch([-2.0, 0.0])["seq_log_ratio_max"] == 2.0  # the largest in absolute value
    # one weight e^800 dominates (no overflow): ESS -> 1 of 3
    assert sequence_mismatch([800.0, 0.0, -5.0])["seq_ess_frac"] == pytest.approx(1 / 3)
    assert all(math.isnan(v) for v in sequence_mismatch([]).values())


@pytest.mark.spec
def test_no_gap_measures_zero():
    trainer, _, mask = _mismatch_example()
    sums = mismatch_sums(trainer, trainer.clone(), mask)
    assert all(total == 0.0 for total, _ in sums.values())
    assert sequence_mismatch(sequence_log_ratios(trainer, trainer, mask)) == {"seq_log_ratio_max": 0.0,
                                                                               "seq_ess_frac": 1.0}


@pytest.mark.spec
def test_truncated_is_weights_by_hand_and_the_loss_they_give():
    trainer, sampler, mask = _mismatch_example()
    w = truncated_is_weights(trainer, sampler, mask, cap=2.0)
    # min(r, 2): 1, 2 (3 capped), 0.4 | 1.25, 0.8, masked -> 0
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.4], [1.25, 0.8, 0.0]], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(truncated_is_weights(trainer, sampler, mask, cap=5.0)[0, 1], torch.tensor(3.0,
                          dtype=torch.float64), atol=1e-12)
    # On-policy update (logp = old): every ratio is 1, so token t's loss is -A_i, times w_t, over 5 tokens
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, _ = policy_loss(trainer, trainer, adv, mask, is_weights=w)
    by_hand = (-1.0 * (1.0 + 2.0 + 0.4) + 2.0 * (1.25 + 0.8)) / 5
    assert loss.item() == pytest.approx(by_hand, abs=1e-12)
    assert policy_loss(trainer, trainer, adv, mask)[0].item() == pytest.approx((-3 + 4) / 5, abs=1e-12)


@pytest.mark.spec
def test_sequence_mask_weights_use_the_geometric_mean_by_hand():
    trainer, sampler, mask = _mismatch_example()
    # g_1 = (1 * 3 * 0.4)^(1/3) = 1.2^(1/3) = 1.0627; g_2 = (1.25 * 0.8)^(1/2) = 1
    w = sequence_mask_weights(trainer, sampler, mask, low=0.95, high=1.05)
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]  # rollout 1 leaves the band; masked slot 0
    assert sequence_mask_weights(trainer, sampler, mask, low=0.95, high=1.07).tolist() == [[1.0] * 3, [1.0, 1.0, 0.0]]
    # The same per-token ratio over 3 or 300 tokens: the geometric mean is the same, so both are kept
    long_mask = torch.ones(2, 300, dtype=torch.long)
    long_mask[0, 3:] = 0
    drift = torch.full((2, 300), math.log(1.03), dtype=torch.float64)
    assert sequence_mask_weights(drift, torch.zeros(2, 300, dtype=torch.float64), long_mask, 0.95, 1.05).sum() == 303
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    loss, _ = sequence_mean_policy_loss(trainer, trainer, adv, mask, is_weights=w)
    # rollout 1 dropped; rollout 2: mean of 2 * (1, 1) over its 2 tokens = 2; over 2 sequences
    assert loss.item() == pytest.approx(2.0 / 2, abs=1e-12)


@pytest.mark.spec
def test_correction_weights_carry_no_gradient():
    trainer, sampler, mask = _mismatch_example()
    logp = trainer.clone().requires_grad_()
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    w = truncated_is_weights(logp, sampler, mask)
    loss, _ = policy_loss(logp, trainer, adv, mask, is_weights=w)
    loss.backward()
    # d/dlogp_t of -w_t * r_t * A = -w_t * A (r = 1 here; unclipped): w is a constant, not differentiated
    expected = -(w.detach() * adv.unsqueeze(1)) * mask / 5
    assert torch.allclose(logp.grad, expected, atol=1e-12)


def test_demo_runs():
    out = subprocess.run([sys.executable, str(ROOT / "mismatch.py")], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for word in ("gap to the sampler", "seq_ess_frac", "tis weights", "seq_mask weights"):
        assert word in out.stdout
