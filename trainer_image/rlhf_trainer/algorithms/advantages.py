"""Advantage estimators: one small function each, one signature, one registry.

Every estimator is ``estimator(inputs: AdvantageInputs, cfg: AdvantageConfig) -> (advantages, returns)``
with both outputs ``[B, T]`` and 0 outside ``action_mask``. The per-token reward they all start from is
``r_t = -kl_penalty_t`` plus the (possibly group-shaped) sequence reward on the last response token
(reverse-kl adds the teacher's term to every token). best-of-n and dpo-pairs pick samples by it and
return advantages of their own: 0 on every token of a sample they do not train on.
``returns`` are never whitened: for ``gae`` they are the critic's targets, otherwise metrics.

Grouped estimators read the batch as prompt-major: ``B = n_prompts * n_samples_per_prompt`` with the
``n`` samples of one prompt adjacent (rows ``p*n .. p*n + n - 1``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..losses.aggregation import Registry, masked_whiten
from ..losses.preference import PreferenceConfig, PreferenceInputs, dpo_loss


@dataclass
class AdvantageInputs:
    """What every advantage estimator reads."""

    rewards: Tensor  # [B] sequence-level reward of each response (reward model / function output)
    action_mask: Tensor  # [B, T] 1 on response tokens, 0 on padding (right-padded)
    kl_penalty: Tensor | None = None  # [B, T] coef * kl per token, already scaled; subtracted from r_t
    values: Tensor | None = None  # [B, T] critic values V(s_t) at the response tokens (gae only)
    n_samples_per_prompt: int = 1  # group size n; rows are prompt-major: B = n_prompts * n
    log_ratio: Tensor | None = None  # [B, T] log pi_actor - log pi_ref at sampling time (dpo-pairs only)
    teacher_log_ratio: Tensor | None = None  # [B, T] log pi_actor - log pi_teacher of the sampled tokens (reverse-kl)


@dataclass
class AdvantageConfig:
    """Knobs shared by the estimators."""

    gamma: float = 1.0  # discount
    lambd: float = 0.95  # GAE lambda (gae only)
    whiten: bool | None = None  # whiten advantages over the batch's tokens; None: the estimator's default
    eps: float = 1e-8  # added to the group std (group-norm) and to the variance (whitening)
    unbiased_std: bool = True  # Bessel-corrected std/variance (torch.std's default, as GRPO code uses)
    keep_per_prompt: int = 1  # best-of-n: the best samples of each group kept
    min_reward: float | None = None  # best-of-n: a kept sample's least reward
    beta: float = 0.1  # dpo-pairs: DPO's inverse temperature
    teacher_coef: float = 1.0  # reverse-kl: the per-token reverse KL's weight in the reward (0: the teacher is in the loss)
    reward_coef: float = 0.0  # reverse-kl: the sequence reward's weight


Estimator = Callable[[AdvantageInputs, AdvantageConfig], "tuple[Tensor, Tensor]"]
ADVANTAGE_ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")
# The estimators that read the actor's log-probs of the rollout (a log-ratio): the trainer scores
# them before the update for these (trainer.actor_scored_in_update).
READS_ACTOR_LOG_PROBS: set[str] = set()


def register_advantage(name: str, reads_actor_log_probs: bool = False) -> Callable[[Estimator], Estimator]:
    """Decorator adding an estimator to ``ADVANTAGE_ESTIMATORS`` under ``name``; reads_actor_log_probs:
    it reads ``log_ratio`` or ``teacher_log_ratio``."""
    if reads_actor_log_probs:
        READS_ACTOR_LOG_PROBS.add(name)
    return ADVANTAGE_ESTIMATORS.register(name)


def compute_advantages(
    estimator: str, inputs: AdvantageInputs, cfg: AdvantageConfig | None = None
) -> tuple[Tensor, Tensor]:
    """Run the named estimator; returns ``(advantages [B, T], returns [B, T])``."""
    return ADVANTAGE_ESTIMATORS[estimator](inputs, cfg or AdvantageConfig())


# ---------------------------------------------------------------------------------------------
# shared steps
# ---------------------------------------------------------------------------------------------


def token_rewards(seq_rewards: Tensor, action_mask: Tensor, kl_penalty: Tensor | None) -> Tensor:
    """``[B, T]`` per-token rewards: ``-kl_penalty`` everywhere, plus ``seq_rewards`` on the last valid token."""
    mask = action_mask.to(seq_rewards.dtype)
    rewards = torch.zeros_like(mask) if kl_penalty is None else -kl_penalty.to(mask.dtype)
    last = mask.shape[1] - 1 - mask.flip(dims=[1]).argmax(dim=1)  # [B] index of the last 1
    rewards = rewards.scatter_add(1, last.unsqueeze(1), seq_rewards.unsqueeze(1).to(mask.dtype))
    return rewards * mask  # an empty response (no valid token) gets no reward


def discounted_returns(rewards: Tensor, action_mask: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_{t'}`` right to left over the policy's tokens (t' the next one), ``[B, T]``,
    0 outside the mask: the tokens between two policy tokens (an environment's observation in a
    multi-turn episode) are part of the transition, not steps of their own."""
    mask = action_mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


