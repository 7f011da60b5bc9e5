"""The optimizer of every trained role is torch's AdamW, on every device and with offloadOptimizer: the
optimizers DeepSpeed picks on its own are ops it builds at first use, FusedAdam (compiled with nvcc at
each GPU pod's start) and DeepSpeedCPUAdam (a C++ build the set-up skips). So the CPU tests run the GPU
pods' optimizer
(tests/trainer/test_edges.py trains an offloaded step with it)."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.engine import DeepSpeedEngine

from rlhf_api.v1alpha1 import ModelSpec, TrainingSpec
from rlhf_trainer.workers.engine import ModelConfig, deepspeed_config


def optimizer_deepspeed_picks(config: dict) -> type:
    """The optimizer class DeepSpeed's engine builds from this config, by DeepSpeed's own choice
    (DeepSpeedEngine.get_optimizer_configuration) on an engine that holds the config alone."""
    engine = object.__new__(DeepSpeedEngine)  # no model, no process group: its config accessors only
    engine._config, engine.zenflow = DeepSpeedConfig(config), False
    optimizer, _ = engine.get_optimizer_configuration(dict(config["optimizer"]["params"]), adam_w_mode=True)
    return optimizer


@pytest.mark.parametrize("offload", [False, True], ids=["on-device", "offloaded"])
@pytest.mark.parametrize("use_gpu", [True, False], ids=["gpu", "cpu"])
def test_deepspeed_builds_no_op_for_the_optimizer(use_gpu: bool, offload: bool):
    training = TrainingSpec(zero_stage=2, offload_optimizer=offload)
    cfg = ModelConfig(role="actor", path="unused", model=ModelSpec(path="unused"), training=training, use_gpu=use_gpu)
    assert optimizer_deepspeed_picks(deepspeed_config(cfg, world_size=1)) is torch.optim.AdamW

