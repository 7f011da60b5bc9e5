"""Jobs deleted while the operator's watches were down: it must never act on them.

kopf's indexes drop an object only on its DELETED event, and a relist (after a watch resumed too
late: 410 Gone) does not remove the objects deleted meanwhile. Here the operator misses the DELETED
events for real: it reaches the API server through a proxy (e2e/operator/apiproxy.py) that the test
cuts while it deletes the job, and the API server is restarted meanwhile, so its watch cache begins
after the deletion and each resumed watch gets 410 Gone and kopf relists.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from kubernetes import watch

from e2e.fixtures import wait_for
from e2e.operator.apiproxy import ApiProxy
from e2e.operator.inprocess import KINDS
from e2e.operator.jobs import children, create_job, rlhf_job, touch_and_wait_reconciled, wait_gone, wait_phase
from e2e.operator.kuberay import RayJobStatus
from rlhf_api import contract
from rlhf_api import v1alpha1 as api
from rlhf_operator import metrics, names


@pytest.fixture
def proxied(control_plane, operator, tmp_path) -> Iterator[ApiProxy]:
    """The operator's way to the API server goes through a proxy the test can cut."""
    proxy = ApiProxy(control_plane.ports["kube-apiserver"])
    operator.kubeconfig = proxy.kubeconfig(control_plane.kubeconfig, tmp_path / "proxied-kubeconfig")
    try:
        yield proxy
    finally:
        proxy.close()


def delete_unseen(control_plane, kube, proxy: ApiProxy, namespace: str, name: str, policy: str) -> str:
    """Delete the job while the operator is cut off, then let its watches resume too late; its uid."""
    job = kube.get(api.KIND, namespace, name)
    proxy.cut()
    kube._request("DELETE", kube._path(api.KIND, namespace, name), {
        "preconditions": {"uid": job["metadata"]["uid"]}, "propagationPolicy": policy})
    wait_gone(kube, api.KIND, namespace, name)
    control_plane.stop_component("kube-apiserver")
    control_plane.start_component("kube-apiserver")
    proxy.release()
    return job["metadata"]["uid"]


def resyncs(operator) -> float:
    found = re.search(r'^rlhf_operator_reconcile_duration_seconds_count\{handler="resync"\} (\S+)$',
                      operator.metrics(), re.M)
    return float(found.group(1)) if found else 0.0


def phase_series(operator, name: str) -> list[str]:
    return [line for line in operator.metrics().splitlines() if line.startswith(f"{metrics.JOB_PHASE}{{")
            and f'{contract.METRIC_JOB_LABELS[0]}="{name}"' in line]


def config_maps_since(kube_api, namespace: str) -> str:
    return kube_api.core.list_namespaced_config_map(namespace).metadata.resource_version


def config_maps_made_for(kube_api, namespace: str, since: str, uid: str) -> list[str]:
    """The ConfigMaps created in the namespace after resourceVersion since with that owner, deleted
    ones too (a watch from since replays them all). A job's ConfigMap is the first child reconcile makes."""
    return [event["object"].metadata.name for event in watch.Watch().stream(
                kube_api.core.list_namespaced_config_map, namespace, resource_version=since, timeout_seconds=1)
            if event["type"] == "ADDED"
            and any(ref.uid == uid for ref in event["object"].metadata.owner_references or [])]


def test_a_job_deleted_unseen_is_never_acted_on(control_plane, kube, kube_api, namespace, operator, proxied,
                                               kuberay_paused):
    """Deleted with its children orphaned (kubectl delete --cascade=orphan), which are then deleted
    in turn, seen: the job's ghost had no RayJob, and its resync made all its children again, owned
    by nothing, every period; its metrics kept it Pending."""
    operator.start("--resync-seconds", "1")
    create_job(kube, namespace, rlhf_job("ghost"))
    create_job(kube, namespace, rlhf_job("live"))
    wait_phase(kube, namespace, "ghost", "Pending", "RayJobCreated")
    wait_phase(kube, namespace, "live", "Pending", "RayJobCreated")
    uid = delete_unseen(control_plane, kube, proxied, namespace, "ghost", "Orphan")

    # The operator's watches work again: an update of a job, then a RayJob's change, each seen.
    touch_and_wait_reconciled(kube, namespace, "live")
    RayJobStatus(kube, namespace, names.ray_job("live")).initializing()
    wait_phase(kube, namespace, "live", "Provisioning", "StartingRayCluster")
    since = config_maps_since(kube_api, namespace)
    for kind, objects in children(kube, namespace, "ghost").items():
        for obj in objects:
            kube.delete(kind, namespace, obj["metadata"]["name"], obj["metadata"]["uid"])
    for kind in KINDS:
        wait_for(lambda: not children(kube, namespace, "ghost")[kind], 30, f"the orphaned {kind} to go")
    before = resyncs(operator)
    wait_for(lambda: resyncs(operator) >= before + 3, 60, "three resyncs (each job's at least once)")
    assert config_maps_made_for(kube_api, namespace, since, uid) == [], "children made for a deleted job"
    wait_for(lambda: not phase_series(operator, "ghost"), 30, "the metrics to forget the deleted job")
    assert phase_series(operator, "live")


def test_a_job_re_created_under_a_ghost_s_name_follows_its_ray_job(control_plane, kube, namespace, operator,
                                                                   proxied, kuberay_paused):
    """The ghost shadowed the new job in the index: its RayJob's events were dropped (uid mismatch)."""
    operator.start("--resync-seconds", "3600")  # only the RayJob's events can move it
    create_job(kube, namespace, rlhf_job("again"))
    wait_phase(kube, namespace, "again", "Pending", "RayJobCreated")
    old = delete_unseen(control_plane, kube, proxied, namespace, "again", "Background")
    wait_gone(kube, "RayJob", namespace, names.ray_job("again"))
    new = create_job(kube, namespace, rlhf_job("again"))["metadata"]["uid"]
    assert new != old
    wait_phase(kube, namespace, "again", "Pending", "RayJobCreated")
    RayJobStatus(kube, namespace, names.ray_job("again")).initializing()
    wait_phase(kube, namespace, "again", "Provisioning", "StartingRayCluster", timeout=30)
    ray_job = kube.get("RayJob", namespace, names.ray_job("again"))
    assert [ref["uid"] for ref in ray_job["metadata"]["ownerReferences"]] == [new]
