"""Processes taking turns on a CPU node: each phase on its share of the pod's cores (workers/threads.py),
and the host memory a phase freed handed back when it ends (workers/host_memory.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rlhf_trainer.workers.threads import share_the_cores, usable_cpus

CPUS = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("cpu_max", "expected"), [
    (None, CPUS),  # no cgroup v2 file: the affinity
    ("max 100000", CPUS),  # no limit
    ("50000 100000", 1),  # half a CPU: at least one thread
    (f"{CPUS * 100000 + 50000} 100000", CPUS),  # a limit above the affinity: the affinity
    ("100000 100000", 1),
])
def test_the_usable_cpus_are_the_affinity_bounded_by_the_cgroup_quota(tmp_path, cpu_max, expected):
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max + "\n")
    assert usable_cpus(path) == expected


def test_the_processes_that_work_at_once_share_the_cores(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    try:
        assert share_the_cores(1, tmp_path / "absent") == CPUS == torch.get_num_threads()
        assert os.environ["OMP_NUM_THREADS"] == str(CPUS)  # for the processes it starts (vLLM's engine core)
        assert share_the_cores(CPUS * 2, tmp_path / "absent") == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


FREED_AND_KEPT = """
import sys
from rlhf_trainer.workers.host_memory import release_free_memory

def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

before = resident_mib()
blocks = [bytearray(64 * 1024) for _ in range(int(sys.argv[1]) * 16)]  # MiB of heap blocks (under glibc's mmap threshold)
top = bytearray(64 * 1024)  # allocated last: the heap cannot shrink from its top past it
del blocks
freed = resident_mib()
release_free_memory()
print(before, freed, resident_mib())
"""


def _freed_then_released(mib: int) -> tuple[float, float]:
    """MiB resident above the start with `mib` MiB of heap freed, and after release_free_memory."""
    result = subprocess.run([sys.executable, "-c", FREED_AND_KEPT, str(mib)], capture_output=True, text=True,
                            check=True, env={**os.environ, "MALLOC_ARENA_MAX": "1"})
    before, freed, released = map(float, result.stdout.split())
    return freed - before, released - before


def test_a_phase_s_freed_heap_goes_back_to_the_os_when_it_ends():
    """glibc keeps freed heap blocks below a live one resident (the process stays at its high-water mark while
    the other processes work); release_free_memory hands them back once more than TRIM_ABOVE is free, and
    leaves less for the next phase to reuse (faulting pages back in costs more than it saves)."""
    freed, released = _freed_then_released(512)
    assert freed > 450, "the freed blocks must stay resident for this test to mean anything"
    assert released < 50
    freed, released = _freed_then_released(128)
    assert freed > 100 and released > 100
