"""reconcile.py against an in-memory API: idempotence, ownership, conflicts, bad input.

The e2e tests run the same code on a real API server; these pin down the branches that are hard
to provoke there (a leftover child of a deleted job, a write conflict at the right moment).
"""

from __future__ import annotations

import copy
import itertools

import kopf
import pytest
from kubernetes.client.exceptions import ApiException
from operator_jobs import tiny

from rlhf_operator import kube, reconcile
from rlhf_operator.api import v1alpha1 as api


class FakeKube:
    """Objects by (kind, namespace, name); resourceVersion preconditions as the API server checks them."""

    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.versions = itertools.count(1)
        self.conflicts_left = 0  # status writes to refuse with 409 before accepting

    def _key(self, kind, namespace, name):
        return kind, namespace, name

    def get(self, kind, namespace, name):
        found = self.objects.get(self._key(kind, namespace, name))
        return copy.deepcopy(found)

    def list(self, kind, namespace, label_selector):
        return [copy.deepcopy(o) for (k, ns, _), o in self.objects.items() if (k, ns) == (kind, namespace)]

    def create(self, obj):
        key = self._key(obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        stored = copy.deepcopy(obj)
        stored["metadata"].setdefault("uid", f"uid-{next(self.versions)}")
        stored["metadata"]["resourceVersion"] = str(next(self.versions))
        self.objects[key] = stored
        return copy.deepcopy(stored)

    def patch(self, kind, namespace, name, patch, subresource=None):
        stored = self.objects[self._key(kind, namespace, name)]
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if subresource == "status" and self.conflicts_left:
            self.conflicts_left -= 1
            self.touch(kind, namespace, name)
            raise ApiException(status=409, reason="Conflict")
        if wanted and wanted != stored["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        _merge(stored, {k: v for k, v in patch.items() if k != "metadata" or subresource is None})
        stored["metadata"]["resourceVersion"] = str(next(self.versions))
        return copy.deepcopy(stored)

    def delete(self, kind, namespace, name, uid):
        self.objects.pop(self._key(kind, namespace, name), None)

    def touch(self, kind, namespace, name):
        """Someone else (the trainer, kopf) wrote the object."""
        self.objects[self._key(kind, namespace, name)]["metadata"]["resourceVersion"] = str(next(self.versions))


def _merge(target: dict, patch: dict) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


@pytest.fixture
def fake(monkeypatch) -> FakeKube:
    client = FakeKube()
    monkeypatch.setattr(kube, "client", lambda: client)
    return client


@pytest.fixture
def posted(monkeypatch) -> list[tuple[str, str, str]]:
    """Events the operator posted: (type, reason, message)."""
    seen: list[tuple[str, str, str]] = []
    monkeypatch.setattr(kopf, "event", lambda body, *, type, reason, message: seen.append((type, reason, message)))
    return seen


def submit(fake: FakeKube, doc: dict, name: str = "tiny") -> dict:
    doc = copy.deepcopy(doc)
    doc["metadata"] = {"name": name, "namespace": "ns", "generation": 1}
    return fake.create(doc)


def job(fake: FakeKube, name: str = "tiny") -> dict:
    return fake.get(api.KIND, "ns", name)


def kinds(fake: FakeKube) -> list[str]:
    return sorted(kind for kind, _, _ in fake.objects if kind != api.KIND)


def test_reconcile_is_idempotent(fake, posted):
    reconcile.reconcile(submit(fake, tiny()))
    assert kinds(fake) == ["ConfigMap", "RayJob", "Role", "RoleBinding", "ServiceAccount"]
    assert (job(fake)["status"]["phase"], job(fake)["status"]["reason"]) == ("Pending", "RayJobCreated")
    assert [reason for _, reason, _ in posted] == ["RayJobCreated"]
    before = copy.deepcopy(fake.objects)
    reconcile.reconcile(job(fake))
    assert fake.objects == before  # nothing created, patched or re-posted
    assert len(posted) == 1


def test_a_status_write_conflict_is_recomputed_and_posted_once(fake, posted):
    body = submit(fake, tiny())
    fake.conflicts_left = 2
    reconcile.reconcile(body)
    assert job(fake)["status"]["phase"] == "Pending"
    assert [reason for _, reason, _ in posted] == ["RayJobCreated"]


def test_foreign_object_with_a_childs_name_fails_the_job(fake, posted):
    fake.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "tiny-config", "namespace": "ns"}})
    reconcile.reconcile(submit(fake, tiny()))
    assert job(fake)["status"]["reason"] == "NameConflict"
    assert "RayJob" not in kinds(fake)
    assert posted[0][0] == "Warning"


def test_leftover_child_of_a_deleted_job_is_waited_for(fake, posted):
    fake.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "tiny-config", "namespace": "ns",
        "ownerReferences": [{"apiVersion": api.API_VERSION, "kind": api.KIND, "name": "tiny", "uid": "old"}]}})
    with pytest.raises(kopf.TemporaryError, match="garbage-collected"):
        reconcile.reconcile(submit(fake, tiny()))
    assert "status" not in job(fake)


def test_a_spec_the_operator_cannot_parse_fails_with_the_fields_to_fix(fake, posted):
    doc = tiny()
    doc["spec"]["rollout"] = {"samplesPerPrompt": 0}  # below the schema's minimum
    reconcile.reconcile(submit(fake, doc))
    status = job(fake)["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "InvalidSpec")
    assert "spec.rollout.samplesPerPrompt" in status["message"]
    assert kinds(fake) == []


def test_finished_and_deleted_jobs_are_left_alone(fake, posted):
    body = submit(fake, tiny())
    body["metadata"]["deletionTimestamp"] = "2026-11-22T10:00:00Z"
    reconcile.reconcile(body)
    body = job(fake)
    body["status"] = {"phase": "Succeeded"}
    reconcile.reconcile(body)
    assert kinds(fake) == [] and posted == []


def test_deleted_ray_job_is_recreated_while_running_but_not_after_the_end(fake, posted):
    reconcile.reconcile(submit(fake, tiny()))
    ray_job = fake.get("RayJob", "ns", "tiny")
    fake.delete("RayJob", "ns", "tiny", None)
    reconcile.on_ray_job_event("DELETED", ray_job)
    assert fake.get("RayJob", "ns", "tiny") is not None
    assert posted[-1][:2] == ("Warning", "RayJobDeleted")

    fake.patch(api.KIND, "ns", "tiny", {"status": {"phase": "Succeeded"}}, subresource="status")
    fake.delete("RayJob", "ns", "tiny", None)
    reconcile.on_ray_job_event("DELETED", ray_job)
    assert fake.get("RayJob", "ns", "tiny") is None
    assert posted[-1][:2] == ("Normal", "RayJobDeleted")


def test_ray_job_events_of_another_job_generation_are_ignored(fake, posted):
    reconcile.reconcile(submit(fake, tiny()))
    stale = fake.get("RayJob", "ns", "tiny")
    stale["metadata"]["ownerReferences"][0]["uid"] = "a-deleted-job"
    stale["status"] = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
    reconcile.on_ray_job_event("MODIFIED", stale)
    assert job(fake)["status"]["phase"] == "Pending"
