"""Report training progress into the job's own RLHFJob status (the status subresource).

Runs as the per-job ServiceAccount, which may patch `rlhfjobs/status` of this one job and nothing
else. Reporting must never stop training: API errors are retried a few times, then the update is
dropped (the next one carries the newest numbers anyway).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from rlhf_api import contract
from rlhf_api import v1alpha1 as api

log = logging.getLogger(__name__)
RESULTS = {"succeeded": "Succeeded", "failed": "Failed"}  # reporter.finish(status) -> status.progress.result


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The trainer's metrics that status.metrics has fields for, under their API names."""
    known = {k: float(v) for k, v in metrics.items() if k in api.Metrics.model_fields}
    return api.Metrics(**known).model_dump(by_alias=True, exclude_none=True)


class KubernetesStatusReporter:
    """A Reporter that patches status.progress, status.metrics and status.lastCheckpoint."""

    def __init__(
        self,
        name: str,
        namespace: str,
        custom_objects: Any,  # kubernetes.client.CustomObjectsApi
        *,
        min_interval: float = 5.0,
        retries: int = 3,
        retry_delay: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name, self.namespace, self.api = name, namespace, custom_objects
        self.min_interval, self.retries, self.retry_delay, self.clock = min_interval, retries, retry_delay, clock
        self.total_steps = 0
        self.started = clock()
        self.last_sent: float | None = None
        self.pending: dict[str, Any] = {}

    @classmethod
    def from_environment(cls, **kwargs: Any) -> KubernetesStatusReporter | None:
        """Inside an RLHFJob's Ray cluster (the operator sets the job's name and namespace); else None."""
        name, namespace = os.environ.get(contract.JOB_NAME_ENV), os.environ.get(contract.JOB_NAMESPACE_ENV)
        if not (name and namespace):
            return None
        from kubernetes import client, config

        if os.environ.get("KUBECONFIG"):
            config.load_kube_config()
        else:
            config.load_incluster_config()
        return cls(name, namespace, client.CustomObjectsApi(), **kwargs)

    # Reporter protocol --------------------------------------------------------------------------

    def start(self, total_steps: int) -> None:
        self.total_steps = total_steps
        self.started = self.clock()
        self._progress(0)
        self.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._progress(step)
        self.pending["metrics"] = status_metrics(metrics)
        if self.last_sent is None or self.clock() - self.last_sent >= self.min_interval:
            self.flush()

    def checkpoint(self, step: int, path: str) -> None:
        self.pending["lastCheckpoint"] = {"step": step, "path": path, "time": _now()}
        self.flush()  # a checkpoint is what a restart resumes from: report it at once

    def finish(self, status: str, message: str = "") -> None:
        # How the run ended, for the operator: a RayJob deleted before KubeRay's verdict was mirrored
        # must not be rerun after training completed.
        self.pending.setdefault("progress", {})["result"] = RESULTS[status]
        self.flush()

    # --------------------------------------------------------------------------------------------

    def _progress(self, step: int) -> None:
        total = max(self.total_steps, 0)
        elapsed = self.clock() - self.started
        eta = int(elapsed / step * (total - step)) if 0 < step <= total else None
        progress = {
            "step": step,
            "totalSteps": total,
            "percent": round(100.0 * step / total, 1) if total else 0.0,
            "summary": f"{step}/{total}",
            "updated": _now(),
            "result": None,  # a merge patch: null clears the previous attempt's result
        }
        if eta is not None:
            progress["etaSeconds"] = eta
        self.pending["progress"] = progress

    def flush(self) -> bool:
        """Send what is pending; True when the API server took it."""
        if not self.pending:
            return True
        body = {"status": self.pending}
        for attempt in range(self.retries + 1):
            try:
                # A merge patch on the status subresource: it touches only these fields, so it
                # cannot clobber the operator's phase and conditions, and needs no resourceVersion.
                self.api.patch_namespaced_custom_object_status(
                    api.GROUP, api.VERSION, self.namespace, api.PLURAL, self.name, body)
            except Exception as error:  # noqa: BLE001 - any failure here must not stop training
                if attempt == self.retries:
                    log.warning("could not report status of RLHFJob %s/%s: %s", self.namespace, self.name, error)
                    return False
                time.sleep(self.retry_delay * 2**attempt)
            else:
                self.pending = {}
                self.last_sent = self.clock()
                return True
        return False
