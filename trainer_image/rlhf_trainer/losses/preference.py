"""Offline preference losses against a frozen reference policy, keyed by algorithm name.

All log-probs are per response, summed over its tokens (IPO's authors and TRL length-normalize
them instead; pass per-token means if you want that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .aggregation import Registry


@dataclass
class PreferenceInputs:
    policy_chosen_logps: Tensor  # [Bc] log pi(y_w | x) of each chosen / desirable response
    policy_rejected_logps: Tensor  # [Br] log pi(y_l | x) of each rejected / undesirable one (paired: Br == Bc)
    reference_chosen_logps: Tensor  # [Bc] same under the reference policy
    reference_rejected_logps: Tensor  # [Br]
    policy_kl_logps: Tensor | None = None  # [Bk] KTO only: log pi of mismatched (x, y') pairs
    reference_kl_logps: Tensor | None = None  # [Bk] KTO only: same under the reference


@dataclass
class PreferenceConfig:
    beta: float = 0.1  # inverse temperature of the implicit reward (IPO: the regularization tau)
    label_smoothing: float = 0.0  # cdpo only: assumed probability that a preference label is flipped
    desirable_weight: float = 1.0  # kto only: lambda_D
    undesirable_weight: float = 1.0  # kto only: lambda_U


class PreferenceLoss(NamedTuple):
    losses: Tensor  # [B] per example (kto: [Bc + Br], desirable first); the caller takes the mean
    chosen_rewards: Tensor  # [Bc] beta * (log pi - log pi_ref) of chosen responses, detached
    rejected_rewards: Tensor  # [Br] same for rejected responses, detached
    kl: Tensor | None = None  # [] kto only: the reference point z_0 that was used, detached


PreferenceLossFn = Callable[[PreferenceInputs, PreferenceConfig], PreferenceLoss]
PREFERENCE_LOSSES: Registry[PreferenceLossFn] = Registry("preference loss")


def _implicit_rewards(inputs: PreferenceInputs, beta: float) -> tuple[Tensor, Tensor]:
    chosen = beta * (inputs.policy_chosen_logps - inputs.reference_chosen_logps)
    rejected = beta * (inputs.policy_rejected_logps - inputs.reference_rejected_logps)
    return chosen.detach(), rejected.detach()


def _margin(inputs: PreferenceInputs) -> Tensor:
    """``(log pi_w - log pi_ref_w) - (log pi_l - log pi_ref_l)`` per pair [B]."""
    if inputs.policy_chosen_logps.shape != inputs.policy_rejected_logps.shape:
        raise ValueError("paired preference losses need as many chosen as rejected responses")
    chosen = inputs.policy_chosen_logps - inputs.reference_chosen_logps
    rejected = inputs.policy_rejected_logps - inputs.reference_rejected_logps
    return chosen - rejected


def _no_label_smoothing(cfg: PreferenceConfig, name: str) -> None:
    if cfg.label_smoothing != 0.0:
        raise ValueError(f"{name} takes no label_smoothing (got {cfg.label_smoothing}); use cdpo")


def _sigmoid_loss(h: Tensor, beta: float, eps: float) -> Tensor:
    return -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)


@PREFERENCE_LOSSES.register("dpo")
def dpo_loss(inputs: PreferenceInputs, cfg: PreferenceConfig) -> PreferenceLoss:
    """``-log sigmoid(beta * margin)`` (Rafailov et al. 2023, arXiv 2305.18290)."""
    _no_label_smoothing(cfg, "dpo")
    return PreferenceLoss(_sigmoid_loss(_margin(inputs), cfg.beta, 0.0), *_implicit_rewards(inputs, cfg.beta))


@PREFERENCE_LOSSES.register("cdpo")
def cdpo_loss(inputs: PreferenceInputs, cfg: PreferenceConfig) -> PreferenceLoss:
    """Label-smoothed DPO ``-(1-e) log s(b h) - e log s(-b h)`` (Mitchell 2023, ericmitchell.ai/cdpo.pdf)."""
    if not 0.0 < cfg.label_smoothing < 0.5:
        raise ValueError(f"cdpo needs 0 < label_smoothing < 0.5, got {cfg.label_smoothing}")
    losses = _sigmoid_loss(_margin(inputs), cfg.beta, cfg.label_smoothing)
    return PreferenceLoss(losses, *_implicit_rewards(inputs, cfg.beta))


@PREFERENCE_LOSSES.register("ipo")
def ipo_loss(inputs: PreferenceInputs, cfg: PreferenceConfig) -> PreferenceLoss:
    """``(margin - 1 / (2 * beta))^2`` (Azar et al. 2023, arXiv 2310.12036)."""
    _no_label_smoothing(cfg, "ipo")
    losses = (_margin(inputs) - 1.0 / (2.0 * cfg.beta)) ** 2
    return PreferenceLoss(losses, *_implicit_rewards(inputs, cfg.beta))


@PREFERENCE_LOSSES.register("kto")
def kto_loss(inputs: PreferenceInputs, cfg: PreferenceConfig) -> PreferenceLoss:
    """``lambda_D (1 - s(b(r_w - z0)))``, ``lambda_U (1 - s(b(z0 - r_l)))`` (Ethayarajh et al. 2024, arXiv 2402.01306).

    ``z0 = max(0, mean(log pi - log pi_ref))`` over the mismatched KL pairs, detached; under data
    parallelism pass the pairs gathered from all ranks so every rank uses the same ``z0``.
    """
    _no_label_smoothing(cfg, "kto")
    if inputs.policy_kl_logps is None or inputs.reference_kl_logps is None:
        raise ValueError("kto needs policy_kl_logps and reference_kl_logps (mismatched pairs)")
    z0 = (inputs.policy_kl_logps - inputs.reference_kl_logps).mean().clamp(min=0).detach()
    chosen = inputs.policy_chosen_logps - inputs.reference_chosen_logps
    rejected = inputs.policy_rejected_logps - inputs.reference_rejected_logps
    losses = torch.cat(
        (
            cfg.desirable_weight * (1.0 - torch.sigmoid(cfg.beta * (chosen - z0))),
            cfg.undesirable_weight * (1.0 - torch.sigmoid(cfg.beta * (z0 - rejected))),
        )
    )
    return PreferenceLoss(losses, *_implicit_rewards(inputs, cfg.beta), kl=z0)
