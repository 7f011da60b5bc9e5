"""Every unfinished RLHFJob reconciled again once per period, whatever its events: the safety net
for a lost watch event or a status mirror that failed (controller-runtime's SyncPeriod).

Each due job is read from the API server before it is reconciled: the index keeps the jobs deleted
while a watch was down (reconcile.resync), and those must not be acted on.

Not a kopf timer: kopf puts its finalizer on every object a timer runs for, which costs each new
job a write and a watch event before its first reconcile, and leaves a job deleted while no
operator runs Terminating. One task walks the jobs index instead. It is started from an RLHFJob
event handler (handlers.count_job), so it runs in kopf's handler context: the Events a resync
posts go through kopf's queue, as every handler's do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from . import metrics, reconcile, usage
from .status import finished

log = logging.getLogger(__name__)
TICKS_PER_PERIOD = 20  # a job is resynced at most a twentieth of a period late
_task: asyncio.Task | None = None


def due(body: dict[str, Any]) -> bool:
    """Unfinished, or with pods counted as running (usage.settle), and not being deleted."""
    return not body["metadata"].get("deletionTimestamp") and (
        not finished(body.get("status")) or usage.running(body.get("status")))


async def forever(period: float, reads: Any, clock: Callable[[], float] = time.monotonic) -> None:
    """Reconcile (in a thread) each job that is due a period after this operator first saw it, then
    every period, as kopf's timers did: the jobs of a burst stay spread as they came, and the jobs
    found at startup (which kopf's resume handler has just reconciled) wait a period.
    reads: handlers.Watched; its jobs index lists the jobs, each name with every copy it keeps (see
    reconcile.resync: a name's older copies are ghosts, which the metrics then forget).
    clock: when each pass happens (a test steps it)."""
    last: dict[str, float] = {}  # uid -> clock() when first seen, then of its last resync
    while True:
        await asyncio.sleep(period / TICKS_PER_PERIOD)
        seen = set()
        for (namespace, name), copies in list(reads.jobs.items()):
            for job in list(copies):
                if not due(job):
                    continue
                uid = job["metadata"]["uid"]
                seen.add(uid)
                now = clock()
                if now - last.setdefault(uid, now) < period:
                    continue
                last[uid] = now
                try:
                    with metrics.measured("resync"):
                        if not await asyncio.to_thread(reconcile.resync, namespace, name, uid, reads):
                            metrics.JOBS.gone(uid)  # a ghost of the index: no alert is to fire for it
                except Exception as error:  # the job's status says why it waits; the next pass tries again
                    log.info("resync of RLHFJob %s/%s: %s", namespace, name, error)
        for gone in last.keys() - seen:
            del last[gone]


def start(period: float, reads: Any) -> None:
    """Start the resync task unless it runs (a new event loop, as in a second kopf run, needs a new one)."""
    global _task
    if _task is None or _task.done():
        _task = asyncio.create_task(forever(period, reads), name="rlhf-resync")
