"""A job on a Ray cluster of several nodes, laid out as in a RayJob: the driver on a head node without
CPUs, the actor, the reference and the vLLM engine each on a worker node of its own
(tests/trainer/conftest.py RayNodes).

Placement, the DeepSpeed and weight-sync rendezvous, weight sync and checkpoint writes all cross
nodes here, and each vLLM engine's core runs in a process of its own as on a GPU; a checkpoint directory that is each node's own disk is refused before any model loads, and
bundles no node can hold fail in time instead of waiting without end.
"""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import ray

from rlhf_api import contract
from rlhf_api.planning.placement import Placement
from rlhf_trainer import checkpoint
from rlhf_trainer.reporting import JsonlWriter
from rlhf_trainer.run import EXIT_FAILED, run
from rlhf_trainer.workers.distributed import join_store
from rlhf_trainer.workers.group import PlacementTimeout, create_placement_group
from rlhf_trainer.workers.model_worker import ModelWorker
from rlhf_trainer.workers.rollout import ENGINE_PROCESS_ENV

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def engine_core_in_its_own_process(monkeypatch):
    monkeypatch.setenv(ENGINE_PROCESS_ENV, "own")  # the driver's, which places the engines


class ActorNodes:
    """A reporter that records, when the run starts, the node of each of the run's live Ray actors
    (from Ray's own actor table): class name -> node ids."""

    def __init__(self):
        self.nodes: dict[str, list[str]] = {}

    def start(self, total_steps: int) -> None:
        for actor in ray._private.state.actors().values():  # noqa: SLF001 - the GCS's actor table
            if actor["State"] == "ALIVE":
                self.nodes.setdefault(actor["ActorClassName"], []).append(actor["Address"]["NodeID"])

    def log(self, step, metrics) -> None:
        pass

    def checkpoint(self, step, path) -> None:
        pass

    def finish(self, status, message="") -> None:
        pass


def _job(toy_job, checkpoints: Path, **spec):
    return toy_job(**{"checkpoint.path": str(checkpoints), **spec})


