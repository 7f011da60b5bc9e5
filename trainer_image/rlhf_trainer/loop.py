"""The run loop both trainers share: the online Trainer (trainer.py) and the OfflineTrainer (offline.py).

A run is `total_steps` steps over a resumable data loader (data.PromptLoader), training.maxSteps
at most: each step trains one batch (the subclass's `_steps`) and is logged; a checkpoint is
saved every checkpoint.intervalSteps steps and after the last one, and checkpoint.resume
continues from the newest one with the trained groups' state, the step and the loader's
position. `request_stop` (rlhf run's SIGTERM handler) ends the run after the step under way, with a
checkpoint of it: `fit` then raises Interrupted. The model groups live in one placement group, reserved
by `_start` and freed by `close`; before any model loads, `_start` checks that the checkpoint directory
is shared by every node of the placement group (checkpoint.require_shared).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Iterator

import ray
from ray.util.placement_group import remove_placement_group

from rlhf_api.algorithms import ALGORITHMS, TRAINED_ROLES
from rlhf_api.paths import model_path
from rlhf_api.planning.placement import ROLLOUT, Placement
from rlhf_api.v1alpha1 import RLHFJob

from . import checkpoint
from .data import PromptLoader
from .paths import checkpoint_dir
from .reporting import Reporter
from .timing import PhaseTimer
from .workers.engine import ModelConfig
from .workers.group import ModelGroup, create_placement_group, trained_rank_env

log = logging.getLogger(__name__)


class Interrupted(Exception):
    """The run was asked to stop before its last step (SIGTERM): running the job again resumes where it stopped."""


class RunLoop(ABC):
    """A subclass's __init__ calls `_use_data`, then `_start`; it implements `_start_workers` and `_steps`."""

    data_key: str  # the loader's position in a checkpoint's trainer_state.json

    def __init__(self, job: RLHFJob, placement: Placement, *, base_dir: Path, output_dir: Path, reporter: Reporter):
        from transformers import AutoTokenizer

        self.job, self.spec, self.placement = job, job.spec, placement
        self.training, self.algorithm = job.spec.training, ALGORITHMS[job.spec.algorithm]
        self.base_dir, self.reporter = Path(base_dir), reporter
        self.checkpoint_dir = checkpoint_dir(self.spec, output_dir)
        self.timer = PhaseTimer()  # a subclass's _steps times its phases with it; fit adds time/step
        self.actor_path = model_path(self.spec.models, "actor", self.base_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.actor_path, revision=self.spec.models.actor.revision)
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id
        self.step = 0
        self.stop_requested = False
        self.extra_batches = 0  # batches drawn beyond one per step (dynamic sampling's extra rounds)
        self.groups: dict[str, ModelGroup] = {}

    def _use_data(self, data: PromptLoader, passes: int) -> None:
        """Train on `passes` epochs of the loader's batches, training.maxSteps at most."""
        self.data, self.passes = data, passes
        self.total_steps = passes * len(data)
        if self.training.max_steps:
            self.total_steps = min(self.total_steps, self.training.max_steps)

    # -- Ray actors ------------------------------------------------------------------------------

    def _start(self) -> None:
        """Reserve the placement group and start the workers; stop what started if that fails."""
        self.placement_group = create_placement_group(self.placement)
        try:
            checkpoint.require_shared(self.checkpoint_dir, self.placement_group)
            self._start_workers()
        except BaseException:
            self.close()
            raise

    @abstractmethod
    def _start_workers(self) -> None:
        """Start the model groups (`_start_groups`) and whatever else the run needs, and wait until they are up."""

    def _start_groups(self, **config: Any) -> list[ray.ObjectRef]:
        """A ModelGroup per role of the placement, loading its model with ModelConfig(..., **config);
        wait on the returned refs."""
        trained_env = trained_rank_env(self.spec, self.placement.use_gpu)
        self.groups = {role: ModelGroup(role, self.placement_group, self.placement,
                                        env=trained_env if role in TRAINED_ROLES else None)
                       for role, bundles in self.placement.ranks.items() if role != ROLLOUT and bundles}
        configs = {role: self._model_config(role, **config) for role in self.groups}
        for role, cfg in configs.items():  # a pipeline's stage shows which stage's model each role took
            log.info("the %s model loads from %s", role, cfg.path)
        setups = [ref for role, group in self.groups.items() for ref in group.setup(configs[role])]
        for role, owner in self.placement.shared.items():  # e.g. a LoRA actor's base as the reference
            self.groups[role] = self.groups[owner].base_model_view(role)
        return setups

    def _model_config(self, role: str, **config: Any) -> ModelConfig:
        _, model = self.spec.models.source(role)
        if self.algorithm.step_labelled and role == self.algorithm.roles[0]:
            config["step_separator"] = self.spec.data.step_separator
        return ModelConfig(role=role, path=model_path(self.spec.models, role, self.base_dir), model=model,
                           training=self.training, use_gpu=self.placement.use_gpu, algorithm=self.spec.algorithm,
                           **config)

    @property
    def trained(self) -> ModelGroup:
        """The group the run trains and exports: the algorithm's first role (the actor, or rm)."""
        return self.groups[self.algorithm.roles[0]]

    @property
    def trained_groups(self) -> dict[str, ModelGroup]:
        """Every group with an optimizer (the actor or rm, and the critic): what a checkpoint holds."""
        return {role: group for role, group in self.groups.items() if role in TRAINED_ROLES}

    @property
    def changed_frozen_groups(self) -> dict[str, ModelGroup]:
        """Groups without an optimizer whose weights the run changes: a checkpoint holds their weights too."""
        return {}

    def _actors(self) -> list:
        """This run's Ray actors: every rank of every model group."""
        return [worker for group in self.groups.values() for worker in group.workers]

    def close(self) -> None:
        """Stop this run's Ray actors and free its placement group (the Ray instance may live on)."""
        for handle in self._actors():
            ray.kill(handle)
        remove_placement_group(self.placement_group)

    # -- the loop --------------------------------------------------------------------------------

    def fit(self) -> None:
        self._resume()
        self._before_steps()
        steps = self._steps(self._batches())
        data_position, saving = None, self.spec.checkpoint.keep > 0  # keep 0: no checkpoint, the export only
        while True:
            with self.timer.phase("step"):
                taken = next(steps, None)
            if taken is None:
                break
            metrics, data_position = taken
            self.step += 1
            self.reporter.log(self.step, metrics | self.timer.take())
            interval = self.spec.checkpoint.interval_steps
            if saving and ((interval and self.step % interval == 0) or self.step == self.total_steps
                           or self.stop_requested):
                self._save(data_position)
            if self.stop_requested and self.step < self.total_steps:
                raise Interrupted(f"stopped after step {self.step} of {self.total_steps}; " + (
                    f"its checkpoint is {checkpoint.step_dir(self.checkpoint_dir, self.step)}: running the job "
                    "again resumes from it" if saving else "no checkpoint (checkpoint.keep 0): running the job "
                    "again starts over"))
        if saving and data_position is not None and self.step < self.total_steps:
            self._save(data_position)  # the data ran out before totalSteps (dynamic sampling's extra rounds)
        if self.spec.checkpoint.export_hf:
            ray.get(self.trained.call("save_pretrained", str(self.checkpoint_dir / "final")))

    def request_stop(self) -> None:
        """Stop after the step under way, with a checkpoint of it (safe in a signal handler: it sets a flag
        `fit` reads between steps)."""
        self.stop_requested = True

    def _before_steps(self) -> None:
        """Whatever runs once before the first step of this run (after the resume), outside any step's time."""

    @abstractmethod
    def _steps(self, batches: Iterator[tuple[list, dict]]) -> Iterator[tuple[dict[str, float], dict]]:
        """Train the batches, one step each: yield each step's metrics and the data position after it.
        `fit` counts the step (self.step) before it asks for the next one."""

    def _batches(self) -> Iterator[tuple[list, dict]]:
        """The batches left, each with the loader's position after it, up to the run's last step (and the
        extra batches `_extra_batch` asked for)."""
        drawn = self.step
        while self.data.epoch < self.passes:
            for batch in self.data:
                if drawn == self.total_steps + self.extra_batches:
                    return
                drawn += 1
                yield batch, self.data.state_dict()

    def _extra_batch(self, batches: Iterator[tuple[list, dict]]) -> tuple[list, dict] | None:
        """One more batch from `batches` than the steps need; None when the data passes are used up."""
        self.extra_batches += 1
        return next(batches, None)

    def _epoch(self, data_position: dict) -> float:
        """The data trained on by a step, in epochs (the `epoch` metric)."""
        return data_position["epoch"] + data_position["position"] / len(self.data)

    # -- checkpoints -----------------------------------------------------------------------------

    def _save(self, data_position: dict) -> None:
        path = checkpoint.save(self.checkpoint_dir, self.step, self.trained_groups, {self.data_key: data_position},
                               keep=self.spec.checkpoint.keep, frozen=self.changed_frozen_groups)
        self.reporter.checkpoint(self.step, str(path))

    def _resume(self) -> bool:
        """Continue from the newest complete checkpoint (checkpoint.resume); whether there was one."""
        path = checkpoint.latest(self.checkpoint_dir) if self.spec.checkpoint.resume else None
        if path is None:
            return False
        state = checkpoint.load(path, self.trained_groups, self.changed_frozen_groups)
        self.step = state["step"]
        self.data.load_state_dict(state[self.data_key])
        log.info("resumed from %s at step %d", path, self.step)
        return True
