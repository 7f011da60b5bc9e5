"""Fixtures of the trainer's tests: tiny models built offline, a private Ray instance, and bare TRL
trainer objects for the tests that use TRL as an oracle."""

from __future__ import annotations

import collections
import os
import shutil
import tempfile
import types
from pathlib import Path

import pytest
import torch
import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"
TOY_JOB = EXAMPLES / "tiny-grpo-cpu-job.yaml"


def write_toy_job(directory: Path, model: Path, **spec: object) -> Path:
    """The tiny CPU example job in `directory` (with its prompts and reward function), its actor
    replaced by `model`, checkpoints under the output directory, and `spec` overrides given by
    dotted path: write_toy_job(d, m, **{"training.maxSteps": 5})."""
    job = yaml.safe_load(TOY_JOB.read_text())
    job["spec"]["models"]["actor"]["path"] = str(model)
    job["spec"]["checkpoint"]["path"] = "checkpoints"  # relative: under the run's --output-dir
    for dotted, value in spec.items():
        *parents, leaf = dotted.split(".")
        node = job["spec"]
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    shutil.copytree(EXAMPLES / "tiny", directory / "tiny", ignore=shutil.ignore_patterns("model"), dirs_exist_ok=True)
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rlhf_trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def toy_job(tiny_model, tmp_path):
    """write_toy_job with the tiny model, in a directory of this test's own: toy_job(**overrides) -> job file."""
    return lambda **spec: write_toy_job(tmp_path, tiny_model, **spec)


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory) -> Path:
    from rlhf_trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "reward", kind="reward", seed=1)


@pytest.fixture(scope="module")
def local_ray():
    """A Ray instance of this module's own (own temp dir; never `ray stop`, which kills every Ray here)."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray's socket paths must stay short: a directory straight under /tmp.
    temp_dir = tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp")
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=temp_dir, log_to_driver=False)
    yield ray
    ray.shutdown()
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
