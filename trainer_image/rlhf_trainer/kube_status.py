"""Report training progress into the job's own RLHFJob status (the status subresource).

Runs as the per-job ServiceAccount, which may patch `rlhfjobs/status` of this one job and nothing
else. Reporting must never slow or stop training, so the training thread only hands its update to
a sender thread and returns. Updates are merge patches, and the outbox holds one: a newer update
merges over an older one not yet sent (the newest value of each field wins, and no field an older
update set is lost), so it stays one status's size however long the API server is away. The
trainer's one condition (learning_signal.py) is written into the operator's conditions list by a
read and a write conditional on what was read. The
sender retries failed patches with jittered backoff (at most SENDER_BACKOFF.cap apart, or the
server's Retry-After) until they go through; only a refusal that no retry can change (a 4xx other
than 408, 409 or 429) drops the update it was for.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from rlhf_api import contract
from rlhf_api import v1alpha1 as api

from . import learning_signal
from .backoff import Backoff, retry_after

log = logging.getLogger(__name__)
# reporter.finish(status) -> status.progress.result; an interrupted run has none: it resumes when rerun.
RESULTS = {"succeeded": "Succeeded", "failed": "Failed"}
SENDER_BACKOFF = Backoff(base=0.5, cap=10.0)  # an API server back from a restart hears from us within ~10 s
REQUEST_TIMEOUT = 10.0  # seconds per patch: a hung connection must not hold newer updates back
FINISH_TIMEOUT = 30.0  # seconds finish() waits for the final status to be delivered
CONDITION_KEY = "condition"  # in an update: learning_signal's condition, written into status.conditions
CONFLICT_ATTEMPTS = 5  # reads and conditional writes of the conditions list before the sender's backoff


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


STATUS_DIGITS = 4  # significant digits of a metric in status: `kubectl get` shows them (the full ones are in metrics.jsonl)


def _rounded(value: float) -> float:
    return float(f"{float(value):.{STATUS_DIGITS}g}")


def status_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The trainer's metrics that status.metrics has fields for, under their API names, to STATUS_DIGITS."""
    known: dict = {k: _rounded(v) for k, v in metrics.items() if k in api.Metrics.model_fields and k != "evaluation"}
    # eval/<set>/<metric> and eval/best/... (evaluation.py) under status.metrics.evaluation
    evaluation = {k.removeprefix("eval/"): _rounded(v) for k, v in metrics.items() if k.startswith("eval/")}
    return api.Metrics(**known, evaluation=evaluation or None).model_dump(by_alias=True, exclude_none=True)


