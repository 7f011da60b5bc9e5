"""The training steps: each trains one micro-batch on one rank, `step(model, batch, **options) -> metrics`.

- online (trainer.py): `policy_step` (the actor, with the policy loss the catalogue names for the
  algorithm: losses.POLICY_LOSSES) and `value_step` (the critic) on
  experience.Experience micro-batches;
- offline (offline.py): OFFLINE_STEPS, keyed by offline.Objective.step, on offline_data.OfflineBatch
  micro-batches: sft, kd, preference (dpo, ipo, cdpo, kto), pairwise (rm) and process (prm).

Each step calls Model.backward_step once: DeepSpeed steps the optimizer every trainBatchSize /
(microTrainBatchSize * ranks) micro-batches (its gradient accumulation). The online losses are
aggregated by training.lossAggregation with the normalizer NORMALIZERS gives it.
"""

from __future__ import annotations

from typing import Callable, Sequence

from torch import Tensor

from ..algorithms.kl import compute_kl, kl_in_loss
from ..experience import Experience
from ..losses import (
    POLICY_LOSSES,
    PREFERENCE_LOSSES,
    PreferenceConfig,
    PreferenceInputs,
    Registry,
    aggregate_loss,
    entropy_bonus,
    entropy_from_logits,
    masked_mean,
    masked_sum,
    pairwise_reward_loss,
    policy_loss,
    process_reward_loss,
    reward_accuracy,
    sft_loss,
    step_accuracy,
    token_log_probs,
    top_k_divergence,
    truncated_is_weights,
    value_loss,
)
from ..offline_data import OfflineBatch
from .engine import Model

Step = Callable[..., "dict[str, float]"]  # (model, micro-batch, **options) -> metrics
Batch = Experience | OfflineBatch
OFFLINE_STEPS: Registry[Step] = Registry("offline training step")
# The normalizer of each loss aggregation that takes one: (model, micro-batch) -> aggregate_loss's normalizer.
NORMALIZERS: Registry[Callable[[Model, Batch], "float | None"]] = Registry("loss normalizer")


def mean_over_micro_batches(model: Model, step: Step, micro_batches: Sequence, **options) -> dict[str, float]:
    """`step` on each micro-batch (moved to the model's device) in turn; the mean of their metrics."""
    totals: dict[str, float] = {}
    for batch in micro_batches:
        for key, value in step(model, batch.to(model.device), **options).items():
            totals[key] = totals.get(key, 0.0) + value
    return {key: value / len(micro_batches) for key, value in totals.items()}


# -- online: the actor and the critic ------------------------------------------------------------


@NORMALIZERS.register("token-mean")
def step_token_count(model: Model, exp: Batch) -> float:
    """The valid tokens of the whole optimizer step, across micro-batches and ranks, as this
    micro-batch's divisor: every token of the step weighs the same (DAPO, Yu et al. 2025, arXiv 2503.14476)."""
    return model.micro_batch_divisor(float(exp.step_tokens[0]))


@NORMALIZERS.register("seq-mean-token-sum-norm")
def generation_budget(model: Model, exp: Batch) -> float | None:
    """The constant rollout.maxNewTokens (Dr. GRPO's generation budget, Liu et al. 2025, arXiv 2503.20783)."""
    return model.cfg.max_new_tokens


def aggregation(model: Model, exp: Batch) -> tuple[str, float | None]:
    """training.lossAggregation and its normalizer for this micro-batch (None: the mode needs none)."""
    mode = model.cfg.training.loss_aggregation
    normalizer = NORMALIZERS.get(mode)
    return mode, normalizer(model, exp) if normalizer else None


