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


# ---------------------------------------------------------------------------------------------
# TRL as an oracle (trl is a dev-only dependency; these tests skip without it)
#
# In TRL 1.16 the DPO, KTO and reward losses live inside `_compute_loss` / `compute_loss`, which
# run the model (TRL has no public loss functions). We call those real methods on trainer objects
# without their __init__ (conftest's trl_trainer), with a stub model that returns chosen per-token
# log-probs (zero outside the completion, as TRL's fused head returns for label -100) and
# precomputed reference log-probs. TRL returns the batch mean.
# Semantics that differ, and how each comparison lines them up:
# - DPO "sigmoid" in TRL 1.16 has no label smoothing. cDPO's formula appears in TRL only inside
#   "aot_unpaired", which first sorts chosen and rejected log-ratios independently; we feed pairs
#   already in that sorted order, where the sort is the identity and the formula is exactly cDPO.
#   (TRL's "robust" is rDPO, Chowdhury et al. 2024, a different, unbiased correction.)
# - TRL's "ipo" divides each log-ratio by its completion length; ours takes whatever log-probs it
#   is given, so we pass per-token means (sum / length) for the comparison.
# - KTO: TRL averages over the batch with nanmean; we return per-example losses (mean compared).
# ---------------------------------------------------------------------------------------------


def _stub_model(per_token_logps: torch.Tensor):
    import types

    def forward(**kwargs):
        return types.SimpleNamespace(
            log_probs=per_token_logps,
            entropy=torch.zeros_like(per_token_logps),
            mean_logits=torch.zeros_like(per_token_logps),
            is_top1=torch.zeros_like(per_token_logps, dtype=torch.bool),
            logits=per_token_logps,
        )

    return forward


def _completion_batch(n: int, t: int, gen: torch.Generator):
    """Per-token policy log-probs [n, t] (0 past each length), TRL masks [n, 1 + t], and lengths [n]."""
    lengths = torch.randint(1, t + 1, (n,), generator=gen)
    shifted = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    per_token = torch.where(shifted, -3 * torch.rand(n, t, generator=gen, dtype=torch.float64), 0.0)
    completion_mask = torch.cat([torch.zeros(n, 1, dtype=torch.long), shifted.long()], dim=1)
    return per_token, completion_mask, lengths


