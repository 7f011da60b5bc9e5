"""Fixtures of the trainer's tests: tiny models built offline, a private Ray instance, a Ray cluster of
several nodes (RayNodes), and bare TRL trainer objects for the tests that use TRL as an oracle."""

from __future__ import annotations

import collections
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
import yaml

from e2e.fixtures import wait_for
from rlhf_trainer.pretrained import point_models_at

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"
TOY_JOB = EXAMPLES / "tiny-grpo-cpu-job.yaml"


def write_toy_job(directory: Path, model: Path, example: Path = TOY_JOB, data: str = "tiny", **spec: object) -> Path:
    """The tiny CPU example job (or another example whose files are in examples/`data`) in
    `directory` (with its prompts and reward function), its actor's model replaced by `model`, checkpoints
    under the output directory, and `spec` overrides given by dotted path:
    write_toy_job(d, m, **{"training.maxSteps": 5})."""
    job = yaml.safe_load(example.read_text())
    point_models_at(job["spec"], model)
    job["spec"]["checkpoint"]["path"] = "checkpoints"  # relative: under the run's --output-dir
    for dotted, value in spec.items():
        *parents, leaf = dotted.split(".")
        node = job["spec"]
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:  # None removes the field
            node.pop(leaf, None)
        else:
            node[leaf] = value
    shutil.copytree(EXAMPLES / data, directory / data, ignore=shutil.ignore_patterns("model"), dirs_exist_ok=True)
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture
def toy_job(tiny_model, tmp_path):
    """write_toy_job with the tiny model, in a directory of this test's own: toy_job(**overrides) -> job file."""
    return lambda **spec: write_toy_job(tmp_path, tiny_model, **spec)


TEACHER_ALGORITHM, TEACHER_STEPS = "raft", 10


@pytest.fixture(scope="module")
def raft_teacher(tiny_model, local_ray, tmp_path_factory) -> Path:
    """A teacher for distillation: the tiny model after raft's 10 steps on the toy task (reward 0.03 -> 0.18),
    exported. test_learning's test_reward_rises[raft] checks this run's metrics (its logs/ beside the export)."""
    from rlhf_trainer.run import run

    out = tmp_path_factory.mktemp("teacher")
    job = write_toy_job(out, tiny_model, **{"algorithm": TEACHER_ALGORITHM, "training.maxSteps": TEACHER_STEPS,
                                            "training.episodes": 3, "checkpoint.intervalSteps": 0})
    assert run(job, output_dir=out / "run") == 0
    return out / "run" / "checkpoints" / "final"


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory) -> Path:
    from rlhf_trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "reward", kind="reward", seed=1)


@pytest.fixture(scope="module")
def local_ray():
    """A Ray instance of this module's own (own temp dir; never `ray stop`, which kills every Ray here)."""
    import ray
    from rlhf_trainer.run import _start_local_ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray's socket paths must stay short: a directory straight under /tmp.
    temp_dir = tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp")
    node = _start_local_ray(8, temp_dir)  # as `rlhf run` starts it: more tries on a busy machine
    yield ray
    ray.shutdown()
    node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
    shutil.rmtree(temp_dir, ignore_errors=True)


class FakeAccelerator:
    """What TRL's loss and scoring code reads of accelerate's Accelerator, for one CPU process."""

    device = torch.device("cpu")
    process_index = 0
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


@pytest.fixture
def trl_trainer():
    """trl_trainer(TrainerClass, **attributes): a TRL trainer object without its __init__ (which
    wants a real model, datasets and an Accelerator), so that one of its real methods can run as
    an oracle: `object.__new__`, a FakeAccelerator, a model stub in training mode, empty metric
    logs, and the attributes the method reads. Skips the test without trl (a dev-only dependency)."""
    pytest.importorskip("trl")

    def build(cls, **attributes):
        trainer = object.__new__(cls)
        defaults = dict(
            accelerator=FakeAccelerator(),
            model=types.SimpleNamespace(training=True),
            _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
            aux_loss_enabled=False,  # no mixture-of-experts auxiliary loss
            _total_train_tokens=0,  # bookkeeping (token counts, tensor parallelism) the loss code reads
            _tp_size=1,
        )
        for key, value in {**defaults, **attributes}.items():
            object.__setattr__(trainer, key, value)
        return trainer

    return build


