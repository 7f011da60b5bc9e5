"""reconcile.py called in-process on the real control plane, for the branches an operator run
reaches only by chance: no-op re-runs, status write conflicts, a leftover child of a deleted job
of the same name, a RayJob event of such a job, a stored spec this operator cannot parse, and
jobs that are finished or being deleted.

The functions run as kopf's handlers run them (on a kopf.Body, in a thread outside the event
loop), with the operator's own client (`rlhf_operator.kube.Kube`) on the control plane. Their
kopf.event() calls go through kopf's own event poster, as `kopf run` starts it, to the API server;
the tests read the Events back from there. Every hard moment is made with real writes: another
client writing the job's status between the operator's read and write, a finalizer holding a
child while the garbage collector deletes it, a CRD release with a looser schema.

Already covered with the operator running, so not repeated here: a same-named object of someone
else (test_operator_bad_input.py::test_a_same_named_object_of_someone_else_is_not_taken_over) and
a RayJob deleted out of band, recreated while the job runs and not after it finished
(test_operator_lifecycle.py::test_ray_job_deleted_*).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import kopf
import pytest
from kubernetes.client.exceptions import ApiException

from e2e.fixtures import wait_for
from e2e.operator.inprocess import (
    CRD, HOLD, SAMPLES_MINIMUM, RacingKube, assert_one_of_each, phase, posted, use_client,
)
from e2e.operator.jobs import children, create_job, get_job, rlhf_job, wait_gone
from e2e.operator.kuberay import RayJobStatus
from rlhf_api import v1alpha1 as api
from rlhf_operator import lifecycle, pods, reconcile, usage
from rlhf_operator import settings as operator_settings
from rlhf_operator.kube import Kube

pytestmark = pytest.mark.usefixtures("operator_client")


def test_reconcile_is_idempotent(kube, namespace, operator_client):
    created = create_job(kube, namespace, rlhf_job("tiny"))
    reconcile.reconcile(kopf.Body(created))
    assert operator_client.writes == [  # children in order, the RayJob last, then the status
        ("ConfigMap", "tiny-config", "create"), ("ServiceAccount", "tiny-trainer", "create"),
        ("Role", "tiny-trainer", "create"), ("RoleBinding", "tiny-trainer", "create"), ("RayJob", "tiny", "create"),
        (api.KIND, "tiny", "patch status")]
    job = get_job(kube, namespace, "tiny")
    assert phase(job) == ("Pending", "RayJobCreated")
    assert_one_of_each(kube, namespace, "tiny", created["metadata"]["uid"])
    assert posted(kube, job) == [("Normal", "RayJobCreated")]

    operator_client.writes.clear()
    reconcile.reconcile(kopf.Body(job))
    assert operator_client.writes == []  # nothing created or written, not even a no-op
    assert posted(kube, job) == [("Normal", "RayJobCreated")]  # nor posted again


def test_a_watched_copy_older_than_our_own_status_write_does_not_hide_a_change(kube, namespace, operator_client):
    """A RayJob event comes with the job's copy from the watch, which may predate the operator's own
    newest status write: KubeRay went A, B, A (a queued job: Suspended, Suspending, Suspended) faster
    than the watch delivered the job. That copy's status already reads A; the write from B back to A
    must still happen (it did not: the job stayed Suspending until the next resync)."""
    created = create_job(kube, namespace, rlhf_job("tiny"))
    reconcile.reconcile(kopf.Body(created))
    lagging = get_job(kube, namespace, "tiny")  # Pending, RayJobCreated: what the watch still has
    ray_job = kube.get("RayJob", namespace, "tiny")
    starting = {**ray_job, "status": {"jobDeploymentStatus": "Initializing", "rayClusterName": "tiny-abc"}}
    reconcile.mirror(kopf.Body(lagging), starting, 1)
    assert phase(get_job(kube, namespace, "tiny")) == ("Provisioning", "StartingRayCluster")

    new_again = {**ray_job, "status": {"jobDeploymentStatus": ""}}
    reconcile.mirror(kopf.Body(lagging), new_again, 1)  # the lagging copy already reads Pending
    assert phase(get_job(kube, namespace, "tiny")) == ("Pending", "RayJobCreated")


def test_an_older_ray_job_copy_does_not_undo_a_newer_mirror(kube, namespace, operator_client):
    """Two handlers at once, as at operator start: a RayJob event mirrors KubeRay's newest status
    while a reconcile of the job holds an older RayJob copy from its index. Whichever writes last
    must not put the older state back (it did: the job stayed Pending until the next resync, and
    test_operator_crash.py's restart after the status write failed once in CI)."""
    created = create_job(kube, namespace, rlhf_job("tiny"))
    reconcile.reconcile(kopf.Body(created))
    job = get_job(kube, namespace, "tiny")  # Pending, RayJobCreated: both handlers' copy of the job
    indexed = kube.get("RayJob", namespace, "tiny")  # the reconcile's copy, from before KubeRay wrote
    reconcile.mirror(kopf.Body(job), RayJobStatus(kube, namespace, "tiny").initializing(), None)
    assert phase(get_job(kube, namespace, "tiny")) == ("Provisioning", "StartingRayCluster")

    reconcile.mirror(kopf.Body(job), indexed, 1)
    assert phase(get_job(kube, namespace, "tiny")) == ("Provisioning", "StartingRayCluster")

    # Nor when the job's copy is newer than that write (an edit, then its reconcile, or the resync, with
    # the index's RayJob): in CI a queued job went back from Queued to Suspending after an annotation.
    touched = kube.patch(api.KIND, namespace, "tiny", {"metadata": {"annotations": {"e2e.rlhf.dev/touch": "1"}}})
    reconcile.reconcile(kopf.Body(touched), Indexed(indexed))
    assert phase(get_job(kube, namespace, "tiny")) == ("Provisioning", "StartingRayCluster")


def test_the_resync_puts_back_a_status_another_hand_wrote(kube, namespace, operator_client):
    """Our own last status write is what a stale copy of the job is compared with (reconcile.record), but
    it is stale itself once someone else wrote the fields we own (a status edited by hand): the resync,
    which reads the job afresh, writes them again (it did not while the RayJob still read as that write)."""
    created = create_job(kube, namespace, rlhf_job("tiny"))
    reconcile.reconcile(kopf.Body(created))  # Pending, RayJobCreated: our last write
    kube.patch(api.KIND, namespace, "tiny", {"status": {"phase": "Running", "reason": "ByHand"}}, subresource="status")
    assert reconcile.resync(namespace, "tiny", created["metadata"]["uid"], reconcile.API)
    assert phase(get_job(kube, namespace, "tiny")) == ("Pending", "RayJobCreated")


class Indexed(reconcile.Reads):
    """The operator's watch as it may lag: the RayJob as this copy has it, the rest from the API server."""

    def __init__(self, ray_job: dict[str, Any]):
        self.copy = ray_job

    def ray_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.copy


def test_a_watched_ray_job_that_already_reads_a_spec_change_does_not_hide_it(kube, namespace, operator_client):
    """The job's startupDeadlineSeconds went 1800, unset, 1800 again faster than the RayJob watch
    delivered the operator's own patches: the watched RayJob still read 1800 from the first patch
    when the third edit came, so nothing was patched and the RayJob stayed without a deadline until
    the next resync (a race test_operator_chaos's quick edits can meet; it failed once with "its
    RayJob to carry ... 1800" not within 60 s)."""
    created = create_job(kube, namespace, rlhf_job("tiny"))
    reconcile.reconcile(kopf.Body(created))
    ray_job = kube.get("RayJob", namespace, "tiny")
    assert "preRunningDeadlineSeconds" not in ray_job["spec"]
    first_patch = {**ray_job, "spec": {**ray_job["spec"], "preRunningDeadlineSeconds": 1800}}
    edited = kube.patch(api.KIND, namespace, "tiny", {"spec": {"startupDeadlineSeconds": 1800}})
    reconcile.reconcile(kopf.Body(edited), Indexed(first_patch))
    assert kube.get("RayJob", namespace, "tiny")["spec"]["preRunningDeadlineSeconds"] == 1800
    assert get_job(kube, namespace, "tiny")["status"]["observedGeneration"] == edited["metadata"]["generation"]

    operator_client.writes.clear()  # carried over: the watched copy is trusted again, nothing is read or written
    reconcile.reconcile(kopf.Body(get_job(kube, namespace, "tiny")), Indexed(kube.get("RayJob", namespace, "tiny")))
    assert operator_client.writes == []


def test_a_status_write_conflict_is_recomputed_and_posted_once(kube, namespace, trainer, monkeypatch):
    stale = create_job(kube, namespace, rlhf_job("tiny"))
    racing = RacingKube(kube.api_client, trainer, races=1)
    racing.report_progress(namespace, "tiny")  # after the operator's copy was read: it is stale
    use_client(monkeypatch, racing)
    reconcile.reconcile(kopf.Body(stale))

    assert racing.conflicts == 2  # the stale copy, and the re-read the trainer overtook
    status = get_job(kube, namespace, "tiny")["status"]
    assert (status["phase"], status["reason"]) == ("Pending", "RayJobCreated")
    assert status["progress"]["step"] == racing.steps == 2  # the trainer's fields stay
    assert posted(kube, stale) == [("Normal", "RayJobCreated")]


def test_a_job_that_keeps_changing_is_retried_later(kube, namespace, trainer, monkeypatch):
    created = create_job(kube, namespace, rlhf_job("tiny"))
    racing = RacingKube(kube.api_client, trainer, races=reconcile.STATUS_WRITE_ATTEMPTS)
    racing.report_progress(namespace, "tiny")
    use_client(monkeypatch, racing)
    with pytest.raises(kopf.TemporaryError, match="kept changing"):
        reconcile.reconcile(kopf.Body(created))
    assert racing.conflicts == reconcile.STATUS_WRITE_ATTEMPTS
    status = get_job(kube, namespace, "tiny")["status"]
    assert status.keys() == {"progress"} and status["progress"]["step"] == racing.steps
    assert posted(kube, created) == []

    # kopf retries the handler with the job as it is now.
    use_client(monkeypatch, kube)
    reconcile.reconcile(kopf.Body(get_job(kube, namespace, "tiny")))
    assert phase(get_job(kube, namespace, "tiny")) == ("Pending", "RayJobCreated")
    assert_one_of_each(kube, namespace, "tiny", created["metadata"]["uid"])
    assert posted(kube, created) == [("Normal", "RayJobCreated")]


def test_a_pods_usage_is_written_through_a_burst_of_conflicting_writes(kube, namespace, trainer, monkeypatch):
    """A pod event is not retried: the usage write waits out the writes that overtake it. In a loaded
    run two pods deleted together started two handlers that gave up after five conflicts within 20 ms,
    and the pods' ends reached status.usage only with the next resync, minutes later."""
    job = create_job(kube, namespace, rlhf_job("tiny"))
    racing = RacingKube(kube.api_client, trainer, races=5)
    racing.report_progress(namespace, "tiny")  # the operator's copy is stale: a conflict, then five more
    use_client(monkeypatch, racing)
    now = lifecycle.timestamp(lifecycle.now())
    pod = {"metadata": {"name": "tiny-head", "creationTimestamp": now, "labels": {pods.CLUSTER_LABEL: "tiny-1"}},
           "spec": {"containers": [{"resources": {"requests": {"cpu": "2"}}}]}, "status": {"startTime": now}}
    usage.on_pod_event("MODIFIED", pod, job)

    assert racing.conflicts == 6
    written = get_job(kube, namespace, "tiny")["status"]
    [attempt] = written["usage"]["attempts"]
    assert attempt["rayClusterName"] == "tiny-1"
    assert attempt["pods"] == [{"name": "tiny-head", "gpus": 0, "cpus": 2, "startTime": now}]
    assert written["progress"]["step"] == racing.steps == 6  # the trainer's writes stay


def delete_job(kube: Kube, namespace: str, job: dict[str, Any]) -> None:
    """Delete the job (no operator runs, so no finalizer holds it); the garbage collector takes its children."""
    kube.delete(api.KIND, namespace, job["metadata"]["name"], job["metadata"]["uid"])
    wait_gone(kube, api.KIND, namespace, job["metadata"]["name"])


def test_a_lagging_copy_of_a_deleted_job_makes_nothing(kube, namespace, operator_client):
    """A handler holding the job as it was before it was deleted with its children orphaned
    (kubectl delete --cascade=orphan), which were then deleted too: kopf's index and an event
    processed late keep such copies (test_operator_ghosts.py), and once made the children of a job
    that is gone until the garbage collector found them (test_operator_ghosts failed once so in a
    loaded run: "children made for a deleted job: ['ghost-config']")."""
    created = create_job(kube, namespace, rlhf_job("tiny"))
    reconcile.reconcile(kopf.Body(created))
    lagging = get_job(kube, namespace, "tiny")  # Pending, with a status: reconciled before
    kube._request("DELETE", kube._path(api.KIND, namespace, "tiny"), {"propagationPolicy": "Orphan"})
    wait_gone(kube, api.KIND, namespace, "tiny")
    for kind, objects in children(kube, namespace, "tiny").items():
        for obj in objects:
            kube.delete(kind, namespace, obj["metadata"]["name"], obj["metadata"]["uid"])
    wait_for(lambda: not any(children(kube, namespace, "tiny").values()), 30, "the orphaned children to go")

    operator_client.writes.clear()
    reconcile.reconcile(kopf.Body(lagging))
    assert operator_client.writes == [] and not any(children(kube, namespace, "tiny").values())


def test_leftover_child_of_a_deleted_job_is_waited_for(kube, namespace):
    old = create_job(kube, namespace, rlhf_job("tiny"))
    reconcile.reconcile(kopf.Body(old))
    # A finalizer holds the old ConfigMap for as long as the test needs the garbage collector to be slow.
    kube.patch("ConfigMap", namespace, "tiny-config", {"metadata": {"finalizers": [HOLD]}})
    delete_job(kube, namespace, old)
    wait_for(lambda: kube.get("ConfigMap", namespace, "tiny-config")["metadata"].get("deletionTimestamp"), 30,
             "the garbage collector to delete the old ConfigMap")

    new = create_job(kube, namespace, rlhf_job("tiny"))
    try:
        with pytest.raises(kopf.TemporaryError, match="garbage-collected"):
            reconcile.reconcile(kopf.Body(new))
        assert "status" not in get_job(kube, namespace, "tiny")
        leftover = kube.get("ConfigMap", namespace, "tiny-config")
        assert [ref["uid"] for ref in leftover["metadata"]["ownerReferences"]] == [old["metadata"]["uid"]]
        ray_job = kube.get("RayJob", namespace, "tiny")
        assert ray_job is None or ray_job["metadata"]["ownerReferences"][0]["uid"] == old["metadata"]["uid"]
    finally:
        kube.patch("ConfigMap", namespace, "tiny-config", {"metadata": {"finalizers": None}})

    # Once the garbage collector is done, the retry goes ahead.
    wait_for(lambda: not any(children(kube, namespace, "tiny").values()), 60, "the old job's children to be deleted")
    reconcile.reconcile(kopf.Body(get_job(kube, namespace, "tiny")))
    assert phase(get_job(kube, namespace, "tiny")) == ("Pending", "RayJobCreated")
    assert_one_of_each(kube, namespace, "tiny", new["metadata"]["uid"])
    assert posted(kube, new) == [("Normal", "RayJobCreated")]


def test_ray_job_events_of_a_deleted_job_of_the_same_name_are_ignored(kube, namespace, operator_client):
    old = create_job(kube, namespace, rlhf_job("tiny"))
    reconcile.reconcile(kopf.Body(old))
    RayJobStatus(kube, namespace, "tiny").initializing()
    old_running = RayJobStatus(kube, namespace, "tiny").running()  # as the watch delivers it
    delete_job(kube, namespace, old)
    wait_gone(kube, "RayJob", namespace, "tiny")

    new = create_job(kube, namespace, rlhf_job("tiny"))
    reconcile.reconcile(kopf.Body(new))
    operator_client.writes.clear()
    # Delivered late, after the job was re-created: they are about the old job's RayJob.
    reconcile.on_ray_job_event("MODIFIED", kopf.Body(old_running))
    reconcile.on_ray_job_event("DELETED", kopf.Body(old_running))
    assert operator_client.writes == []  # not mirrored, nothing recreated
    assert phase(get_job(kube, namespace, "tiny")) == ("Pending", "RayJobCreated")
    assert posted(kube, new) == [("Normal", "RayJobCreated")]

    # The new job's own RayJob is followed.
    reconcile.on_ray_job_event("MODIFIED", kopf.Body(RayJobStatus(kube, namespace, "tiny").initializing()))
    assert phase(get_job(kube, namespace, "tiny")) == ("Provisioning", "StartingRayCluster")


def dry_run_refused(kube: Kube, namespace: str, job: dict[str, Any]) -> bool:
    try:
        kube._request("POST", f"/apis/{api.API_VERSION}/namespaces/{namespace}/{api.PLURAL}", job,
                      query=[("dryRun", "All")])
    except ApiException as error:
        if error.status == 422:
            return True
        raise
    return False


@pytest.fixture
def looser_crd_release(kube_api, kube: Kube, namespace: str) -> Iterator[Any]:
    """The RLHFJob CRD of a release with no minimum for spec.rollout.samplesPerPrompt; call the
    returned function to install this release's CRD again (and wait until the API server applies it)."""
    probe = rlhf_job("probe", rollout={"samplesPerPrompt": 0})
    probe["metadata"]["namespace"] = namespace
    kube_api.apiextensions.patch_custom_resource_definition(
        CRD, [{"op": "test", "path": SAMPLES_MINIMUM, "value": 1}, {"op": "remove", "path": SAMPLES_MINIMUM}])
    restored = False

    def restore() -> None:
        nonlocal restored
        if not restored:
            kube_api.apiextensions.patch_custom_resource_definition(
                CRD, [{"op": "add", "path": SAMPLES_MINIMUM, "value": 1}])
            restored = True
        wait_for(lambda: dry_run_refused(kube, namespace, probe), 30, "the API server to apply the CRD")

    try:
        wait_for(lambda: not dry_run_refused(kube, namespace, probe), 30, "the API server to apply the looser CRD")
        yield restore
    finally:
        restore()


def test_a_stored_spec_the_operator_cannot_parse_fails_with_the_fields_to_fix(kube, namespace, looser_crd_release):
    # Stored under the looser CRD; this release's CRD, installed with the operator, refuses it.
    created = create_job(kube, namespace, rlhf_job("tiny", rollout={"samplesPerPrompt": 0}))
    looser_crd_release()
    reconcile.reconcile(kopf.Body(get_job(kube, namespace, "tiny")))

    status = get_job(kube, namespace, "tiny")["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "InvalidSpec")
    assert "spec.rollout.samplesPerPrompt" in status["message"]
    assert not any(children(kube, namespace, "tiny").values())
    assert posted(kube, created) == [("Warning", "InvalidSpec")]


def test_finished_and_deleted_jobs_are_left_alone(kube, namespace, operator_client):
    finished = create_job(kube, namespace, rlhf_job("done"))
    finished = kube.patch(api.KIND, namespace, "done", {"status": {"phase": "Succeeded", "reason": "Completed"}},
                          subresource="status")
    # kopf's finalizer keeps a deleted job while the operator still has work on it.
    going = rlhf_job("going")
    going["metadata"]["finalizers"] = [operator_settings.FINALIZER]
    going = create_job(kube, namespace, going)
    kube.delete(api.KIND, namespace, "going", going["metadata"]["uid"])
    going = get_job(kube, namespace, "going")
    assert going["metadata"]["deletionTimestamp"]
    try:
        reconcile.reconcile(kopf.Body(finished))
        reconcile.reconcile(kopf.Body(going))
        assert operator_client.writes == []
        assert not any(children(kube, namespace, "done").values())
        assert not any(children(kube, namespace, "going").values())
        assert posted(kube, finished) == [] and posted(kube, going) == []
    finally:
        kube.patch(api.KIND, namespace, "going", {"metadata": {"finalizers": None}})
