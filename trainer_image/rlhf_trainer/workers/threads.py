"""Torch threads on CPU: every phase of a step on all of the node's cores.

On CPU the engine and the model groups take turns (generation, scoring, update, weight sync), as
the hybrid engine's share a GPU. Ray's bundles give each of them a share of one CPU, and Ray sets
OMP_NUM_THREADS=1 in such an actor: each phase then ran on one core while the others idled. Here
each process that works in a phase runs torch on the cores its pod (or machine) has, divided among
the processes of its kind that work at the same time (a group's ranks, an engine's tensor-parallel
workers), and OpenMP threads sleep while their process waits (OMP_WAIT_POLICY=PASSIVE: libgomp
otherwise spins after each parallel region, on cores the next phase needs). On GPUs nothing changes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"
# Set before torch loads (Ray's runtime_env): libgomp reads it when it starts.
CPU_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may run on: its affinity, bounded by its cgroup's quota (a pod's CPU limit,
    rounded down, at least 1)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, math.floor(int(quota) / int(period))))


def share_the_cores(processes: int, cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """Run torch in this process on its share of the cores, among `processes` that work at once; the
    thread count set (also in OMP_NUM_THREADS, for the processes it starts: vLLM's engine core)."""
    import torch

    threads = max(1, usable_cpus(cpu_max) // max(1, processes))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads
