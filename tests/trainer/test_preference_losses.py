"""Offline preference losses against plain-loop references (and TRL where it computes the same)."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_trainer.losses import PREFERENCE_LOSSES, PreferenceConfig, PreferenceInputs

ATOL = 1e-6
SIZES = [1, 4, 33]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def make_paired(b: int, seed: int) -> PreferenceInputs:
    gen = torch.Generator().manual_seed(seed)
    logps = [-20 * torch.rand(b, generator=gen, dtype=torch.float64) for _ in range(4)]
    return PreferenceInputs(*logps)


def make_unpaired(bc: int, br: int, bk: int, seed: int) -> PreferenceInputs:
    gen = torch.Generator().manual_seed(seed)

    def lp(n):
        return -20 * torch.rand(n, generator=gen, dtype=torch.float64)

    pc, pr, rc, rr = lp(bc), lp(br), lp(bc), lp(br)
    ref_kl = lp(bk)
    pol_kl = ref_kl + 2 * torch.randn(bk, generator=gen, dtype=torch.float64)
    return PreferenceInputs(pc, pr, rc, rr, pol_kl, ref_kl)


def ref_paired(name: str, x: PreferenceInputs, cfg: PreferenceConfig):
    losses, chosen, rejected = [], [], []
    for i in range(x.policy_chosen_logps.shape[0]):
        cw = x.policy_chosen_logps[i].item() - x.reference_chosen_logps[i].item()
        cl = x.policy_rejected_logps[i].item() - x.reference_rejected_logps[i].item()
        h = cw - cl
        if name == "dpo":
            losses.append(-log_sigmoid(cfg.beta * h))
        elif name == "cdpo":
            e = cfg.label_smoothing
            losses.append(-(1 - e) * log_sigmoid(cfg.beta * h) - e * log_sigmoid(-cfg.beta * h))
        elif name == "ipo":
            losses.append((h - 1 / (2 * cfg.beta)) ** 2)
        chosen.append(cfg.beta * cw)
        rejected.append(cfg.beta * cl)
    return losses, chosen, rejected


def ref_kto(x: PreferenceInputs, cfg: PreferenceConfig):
    diffs = [a - b for a, b in zip(x.policy_kl_logps.tolist(), x.reference_kl_logps.tolist())]
    z0 = max(0.0, sum(diffs) / len(diffs))
    losses = []
    for p, r in zip(x.policy_chosen_logps.tolist(), x.reference_chosen_logps.tolist()):
        losses.append(cfg.desirable_weight * (1 - sigmoid(cfg.beta * ((p - r) - z0))))
    for p, r in zip(x.policy_rejected_logps.tolist(), x.reference_rejected_logps.tolist()):
        losses.append(cfg.undesirable_weight * (1 - sigmoid(cfg.beta * (z0 - (p - r)))))
    return losses, z0


def assert_list_close(tensor: torch.Tensor, values: list[float]):
    assert tensor.shape == (len(values),)
    for got, want in zip(tensor.tolist(), values):
        assert abs(got - want) < ATOL


def test_registry_keys_and_unknown_name():
    assert sorted(PREFERENCE_LOSSES) == ["cdpo", "dpo", "ipo", "kto"]
    with pytest.raises(KeyError) as err:
        PREFERENCE_LOSSES["simpo"]
    for name in ("cdpo", "dpo", "ipo", "kto"):
        assert name in str(err.value)


@pytest.mark.parametrize("b", SIZES)
@pytest.mark.parametrize(
    "name,cfg",
    [
        ("dpo", PreferenceConfig(beta=0.1)),
        ("dpo", PreferenceConfig(beta=0.5)),
        ("cdpo", PreferenceConfig(beta=0.1, label_smoothing=0.1)),
        ("cdpo", PreferenceConfig(beta=0.3, label_smoothing=0.4)),
        ("ipo", PreferenceConfig(beta=0.1)),
        ("ipo", PreferenceConfig(beta=1.0)),
    ],
)
def test_paired_losses_match_reference(name, cfg, b):
    x = make_paired(b, seed=b)
    out = PREFERENCE_LOSSES[name](x, cfg)
    losses, chosen, rejected = ref_paired(name, x, cfg)
    assert_list_close(out.losses, losses)
    assert_list_close(out.chosen_rewards, chosen)
    assert_list_close(out.rejected_rewards, rejected)
    assert out.kl is None


@pytest.mark.parametrize("bc,br,bk", [(1, 1, 1), (3, 5, 8), (16, 0, 16), (0, 7, 7)])
@pytest.mark.parametrize(
    "cfg", [PreferenceConfig(beta=0.1), PreferenceConfig(beta=0.5, desirable_weight=1.33, undesirable_weight=0.7)]
)
def test_kto_matches_reference(bc, br, bk, cfg):
    x = make_unpaired(bc, br, bk, seed=bc * 10 + br)
    out = PREFERENCE_LOSSES["kto"](x, cfg)
    losses, z0 = ref_kto(x, cfg)
    assert_list_close(out.losses, losses)
    assert abs(out.kl.item() - z0) < ATOL


def test_kto_reference_point_is_clamped_at_zero_and_detached():
    x = make_unpaired(2, 2, 4, seed=0)
    x.policy_kl_logps = (x.reference_kl_logps - 5.0).requires_grad_(True)
    out = PREFERENCE_LOSSES["kto"](x, PreferenceConfig())
    assert out.kl.item() == 0.0 and not out.kl.requires_grad


def test_gradients_flow_to_the_policy_only_through_losses():
    x = make_paired(4, seed=1)
    x.policy_chosen_logps.requires_grad_(True)
    out = PREFERENCE_LOSSES["dpo"](x, PreferenceConfig())
    assert not out.chosen_rewards.requires_grad
    out.losses.mean().backward()
    assert (x.policy_chosen_logps.grad < 0).all()  # raising the chosen log-prob lowers the loss


@pytest.mark.parametrize("name", ["dpo", "ipo", "kto"])
def test_label_smoothing_is_refused_outside_cdpo(name):
    x = make_unpaired(2, 2, 2, seed=0)
    with pytest.raises(ValueError, match="cdpo"):
        PREFERENCE_LOSSES[name](x, PreferenceConfig(label_smoothing=0.1))


@pytest.mark.parametrize("eps", [0.0, 0.5, -0.1])
def test_cdpo_needs_label_smoothing_in_open_interval(eps):
    with pytest.raises(ValueError, match="label_smoothing"):
        PREFERENCE_LOSSES["cdpo"](make_paired(2, 0), PreferenceConfig(label_smoothing=eps))


def test_paired_losses_refuse_unpaired_batches():
    with pytest.raises(ValueError, match="as many chosen"):
        PREFERENCE_LOSSES["dpo"](make_unpaired(2, 3, 2, seed=0), PreferenceConfig())


def test_kto_needs_kl_pairs():
    with pytest.raises(ValueError, match="kl"):
        PREFERENCE_LOSSES["kto"](make_paired(2, 0), PreferenceConfig())
