"""Colocated model groups take turns on a GPU, and the memory plan charges only the largest of their passes: each
process must hand its caching allocator's blocks back when its pass ends (issue 50: they kept them until vLLM
woke, so the PPO example's scoring phase held the sum of its passes, not the largest).

A fake accelerator stands for CUDA: for each process, what torch's caching allocator keeps reserved, grown by
each of its passes by the plan's own figure for that pass and emptied only by torch.cuda.empty_cache. Real
ModelWorker methods run the passes, in the trainer's own order (Trainer._log_probs_and_values, Trainer._train);
the GPU's use in each phase is held to the plan's figure for it."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from rlhf_api.planning.memory import local_config, plan_job
from rlhf_api.validation import validate
from rlhf_trainer import trainer as trainer_module
from rlhf_trainer.trainer import Trainer
from rlhf_trainer.workers import model_worker
from rlhf_trainer.workers.model_worker import ModelWorker

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"
ROLES = ("actor", "reference", "critic")


class FakeAccelerator:
    """One GPU's memory: every process's resident bytes (the plan's), plus what each one's allocator keeps."""

    def __init__(self, gpu_plan, total: int):
        self.resident = sum(p.resident for p in gpu_plan.processes)
        self.cached = {p.name.split(" rank")[0]: 0 for p in gpu_plan.processes}
        self.process = self.phase = ""
        self.peaks: dict[str, int] = {}
        self.releases: list[str] = []

    def allocate(self, n: int) -> None:
        """A pass of the current process: its allocator reuses its cached blocks, and reserves what is missing."""
        self.cached[self.process] = max(self.cached[self.process], n)
        used = self.resident + sum(self.cached.values())
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), used)

    def empty_cache(self) -> None:
        self.releases.append(self.process)
        self.cached[self.process] = 0


class Model:
    """What ModelWorker reads of its model; its passes allocate the plan's figure on the fake accelerator."""

    def __init__(self, role: str, extra: dict[str, int], gpu: FakeAccelerator):
        self.cfg = SimpleNamespace(role=role, training=SimpleNamespace(micro_rollout_batch_size=4))
        self.device, self.extra, self.gpu, self.learning_rate = torch.device("cpu"), extra, gpu, 1e-6

    def scoring(self):
        return nullcontext()

    def action_log_probs(self, sequences, attention_mask, num_actions):
        self.gpu.allocate(self.extra["score"])
        return torch.zeros(len(sequences), num_actions)

    action_values = action_log_probs

    def take_grad_norm(self):
        return None


class Group:
    """A model group of one rank on the fake GPU, called as the trainer calls ModelGroup."""

    def __init__(self, role: str, worker: ModelWorker, gpu: FakeAccelerator):
        self.role, self.worker, self.gpu = role, worker, gpu

    def start_forward(self, sequences, attention_mask, num_actions, vision=None):
        self.gpu.process = self.role
        out = self.worker.forward(sequences, attention_mask, num_actions)
        return lambda: out

    def train(self, experience, **options):
        self.gpu.process = self.role
        self.worker.train([experience])
        return [self.role]


@pytest.fixture
def ppo_on_one_gpu(monkeypatch):
    """The PPO example (colocation all: every model and vLLM on each GPU) planned on H100s, and GPU 0 of it as a
    fake accelerator under real ModelWorkers."""
    manifest = yaml.safe_load((EXAMPLES / "ppo-job.yaml").read_text())
    spec = validate(manifest).spec
    plan = plan_job(spec, "H100", local_config(EXAMPLES / "model-configs", EXAMPLES, spec))
    gpu_plan = plan.gpus[0]
    gpu = FakeAccelerator(gpu_plan, plan.total)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", gpu.empty_cache)

    def update(model, step, micro_batches, **options):  # the update's pass, as the plan sizes it
        model.gpu.allocate(model.extra["train"])
        return {}

    monkeypatch.setattr(model_worker, "mean_over_micro_batches", update)
    extra = {p.name.split(" rank")[0]: p.extra for p in gpu_plan.processes}
    groups = {}
    for role in ROLES:
        worker = ModelWorker(0, 1)
        worker.model = Model(role, extra[role], gpu)
        groups[role] = Group(role, worker, gpu)
    trainer = SimpleNamespace(
        placement=SimpleNamespace(colocated=lambda *roles: True), groups=groups, step=0,
        training=SimpleNamespace(seed=1, train_batch_size=4, micro_train_batch_size=4, epochs=1),
        actor_scored_in_update=False, teacher_top_k=None,
        trained_groups={role: groups[role] for role in ("actor", "critic")})
    monkeypatch.setattr(trainer_module, "mean_metrics", lambda refs: {})
    return trainer, gpu, gpu_plan, plan.total


def test_colocated_passes_hold_no_more_than_the_plan_s_largest(ppo_on_one_gpu):
    trainer, gpu, gpu_plan, total = ppo_on_one_gpu
    sequences, mask = torch.ones(4, 6, dtype=torch.long), torch.ones(4, 6, dtype=torch.long)
    gpu.phase = "score"
    Trainer._log_probs_and_values(trainer, sequences, mask, torch.ones(4, 3, dtype=torch.bool))
    gpu.phase = "train"
    Trainer._train(trainer, SimpleNamespace())
    for phase in ("score", "train"):
        assert gpu.peaks[phase] <= gpu_plan.phase(phase, total), (phase, gpu.peaks[phase], gpu_plan.phase(phase, total))
    # each pass handed its blocks back as it ended: the three scoring passes, then the two updates
    assert gpu.releases == ["actor", "reference", "critic", "actor", "critic"]
