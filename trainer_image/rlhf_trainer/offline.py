"""The offline algorithms (the catalogue's entries trained on a dataset: no rollouts, no vLLM), by objective.

Each step is one optimizer step over training.trainBatchSize examples (pairs, for the preference
algorithms), split evenly over the trained group's ranks and into microTrainBatchSize
micro-batches; training.epochs passes over the dataset, capped by training.maxSteps.

- sft: token NLL of the response (the prompt masked out), data.sft records; csft the same on prompts that
  carry each record's score (data.scoreTemplate with data.sft.scoreKey); kd the same plus the forward KL
  (or training.distillation.jsdBeta's divergence) to the teacher's next-token distributions at the response's
  tokens (its top-k, losses/distillation.py).
- dpo, ipo, cdpo: the actor against a frozen reference (spec.models.reference, else the actor's
  initial weights) on the summed log-probs of chosen and rejected responses, with
  losses.PREFERENCE_LOSSES[algorithm]; data.preferences pairs.
- kto: the same with losses.kto_loss on desirable/undesirable responses (records with a
  desirable flag in labelKey, or pairs), its reference point z0 from mismatched pairs of each step.
- rm: a sequence classifier (spec.models.actor, a fresh score head if it is a causal LM) scored
  at the last token of prompt + response + eos, as rewards/model.py reads it, with the pairwise
  (Bradley-Terry) loss; exported in Hugging Face format, ready to serve as spec.models.reward.
- prm: the same classifier read at the end of each step of a solution (data.sft records: a list of
  steps and a label for each, joined by data.stepSeparator), with the binary cross-entropy against
  each step's label; served as spec.models.reward to a source that reads it step by step (steps).

The loop (batches, checkpoints, resuming) is loop.RunLoop's, shared with the online trainer. An
algorithm's training step is found as catalogue objective key -> OBJECTIVES[key].step ->
workers.objectives.OFFLINE_STEPS[step], a function each rank runs on every micro-batch.

Metrics (api.Metrics names where they exist): loss, learning_rate, epoch, <role>/grad_norm,
time/experience (reference log-probs, the teacher's distributions), time/update, time/step; kd also
teacher_kl; the preference algorithms and rm reward_accuracy, reward_margin, chosen_reward, rejected_reward; prm
step_accuracy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator

import ray
import torch

from rlhf_api.algorithms import TAKES_IMAGES, prose
from rlhf_api.planning.placement import Placement
from rlhf_api.v1alpha1 import RLHFJob, RLHFJobSpec

from .data import PromptLoader
from .loop import RunLoop
from .losses import PreferenceConfig, masked_sum
from .offline_data import OfflineBatch, OfflineDataset, OfflineExample, mismatched, pack, with_step_tokens
from .workers.group import mean_metrics


@dataclass(frozen=True)
class Objective:
    """How an offline objective reads its records and trains (the catalogue names one per algorithm)."""

    response_keys: Callable  # DatasetSpec -> the record keys of the responses
    step: str  # workers.objectives.OFFLINE_STEPS key: the function training one micro-batch
    options: Callable[[RLHFJobSpec], dict]  # the objective's options
    flag_key: Callable = lambda d: None  # DatasetSpec -> the record key of a desirable flag
    kl_pairs: bool = False  # kto: the reference point from mismatched (prompt, response) pairs


def _preference_options(spec: RLHFJobSpec) -> dict:
    p = spec.training.preference
    config = PreferenceConfig(beta=p.beta, label_smoothing=p.label_smoothing,
                              desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight)
    return {"loss": spec.algorithm, "config": config}


def _pair(d) -> tuple[str, str]:
    return d.chosen_key, d.rejected_key


# The catalogue's `objective` keys (rlhf_api.algorithms: AlgorithmInfo.objective).
OBJECTIVES: dict[str, Objective] = {
    "sft": Objective(lambda d: (d.output_key,), step="sft", options=lambda spec: {}),
    "preference": Objective(_pair, step="preference", options=_preference_options),
    "pairwise": Objective(_pair, step="pairwise", options=lambda spec: {}),
    # prm: records {inputKey, outputKey: [steps], labelKey: [labels]} (offline_data, step_labelled)
    "process": Objective(lambda d: (d.output_key,), step="process", options=lambda spec: {}),
    "kd": Objective(lambda d: (d.output_key,), step="kd",
                    options=lambda spec: {"kl_coef": spec.training.distillation.kl_coef,
                                          "beta": spec.training.distillation.jsd_beta or 0.0}),
    # kto: records {input, outputKey, labelKey: desirable flag}; without labelKey, pairs (each one
    # desirable and one undesirable response).
    "kto": Objective(lambda d: (d.output_key,) if d.label_key else _pair(d), step="preference",
                     options=_preference_options, flag_key=lambda d: d.label_key, kl_pairs=True),
}


class OfflineTrainer(RunLoop):
    data_key = "data"

    def __init__(self, job: RLHFJob, placement: Placement, **options):
        """options: base_dir, output_dir and reporter (see RunLoop)."""
        super().__init__(job, placement, **options)
        self.objective = OBJECTIVES[self.algorithm.objective]
        data_spec = getattr(self.spec.data, self.algorithm.dataset)
        dataset = OfflineDataset.from_spec(
            data_spec, self.spec.data, self.tokenizer, response_keys=self.objective.response_keys(data_spec),
            base_dir=self.base_dir, seed=self.training.seed, name=self.algorithm.dataset,
            flag_key=self.objective.flag_key(data_spec), conditioned_on_score=self.algorithm.conditioned,
            step_labelled=self.algorithm.step_labelled)
        if (with_images := sum(e.vision is not None for e in dataset.items)) and not self.algorithm.images:
            raise ValueError(f"data.{self.algorithm.dataset}: {with_images} records have images, and "
                             f"{self.algorithm.name} does not take images: use one of {prose(TAKES_IMAGES)}")
        if len(dataset) < self.training.train_batch_size:
            raise ValueError(f"data.{self.algorithm.dataset} has {len(dataset)} records, fewer than one optimizer step "
                             f"of training.trainBatchSize={self.training.train_batch_size}: lower it or add records")
        self._use_data(PromptLoader(dataset, self.training.train_batch_size, seed=self.training.seed,
                                    shuffle=data_spec.shuffle), passes=self.training.epochs)
        self._start()

    def _start_workers(self) -> None:
        ray.get(self._start_groups(optimizer_steps=max(self.total_steps, 1)))

    # -- the loop --------------------------------------------------------------------------------

    def _steps(self, batches: Iterator[tuple[list[OfflineExample], dict]]) -> Iterator[tuple[dict[str, float], dict]]:
        options = self.objective.options(self.spec)
        for examples, position in batches:
            calls = self._train_step(examples, options)
            with self.timer.phase("update"):  # the ranks train while the driver waits
                metrics = mean_metrics(calls)
            metrics["epoch"] = self._epoch(position)
            yield metrics, position

    def _train_step(self, examples: list[OfflineExample], options: dict) -> list[ray.ObjectRef]:
        """The examples split over the trained group's ranks, in micro-batches; each rank's metrics."""
        micro = self.training.micro_train_batch_size
        per_rank = torch.arange(len(examples)).chunk(self.trained.size)
        # token-mean divides by the step's tokens, which only the driver sees (objectives.NORMALIZERS).
        step_tokens = torch.tensor(float(sum(len(r) for example in examples for r in example.responses)))
        # the frozen reference's log-probs, kto's reference point, the teacher's distributions (kd)
        with self.timer.phase("experience"):
            reference = self._reference_logps(examples) if "reference" in self.groups else None
            kl_logps = self._kl_logps(examples) if self.objective.kl_pairs else None
            batches = [[self._with_teacher(with_step_tokens(pack(
                [examples[i] for i in part], self.pad_token_id, reference[part] if reference is not None else None,
                kl_logps), step_tokens)) for part in rows.split(micro)] for rows in per_rank]
        return [worker.train_offline.remote(own, self.objective.step, options)
                for worker, own in zip(self.trained.workers, batches)]

    def _with_teacher(self, batch: OfflineBatch) -> OfflineBatch:
        """kd: the batch with the teacher's k likeliest next tokens (log-probs and ids) at its response positions."""
        if "teacher" not in self.groups:
            return batch
        logps, ids = self.groups["teacher"].start_top_log_probs(batch.sequences, batch.attention_mask,
                                                                batch.num_actions, self.training.distillation.top_k)()
        return replace(batch, teacher_logps=logps, teacher_ids=ids)

    def _reference_logps(self, examples: list[OfflineExample]) -> torch.Tensor:
        """Summed response log-probs under the frozen reference, [examples, responses per example]."""
        batch = pack(examples, self.pad_token_id)
        token_logps = self.groups["reference"].forward(batch.sequences, batch.attention_mask, batch.num_actions,
                                                       batch.vision)
        summed = masked_sum(token_logps, batch.action_mask, dim=-1)  # response-major rows
        return summed.view(len(examples[0].responses), len(examples)).T

    def _kl_logps(self, examples: list[OfflineExample]) -> torch.Tensor:
        """kto: the mean summed log-prob of the step's mismatched pairs under the policy (before the
        step; the loss detaches it) and under the reference, [2]: the same reference point on every rank."""
        batch = pack(mismatched(examples), self.pad_token_id)
        means = [masked_sum(self.groups[role].forward(batch.sequences, batch.attention_mask, batch.num_actions,
                                                      batch.vision),
                            batch.action_mask, dim=-1).mean() for role in ("actor", "reference")]
        return torch.stack(means)
