"""The operator's Prometheus metrics: jobs by phase, each job's phase and since when, the GPU- and
CPU-seconds its pods held (status.usage), reconcile durations, errors by kind."""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, get_args

import kopf
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rlhf_api import contract
from rlhf_api.v1alpha1 import Phase

PHASES = get_args(Phase)
JOB_PHASE = "rlhf_job_phase"
JOB_PHASE_ENTERED = "rlhf_job_phase_entered_timestamp_seconds"
JOB_GPU_SECONDS = "rlhf_job_gpu_seconds"  # a counter: exposed as rlhf_job_gpu_seconds_total
JOB_CPU_SECONDS = "rlhf_job_cpu_seconds"

RECONCILE_SECONDS = Histogram(
    "rlhf_operator_reconcile_duration_seconds", "Time spent in one handler run, by handler.", ["handler"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
LEADER = Gauge("rlhf_operator_leader", "1 on the replica that reconciles (holds the leader Lease), 0 on a standby.")
ERRORS = Counter("rlhf_operator_errors_total", "Handler runs that raised, by exception kind.", ["kind"])
ACTIVE = Gauge("rlhf_operator_handlers_active", "Handler runs under way, by handler (controller-runtime's "
               "active workers): a worker pool that stays full is the sign to look for.", ["handler"])


@dataclass(frozen=True)
class JobState:
    namespace: str
    name: str
    phase: str
    reason: str
    entered: float  # Unix time the job entered this phase
    gpu_seconds: float  # status.usage: kept in status, so the counters survive an operator restart
    cpu_seconds: float


class JobsByPhase(Collector):
    """Counted at scrape time from the status of every RLHFJob seen: rlhf_operator_jobs{phase}, and
    per job its phase and reason and when it entered that phase (what the stuck-job alerts measure),
    and the GPU- and CPU-seconds its pods held."""

    def __init__(self) -> None:
        self._jobs: dict[str, JobState] = {}  # uid -> state
        self._lock = threading.Lock()

    def seen(self, uid: str, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        phase = status.get("phase") or "Pending"  # not reconciled yet
        with self._lock:
            old = self._jobs.get(uid)
            entered = old.entered if old and old.phase == phase else phase_entered(phase, status)
            usage = status.get("usage") or {}
            self._jobs[uid] = JobState(namespace, name, phase, status.get("reason") or "", entered,
                                       usage.get("gpuSeconds") or 0, usage.get("cpuSeconds") or 0)

    def gone(self, uid: str) -> None:
        with self._lock:
            self._jobs.pop(uid, None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            jobs = list(self._jobs.values())
        counts = Tally(job.phase for job in jobs)
        family = GaugeMetricFamily("rlhf_operator_jobs", "RLHFJobs by phase.", labels=["phase"])
        for phase in PHASES:
            family.add_metric([phase], counts.get(phase, 0))
        yield family
        # Labelled as the trainer's series are (contract.METRIC_JOB_LABELS: job name, then namespace).
        current = GaugeMetricFamily(JOB_PHASE, "1 per RLHFJob, labelled with its status.phase and status.reason.",
                                    labels=[*contract.METRIC_JOB_LABELS, "phase", "reason"])
        entered = GaugeMetricFamily(JOB_PHASE_ENTERED, "Unix time each RLHFJob entered its current phase.",
                                    labels=[*contract.METRIC_JOB_LABELS, "phase"])
        gpu = CounterMetricFamily(JOB_GPU_SECONDS, "GPU-seconds the RLHFJob's pods held, every attempt (status.usage).",
                                  labels=contract.METRIC_JOB_LABELS)
        cpu = CounterMetricFamily(JOB_CPU_SECONDS, "CPU-core-seconds the RLHFJob's pods held, every attempt.",
                                  labels=contract.METRIC_JOB_LABELS)
        for job in jobs:
            current.add_metric([job.name, job.namespace, job.phase, job.reason], 1)
            entered.add_metric([job.name, job.namespace, job.phase], job.entered)
            gpu.add_metric([job.name, job.namespace], job.gpu_seconds)
            cpu.add_metric([job.name, job.namespace], job.cpu_seconds)
        yield from (current, entered, gpu, cpu)


def phase_entered(phase: str, status: Mapping[str, Any]) -> float:
    """When the job entered phase: the lastTransitionTime of its true condition of the same name
    (Running, Succeeded, Failed, Suspended), so an operator restart keeps it; Pending and
    Provisioning have no condition of their own, so for them it is when this process first saw it."""
    for condition in status.get("conditions") or ():
        if condition.get("type") == phase and condition.get("status") == "True":
            return datetime.fromisoformat(condition["lastTransitionTime"]).timestamp()
    return time.time()


JOBS = JobsByPhase()
REGISTRY.register(JOBS)


@contextmanager
def measured(handler: str) -> Iterator[None]:
    """Time a handler run and count what it raises (the exception still propagates to kopf). A
    TemporaryError is kopf's scheduled retry of a job that waits (e.g. for a ConfigMap), not an error."""
    with ACTIVE.labels(handler).track_inprogress(), RECONCILE_SECONDS.labels(handler).time():
        try:
            yield
        except kopf.TemporaryError:
            raise
        except Exception as error:
            ERRORS.labels(type(error).__name__).inc()
            raise


def serve(port: int) -> None:
    start_http_server(port)
