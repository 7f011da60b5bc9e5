"""Leader election on a coordination.k8s.io Lease, so that replicas > 1 is safe.

The rules are client-go's (kube-controller-manager, controller-runtime): one replica holds the
Lease and renews it every retry period; the others poll it and take it over only after they have
seen the same renewal for a whole lease duration by their own clock (no trust in other machines'
clocks). A leader that cannot renew within the renew deadline (shorter than the lease duration)
stops reconciling, so it has stopped before anyone may take over. A leader that exits cleanly
releases the Lease, so a rolling update hands over at once.

Every Lease call runs on one thread of the elector's own, with a client of its own whose requests
time out at the renew deadline, and a leader's renewals are timed by another thread of its own:
neither handlers, the resync nor the TTL and deadline daemons (asyncio's default executor, the
event loop) can delay a renewal, and a renewal hung on a half-open connection counts as failed
once the deadline passes, as client-go bounds each renew round by the renew deadline.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client.exceptions import ApiException

from .kube import Kube

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Timing:
    """client-go's defaults; the renew deadline must be shorter than the lease duration."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError("leader election needs 0 < retry period < renew deadline < lease duration "
                             f"(got {self.retry_period}, {self.renew_deadline}, {self.lease_duration})")


def default_identity() -> str:
    """The pod's name (its hostname) and a random suffix: a restarted container is a new candidate."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


@dataclass
class Elector:
    namespace: str
    name: str
    identity: str = field(default_factory=default_identity)
    timing: Timing = field(default_factory=Timing)
    # The last Lease record seen held by another candidate, and when (our monotonic clock) it changed.
    _observed: tuple[Any, float] | None = None
    kube: Kube | None = None  # default: a client of its own, made on first use
    answered: float | None = None  # time.monotonic() of the API server's last answer to a Lease read
    _calls: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="lease"), init=False, repr=False)
    _stopping: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _keeper: threading.Thread | None = field(default=None, init=False, repr=False)

    @property
    def api(self) -> Kube:
        if self.kube is None:  # its own connections, no request outlives the renew deadline
            deadline = self.timing.renew_deadline
            self.kube = Kube.from_environment(timeout=(deadline, deadline))
        return self.kube

    def ready(self) -> bool:
        """The API server answered a Lease read within the renew deadline (a leader renews and a
        standby polls every retry period): this replica can lead, or goes on leading."""
        return self.answered is not None and time.monotonic() - self.answered < self.timing.renew_deadline

    def try_acquire_or_renew(self) -> bool:
        """One attempt: True when this candidate holds the Lease afterwards."""
        lease = self.api.get("Lease", self.namespace, self.name)
        self.answered = time.monotonic()
        if lease is None:
            return self._write(None, self._record(acquiring=True, transitions=0))
        spec = lease.get("spec", {})
        holder = spec.get("holderIdentity") or ""
        if holder and holder != self.identity and not self._expired(spec):
            return False
        acquiring = holder != self.identity
        transitions = spec.get("leaseTransitions", 0) + (1 if acquiring else 0)
        record = self._record(acquiring=acquiring, transitions=transitions)
        if not acquiring:
            record["acquireTime"] = spec.get("acquireTime", record["acquireTime"])
        return self._write(lease["metadata"]["resourceVersion"], record)

    def _expired(self, spec: dict[str, Any]) -> bool:
        key = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        if self._observed is None or self._observed[0] != key:
            self._observed = (key, time.monotonic())
        return time.monotonic() - self._observed[1] >= (spec.get("leaseDurationSeconds") or 0)

    def _record(self, acquiring: bool, transitions: int) -> dict[str, Any]:
        now = _now()
        return {"holderIdentity": self.identity, "leaseDurationSeconds": max(1, round(self.timing.lease_duration)),
                "acquireTime": now, "renewTime": now, "leaseTransitions": transitions}

    def _write(self, resource_version: str | None, spec: dict[str, Any]) -> bool:
        try:
            if resource_version is None:
                self.api.create({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                  "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec})
            else:  # conditional on what we read: two candidates never both win
                self.api.patch("Lease", self.namespace, self.name,
                                {"metadata": {"resourceVersion": resource_version}, "spec": spec})
        except ApiException as error:
            if error.status in (404, 409):  # someone else wrote first
                return False
            raise
        return True

    async def acquire(self) -> None:
        """Wait until this candidate leads (API errors are retried: the API server may be away)."""
        log.info("leader election: waiting for Lease %s/%s as %s", self.namespace, self.name, self.identity)
        while not await asyncio.get_running_loop().run_in_executor(self._calls, self._attempt):
            await asyncio.sleep(self.timing.retry_period)
        log.info("leader election: %s leads (Lease %s/%s)", self.identity, self.namespace, self.name)

    def keep(self, lost: Callable[[], None]) -> None:
        """Renew every retry period from a thread of its own; call lost() there, once, when no
        renewal has succeeded within the renew deadline (a renewal still hanging counts as failed)."""
        self._keeper = threading.Thread(target=self._keep, args=(lost,), name="lease-renewal", daemon=True)
        self._keeper.start()

    def _keep(self, lost: Callable[[], None]) -> None:
        renewed = time.monotonic()
        while not self._stopping.wait(self.timing.retry_period):
            started = time.monotonic()  # the renewal is written after this: standbys count from later
            left = renewed + self.timing.renew_deadline - started
            try:
                ok = left > 0 and self._calls.submit(self._attempt).result(timeout=left)
            except TimeoutError:  # hung: the call's own timeout frees the Lease thread later
                ok = False
            if ok:
                renewed = started
            elif time.monotonic() - renewed >= self.timing.renew_deadline and not self._stopping.is_set():
                log.error("leader election: %s lost Lease %s/%s (no renewal for %.1f s)",
                          self.identity, self.namespace, self.name, time.monotonic() - renewed)
                lost()
                return

    def _attempt(self) -> bool:
        try:
            return self.try_acquire_or_renew()
        except Exception as error:  # noqa: BLE001  (the API server away, a timeout: try again)
            log.warning("leader election: Lease %s/%s: %s", self.namespace, self.name, error)
            return False

    def release(self) -> None:
        """Stop renewing and give the Lease up (on a clean exit), so that a standby takes over
        without waiting it out. After the last renewal: one running after would take it back."""
        self._stopping.set()
        if self._keeper is not None:
            self._keeper.join()
        self._calls.submit(self._release).result()

    def _release(self) -> None:
        try:
            lease = self.api.get("Lease", self.namespace, self.name)
            if lease and lease.get("spec", {}).get("holderIdentity") == self.identity and self._write(
                    lease["metadata"]["resourceVersion"],
                    {"holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _now()}):
                log.info("leader election: %s released Lease %s/%s", self.identity, self.namespace, self.name)
        except Exception as error:  # noqa: BLE001  (the API server away: the Lease runs out instead)
            log.warning("leader election: could not release Lease %s/%s: %s", self.namespace, self.name, error)
