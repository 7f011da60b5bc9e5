"""The API requests the operator makes for a job, counted: children created without a read first,
and what the operator's watches know (its kopf indexes) used instead of reads.

In-process, with a client that notes every request: ensure() creates first and reads only when
the child exists. With the operator running as a ServiceAccount of the audited namespace (the
chart's RBAC, as test_operator_rbac.py), from the API server's audit log: a new job costs one
create per child and no read of any of them, and a RayJob event mirrors its status without a read
of the RLHFJob (except after a conflict on the status write) or a list of pods; the RayJob is read
again only where the copy of the job was stale (a conflict, or a copy older than our own write).
"""

from __future__ import annotations

import collections
import re
from typing import Any

import kopf
import pytest

from e2e.fixtures import wait_for
from e2e.operator.conftest import OperatorProcess, stop_operator
from e2e.operator.inprocess import use_client
from e2e.operator.jobs import create_job, get_job, rlhf_job, wait_phase
from e2e.operator.kuberay import RayJobStatus
from e2e.operator.test_operator_rbac import (  # noqa: F401  (audited_namespace is a fixture)
    audited, audited_namespace, install_rbac, request_key, token_kubeconfig,
)
from e2e.test_helm_chart import helm  # noqa: F401  (a fixture)
from rlhf_api import v1alpha1 as api
from rlhf_api.validation import validate
from rlhf_operator import reconcile, render
from rlhf_operator.kube import Kube

CHILDREN = ("configmaps", "serviceaccounts", "roles", "rolebindings", "rayjobs")


