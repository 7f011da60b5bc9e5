"""Fixtures of the trainer's integration tests: tiny models built offline and a private Ray instance."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from rlhf_trainer.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


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