@pytest.mark.parametrize("b,t", [(1, 1), (4, 6), (16, 12)])
@pytest.mark.parametrize(
    "name,loss_type,cfg",
    [
        ("dpo", "sigmoid", PreferenceConfig(beta=0.1)),
        ("dpo", "sigmoid", PreferenceConfig(beta=0.7)),
        ("ipo", "ipo", PreferenceConfig(beta=0.1)),
        ("ipo", "ipo", PreferenceConfig(beta=0.5)),
        ("cdpo", "aot_unpaired", PreferenceConfig(beta=0.1, label_smoothing=0.1)),
        ("cdpo", "aot_unpaired", PreferenceConfig(beta=0.4, label_smoothing=0.3)),
    ],
)
def test_paired_losses_match_trl_dpo_trainer(name, loss_type, cfg, b, t, trl_trainer):
    from trl.trainer.dpo_trainer import DPOTrainer

    gen = torch.Generator().manual_seed(b * 100 + t)
    per_token, completion_mask, lengths = _completion_batch(2 * b, t, gen)
    ref = -3 * t * torch.rand(2 * b, generator=gen, dtype=torch.float64)
    if loss_type == "aot_unpaired":  # present chosen and rejected already sorted by log-ratio
        ratio = per_token.sum(1) - ref
        order = torch.cat([ratio[:b].argsort(), b + ratio[b:].argsort()])
        per_token, completion_mask, lengths, ref = per_token[order], completion_mask[order], lengths[order], ref[order]

    trainer = trl_trainer(
        DPOTrainer,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=cfg.beta,
        label_smoothing=cfg.label_smoothing,
        use_weighting=False,
    )
    inputs = {
        "input_ids": torch.ones(2 * b, 1 + t, dtype=torch.long),
        "attention_mask": torch.ones(2 * b, 1 + t, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref[:b],
        "ref_rejected_logps": ref[b:],
    }
    trl_loss = trainer._compute_loss(_stub_model(per_token), inputs, return_outputs=False)

    policy = per_token.sum(1)
    scale = lengths.to(policy.dtype) if name == "ipo" else torch.ones_like(policy)
    ours = PREFERENCE_LOSSES[name](
        PreferenceInputs(policy[:b] / scale[:b], policy[b:] / scale[b:], ref[:b] / scale[:b], ref[b:] / scale[b:]),
        cfg,
    )
    assert abs(ours.losses.mean().item() - trl_loss.item()) < ATOL
    if name != "ipo":  # TRL logs unnormalized rewards
        metrics = trainer._metrics["train"]
        assert abs(ours.chosen_rewards.mean().item() - metrics["rewards/chosen"][-1]) < ATOL
        assert abs(ours.rejected_rewards.mean().item() - metrics["rewards/rejected"][-1]) < ATOL


@pytest.mark.parametrize("n,t", [(2, 3), (9, 5), (24, 8)])
@pytest.mark.parametrize(
    "cfg", [PreferenceConfig(beta=0.1), PreferenceConfig(beta=0.3, desirable_weight=1.5, undesirable_weight=0.8)]
)
def test_kto_matches_trl_kto_trainer(n, t, cfg, trl_trainer):
    from trl.trainer.kto_trainer import KTOTrainer

    gen = torch.Generator().manual_seed(n * t)
    per_token, completion_mask, _ = _completion_batch(n, t, gen)
    labels = torch.rand(n, generator=gen) < 0.5
    labels[0], labels[-1] = True, False  # both kinds present
    ref = -3 * t * torch.rand(n, generator=gen, dtype=torch.float64)
    ref_kl = -3 * t * torch.rand(n, generator=gen, dtype=torch.float64)
    pol_kl = ref_kl + 4 * torch.randn(n, generator=gen, dtype=torch.float64) + 1.0

    trainer = trl_trainer(
        KTOTrainer,
        precompute_ref_logps=True,
        calculate_KL=True,
        loss_type="kto",
        beta=cfg.beta,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
        _compute_kl_logps=lambda model, batch: pol_kl,
    )
    inputs = {
        "input_ids": torch.ones(n, 1 + t, dtype=torch.long),
        "attention_mask": torch.ones(n, 1 + t, dtype=torch.long),
        "completion_mask": completion_mask,
        "label": labels,
        "ref_logps": ref,
        "ref_KL_logps": ref_kl,
    }
    trl_loss = trainer._compute_loss(_stub_model(per_token), inputs, return_outputs=False)

    policy = per_token.sum(1)
    ours = PREFERENCE_LOSSES["kto"](
        PreferenceInputs(policy[labels], policy[~labels], ref[labels], ref[~labels], pol_kl, ref_kl), cfg
    )
    assert abs(ours.losses.mean().item() - trl_loss.item()) < ATOL
    assert abs(ours.kl.item() - trainer._metrics["train"]["kl"][-1]) < ATOL
    assert abs(ours.chosen_rewards.mean().item() - trainer._metrics["train"]["rewards/chosen"][-1]) < ATOL


@pytest.mark.parametrize("b", [1, 5, 32])
@pytest.mark.parametrize("with_margin", [False, True])
def test_pairwise_reward_loss_matches_trl_reward_trainer(b, with_margin, trl_trainer):
    import types

    from trl.trainer.reward_trainer import RewardTrainer

    from rlhf_trainer.losses import pairwise_reward_loss, reward_accuracy

    gen = torch.Generator().manual_seed(b)
    scores = 3 * torch.randn(2 * b, 1, generator=gen, dtype=torch.float64)  # [chosen; rejected]
    trainer = trl_trainer(RewardTrainer, args=types.SimpleNamespace(center_rewards_coefficient=None))
    inputs = {"attention_mask": torch.ones(2 * b, 3, dtype=torch.long)}
    margin = torch.rand(b, generator=gen, dtype=torch.float64) if with_margin else None
    if with_margin:
        inputs["margin"] = margin
    trl_loss = trainer.compute_loss(_stub_model(scores), inputs)
    chosen, rejected = scores[:b, 0], scores[b:, 0]
    assert abs(pairwise_reward_loss(chosen, rejected, margin).item() - trl_loss.item()) < ATOL
    assert abs(reward_accuracy(chosen, rejected).item() - trainer._metrics["train"]["accuracy"][-1]) < ATOL


@pytest.mark.parametrize("b,t", [(1, 1), (4, 6), (16, 12)])
def test_sft_nll_matches_trl_dpo_sft_term(b, t, trl_trainer):
    """TRL's DPO "sft" loss type is the token-mean NLL of the chosen completions."""
    from trl.trainer.dpo_trainer import DPOTrainer

    from rlhf_trainer.losses import sft_loss

    gen = torch.Generator().manual_seed(b + t)
    per_token, completion_mask, _ = _completion_batch(2 * b, t, gen)
    trainer = trl_trainer(
        DPOTrainer, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=["sft"], loss_weights=[1.0], beta=0.1, label_smoothing=0.0, use_weighting=False,
    )
    inputs = {
        "input_ids": torch.ones(2 * b, 1 + t, dtype=torch.long),
        "attention_mask": torch.ones(2 * b, 1 + t, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": torch.zeros(b, dtype=torch.float64),
        "ref_rejected_logps": torch.zeros(b, dtype=torch.float64),
    }
    trl_loss = trainer._compute_loss(_stub_model(per_token), inputs, return_outputs=False)
    ours = sft_loss(per_token[:b], completion_mask[:b, 1:].bool(), "token-mean")
    assert abs(ours.item() - trl_loss.item()) < ATOL