def merge_patches(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """One JSON merge patch (RFC 7386) doing what applying older, then newer does (for patches whose
    objects nest alike, as status updates do)."""
    merged = dict(older)
    for key, value in newer.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_patches(merged[key], value)
        else:
            merged[key] = value
    return merged


def _retry_after(error: Exception) -> float | None:
    headers = getattr(error, "headers", None) or {}
    return retry_after(headers.get("Retry-After"))


def _hopeless(error: Exception) -> bool:
    """A refusal a retry cannot change: the patch itself is wrong, or the job or our rights are gone."""
    status = getattr(error, "status", None)
    return isinstance(status, int) and 400 <= status < 500 and status not in (408, 409, 429)


class KubernetesStatusReporter:
    """A Reporter that patches status.progress, status.metrics and status.lastCheckpoint.

    log() hands an update over at most every min_interval seconds (the rest wait for the next
    one); start(), checkpoint() and finish() hand theirs over at once. Only finish() waits: up to
    finish_timeout seconds, for everything to be delivered. close() stops the sender.
    """

    def __init__(
        self,
        name: str,
        namespace: str,
        custom_objects: Any,  # kubernetes.client.CustomObjectsApi
        *,
        min_interval: float = 5.0,
        backoff: Backoff = SENDER_BACKOFF,
        request_timeout: float = REQUEST_TIMEOUT,
        finish_timeout: float = FINISH_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.name, self.namespace, self.api = name, namespace, custom_objects
        self.min_interval, self.backoff, self.clock = min_interval, backoff, clock
        self.request_timeout, self.finish_timeout = request_timeout, finish_timeout
        self.total_steps = 0
        self.started = clock()
        self.last_handed: float | None = None  # when log() last handed an update over
        self.held: dict[str, Any] = {}  # logged, waiting for min_interval (the training thread's own)
        # Shared with the sender, under `changed`:
        self.changed = threading.Condition()
        self.outbox: dict[str, Any] = {}  # the merged patch the sender is to deliver
        self.sending = False  # a patch is on its way
        self.closed = False
        self.failures = 0  # consecutive failed patches
        self.sender: threading.Thread | None = None

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

    # Reporter protocol (the training thread) -----------------------------------------------------

    def start(self, total_steps: int) -> None:
        self.total_steps = total_steps
        self.started = self.clock()
        self._progress(0)
        self._hand_over()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._progress(step)
        self.held["metrics"] = status_metrics(metrics)
        if (condition := learning_signal.condition(metrics)) is not None:
            # Sent with every update while it holds: the operator writes the conditions list whole and may
            # have dropped ours from a read older than our write.
            self.held[CONDITION_KEY] = condition
        if self.last_handed is None or self.clock() - self.last_handed >= self.min_interval:
            self._hand_over()

    def checkpoint(self, step: int, path: str) -> None:
        self.held["lastCheckpoint"] = {"step": step, "path": path, "time": _now()}
        self._hand_over()  # a checkpoint is what a restart resumes from: report it at once

    def finish(self, status: str, message: str = "") -> None:
        # How the run ended, for the operator: a RayJob deleted before KubeRay's verdict was mirrored
        # must not be rerun after training completed.
        if status in RESULTS:
            self.held.setdefault("progress", {})["result"] = RESULTS[status]
        self._hand_over()
        if not self.wait(self.finish_timeout):
            log.warning("the final status of RLHFJob %s/%s was not delivered within %gs; the operator will go by "
                        "the RayJob's status", self.namespace, self.name, self.finish_timeout)

    # ---------------------------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every update handed over has been delivered (or refused for good); False if
        timeout came first."""
        with self.changed:
            return self.changed.wait_for(lambda: not (self.outbox or self.sending), timeout)

    def close(self) -> None:
        """Stop the sender; what it has not delivered is dropped."""
        with self.changed:
            self.closed = True
            self.changed.notify_all()
        if self.sender is not None:
            self.sender.join(self.request_timeout + 1)

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
        self.held["progress"] = progress

    def _hand_over(self) -> None:
        """Give what is held to the sender, merged over what it has not sent yet; never blocks on the network."""
        update, self.held = self.held, {}
        self.last_handed = self.clock()
        with self.changed:
            self.outbox = merge_patches(self.outbox, update)
            self.closed = False
            if self.sender is None or not self.sender.is_alive():
                self.sender = threading.Thread(target=self._send, name=f"status-{self.name}", daemon=True)
                self.sender.start()
            self.changed.notify_all()

    def _send(self) -> None:
        """The sender thread: patch the outbox until closed, retrying with backoff."""
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.outbox or self.closed)
                if self.closed:
                    return
                body, self.outbox, self.sending = self.outbox, {}, True
            error = self._patch(body)
            with self.changed:
                self.sending = False
                if error is None or _hopeless(error):
                    if error is not None:
                        log.warning("RLHFJob %s/%s refused a status update, dropped: %s", self.namespace, self.name, error)
                    elif self.failures:
                        log.info("status updates of RLHFJob %s/%s delivered again after %d failed attempts",
                                 self.namespace, self.name, self.failures)
                    self.failures = 0
                    self.changed.notify_all()
                    continue
                self.outbox = merge_patches(body, self.outbox)  # what came meanwhile is newer
                delay = self.backoff.delay(self.failures, _retry_after(error))
                if not self.failures:
                    log.warning("cannot report the status of RLHFJob %s/%s (%s); retrying in the background",
                                self.namespace, self.name, error)
                self.failures += 1
                self.changed.wait_for(lambda: self.closed, delay)

    def _patch(self, body: dict[str, Any]) -> Exception | None:
        status = {field: value for field, value in body.items() if field != CONDITION_KEY}
        try:
            # A merge patch on the status subresource: it touches only these fields, so it cannot
            # clobber the operator's phase and conditions, and needs no resourceVersion.
            if status:
                self._patch_status({"status": status})
            if condition := body.get(CONDITION_KEY):
                self._put_condition(condition)
        except Exception as error:  # noqa: BLE001 - whatever failed, training goes on
            return error
        return None

    def _patch_status(self, body: dict[str, Any]) -> None:
        self.api.patch_namespaced_custom_object_status(api.GROUP, api.VERSION, self.namespace, api.PLURAL, self.name,
                                                       body, _request_timeout=self.request_timeout)

    def _put_condition(self, condition: dict[str, str]) -> None:
        """One condition of the list the operator writes (status.py keeps the types it does not own): a list is
        replaced whole by a merge patch, so the write is conditional on the version read, and read again on a
        conflict. lastTransitionTime moves only when the condition's status flips."""
        for attempt in range(CONFLICT_ATTEMPTS):
            job = self.api.get_namespaced_custom_object(api.GROUP, api.VERSION, self.namespace, api.PLURAL, self.name,
                                                        _request_timeout=self.request_timeout)
            conditions = (job.get("status") or {}).get("conditions") or []
            old = next((c for c in conditions if c["type"] == condition["type"]), None)
            if old and all(old.get(key) == value for key, value in condition.items()):
                return
            since = old["lastTransitionTime"] if old and old["status"] == condition["status"] else _now()
            conditions = [c for c in conditions if c["type"] != condition["type"]] + [
                condition | {"lastTransitionTime": since}]
            try:
                self._patch_status({"metadata": {"resourceVersion": job["metadata"]["resourceVersion"]},
                                    "status": {"conditions": conditions}})
                return
            except Exception as error:  # noqa: BLE001 - a conflict is tried again; the rest is the sender's
                if getattr(error, "status", None) != 409 or attempt == CONFLICT_ATTEMPTS - 1:
                    raise