class RayNodes:
    """A Ray cluster of several nodes on this machine, laid out as the operator's RayJob lays one out:
    a head node with no CPUs (it runs the driver, this process, and no model group) and worker nodes
    that run every rank and engine. Each worker node is a `ray start` in a mount namespace of its own
    with a private tmpfs on `local`: what a node writes under `local` only that node sees, as a pod's
    own disk; `shared` is one directory every node sees, as a claim every pod mounts."""

    def __init__(self, root: Path, cpus_per_worker: list[int]):
        import ray

        self.root, self.shared, self.local = root, root / "shared", root / "local"
        for directory in (self.shared, self.local):
            directory.mkdir()
        context = ray.init(num_cpus=0, include_dashboard=False, _temp_dir=str(root / "ray"), log_to_driver=False)
        self.head = ray.get_runtime_context().get_node_id()
        self.address = context.address_info["gcs_address"]
        self.workers: dict[str, subprocess.Popen] = {}  # node id -> its `ray start`
        self.started = 0
        # One at a time: nodes starting together in one session directory race for its socket names.
        try:
            for cpus in cpus_per_worker:
                self.add_worker(cpus)
        except BaseException:
            self.stop()  # else this process stays connected, and every later ray.init fails
            raise

    def add_worker(self, cpus: int, attempts: int = 3) -> str:
        """Start a worker node (as KubeRay starts a worker pod) and return its node id once it has joined.
        A `ray start` that exits first is started again, as the kubelet restarts a worker pod's container:
        its raylet gives up registering with the head after a fixed 30 s (Ray's node.py), which a loaded
        machine can exceed."""
        start = ["ray", "start", f"--address={self.address}", f"--num-cpus={cpus}", "--num-gpus=0", "--block",
                 "--disable-usage-stats"]
        script = f"mount -t tmpfs tmpfs {shlex.quote(str(self.local))} && exec {shlex.join(start)}"
        for attempt in range(1, attempts + 1):
            log = self.root / f"worker-{self.started}.log"
            self.started += 1
            with open(log, "wb") as out:
                process = subprocess.Popen(
                    ["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})

            def joined() -> set[str] | str:
                if process.poll() is not None:
                    return "exited"
                return set(self.worker_nodes()) - self.workers.keys()

            found = wait_for(joined, 300, f"the worker node of {log} to join the head")  # minutes on a loaded machine
            if found != "exited":
                [node] = found
                self.workers[node] = process
                return node
            assert attempt < attempts, f"`ray start` exited {attempts} times; the last:\n{log.read_text()[-3000:]}"

    def worker_nodes(self) -> list[str]:
        import ray

        return [node["NodeID"] for node in ray.nodes() if node["Alive"] and node["NodeID"] != self.head]

    def kill_worker(self, node: str, wait: bool = True) -> None:
        """The node's processes killed at once, as a worker pod's are when its node is lost; `wait` until
        the head has seen it go."""
        process = self.workers.pop(node)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        if wait:
            wait_for(lambda: node not in self.worker_nodes(), 120, f"Ray to see node {node} dead")

    def stop(self) -> None:
        """Disconnect, then kill every worker node outright (`ray start` waits out a slow shutdown on SIGTERM)."""
        import ray

        ray.shutdown()
        for node in list(self.workers):
            self.kill_worker(node, wait=False)


@pytest.fixture(scope="module")
def ray_nodes():
    """RayNodes with three worker nodes of one CPU each: a job's actor, reference and vLLM engine land on
    different nodes, none the driver's. Module-scoped: every test of the module shares the cluster."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    root = Path(tempfile.mkdtemp(prefix="rlhf-nodes-", dir="/tmp"))  # short: Ray's socket paths
    nodes = RayNodes(root, [1, 1, 1])
    yield nodes
    nodes.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def smollm2_job(smollm2, tmp_path):
    """A real model's example job (smollm2-grpo-cpu, or the `example` named) in this test's directory:
    smollm2_job(**overrides) -> job file."""
    return lambda example="smollm2-grpo-cpu-job.yaml", **spec: write_toy_job(
        tmp_path, smollm2, EXAMPLES / example, "arithmetic", **spec)