class CountingKube(Kube):
    """The operator's client on the control plane, noting the method and path of each request."""

    def __init__(self, api_client: Any):
        super().__init__(api_client)
        self.requests: list[tuple[str, str]] = []

    def _request(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        self.requests.append((method, path))
        return super()._request(method, path, *args, **kwargs)


def test_ensure_creates_first_and_reads_only_an_existing_child(kube, namespace, monkeypatch):
    client = CountingKube(kube.api_client)
    use_client(monkeypatch, client)
    job = create_job(kube, namespace, rlhf_job("tiny"))
    config_map = render.config_map(validate(reconcile._manifest(job)))
    path = f"/api/v1/namespaces/{namespace}/configmaps"

    created = reconcile.ensure(config_map, job["metadata"]["uid"])
    assert client.requests == [("POST", path)]

    client.requests.clear()
    assert reconcile.ensure(config_map, job["metadata"]["uid"])["metadata"]["uid"] == created["metadata"]["uid"]
    assert client.requests == [("POST", path), ("GET", f"{path}/tiny-config")]  # 409, then the owner check


class NothingStuck(reconcile.Reads):
    """What the operator's index of stuck pods says while none of the Ray cluster's pods has a problem."""

    def pod_problem(self, namespace: str, cluster: str) -> tuple[str, str] | None:
        return None


@pytest.mark.parametrize("written_here", [True, False], ids=["our-write", "another-writer"])
def test_a_stale_copy_of_the_job_is_caught_up_without_a_list(kube, namespace, operator_client, monkeypatch,
                                                              written_here):
    """A RayJob event mirrored with an older copy of its job (the index lagged). Where the newer status is
    this operator's own write, the change is computed from the job as written (the RayJob read again: that
    write may have observed a newer one); where another writer made it (say the operator that led before),
    the status write meets a 409, then the job and its RayJob are read afresh and the write is made again.
    What the pods wait for still comes from the pod watch's index, not from a list of every pod."""
    stale = create_job(kube, namespace, rlhf_job("tiny"))
    reconcile.reconcile(kopf.Body(stale))  # children, RayJob, status: the copy above is now stale
    if not written_here:
        monkeypatch.setattr(reconcile, "_written", reconcile.Kept())
    ray_job = RayJobStatus(kube, namespace, "tiny").initializing()  # its cluster is named: Provisioning
    client = CountingKube(kube.api_client)
    use_client(monkeypatch, client)

    reconcile.mirror(kopf.Body(stale), ray_job, None, NothingStuck())

    job_path = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{namespace}/{api.PLURAL}/tiny"
    ray_job_read = ("GET", f"/apis/ray.io/v1/namespaces/{namespace}/rayjobs/tiny")
    caught_up = [ray_job_read] if written_here else [("PATCH", f"{job_path}/status"), ("GET", job_path), ray_job_read]
    assert client.requests == [*caught_up, ("PATCH", f"{job_path}/status")]
    assert get_job(kube, namespace, "tiny")["status"]["phase"] == "Provisioning"


def test_a_newer_copy_with_our_status_costs_no_read(kube, namespace, operator_client, monkeypatch):
    """A RayJob event mirrored with a copy of its job newer than our last status write (kopf annotated
    the job since) whose status is ours: nothing to write, and nothing to read (CI once saw the RayJob
    read again here, the comparison with our write taken for a stale copy's)."""
    reconcile.reconcile(kopf.Body(create_job(kube, namespace, rlhf_job("tiny"))))  # status written
    annotated = kube.patch(api.KIND, namespace, "tiny", {"metadata": {"annotations": {"kopf.zalando.org/x": "1"}}})
    ray_job = kube.get("RayJob", namespace, "tiny")
    client = CountingKube(kube.api_client)
    use_client(monkeypatch, client)

    reconcile.mirror(kopf.Body(annotated), ray_job, None, NothingStuck())

    assert client.requests == []


def settled_requests(control_plane, release: str, started: int, namespace: str, operator: OperatorProcess) -> list[dict]:
    """The operator's completed requests in namespace since `started`, once no handler of its runs
    (rlhf_operator_handlers_active): a handler still at work when the job reached its phase (say, the
    reads after a conflict) is counted whole, not cut between its write and its reads."""
    wait_for(lambda: not re.search(r"^rlhf_operator_handlers_active\{.*\} [1-9]", operator.metrics(), re.M), 60,
             "the operator's handlers to finish")
    return [e for e in audited(control_plane, release)[started:]
            if e["stage"] == "ResponseComplete" and e["objectRef"].get("namespace") == namespace]


def test_a_job_and_a_ray_job_event_cost_no_reads(helm, control_plane, kube, namespace, audited_namespace,
                                                 kuberay_paused, tmp_path):
    release = "requests"
    install_rbac(helm, control_plane, tmp_path, release, {})
    operator = OperatorProcess(control_plane, None, tmp_path,  # all namespaces, as the chart's ClusterRole allows
                               kubeconfig=token_kubeconfig(control_plane, release, tmp_path / "kubeconfig"))
    try:
        operator.start("--resync-seconds", "3600")  # the events' requests, not the safety net's (a slow run's)
        started = len(audited(control_plane, release))
        create_job(kube, namespace, rlhf_job("tiny"))
        wait_phase(kube, namespace, "tiny", "Pending", "RayJobCreated")
        RayJobStatus(kube, namespace, "tiny").initializing()
        wait_phase(kube, namespace, "tiny", "Provisioning")
        requests = settled_requests(control_plane, release, started, namespace, operator)  # not the deletion below
    finally:
        stop_operator(kube, namespace, operator)

    count = collections.Counter((resource, verb) for _, resource, verb in map(request_key, requests))
    sequence = [(e["verb"], request_key(e)[1], e["responseStatus"]["code"]) for e in requests]  # what failed shows
    assert {resource: count[resource, "create"] for resource in CHILDREN} == dict.fromkeys(CHILDREN, 1), sequence
    assert count["pods", "list"] == 0, count
    # The job is read only after a status write met a newer one, and its RayJob then too, to observe
    # afresh; the RayJob also once per mirror at most (the job's creation and the RayJob's two events)
    # whose copy of the job predates this operator's own write (test_a_stale_copy_of_the_job_...).
    conflicts = sum(1 for e in requests if request_key(e)[1:] == (f"{api.PLURAL}/status", "patch")
                    and e["responseStatus"]["code"] == 409)
    reads = {resource: count[resource, "get"] for resource in (*CHILDREN, api.PLURAL)}
    assert reads == {**dict.fromkeys(CHILDREN, 0), "rayjobs": reads["rayjobs"], api.PLURAL: conflicts}, sequence
    assert conflicts <= reads["rayjobs"] <= conflicts + 3, sequence