def _metrics(checkpoints: Path) -> list[dict]:
    return [json.loads(line) for line in (checkpoints / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_a_job_trains_on_worker_nodes_with_its_checkpoint_on_their_shared_directory(ray_nodes, toy_job, tmp_path):
    """The actor, the reference and the engine each on a worker node, none on the driver's; weights
    synced across nodes every step (vLLM's sampling log-probs stay the trainer's); the actor's shards,
    the state file, final/ and best/ on the shared directory. (A resume from a checkpoint the worker pods
    wrote, and the same job's numbers on one local node, are e2e/operator/test_multipod.py's, on
    KubeRay's own pods.)"""
    checkpoints = ray_nodes.shared / "grpo"
    evaluation = {"datasets": [{"name": "letters", "sources": [{"path": "tiny/prompts.jsonl"}], "labelKey": "label",
                                "maxSamples": 16}],
                  "intervalSteps": 2, "temperature": 0.0, "bestMetric": "letters/mean_reward"}
    spec = {"training.maxSteps": 2, "checkpoint.intervalSteps": 1, "evaluation": evaluation}
    placed = ActorNodes()
    job = _job(toy_job, checkpoints, **spec)
    assert run(job, output_dir=tmp_path / "out", reporters=[placed, JsonlWriter(checkpoints / "logs" / "metrics.jsonl")]) == 0

    assert sorted(placed.nodes) == ["ModelWorker", "RolloutEngine"]
    [engine] = placed.nodes["RolloutEngine"]
    assert {*placed.nodes["ModelWorker"], engine} == set(ray_nodes.worker_nodes())  # actor, reference: a node each
    steps = _metrics(checkpoints)
    assert [m["step"] for m in steps] == [1, 2]
    # Step 2's rollout came from the weights step 1 trained, sent across nodes: vLLM and the trainer agree.
    assert steps[-1]["logprob_diff"] < 1e-3, steps[-1]
    newest = checkpoint.latest(checkpoints)
    assert newest.name == "step-00000002" and list((newest / "actor").iterdir())  # a worker node's shards
    assert (checkpoints / "final" / "model.safetensors").is_file()
    assert json.loads((checkpoints / "best" / checkpoint.BEST_FILE).read_text())["step"] == 2


def test_a_checkpoint_directory_on_each_nodes_own_disk_is_refused_before_any_model_loads(
        ray_nodes, toy_job, tmp_path, capsys):
    """checkpoint.path where the worker nodes see a disk of their own (as a pod without checkpoint.pvc):
    the run fails at once, saying what to change, with no model loaded and nothing written."""
    checkpoints = ray_nodes.local / "grpo"
    job = _job(toy_job, checkpoints, **{"training.maxSteps": 1})
    actors_before = len(ray._private.state.actors())  # noqa: SLF001 - the GCS's actor table, dead ones too
    assert run(job, output_dir=tmp_path / "out", reporters=[]) == EXIT_FAILED
    failure = capsys.readouterr().err.splitlines()[-1]
    assert contract.RUN_FAILED + "CheckpointNotShared: checkpoint.path" in failure, failure
    assert "set checkpoint.pvc to a ReadWriteMany claim" in failure
    assert len(ray._private.state.actors()) == actors_before  # noqa: SLF001 - no model group, no engine started
    assert checkpoint.latest(checkpoints) is None and not list(checkpoints.iterdir())  # no marker left behind
    assert ray.util.placement_group_table() == {} or all(
        group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


def test_a_checkpoint_directory_this_user_cannot_create_is_refused_with_the_os_reason(tmp_path):
    """checkpoint.path that cannot be made (in a pod: /checkpoints, which uid 1000 may not create; here, where
    the tests run as root, a path under a file): refused before any node is asked, saying where to point it."""
    (tmp_path / "file").write_text("")
    with pytest.raises(checkpoint.CheckpointNotShared) as refused:
        checkpoint.require_shared(tmp_path / "file" / "checkpoints", group=None)
    assert str(refused.value).startswith(f"checkpoint.path {tmp_path}/file/checkpoints cannot be written: Not a "
                                         "directory. Point it at a directory this user may create"), refused.value
    assert "checkpoint.pvc" in str(refused.value)


def test_bundles_no_node_can_hold_fail_in_time_saying_what_each_node_has(ray_nodes):
    """Four one-CPU bundles on three one-CPU workers: not a wait without end, a PlacementTimeout that
    lists each node's free CPUs and GPUs; the unplaceable group is removed."""
    with pytest.raises(PlacementTimeout, match=r"the 4 bundles of \{'CPU': 1\} .* were not placed in 2s") as error:
        create_placement_group(Placement(use_gpu=False, bundles=4, ranks={"actor": [0, 1, 2, 3]}), timeout=2)
    # Each node's free resources: the head has none, each worker one CPU (a group is placed whole or not at all).
    assert str(error.value).count(": CPU 0, GPU 0") == 1 and str(error.value).count(": CPU 1, GPU 0") == 3
    assert all(group["state"] == "REMOVED" for group in ray.util.placement_group_table().values())


@pytest.mark.parametrize("opens", ["open_rendezvous", "open_weight_sync"])
def test_a_rendezvous_port_is_held_from_the_moment_it_is_handed_out(ray_nodes, opens):
    """A model group's rank 0 (on a worker node) serves its rendezvous on a port that is already bound when
    the address reaches the other ranks: no other process can take it first. The other ranks join it."""
    worker = ray.remote(ModelWorker).options(num_cpus=1).remote(0, 2)
    try:
        address, port = ray.get(getattr(worker, opens).remote(*([2] if opens == "open_weight_sync" else [])))
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("", port))
        join_store(address, port, 2, timedelta(seconds=30)).set("joined", "yes")
    finally:
        ray.kill(worker)
