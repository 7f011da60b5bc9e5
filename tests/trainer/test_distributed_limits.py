"""A GPU rank of a job with resources.rdma checks, before NCCL starts, that it may lock memory without
limit: NCCL registers its buffers with the RDMA adapters by locking them, and the worker runs as uid
1000 without capabilities, so an IPC_LOCK added to the container (as the operator once did) never
reached it. Under a limit (a stock containerd's) it warns and goes on, unless the job asks for it
strictly (resources.rdma.requireLockedMemory): then it fails, NodeUnusable. Read here as the process
sees it, under limits set with prlimit (only lowered: this machine's hard limit is 8 MiB, so the
unlimited case cannot be granted here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlhf_api import contract

CHECK = "from rlhf_trainer.workers.distributed import require_locked_memory; require_locked_memory(); print('ok')"


def check_under(memlock: str, rdma: bool, strict: bool = False) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **({contract.RDMA_ADAPTERS_ENV: "mlx5_0"} if rdma else {}),
           **({contract.REQUIRE_LOCKED_MEMORY_ENV: "true"} if strict else {})}
    return subprocess.run(["prlimit", f"--memlock={memlock}", sys.executable, "-c", CHECK], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("memlock", "rdma"), [
    ("65536:65536", True),  # a container runtime's usual default: 64 KiB
    ("65536:65536", False),  # NCCL over the pod network locks nothing
])
def test_an_rdma_rank_under_a_memlock_limit_warns_and_starts(memlock: str, rdma: bool):
    result = check_under(memlock, rdma)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr
    warned = "may lock only 65536 bytes" in result.stderr and "LimitMEMLOCK=infinity" in result.stderr
    assert warned == rdma and ("requireLockedMemory" in result.stderr) == rdma, result.stderr


def test_an_rdma_rank_that_requires_locked_memory_refuses_to_start_under_a_limit():
    result = check_under("65536:65536", rdma=True, strict=True)
    assert result.returncode != 0 and result.stdout == ""
    assert f"{contract.NODE_UNUSABLE}: resources.rdma is set but this pod may lock only 65536 bytes" in result.stderr
    assert "LimitMEMLOCK=infinity" in result.stderr, result.stderr