def _groups(inputs: AdvantageInputs, name: str) -> Tensor:
    """Sequence rewards viewed as ``[n_prompts, n]``; refuses groups too small to have a baseline."""
    n = inputs.n_samples_per_prompt
    batch = inputs.rewards.shape[0]
    if n < 2 or batch % n:
        raise ValueError(
            f"{name} needs n_samples_per_prompt >= 2 dividing the batch size, got n={n}, B={batch}"
        )
    return inputs.rewards.reshape(-1, n)


def _finish(
    advantages: Tensor, returns: Tensor, mask: Tensor, cfg: AdvantageConfig, whiten_by_default: bool
) -> tuple[Tensor, Tensor]:
    whiten = whiten_by_default if cfg.whiten is None else cfg.whiten
    mask = mask.to(advantages.dtype)
    if whiten:
        advantages = masked_whiten(advantages, mask, eps=cfg.eps, unbiased=cfg.unbiased_std)
    return advantages * mask, returns * mask


def _from_sequence_rewards(
    seq_rewards: Tensor, inputs: AdvantageInputs, cfg: AdvantageConfig, whiten_by_default: bool
) -> tuple[Tensor, Tensor]:
    """Critic-free estimators: the advantage of token t is the discounted return from t."""
    rewards = token_rewards(seq_rewards, inputs.action_mask, inputs.kl_penalty)
    returns = discounted_returns(rewards, inputs.action_mask, cfg.gamma)
    return _finish(returns.clone(), returns, inputs.action_mask, cfg, whiten_by_default)


# ---------------------------------------------------------------------------------------------
# estimators
# ---------------------------------------------------------------------------------------------


