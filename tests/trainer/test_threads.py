"""Torch threads on CPU (workers/threads.py): each phase on its share of the pod's cores."""

from __future__ import annotations

import os

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
