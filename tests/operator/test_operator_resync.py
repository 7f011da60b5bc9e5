"""resync.py: which jobs the periodic resync reconciles again, and when."""

from __future__ import annotations

import asyncio
import time

from rlhf_operator import resync

PERIOD = 0.3


def job(uid: str, **status: str) -> dict:
    return {"metadata": {"name": uid, "namespace": "n", "uid": uid}, "status": status}


def test_an_unfinished_job_is_due_a_finished_or_deleted_one_is_not():
    assert resync.due(job("a", phase="Running")) and resync.due(job("a"))  # no status: its first reconcile failed
    assert not resync.due(job("a", phase="Succeeded")) and not resync.due(job("a", phase="Failed"))
    deleted = job("a", phase="Running")
    deleted["metadata"]["deletionTimestamp"] = "2026-11-23T00:00:00Z"
    assert not resync.due(deleted)


class Jobs:
    """handlers.Watched's two members resync reads: the index's keys and the newest copy of a job."""

    def __init__(self, *jobs: dict):
        self.jobs = {(j["metadata"]["namespace"], j["metadata"]["name"]): j for j in jobs}

    def job(self, namespace: str, name: str) -> dict | None:
        return self.jobs.get((namespace, name))


def test_each_unfinished_job_is_reconciled_a_period_after_it_was_seen_then_every_period(monkeypatch):
    calls: dict[str, list[float]] = {"running": [], "done": []}
    monkeypatch.setattr(resync.reconcile, "reconcile", lambda body, reads: calls[body["metadata"]["uid"]].append(
        time.monotonic()))

    async def run() -> float:
        started = time.monotonic()
        task = asyncio.create_task(resync.forever(PERIOD, Jobs(job("running", phase="Running"),
                                                               job("done", phase="Succeeded"))))
        while len(calls["running"]) < 2 and time.monotonic() - started < 30:
            await asyncio.sleep(0.05)
        task.cancel()
        return started

    started = asyncio.run(run())
    first, second = calls["running"][:2]
    assert first - started >= PERIOD and second - first >= PERIOD  # never sooner than a period
    assert calls["done"] == []