def policy_step(model: Model, exp: Experience) -> dict[str, float]:
    """The algorithm's policy loss (with training.kl in the loss when placed there, and the entropy bonus).
    Without exp.action_log_probs (one optimizer step per rollout) this forward's log-probs, detached, are
    the policy's before the update (the weights have not moved yet): the ratio is 1, the gradient the
    policy gradient, and the metrics the trainer reads from them (logprob_diff, kl) come from here."""
    training = model.cfg.training
    mode, normalizer = aggregation(model, exp)
    targets, teacher = exp.sequences[:, -exp.num_actions:], exp.teacher_logps is not None
    reads = [lambda logits, at: token_log_probs(logits, targets[at]),
             lambda logits, at: entropy_from_logits(logits if training.entropy_coef else logits.detach())]
    if teacher:  # distill with training.distillation.jsdBeta: GKD's divergence in the loss
        reads.append(lambda logits, at: top_k_divergence(logits, exp.teacher_logps[at], exp.teacher_ids[at],
                                                         training.distillation.jsd_beta))
    # Per-token reads, not the logits: under sequence parallelism no rank holds a whole row's logits.
    log_probs, entropy, *divergence = model.action_reads(exp.sequences, exp.attention_mask, exp.num_actions, *reads,
                                                         vision=exp.vision)
    scored_here = exp.action_log_probs is None
    old_log_probs = log_probs.detach() if scored_here else exp.action_log_probs
    per_token = POLICY_LOSSES[model.cfg.policy_loss](
        log_probs, old_log_probs, exp.advantages, exp.action_mask, training)
    correction = {}
    if training.rollout_correction_cap is not None:
        tis = truncated_is_weights(old_log_probs, exp.rollout_log_probs, exp.action_mask,
                                   training.rollout_correction_cap)
        token_loss, *flags = per_token  # the TIS-weighted loss of Yao et al. 2025: each token's loss times its weight
        per_token = (token_loss * tis.weights, *flags)
        correction = {"rollout_correction_clipped_fraction": float(tis.clipped_fraction)}
    policy = policy_loss(per_token, log_probs, old_log_probs, exp.action_mask, mode, normalizer)
    loss = policy.loss
    metrics = policy.metrics()  # loss, clip_fraction, dual_clip_fraction, approx_kl
    metrics["policy_loss"] = metrics.pop("loss")
    metrics.update(correction)
    if scored_here and exp.rollout_log_probs is not None:
        metrics["logprob_diff"] = float(masked_mean((exp.rollout_log_probs - old_log_probs).abs(), exp.action_mask))
    if training.kl.placement == "loss" and exp.base_action_log_probs is not None:
        kl = compute_kl(log_probs, exp.base_action_log_probs, exp.action_mask, training.kl.estimator)
        loss = loss + kl_in_loss(kl, training.kl.coef, exp.action_mask, mode, normalizer)
        if scored_here:
            metrics["kl"] = float(masked_mean(kl.detach(), exp.action_mask))
    if training.entropy_coef:
        loss = loss + entropy_bonus(entropy, exp.action_mask, training.entropy_coef, mode, normalizer)
    metrics["entropy"] = float(masked_mean(entropy.detach(), exp.action_mask))
    if teacher:
        distillation, divergence = training.distillation, divergence[0]
        loss = loss + distillation.kl_coef * aggregate_loss(divergence, exp.action_mask, mode, normalizer)
        metrics[teacher_metric(distillation.jsd_beta)] = float(masked_mean(divergence.detach(), exp.action_mask))
    model.backward_step(loss)
    return metrics


def value_step(model: Model, exp: Experience) -> dict[str, float]:
    """The clipped value loss against the returns."""
    mode, normalizer = aggregation(model, exp)
    values = model.action_values(exp.sequences, exp.attention_mask, exp.num_actions)
    result = value_loss(values, exp.values, exp.returns, exp.action_mask, clip_eps=model.cfg.training.value_clip,
                        aggregation=mode, normalizer=normalizer)
    model.backward_step(result.loss)
    metrics = result.metrics()
    return {"value_loss": metrics["loss"], "value_clip_fraction": metrics["clip_fraction"]}


# -- offline -------------------------------------------------------------------------------------


@OFFLINE_STEPS.register("sft")
def sft_step(model: Model, batch: OfflineBatch) -> dict[str, float]:
    """Token NLL of the responses only (the prompt is context, not a target)."""
    log_probs = model.action_log_probs(batch.sequences, batch.attention_mask, batch.num_actions, batch.vision)
    loss = sft_loss(log_probs, batch.action_mask, *aggregation(model, batch))
    model.backward_step(loss)
    return {"loss": loss.item()}


