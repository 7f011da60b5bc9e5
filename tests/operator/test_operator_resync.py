"""resync.due: which jobs the periodic resync reconciles again."""

from __future__ import annotations

import datetime

from rlhf_operator import lifecycle, resync

PERIOD = 120


def job(age_seconds: float, **status: str) -> dict:
    created = lifecycle.now() - datetime.timedelta(seconds=age_seconds)
    return {"metadata": {"name": "j", "namespace": "n", "creationTimestamp": lifecycle.timestamp(created)},
            "status": status}


def test_an_unfinished_job_older_than_a_period_is_due():
    assert resync.due(job(PERIOD + 5, phase="Running"), PERIOD)
    assert resync.due(job(PERIOD + 5), PERIOD)  # no status yet: the first reconcile failed


def test_a_new_finished_or_deleted_job_is_not():
    assert not resync.due(job(5, phase="Pending"), PERIOD)  # its create handler just ran
    assert not resync.due(job(PERIOD + 5, phase="Succeeded"), PERIOD)
    assert not resync.due(job(PERIOD + 5, phase="Failed"), PERIOD)
    deleted = job(PERIOD + 5, phase="Running")
    deleted["metadata"]["deletionTimestamp"] = deleted["metadata"]["creationTimestamp"]
    assert not resync.due(deleted, PERIOD)
