"""Every unfinished RLHFJob reconciled again once per period, whatever its events: the safety net
for a lost watch event or a status mirror that failed (controller-runtime's SyncPeriod).

Not a kopf timer: kopf puts its finalizer on every object a timer runs for, which costs each new
job a write and a watch event before its first reconcile, and leaves a job deleted while no
operator runs Terminating. One task walks the jobs index instead and spreads the jobs over the
period. It is started from an RLHFJob event handler (handlers.count_job), so it runs in kopf's
handler context: the Events a resync posts go through kopf's queue, as every handler's do.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from . import lifecycle, metrics, reconcile
from .status import finished

log = logging.getLogger(__name__)
_task: asyncio.Task | None = None


def due(body: dict[str, Any], period: float) -> bool:
    """Unfinished, not being deleted, and older than a period (a new job was just reconciled)."""
    meta = body["metadata"]
    if meta.get("deletionTimestamp") or finished(body.get("status")):
        return False
    created = meta.get("creationTimestamp")
    return created is None or (lifecycle.now() - lifecycle.parse(created)).total_seconds() >= period


async def forever(period: float, reads: Any) -> None:
    """Each period, reconcile (in a thread) every job that is due, one after another, evenly spaced.
    reads: handlers.Watched, whose jobs index lists the jobs and gives each one's newest copy."""
    while True:
        keys = list(reads.jobs)
        if not keys:
            await asyncio.sleep(period)
        for namespace, name in keys:
            await asyncio.sleep(period / len(keys))
            job = reads.job(namespace, name)
            if job is None or not due(job, period):
                continue
            try:
                with metrics.measured("resync"):
                    await asyncio.to_thread(reconcile.reconcile, job, reads)
            except Exception as error:  # the job's status says why it waits; the next pass tries again
                log.info("resync of RLHFJob %s/%s: %s", namespace, name, error)


def start(period: float, reads: Any) -> None:
    """Start the resync task unless it runs (a new event loop, as in a second kopf run, needs a new one)."""
    global _task
    if _task is None or _task.done():
        _task = asyncio.create_task(forever(period, reads), name="rlhf-resync")
