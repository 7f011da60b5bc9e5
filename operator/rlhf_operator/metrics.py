"""The operator's Prometheus metrics: jobs by phase, reconcile durations, errors by kind."""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Iterator
from contextlib import contextmanager

import kopf
from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PHASES = ("Pending", "Provisioning", "Running", "Succeeded", "Failed", "Suspended")

RECONCILE_SECONDS = Histogram(
    "rlhf_operator_reconcile_duration_seconds", "Time spent in one handler run, by handler.", ["handler"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
ERRORS = Counter("rlhf_operator_errors_total", "Handler runs that raised, by exception kind.", ["kind"])


class JobsByPhase(Collector):
    """rlhf_operator_jobs{phase}: counted at scrape time from the phase of every RLHFJob seen."""

    def __init__(self) -> None:
        self._phases: dict[str, str] = {}  # uid -> phase
        self._lock = threading.Lock()

    def seen(self, uid: str, phase: str | None) -> None:
        with self._lock:
            self._phases[uid] = phase or "Pending"  # not reconciled yet

    def gone(self, uid: str) -> None:
        with self._lock:
            self._phases.pop(uid, None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            counts = Tally(self._phases.values())
        family = GaugeMetricFamily("rlhf_operator_jobs", "RLHFJobs by phase.", labels=["phase"])
        for phase in PHASES:
            family.add_metric([phase], counts.get(phase, 0))
        yield family


JOBS = JobsByPhase()
REGISTRY.register(JOBS)


@contextmanager
def measured(handler: str) -> Iterator[None]:
    """Time a handler run and count what it raises (the exception still propagates to kopf). A
    TemporaryError is kopf's scheduled retry of a job that waits (e.g. for a ConfigMap), not an error."""
    with RECONCILE_SECONDS.labels(handler).time():
        try:
            yield
        except kopf.TemporaryError:
            raise
        except Exception as error:
            ERRORS.labels(type(error).__name__).inc()
            raise


def serve(port: int) -> None:
    start_http_server(port)
