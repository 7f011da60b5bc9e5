"""Roles that share bundles take turns (issue: on a GPU, three models' activations at once, and vLLM
sizing its KV cache while the models loaded beside it). plan_placement of the GPU examples says which
roles share; the trainer's passes over colocated groups run one after another, over separate groups
at once. The groups here record the order of calls the trainer makes (no Ray: the order is the
trainer's, whatever the groups do)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from rlhf_api.planning.placement import ROLLOUT, plan_placement
from rlhf_api.validation import validate
from rlhf_trainer import trainer as trainer_module
from rlhf_trainer.trainer import Trainer
from rlhf_trainer.workers.group import trained_rank_env

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"


def placement_of(colocation: str):
    """The PPO example (16 GPUs: actor, reference, critic, reward and vLLM) under `colocation`; without
    the hybrid engine, 8 GPUs for vLLM and 2 per role."""
    manifest = yaml.safe_load((EXAMPLES / "ppo-job.yaml").read_text())
    manifest["spec"]["training"]["colocation"] = colocation
    if colocation != "all":
        manifest["spec"]["rollout"]["engines"] = 4
        manifest["spec"]["resources"]["gpus"] = {role: 2 for role in ("actor", "critic", "reward")} | (
            {"reference": 2} if colocation == "none" else {})
    return plan_placement(validate(manifest).spec, use_gpu=True)


@pytest.mark.parametrize(("colocation", "models_share", "engines_share"), [
    ("none", False, False), ("actor-reference", True, False), ("all", True, True)])
def test_which_roles_share_gpus_follows_training_colocation(colocation, models_share, engines_share):
    placement = placement_of(colocation)
    models = [role for role in placement.ranks if role != ROLLOUT]
    assert set(models) == {"actor", "reference", "critic", "reward"}
    assert placement.colocated(*models) == models_share
    assert placement.engines_colocated == engines_share
    assert placement.colocated("actor", "critic") == (colocation == "all")


class Group:
    """Records when the trainer starts a pass and when it waits for its result."""

    def __init__(self, role: str, calls: list[str]) -> None:
        self.role, self.calls = role, calls

    def start_forward(self, sequences, attention_mask, num_actions, vision=None):
        self.calls.append(f"start {self.role}")

        def result():
            self.calls.append(f"wait {self.role}")
            return torch.zeros(sequences.shape[0], num_actions)

        return result

    def train(self, experience, **options):
        self.calls.append(f"train {self.role}")
        return [self.role]


def trainer_with(colocation: str, calls: list[str]) -> SimpleNamespace:
    placement = placement_of(colocation)
    groups = {role: Group(role, calls) for role in ("actor", "reference", "critic")}
    training = SimpleNamespace(seed=1, train_batch_size=2, micro_train_batch_size=1, epochs=1)
    return SimpleNamespace(placement=placement, groups=groups, training=training, step=0, actor_scored_in_update=False,
                           teacher_top_k=None,
                           trained_groups={role: groups[role] for role in ("actor", "critic")})


@pytest.mark.parametrize(("colocation", "order"), [
    ("none", ["start actor", "start reference", "start critic", "wait actor", "wait reference", "wait critic"]),
    ("all", ["start actor", "wait actor", "start reference", "wait reference", "start critic", "wait critic"]),
])
def test_colocated_groups_score_one_after_another(colocation, order):
    calls: list[str] = []
    sequences, mask = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    scored = Trainer._log_probs_and_values(trainer_with(colocation, calls), sequences, mask,
                                           torch.ones(2, 3, dtype=torch.bool))
    assert calls == order
    assert scored.actor.shape == scored.reference.shape == scored.values.shape == (2, 3) and scored.teacher is None


@pytest.mark.parametrize(("colocation", "order"), [
    ("none", ["train actor", "train critic", "wait actor", "wait critic"]),
    ("all", ["train actor", "wait actor", "train critic", "wait critic"]),
])
def test_colocated_groups_train_one_after_another(colocation, order, monkeypatch):
    calls: list[str] = []

    def mean_metrics(refs):
        calls.append(f"wait {refs[0]}")
        return {f"{refs[0]}/loss": 0.0}

    monkeypatch.setattr(trainer_module, "mean_metrics", mean_metrics)
    metrics = Trainer._train(trainer_with(colocation, calls), SimpleNamespace())
    assert calls == order and set(metrics) == {"actor/loss", "critic/loss"}


class Engine:
    """Records the sleep and wake calls the trainer makes (ray.get of its results is the identity here)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.sleep = SimpleNamespace(remote=lambda level: calls.append(f"sleep {level}"))
        self.wake_up = SimpleNamespace(remote=lambda tags: calls.append(f"wake {tags}"))


class Ranks(Group):
    def call(self, method: str) -> list[None]:
        self.calls.append(f"{method} {self.role}")
        return [None]


