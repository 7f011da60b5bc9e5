"""The operator's reconcile functions called in-process on the real control plane, as kopf calls them.

For the tests that reach branches an operator run reaches only by chance: reconcile's client on
the control plane noting its writes (`OperatorKube`, the `operator_client` fixture), kopf's own
event poster sending kopf.event() to the API server (`KopfEventPoster`), and `posted` to read
those Events back in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import kopf
import pytest
from kopf._cogs.clients import auth, scanning
from kopf._cogs.structs import credentials, references
from kopf._core.engines import posting
from kubernetes.client.exceptions import ApiException

import rlhf_operator.kube as operator_kube
from e2e.fixtures import wait_for
from e2e.operator.jobs import children
from rlhf_operator import settings as operator_settings
from rlhf_api import v1alpha1 as api
from rlhf_operator.kube import Kube
from rlhf_operator.names import MANAGED_BY

log = logging.getLogger(__name__)

KINDS = ("ConfigMap", "ServiceAccount", "Role", "RoleBinding", "RayJob")
BARRIER = "E2EBarrier"
HOLD = "e2e.rlhf.dev/hold"
CRD = "rlhfjobs.rlhf.dev"
SAMPLES_MINIMUM = ("/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/rollout"
                   "/properties/samplesPerPrompt/minimum")


class KopfEventPoster:
    """kopf's event machinery as `kopf run` sets it up: kopf.event() queues an event, kopf's poster
    task posts it to the API server from its own event loop, with credentials from the kubeconfig."""

    def __init__(self) -> None:
        self.settings = kopf.OperatorSettings()
        operator_settings.configure(self.settings)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kopf-event-poster", daemon=True)
        self.thread.start()
        self.queue, self.vault, self.task = self._run(self._start())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    async def _start(self) -> tuple[posting.K8sEventQueue, credentials.Vault, asyncio.Task]:
        vault = credentials.Vault()
        await vault.populate({"kubeconfig": kopf.login_with_kubeconfig(settings=self.settings)})
        auth.vault_var.set(vault)  # seen by the tasks created below
        backbone = references.Backbone()
        await backbone.fill(resources=await scanning.scan_resources(groups={""}, settings=self.settings, logger=log))
        queue: posting.K8sEventQueue = asyncio.Queue()
        task = asyncio.create_task(posting.poster(event_queue=queue, backbone=backbone, settings=self.settings))
        return queue, vault, task

    async def _stop(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.vault.close()

    def close(self) -> None:
        self._run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """kopf.event() in this thread goes to this poster (kopf's handler threads get the same context)."""
        tokens = [(var, var.set(value)) for var, value in ((posting.settings_var, self.settings),
                                                           (posting.event_queue_var, self.queue),
                                                           (posting.event_queue_loop_var, self.loop))]
        try:
            yield
        finally:
            for var, token in reversed(tokens):
                var.reset(token)


@pytest.fixture(scope="module")
def event_poster(kubeconfig: str) -> Iterator[KopfEventPoster]:
    poster = KopfEventPoster()
    try:
        yield poster
    finally:
        poster.close()


class OperatorKube(Kube):
    """The operator's client on the control plane, noting each write it sends (kind, name, verb)
    and each conflict the API server answers. A no-op write leaves no trace in the API (the
    resourceVersion stays), so this is how a test sees one."""

    def __init__(self, api_client: Any):
        super().__init__(api_client)
        self.writes: list[tuple[str, str, str]] = []
        self.conflicts = 0

    def _sent(self, kind: str, name: str, verb: str, call: Any) -> Any:
        self.writes.append((kind, name, verb))
        try:
            return call()
        except ApiException as error:
            self.conflicts += error.status == 409
            raise

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._sent(obj["kind"], obj["metadata"]["name"], "create", lambda: super(OperatorKube, self).create(obj))

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        return self._sent(kind, name, f"patch {subresource or ''}".strip(),
                          lambda: super(OperatorKube, self).patch(kind, namespace, name, patch, subresource))

    def delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        return self._sent(kind, name, "delete", lambda: super(OperatorKube, self).delete(kind, namespace, name, uid))


class RacingKube(OperatorKube):
    """... with the trainer writing the job's progress right after each of the operator's reads of
    the job, `races` times: the operator's next status write is then stale."""

    def __init__(self, api_client: Any, trainer: Kube, races: int):
        super().__init__(api_client)
        self.trainer, self.races, self.steps = trainer, races, 0

    def report_progress(self, namespace: str, name: str) -> None:
        self.steps += 1
        self.trainer.patch(api.KIND, namespace, name, {"status": {"progress": {"step": self.steps, "totalSteps": 10}}},
                           subresource="status")

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        found = super().get(kind, namespace, name)
        if kind == api.KIND and self.races:
            self.races -= 1
            self.report_progress(namespace, name)
        return found


@pytest.fixture
def operator_client(kube: Kube, event_poster: KopfEventPoster, monkeypatch: pytest.MonkeyPatch,
                    kuberay_paused: None) -> Iterator[OperatorKube]:
    """reconcile's client (on the control plane); its Events go to the API server."""
    client = OperatorKube(kube.api_client)
    use_client(monkeypatch, client)
    with event_poster.active():
        yield client


def use_client(monkeypatch: pytest.MonkeyPatch, client: Kube) -> None:
    monkeypatch.setattr(operator_kube, "client", lambda: client)


@pytest.fixture
def trainer(control_plane) -> Iterator[Kube]:
    """Another client: the trainer, which writes the job's status.progress."""
    client = Kube(control_plane.api_client())
    yield client
    client.api_client.close()


def posted(kube: Kube, job: dict[str, Any]) -> list[tuple[str, str]]:
    """(type, reason) of the Events about this very job on the API server, oldest first, once every
    event queued so far has been posted (one worker posts an object's events in order, so a marker
    event queued now is posted after them)."""
    meta = job["metadata"]
    marker = uuid.uuid4().hex
    kopf.event(kopf.Body(job), type="Normal", reason=BARRIER, message=marker)

    def found() -> list[dict[str, Any]] | None:
        items = kube._request("GET", f"/api/v1/namespaces/{meta['namespace']}/events", query=[
            ("fieldSelector", f"involvedObject.kind={api.KIND},involvedObject.uid={meta['uid']}")])["items"]
        return items if any(e["message"] == marker for e in items) else None

    items = sorted(wait_for(found, 30, f"the events of {meta['name']} to be posted"), key=lambda e: e["eventTime"])
    assert all(e["source"]["component"] == MANAGED_BY for e in items)
    return [(e["type"], e["reason"]) for e in items if e["reason"] != BARRIER]


def assert_one_of_each(kube: Kube, namespace: str, name: str, uid: str) -> None:
    found = children(kube, namespace, name)
    assert {kind: len(objs) for kind, objs in found.items()} == dict.fromkeys(KINDS, 1)
    for objs in found.values():
        assert [ref["uid"] for ref in objs[0]["metadata"]["ownerReferences"]] == [uid]


def phase(job: dict[str, Any]) -> tuple[str | None, str | None]:
    status = job.get("status") or {}
    return status.get("phase"), status.get("reason")
