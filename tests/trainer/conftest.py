"""Fixtures of the trainer's integration tests: tiny models built offline and a private Ray instance."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
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