@pytest.mark.parametrize(("colocation", "use_gpu", "order"), [
    # The hybrid engine (issue: it woke into a GPU still holding the passes' blocks): blocks handed back,
    # weights woken and synced, then the KV cache.
    ("all", True, ["release_memory actor", "release_memory reference", "release_memory critic",
                   "wake ['weights']", "sync", "wake ['kv_cache']"]),
    ("all", False, ["sync"]),  # on CPU vLLM cannot sleep: the engines stay up
    ("actor-reference", True, ["sync"]),  # the engines have GPUs of their own
])
def test_the_hybrid_engine_wakes_its_weights_takes_the_sync_then_wakes_its_kv_cache(
        colocation, use_gpu, order, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(trainer_module.ray, "get", lambda refs: refs)
    trainer = Trainer.__new__(Trainer)  # the trainer's own methods, on the fakes below
    trainer.placement = SimpleNamespace(use_gpu=use_gpu, engines_colocated=placement_of(colocation).engines_colocated)
    trainer.groups = {role: Ranks(role, calls) for role in ("actor", "reference", "critic")}
    trainer.engines = [Engine(calls)]
    trainer._sync_weights = lambda version: calls.append("sync")
    trainer._wake_and_sync(1)
    assert calls == order


def test_the_hybrid_engine_s_first_wake_follows_the_models_handing_back_what_their_load_cached(monkeypatch):
    """Issue 50: the first wake, once the models had loaded, skipped release_memory: vLLM woke beside the blocks
    the loads left in each process's caching allocator."""
    calls: list[str] = []
    engine = Engine(calls)
    engine.ready = SimpleNamespace(remote=lambda: calls.append("ready"))
    monkeypatch.setattr(trainer_module.ray, "get", lambda refs: refs)
    monkeypatch.setattr(trainer_module, "create_rollout_engines", lambda *args, **kwargs: [engine])
    monkeypatch.setattr(trainer_module, "build_reward", lambda *args, **kwargs: None)
    monkeypatch.setattr(trainer_module, "setup_weight_sync", lambda *args, **kwargs: calls.append("weight sync"))
    manifest = yaml.safe_load((EXAMPLES / "ppo-job.yaml").read_text())
    trainer = Trainer.__new__(Trainer)
    trainer.spec = validate(manifest).spec
    trainer.rollout, trainer.training, trainer.optimizer_steps = trainer.spec.rollout, trainer.spec.training, 1
    trainer.placement = SimpleNamespace(use_gpu=True, engines_colocated=True)
    trainer.placement_group = trainer.actor_path = trainer.base_dir = None
    trainer.groups = {role: Ranks(role, calls) for role in ("actor", "reference", "critic")}
    trainer._start_groups = lambda **options: calls.append("load") or []
    trainer._start_workers()
    assert calls == ["ready", "sleep 1", "load", "release_memory actor", "release_memory reference",
                     "release_memory critic", "wake None", "weight sync"]


@pytest.mark.parametrize(("offload", "use_gpu", "env"), [
    (True, True, {"OMP_NUM_THREADS": "8"}),  # the PPO example's worker pods: 64 CPUs, 8 GPUs
    (False, True, {}), (True, False, {}),  # Adam on the GPU; on CPU, Ray's CPUs per rank
])
def test_cpu_adam_gets_the_worker_pod_s_cpus_per_gpu(offload, use_gpu, env):
    """With offloadOptimizer DeepSpeed's CPU Adam stepped an 8B model's optimizer on one OpenMP thread per
    rank: Ray sets OMP_NUM_THREADS=1 for an actor of a fraction of a CPU."""
    manifest = yaml.safe_load((EXAMPLES / "ppo-job.yaml").read_text())
    manifest["spec"]["training"]["offloadOptimizer"] = offload
    assert trained_rank_env(validate(manifest).spec, use_gpu) == env


def test_without_the_actors_pass_the_other_groups_score_and_the_actor_is_left_none():
    """One optimizer step per rollout (trainer.actor_scored_in_update): step 3 does not start the actor."""
    calls: list[str] = []
    trainer = trainer_with("none", calls)
    trainer.actor_scored_in_update = True
    scored = Trainer._log_probs_and_values(trainer, torch.ones(2, 5, dtype=torch.long),
                                           torch.ones(2, 5, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool))
    assert calls == ["start reference", "start critic", "wait reference", "wait critic"]
    assert scored.actor is None and scored.log_ratio(scored.reference) is None


@pytest.mark.parametrize(("example", "changes", "skipped"), [
    ("smollm2-grpo-cpu-job.yaml", {}, True),  # 8 prompts x 8 samples, trainBatchSize 64, one epoch, KL in the loss
    ("smollm2-grpo-cpu-job.yaml", {"epochs": 2}, False),  # the second epoch's ratio needs the first's weights
    ("smollm2-grpo-cpu-job.yaml", {"trainBatchSize": 32, "microTrainBatchSize": 8}, False),  # two optimizer steps
    ("smollm2-grpo-cpu-job.yaml", {"kl": {"coef": 0.01, "placement": "reward"}}, False),  # read by the advantages
    ("smollm2-grpo-cpu-job.yaml", {"kl": {"coef": 0.0, "placement": "reward"}}, True),  # no penalty to read
    ("smollm2-online-dpo-cpu-job.yaml", {}, False),  # its estimator reads the log-ratio to the reference
    ("smollm2-distill-cpu-job.yaml", {}, False),  # its estimator reads the log-ratio to the teacher
    # GKD's divergence: the teacher's top-k distributions in the loss, no log-ratio before the update
    ("smollm2-distill-cpu-job.yaml", {"distillation": {"klCoef": 1.0, "rewardCoef": 0, "jsdBeta": 0.5}}, True),
])
def test_the_actor_is_scored_in_the_update_when_nothing_before_it_reads_its_log_probs(example, changes, skipped):
    manifest = yaml.safe_load((EXAMPLES / example).read_text())
    manifest["spec"]["training"].update(changes)
    assert trainer_module.actor_scored_in_update(validate(manifest).spec) is skipped