@OFFLINE_STEPS.register("kd")
def kd_step(model: Model, batch: OfflineBatch, kl_coef: float, beta: float) -> dict[str, float]:
    """The response's NLL plus kl_coef times the divergence (forward KL at beta 0, GKD's JSD above) from the
    teacher's top-k next-token distributions (the batch's teacher_logps and teacher_ids), both aggregated by
    training.lossAggregation."""
    logits = model.action_logits(batch.sequences, batch.attention_mask, batch.num_actions)
    mode, normalizer = aggregation(model, batch)
    nll = sft_loss(token_log_probs(logits, batch.sequences[:, -batch.num_actions:]), batch.action_mask, mode, normalizer)
    divergence = aggregate_loss(top_k_divergence(logits, batch.teacher_logps, batch.teacher_ids, beta),
                                batch.action_mask, mode, normalizer)
    loss = nll + kl_coef * divergence
    model.backward_step(loss)
    return {"loss": loss.item(), teacher_metric(beta): divergence.item()}


def teacher_metric(beta: float) -> str:
    """The metric of the divergence from the teacher's distributions: teacher_kl (forward, beta 0) or teacher_jsd."""
    return "teacher_jsd" if beta else "teacher_kl"


@OFFLINE_STEPS.register("preference")
def preference_step(model: Model, batch: OfflineBatch, loss: str, config: PreferenceConfig) -> dict[str, float]:
    """PREFERENCE_LOSSES[loss] on summed response log-probs of the desirable (chosen) and the
    other rows (pairs keep their order on both sides); kto also reads the batch's kl_logps."""
    log_probs = model.action_log_probs(batch.sequences, batch.attention_mask, batch.num_actions, batch.vision)
    logps = masked_sum(log_probs, batch.action_mask, dim=-1)
    good, reference = batch.desirable, batch.reference_logps
    kl = (batch.kl_logps[0:1], batch.kl_logps[1:2]) if batch.kl_logps is not None else (None, None)
    inputs = PreferenceInputs(logps[good], logps[~good], reference[good], reference[~good], *kl)
    result = PREFERENCE_LOSSES[loss](inputs, config)
    total = result.losses.mean()
    model.backward_step(total)
    metrics = {"loss": total.item(), **_pair_metrics(result.chosen_rewards, result.rejected_rewards)}
    if result.kl is not None:
        metrics["kto_reference_point"] = result.kl.item()
    return metrics


@OFFLINE_STEPS.register("pairwise")
def pairwise_step(model: Model, batch: OfflineBatch) -> dict[str, float]:
    """Bradley-Terry loss on the reward model's scores, read at each sequence's last token."""
    chosen, rejected = model.last_token_scores(batch.sequences, batch.attention_mask).chunk(2)
    loss = pairwise_reward_loss(chosen, rejected)
    model.backward_step(loss)
    return {"loss": loss.item(), **_pair_metrics(chosen.detach(), rejected.detach())}


@OFFLINE_STEPS.register("process")
def process_step(model: Model, batch: OfflineBatch) -> dict[str, float]:
    """The reward model's score at the end of each step against the step's label (1 correct, 0 wrong), with
    the binary cross-entropy of its sigmoid, the loss nowhere else (Lightman et al. 2023, arXiv:2305.20050;
    Wang et al. 2024, Math-Shepherd, arXiv:2312.08935): the sigmoid is the probability that the step is correct."""
    labelled = batch.step_labels >= 0
    scores = model.response_scores(batch.sequences, batch.attention_mask, batch.num_actions)[labelled]
    labels = batch.step_labels[labelled]
    loss = process_reward_loss(scores, labels)
    model.backward_step(loss)
    return {"loss": loss.item(), "step_accuracy": step_accuracy(scores.detach(), labels).item()}


def _pair_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, float]:
    """Implicit (dpo) or model (rm) rewards of chosen and rejected responses: accuracy and margin
    (unpaired kto batches: the margin of the means, no accuracy; a side a batch lacks counts 0)."""
    chosen_mean = chosen.float().mean().item() if chosen.numel() else 0.0
    rejected_mean = rejected.float().mean().item() if rejected.numel() else 0.0
    metrics = {"reward_margin": chosen_mean - rejected_mean, "chosen_reward": chosen_mean,
               "rejected_reward": rejected_mean}
    if chosen.shape == rejected.shape:
        metrics["reward_accuracy"] = reward_accuracy(chosen.float(), rejected.float()).item()
    return metrics
