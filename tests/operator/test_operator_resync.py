"""resync.py: which jobs the periodic resync reconciles again, and when."""

from __future__ import annotations

import asyncio

from rlhf_api import contract
from rlhf_operator import resync

PERIOD = 1.0  # a quarter of it is exact in binary floating point: the clock steps by quarters


def job(uid: str, **status: str) -> dict:
    return {"metadata": {"name": uid, "namespace": "n", "uid": uid}, "status": status}


def test_an_unfinished_job_is_due_a_finished_or_deleted_one_is_not():
    assert resync.due(job("a", phase="Running")) and resync.due(job("a"))  # no status: its first reconcile failed
    assert not resync.due(job("a", phase="Succeeded")) and not resync.due(job("a", phase="Failed"))
    deleted = job("a", phase="Running")
    deleted["metadata"]["deletionTimestamp"] = "2026-11-23T00:00:00Z"
    assert not resync.due(deleted)


class Jobs:
    """The member of handlers.Watched that resync reads: the jobs index (name -> every copy kept).
    passes: how many times it was read, once a pass."""

    def __init__(self, *jobs: dict):
        self.index: dict[tuple[str, str], list[dict]] = {}
        for j in jobs:
            self.index.setdefault((j["metadata"]["namespace"], j["metadata"]["name"]), []).append(j)
        self.passes = 0

    @property
    def jobs(self) -> dict:
        self.passes += 1
        return self.index


async def passes(reads: Jobs, count: int, task: asyncio.Task) -> None:
    """Until the resync has begun `count` passes (a resync that raised raises here)."""
    while reads.passes < count:
        if task.done():
            task.result()
        await asyncio.sleep(PERIOD / resync.TICKS_PER_PERIOD)


def test_each_unfinished_job_is_reconciled_a_period_after_it_was_seen_then_every_period(monkeypatch):
    """On a clock the test steps a quarter period at a time, with a whole pass after each step."""
    now = [0.0]
    calls: dict[str, list[float]] = {"running": [], "done": []}

    def reconciled(namespace: str, name: str, uid: str, reads: Jobs) -> bool:
        calls[uid].append(now[0])
        return True  # it exists

    monkeypatch.setattr(resync.reconcile, "resync", reconciled)
    reads = Jobs(job("running", phase="Running"), job("done", phase="Succeeded"))

    async def run() -> None:
        task = asyncio.create_task(resync.forever(PERIOD, reads, clock=lambda: now[0]))
        for step in range(1, 10):
            # Two more passes begin: the first of them has run whole on this step's clock.
            await passes(reads, reads.passes + 2, task)
            now[0] = step * PERIOD / 4
        task.cancel()

    asyncio.run(run())
    assert calls == {"running": [PERIOD, 2 * PERIOD], "done": []}


def test_a_ghost_is_not_reconciled_and_the_metrics_forget_it(monkeypatch):
    """A job deleted while the watch was down stays in kopf's index, here beside the job re-created
    under its name: reconcile.resync finds it gone, and its phase series goes."""
    now = [0.0]
    ghost, new = job("ghost", phase="Pending"), job("new", phase="Pending")
    new["metadata"]["name"] = ghost["metadata"]["name"]
    reads = Jobs(ghost, new)
    resynced = []

    def resync_exists(namespace: str, name: str, uid: str, reads: Jobs) -> bool:
        resynced.append(uid)
        return uid == "new"  # what the API server answers

    monkeypatch.setattr(resync.reconcile, "resync", resync_exists)
    for uid in ("ghost", "new"):
        resync.metrics.JOBS.seen(uid, "n", "ghost", {"phase": "Pending"})

    async def run() -> None:
        task = asyncio.create_task(resync.forever(PERIOD, reads, clock=lambda: now[0]))
        await passes(reads, 2, task)  # the first pass saw both at 0
        now[0] = PERIOD
        await passes(reads, 4, task)  # the third pass ran whole on the new clock
        task.cancel()

    asyncio.run(run())
    phases = next(family for family in resync.metrics.JOBS.collect() if family.name == resync.metrics.JOB_PHASE)
    named = [sample.labels for sample in phases.samples if sample.labels[contract.METRIC_JOB_LABELS[0]] == "ghost"]
    resync.metrics.JOBS.gone("new")
    assert sorted(resynced) == ["ghost", "new"]
    assert len(named) == 1  # the re-created job's