@register_advantage("gae")
def gae(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation with a critic (Schulman et al. 2015, arXiv 1506.02438); whitens by default."""
    if inputs.values is None:
        raise ValueError("gae needs critic values (inputs.values), got None")
    mask = inputs.action_mask.to(inputs.values.dtype)
    values = inputs.values * mask
    rewards = token_rewards(inputs.rewards, inputs.action_mask, inputs.kl_penalty)
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):  # masked tokens (observations, padding) are skipped
        acting = mask[:, t] > 0
        delta = rewards[:, t] + cfg.gamma * next_value - values[:, t]
        running = torch.where(acting, delta + cfg.gamma * cfg.lambd * running, running)
        advantages[:, t] = running
        next_value = torch.where(acting, values[:, t], next_value)
    returns = advantages + values
    return _finish(advantages, returns, mask, cfg, whiten_by_default=True)


@register_advantage("reinforce++")
def reinforce_pp(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted return, whitened over the batch (Hu 2025, arXiv 2501.03262)."""
    return _from_sequence_rewards(inputs.rewards, inputs, cfg, whiten_by_default=True)


@register_advantage("reinforce++-baseline")
def reinforce_pp_baseline(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline: group-mean baseline, then batch whitening (Hu 2025, arXiv 2501.03262)."""
    groups = _groups(inputs, "reinforce++-baseline")
    shaped = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    return _from_sequence_rewards(shaped, inputs, cfg, whiten_by_default=True)


@register_advantage("group-norm")
def group_norm(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """GRPO: ``(r - mean_group) / (std_group + eps)`` (Shao et al. 2024, arXiv 2402.03300)."""
    groups = _groups(inputs, "group-norm")
    std = groups.std(dim=1, keepdim=True, unbiased=cfg.unbiased_std)
    shaped = ((groups - groups.mean(dim=1, keepdim=True)) / (std + cfg.eps)).reshape(-1)
    return _from_sequence_rewards(shaped, inputs, cfg, whiten_by_default=False)


@register_advantage("dr-grpo")
def dr_grpo(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """Dr. GRPO: ``r - mean_group``, no std division (Liu et al. 2025, arXiv 2503.20783)."""
    groups = _groups(inputs, "dr-grpo")
    shaped = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    return _from_sequence_rewards(shaped, inputs, cfg, whiten_by_default=False)


@register_advantage("rloo")
def rloo(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """RLOO: ``r_i - mean_{j != i} r_j`` (Ahmadian et al. 2024, arXiv 2402.14740)."""
    groups = _groups(inputs, "rloo")
    n = groups.shape[1]
    leave_one_out = (groups.sum(dim=1, keepdim=True) - groups) / (n - 1)
    shaped = (groups - leave_one_out).reshape(-1)
    return _from_sequence_rewards(shaped, inputs, cfg, whiten_by_default=False)


def _ranked(inputs: AdvantageInputs, n: int) -> tuple[Tensor, Tensor]:
    """Per-token rewards [B, T] and what ranks a group's samples: their sum, [n_prompts, n]."""
    rewards = token_rewards(inputs.rewards, inputs.action_mask, inputs.kl_penalty)
    return rewards, rewards.sum(dim=1).reshape(-1, n)


@register_advantage("best-of-n")
def best_of_n(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """Rejection sampling (RAFT, Dong et al. 2023, arXiv 2304.06767): 1 on every token of each group's
    ``keep_per_prompt`` best samples, 0 elsewhere; the policy loss is then their likelihood.

    Samples rank by their reward less the KL penalty in the reward (summed over their tokens). A sample
    no better than its group's worst is never kept, so a group whose samples all score alike trains
    nothing (as with every group-relative estimator); with ``min_reward``, neither does one whose
    reward is below it. Returns are the discounted returns (metrics).
    """
    n = _groups(inputs, "best-of-n").shape[1]
    rewards, scores = _ranked(inputs, n)
    # Each sample's place in its group, best first; the first of equal samples ranks first.
    rank = torch.sort(scores, dim=1, descending=True, stable=True).indices.argsort(dim=1)
    kept = (rank < cfg.keep_per_prompt) & (scores > scores.amin(dim=1, keepdim=True))
    if cfg.min_reward is not None:
        kept &= inputs.rewards.reshape(-1, n) >= cfg.min_reward
    returns = discounted_returns(rewards, inputs.action_mask, cfg.gamma)
    advantages = kept.reshape(-1, 1).to(returns.dtype).expand_as(returns)
    return _finish(advantages, returns, inputs.action_mask, cfg, whiten_by_default=False)


@register_advantage("dpo-pairs", reads_actor_log_probs=True)
def dpo_pairs(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """Online DPO (Xiong et al. 2024, arXiv 2312.11456; Guo et al. 2024, arXiv 2402.04792): each group's
    best sample is chosen against its worst (the first of equals; a group that scores alike has no
    pair), and each sample's advantage is minus DPO's gradient with respect to its summed log-ratio to
    the reference, times the batch's rows, on every token. With the nll policy loss aggregated
    seq-mean-token-sum over those rows, the update's gradient is the DPO loss's mean over the pairs
    (losses.preference.dpo_loss), exactly, while the policy is the one whose log-ratio was read.
    """
    if inputs.log_ratio is None:
        raise ValueError("dpo-pairs needs the policy's log-ratio to the reference (inputs.log_ratio), got None")
    n = _groups(inputs, "dpo-pairs").shape[1]
    rewards, scores = _ranked(inputs, n)
    returns = discounted_returns(rewards, inputs.action_mask, cfg.gamma)
    paired = scores.amax(dim=1) > scores.amin(dim=1)
    first = torch.arange(scores.shape[0]) * n
    chosen, rejected = (first + scores.argmax(dim=1))[paired], (first + scores.argmin(dim=1))[paired]
    sequence_log_ratio = (inputs.log_ratio * inputs.action_mask).sum(dim=1).detach().requires_grad_()
    weights = torch.zeros_like(sequence_log_ratio)
    if paired.any():
        with torch.enable_grad():
            reference = torch.zeros(len(chosen), dtype=sequence_log_ratio.dtype)  # already in the log-ratio
            pairs = PreferenceInputs(sequence_log_ratio[chosen], sequence_log_ratio[rejected], reference, reference)
            loss = dpo_loss(pairs, PreferenceConfig(beta=cfg.beta)).losses.mean()
            (gradient,) = torch.autograd.grad(loss, sequence_log_ratio)
        weights = -gradient * len(weights)
    advantages = weights.unsqueeze(1).expand_as(returns)
    return _finish(advantages, returns, inputs.action_mask, cfg, whiten_by_default=False)


@register_advantage("reverse-kl", reads_actor_log_probs=True)
def reverse_kl(inputs: AdvantageInputs, cfg: AdvantageConfig) -> tuple[Tensor, Tensor]:
    """On-policy distillation (Agarwal et al. 2024, GKD, arXiv 2306.13649; Gu et al. 2024, MiniLLM, arXiv
    2306.08543): each sampled token's reward is ``-teacher_coef * (log pi_actor - log pi_teacher)``, whose
    expectation under the actor's sampling is minus the reverse KL to the teacher, plus ``reward_coef``
    times the sequence reward on the last token; the advantage is the discounted return (gamma 1: the
    policy gradient of the whole sequence's reverse KL), not whitened. ``teacher_coef`` 0: the teacher's
    divergence is in the actor's loss instead (GKD, training.distillation.jsdBeta), the reward alone here.
    """
    rewards = token_rewards(cfg.reward_coef * inputs.rewards, inputs.action_mask, inputs.kl_penalty)
    if cfg.teacher_coef:
        if inputs.teacher_log_ratio is None:
            raise ValueError("reverse-kl needs the teacher's log-ratio (inputs.teacher_log_ratio), got None")
        rewards = rewards - cfg.teacher_coef * inputs.teacher_log_ratio * inputs.action_mask.to(rewards.dtype)
    returns = discounted_returns(rewards, inputs.action_mask, cfg.gamma)
    return _finish(returns.clone(), returns, inputs.action_mask, cfg, whiten_by_default=False)
