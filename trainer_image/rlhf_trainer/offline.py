"""The offline algorithms: sft, dpo, ipo, cdpo, kto and rm, trained on a dataset (no rollouts, no vLLM).

Each step is one optimizer step over training.trainBatchSize examples (pairs, for the preference
algorithms), split evenly over the trained group's ranks and into microTrainBatchSize
micro-batches; training.epochs passes over the dataset, capped by training.maxSteps.

- sft: token NLL of the response (the prompt masked out), data.sft records.
- dpo, ipo, cdpo: the actor against a frozen reference (spec.models.reference, else the actor's
  initial weights) on the summed log-probs of chosen and rejected responses, with
  losses.PREFERENCE_LOSSES[algorithm]; data.preferences pairs.
- kto: the same with losses.kto_loss on desirable/undesirable responses (records with a
  desirable flag in labelKey, or pairs), its reference point z0 from mismatched pairs of each step.
- rm: a sequence classifier (spec.models.actor, a fresh score head if it is a causal LM) scored
  at the last token of prompt + response + eos, as rewards/model.py reads it, with the pairwise
  (Bradley-Terry) loss; exported in Hugging Face format, ready to serve as spec.models.reward.

Metrics (api.Metrics names where they exist): loss, learning_rate, epoch; the preference
algorithms and rm also reward_accuracy, reward_margin, chosen_reward, rejected_reward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import ray
import torch
from ray.util.placement_group import remove_placement_group

from rlhf_api.algorithms import ALGORITHMS
from rlhf_api.v1alpha1 import RLHFJob, RLHFJobSpec

from . import checkpoint
from .data import PromptLoader
from .losses import PreferenceConfig, masked_sum
from .offline_data import OfflineDataset, OfflineExample, mismatched, pack
from .paths import model_path
from .reporting import Reporter
from .workers.group import ModelGroup, Placement, create_placement_group, mean_metrics
from .workers.model_worker import ModelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Objective:
    """How an offline objective reads its records and trains (the catalogue names one per algorithm)."""

    response_keys: Callable  # DatasetSpec -> the record keys of the responses
    step: str  # model_worker.OFFLINE_OBJECTIVES key
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


# The catalogue's `objective` keys.
OBJECTIVES: dict[str, Objective] = {
    "sft": Objective(lambda d: (d.output_key,), "sft", lambda spec: {}),
    "preference": Objective(_pair, "preference", _preference_options),
    "pairwise": Objective(_pair, "pairwise", lambda spec: {}),
    # kto: records {input, outputKey, labelKey: desirable flag}; without labelKey, pairs (each one
    # desirable and one undesirable response).
    "kto": Objective(lambda d: (d.output_key,) if d.label_key else _pair(d), "preference", _preference_options,
                     flag_key=lambda d: d.label_key, kl_pairs=True),
}


class OfflineTrainer:
    def __init__(self, job: RLHFJob, placement: Placement, *, base_dir: Path, output_dir: Path, reporter: Reporter):
        from transformers import AutoTokenizer

        self.job, self.spec, self.placement = job, job.spec, placement
        self.training, self.algorithm = job.spec.training, ALGORITHMS[job.spec.algorithm]
        self.objective = OBJECTIVES[self.algorithm.objective]
        self.trained_role = self.algorithm.roles[0]
        self.base_dir, self.reporter = Path(base_dir), reporter
        self.checkpoint_dir = Path(output_dir) / self.spec.checkpoint.path
        actor = self.spec.models.actor
        self.tokenizer = AutoTokenizer.from_pretrained(model_path(self.spec.models, "actor", self.base_dir),
                                                       revision=actor.revision)
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id

        data_spec = getattr(self.spec.data, self.algorithm.dataset)
        dataset = OfflineDataset.from_spec(
            data_spec, self.spec.data, self.tokenizer, response_keys=self.objective.response_keys(data_spec),
            base_dir=self.base_dir, seed=self.training.seed, name=self.algorithm.dataset,
            flag_key=self.objective.flag_key(data_spec))
        if len(dataset) < self.training.train_batch_size:
            raise ValueError(f"data.{self.algorithm.dataset} has {len(dataset)} records, fewer than one optimizer step "
                             f"of training.trainBatchSize={self.training.train_batch_size}: lower it or add records")
        self.data = PromptLoader(dataset, self.training.train_batch_size, seed=self.training.seed,
                                 shuffle=data_spec.shuffle)
        self.total_steps = self.training.epochs * len(self.data)
        if self.training.max_steps:
            self.total_steps = min(self.total_steps, self.training.max_steps)

        self.step = 0
        self.groups: dict[str, ModelGroup] = {}
        self.placement_group = create_placement_group(placement)
        try:
            self.groups = {role: ModelGroup(role, self.placement_group, placement) for role in placement.ranks
                           if placement.ranks[role] and role != "rollout"}
            ray.get([ref for role, g in self.groups.items() for ref in g.setup(self._model_config(role))])
        except BaseException:
            self.close()
            raise

    def _model_config(self, role: str) -> ModelConfig:
        _, model = self.spec.models.source(role)
        return ModelConfig(role=role, path=model_path(self.spec.models, role, self.base_dir), model=model,
                           training=self.training, temperature=1.0, optimizer_steps=max(self.total_steps, 1), use_gpu=self.placement.use_gpu)

    @property
    def trained(self) -> ModelGroup:
        return self.groups[self.trained_role]

    def close(self) -> None:
        for handle in [w for g in self.groups.values() for w in g.workers]:
            ray.kill(handle)
        remove_placement_group(self.placement_group)

    # -- the loop --------------------------------------------------------------------------------

    def fit(self) -> None:
        self._resume()
        options = self.objective.options(self.spec)
        for examples, position in self._batches():
            metrics = mean_metrics(self._train_step(examples, options))
            metrics["epoch"] = position["epoch"] + position["position"] / len(self.data)
            self.step += 1
            self.reporter.log(self.step, metrics)
            interval = self.spec.checkpoint.interval_steps
            if (interval and self.step % interval == 0) or self.step == self.total_steps:
                self._save(position)
        if self.spec.checkpoint.export_hf:
            ray.get(self.trained.call("save_pretrained", str(self.checkpoint_dir / "final")))

    def _batches(self) -> Iterator[tuple[list[OfflineExample], dict]]:
        drawn = self.step
        while self.data.epoch < self.training.epochs:
            for batch in self.data:
                if drawn == self.total_steps:
                    return
                drawn += 1
                yield batch, self.data.state_dict()

    def _train_step(self, examples: list[OfflineExample], options: dict) -> list[ray.ObjectRef]:
        """The examples split over the trained group's ranks, in micro-batches; each rank's metrics."""
        reference = self._reference_logps(examples) if "reference" in self.groups else None
        kl_logps = self._kl_logps(examples) if self.objective.kl_pairs else None
        micro = self.training.micro_train_batch_size
        per_rank = torch.arange(len(examples)).chunk(self.trained.size)
        calls = []
        for worker, rows in zip(self.trained.workers, per_rank):
            batches = [
                pack([examples[i] for i in part], self.pad_token_id,
                     reference[part] if reference is not None else None, kl_logps)
                for part in rows.split(micro)
            ]
            calls.append(worker.train_offline.remote(batches, self.objective.step, options))
        return calls

    def _reference_logps(self, examples: list[OfflineExample]) -> torch.Tensor:
        """Summed response log-probs under the frozen reference, [examples, responses per example]."""
        batch = pack(examples, self.pad_token_id)
        token_logps = self.groups["reference"].forward(batch.sequences, batch.attention_mask, batch.num_actions)
        summed = masked_sum(token_logps, batch.action_mask, dim=-1)  # response-major rows
        return summed.view(len(examples[0].responses), len(examples)).T

    def _kl_logps(self, examples: list[OfflineExample]) -> torch.Tensor:
        """kto: the mean summed log-prob of the step's mismatched pairs under the policy (before the
        step; the loss detaches it) and under the reference, [2]: the same reference point on every rank."""
        batch = pack(mismatched(examples), self.pad_token_id)
        means = [masked_sum(self.groups[role].forward(batch.sequences, batch.attention_mask, batch.num_actions),
                            batch.action_mask, dim=-1).mean() for role in ("actor", "reference")]
        return torch.stack(means)

    # -- checkpoints -----------------------------------------------------------------------------

    def _save(self, position: dict) -> None:
        path = checkpoint.save(self.checkpoint_dir, self.step, {self.trained_role: self.trained},
                               {"data": position}, keep=self.spec.checkpoint.keep)
        self.reporter.checkpoint(self.step, str(path))

    def _resume(self) -> None:
        path = checkpoint.latest(self.checkpoint_dir) if self.spec.checkpoint.resume else None
        if path is None:
            return
        state = checkpoint.load(path, {self.trained_role: self.trained})
        self.step = state["step"]
        self.data.load_state_dict(state["data"])
        log.info("resumed from %s at step %d", path, self.step)

