"""KL estimators and their two placements against plain-loop references."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_trainer.algorithms import KL_ESTIMATORS, KL_PLACEMENTS, compute_kl, kl_in_loss, kl_in_reward

ATOL = 1e-6
SHAPES = [(1, 1), (3, 7), (8, 16), (2, 65)]


def make(b: int, t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 5
    ref = logp + 0.7 * torch.randn(b, t, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    return logp, ref, mask


def ref_kl(name: str, lp: float, rp: float) -> float:
    if name == "k1":
        return lp - rp
    if name == "k2":
        return 0.5 * (lp - rp) ** 2
    ratio = math.exp(rp - lp)  # pi_ref / pi
    return ratio - 1 - math.log(ratio)


def ref_table(name, logp, ref, mask, clamp=None):
    out = []
    for b in range(logp.shape[0]):
        row = []
        for t in range(logp.shape[1]):
            lp, rp = logp[b, t].item(), ref[b, t].item()
            if clamp is not None:
                rp = lp - min(max(lp - rp, -clamp), clamp)
            row.append(ref_kl(name, lp, rp) if mask[b, t] else 0.0)
        out.append(row)
    return torch.tensor(out, dtype=torch.float64)


def test_registry_keys():
    assert sorted(KL_ESTIMATORS) == ["k1", "k2", "k3"]
    assert KL_PLACEMENTS == ("reward", "loss")


def test_unknown_estimator_lists_valid_names():
    logp, ref, mask = make(2, 3, 0)
    with pytest.raises(KeyError, match="k1, k2, k3"):
        compute_kl(logp, ref, mask, estimator="k4")


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
@pytest.mark.parametrize("shape", SHAPES)
def test_estimator_matches_reference(name, shape):
    logp, ref, mask = make(*shape, seed=shape[1])
    torch.testing.assert_close(
        compute_kl(logp, ref, mask, estimator=name), ref_table(name, logp, ref, mask), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_clamped_log_ratio(name):
    logp, ref, mask = make(4, 9, seed=3)
    ref = ref * 4  # push log-ratios past the clamp
    got = compute_kl(logp, ref, mask, estimator=name, clamp=1.5)
    torch.testing.assert_close(got, ref_table(name, logp, ref, mask, clamp=1.5), atol=ATOL, rtol=0)


def test_k2_k3_nonnegative_and_zero_at_equal_policies():
    logp, ref, mask = make(5, 11, seed=4)
    for name in ("k2", "k3"):
        assert (compute_kl(logp, ref, mask, estimator=name) >= 0).all()
        assert compute_kl(logp, logp, mask, estimator=name).abs().max() == 0


def test_k1_and_k3_are_unbiased_for_the_true_kl():
    """Sampling from p, the mean of k1 and k3 approach KL(p||q); k2 does not in general."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    true_kl = (p * (p.log() - q.log())).sum()
    # exact expectation over the sampling distribution instead of Monte Carlo
    for name in ("k1", "k3"):
        per_action = compute_kl(p.log().unsqueeze(0), q.log().unsqueeze(0), estimator=name)[0]
        torch.testing.assert_close((p * per_action).sum(), true_kl, atol=1e-12, rtol=0)


def test_kl_in_reward_scales_and_masks():
    logp, ref, mask = make(3, 5, seed=8)
    kl = compute_kl(logp, ref, mask, estimator="k1")
    penalty = kl_in_reward(kl, 0.05, mask)
    expected = torch.tensor(
        [[0.05 * kl[b, t].item() if mask[b, t] else 0.0 for t in range(5)] for b in range(3)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(penalty, expected, atol=ATOL, rtol=0)


def test_kl_in_loss_is_coef_times_token_mean():
    logp, ref, mask = make(4, 6, seed=9)
    kl = compute_kl(logp, ref, mask, estimator="k3")
    vals = [kl[b, t].item() for b in range(4) for t in range(6) if mask[b, t]]
    expected = 0.1 * sum(vals) / len(vals)
    assert abs(kl_in_loss(kl, 0.1, mask).item() - expected) < ATOL
