"""resync.py: which jobs the periodic resync reconciles again, and when."""

from __future__ import annotations

import asyncio

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
    """handlers.Watched's two members resync reads: the index's keys and the newest copy of a job.
    passes: how many times the keys were read, one a pass."""

    def __init__(self, *jobs: dict):
        self.index = {(j["metadata"]["namespace"], j["metadata"]["name"]): j for j in jobs}
        self.passes = 0

    @property
    def jobs(self) -> dict:
        self.passes += 1
        return self.index

    def job(self, namespace: str, name: str) -> dict | None:
        return self.index.get((namespace, name))


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
            passes = reads.passes
            while reads.passes < passes + 2:
                await asyncio.sleep(PERIOD / resync.TICKS_PER_PERIOD)
            now[0] = step * PERIOD / 4
        task.cancel()

    asyncio.run(run())
    assert calls == {"running": [PERIOD, 2 * PERIOD], "done": []}
