"""Runtimes (ClusterRLHFRuntime, RLHFRuntime) on the real API server with the operator running: a job that names
one is rendered with the runtime's settings where it leaves a field at its default, its own fields win, a field
the runtime locks fails it, a missing runtime is waited for, and the runtime as it was when the job started is
recorded in status and kept: an edit or a deletion of the runtime changes no job made from it. With the operator's
admission webhook registered, the API server refuses a job naming a missing runtime or setting a locked field
before it is stored. Cluster runtimes are cluster-wide: each test names its own after its namespace and marks none
default (other tests run beside); the webhook is registered for the test's namespace alone."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.controlplane import free_ports
from e2e.controlplane.certs import make_serving_cert
from e2e.fixtures import wait_for
from e2e.operator.jobs import children, create_job, get_job, rlhf_job, touch_and_wait_reconciled, wait_phase
from rlhf_api import v1alpha1 as api
from rlhf_api import validation
from rlhf_operator import admission, checks

GPU_TAINT = {"key": "pool", "operator": "Equal", "value": "h100", "effect": "NoSchedule"}


def runtime(kind: str, name: str, namespace: str = "", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": kind,
            "metadata": {"name": name, **({"namespace": namespace} if namespace else {})}, "spec": spec}


@pytest.fixture
def cluster_runtime(kube, namespace):
    """A ClusterRLHFRuntime of this test's (deleted at the end): an H100 pool's conventions."""
    name = f"h100-{namespace}"
    kube.create(runtime("ClusterRLHFRuntime", name, trainerImages={"cpu": "registry.example/trainer:1.0-cpu"},
                        resources={"tolerations": [GPU_TAINT], "nodeSelector": {"pool": "h100"}, "shmSize": "64Gi",
                                   "head": {"cpu": "2"}, "priorityClassName": "training"},
                        locked=["tolerations"]))
    yield name
    found = kube.get("ClusterRLHFRuntime", "", name)
    if found:
        kube.delete("ClusterRLHFRuntime", "", name, found["metadata"]["uid"])


def _job_with_runtime(name: str, runtime_name: str, **resources: Any) -> dict[str, Any]:
    job = rlhf_job(name, runtimeRef={"name": runtime_name}, resources=resources)
    for left_at_default in ("shmSize", "head"):  # rlhf_job sets them: the runtime's apply only where a job does not
        job["spec"]["resources"].pop(left_at_default, None)
    return job


def _worker_pod(kube, namespace: str, name: str) -> dict[str, Any]:
    [ray_job] = children(kube, namespace, name)["RayJob"]
    return ray_job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]


def test_a_job_gets_its_runtime_s_settings_its_own_win_and_it_keeps_them(kube, namespace, operator, kuberay_paused,
                                                                      cluster_runtime):
    operator.start()
    create_job(kube, namespace, _job_with_runtime("uses-runtime", cluster_runtime, nodeSelector={"team": "a"}))
    wait_phase(kube, namespace, "uses-runtime", "Pending", "RayJobCreated")
    [ray_job] = children(kube, namespace, "uses-runtime")["RayJob"]
    head = ray_job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    worker = _worker_pod(kube, namespace, "uses-runtime")
    assert GPU_TAINT in worker["tolerations"] and GPU_TAINT in head["tolerations"]
    assert worker["nodeSelector"] == {"team": "a"}  # the job's own
    assert head["containers"][0]["resources"]["limits"]["cpu"] == "2"
    assert head["containers"][0]["image"] == "registry.example/trainer:1.0-cpu"  # a CPU job: the cpu image
    assert worker["priorityClassName"] == "training"
    shm = next(v for v in worker["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["sizeLimit"] == "64Gi"
    recorded = get_job(kube, namespace, "uses-runtime")["status"]["runtime"]
    assert (recorded["kind"], recorded["name"], recorded["generation"]) == ("ClusterRLHFRuntime", cluster_runtime, 1)
    assert recorded["spec"]["resources"]["shmSize"] == "64Gi"

    # The runtime edited, then deleted: the job keeps what it started with.
    kube.patch("ClusterRLHFRuntime", "", cluster_runtime, {"spec": {"resources": {"shmSize": "8Gi"}}})
    touch_and_wait_reconciled(kube, namespace, "uses-runtime")
    found = kube.get("ClusterRLHFRuntime", "", cluster_runtime)
    kube.delete("ClusterRLHFRuntime", "", cluster_runtime, found["metadata"]["uid"])
    wait_for(lambda: kube.get("ClusterRLHFRuntime", "", cluster_runtime) is None, 30, "the runtime to go")
    touch_and_wait_reconciled(kube, namespace, "uses-runtime")
    job = get_job(kube, namespace, "uses-runtime")
    assert job["status"]["runtime"] == recorded and job["status"]["phase"] == "Pending"
    assert next(v for v in _worker_pod(kube, namespace, "uses-runtime")["volumes"]
                if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "64Gi"

    # ... and a new job naming it waits for it (RuntimeNotFound), with nothing made.
    create_job(kube, namespace, _job_with_runtime("after-deletion", cluster_runtime))
    waiting = wait_phase(kube, namespace, "after-deletion", "Pending", "RuntimeNotFound")["status"]
    assert f"ClusterRLHFRuntime {cluster_runtime}, which does not exist" in waiting["message"]
    assert not any(children(kube, namespace, "after-deletion").values())


def _serving_cert(control_plane, name: str, into: Path) -> Path:
    """A serving certificate for 127.0.0.1 signed by the control plane's CA, as a kubernetes.io/tls Secret's files."""
    make_serving_cert(control_plane.pki, name, name, ["IP:127.0.0.1"])
    into.mkdir()
    for suffix, file in (("crt", admission.CERT_FILE), ("key", admission.KEY_FILE)):
        shutil.move(control_plane.pki / f"{name}.{suffix}", into / file)
    return into


def _webhook_configuration(name: str, namespace: str, port: int, ca: bytes) -> dict[str, Any]:
    """The chart's ValidatingWebhookConfiguration, called by URL (no Service here) for one namespace."""
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{"name": "rlhfjobs.rlhf.dev", "admissionReviewVersions": ["v1"], "sideEffects": "None",
                          "failurePolicy": "Fail", "timeoutSeconds": 10,
                          "clientConfig": {"url": f"https://127.0.0.1:{port}{admission.PATH}",
                                           "caBundle": base64.b64encode(ca).decode()},
                          "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
                          "rules": [{"apiGroups": [api.GROUP], "apiVersions": [api.VERSION], "operations": ["CREATE"],
                                     "resources": [api.PLURAL], "scope": "Namespaced"}]}]}


def test_a_job_that_sets_a_field_its_runtime_locks_fails_naming_it_and_the_webhook_refuses_it_first(
        kube, control_plane, namespace, operator, kuberay_paused, cluster_runtime, tmp_path):
    [port] = free_ports(1)
    cert_dir = _serving_cert(control_plane, f"webhook-{namespace}", tmp_path / "webhook")
    operator.start("--webhook-port", str(port), "--webhook-cert-dir", str(cert_dir))
    # No webhook registered (a cluster installed without it): the operator refuses the job after admission.
    create_job(kube, namespace, _job_with_runtime("locked-out", cluster_runtime, tolerations=[{"operator": "Exists"}]))
    failed = wait_phase(kube, namespace, "locked-out", "Failed", "RuntimeFieldLocked")["status"]
    assert "spec.resources.tolerations" in failed["message"]
    assert not any(children(kube, namespace, "locked-out").values())

    # Registered: the API server asks the operator's webhook, and kubectl says what to change.
    ca = (control_plane.pki / "ca.crt").read_bytes()
    configuration = _webhook_configuration(f"rlhf-{namespace}", namespace, port, ca)
    control_plane.kubectl("apply", "-f", "-", input=json.dumps(configuration))

    def apply(job: dict[str, Any], *flags: str):
        job["metadata"]["namespace"] = namespace
        return control_plane.kubectl("apply", *flags, "-f", "-", input=json.dumps(job), check=False)

    try:
        missing = _job_with_runtime("missing-runtime", f"{cluster_runtime}-gone")
        refused = wait_for(lambda: (result := apply(missing, "--dry-run=server")).returncode and result, 30,
                           "the API server to call the webhook")
        assert (f"spec.runtimeRef names ClusterRLHFRuntime {cluster_runtime}-gone, which does not exist: create the "
                "runtime before the job, or name one that exists" in refused.stderr), refused.stderr
        assert apply(missing).returncode and kube.get(api.KIND, namespace, "missing-runtime") is None
        locked = apply(_job_with_runtime("locked-at-admission", cluster_runtime, tolerations=[{"operator": "Exists"}]))
        assert locked.returncode and "sets spec.resources.tolerations for every job made with it and locks them: " \
            "remove them from this job" in locked.stderr and "RuntimeFieldLocked" in locked.stderr, locked.stderr
        admitted = apply(_job_with_runtime("admitted", cluster_runtime))
        assert admitted.returncode == 0, admitted.stderr
        assert get_job(kube, namespace, "admitted")["spec"]["runtimeRef"]["name"] == cluster_runtime
    finally:
        control_plane.kubectl("delete", "validatingwebhookconfiguration", configuration["metadata"]["name"])


def test_the_namespace_s_default_runtime_applies_to_a_job_that_names_none(kube, namespace, operator, kuberay_paused):
    kube.create(runtime("RLHFRuntime", "team-default", namespace, default=True, queueName="team-queue",
                        resources={"nodeSelector": {"team": "b"}}))
    operator.start()
    create_job(kube, namespace, rlhf_job("plain"))
    wait_for(lambda: children(kube, namespace, "plain")["RayJob"], 60, "the RayJob")
    [ray_job] = children(kube, namespace, "plain")["RayJob"]
    assert _worker_pod(kube, namespace, "plain")["nodeSelector"] == {"team": "b"}
    assert ray_job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-queue"
    wait_for(lambda: (get_job(kube, namespace, "plain").get("status") or {}).get("runtime", {}).get("name")
             == "team-default", 30, "status.runtime")


def test_rlhf_validate_reads_the_cluster_s_runtimes_and_claims(kube, control_plane, namespace, cluster_runtime,
                                                               tmp_path, capsys):
    from rlhf_cli.cli import main

    def validate(job: dict[str, Any]) -> int:
        (path := tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
        return main(["validate", "--cluster", "--kubeconfig", str(control_plane.kubeconfig), "-n", namespace, str(path)])

    assert validate(_job_with_runtime("j", cluster_runtime)) == 0
    assert f"valid (sft job j, with ClusterRLHFRuntime {cluster_runtime})" in capsys.readouterr().out

    # A job that needs shared storage without it: refused as the operator would, in its words.
    for claim, mode in (("zonal-disk", "ReadWriteOnce"), ("one-pod", "ReadWriteOncePod")):
        control_plane.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
            "spec": {"accessModes": [mode], "resources": {"requests": {"storage": "1Gi"}}}}))
    assert validate(rlhf_job("one-node", checkpoint={"pvc": "zonal-disk"})) == 0  # its head on its worker's node
    capsys.readouterr()
    job = {"one-pod": rlhf_job("one-pod", checkpoint={"pvc": "one-pod"}),
           "two-nodes": rlhf_job("two-nodes", checkpoint={"pvc": "zonal-disk"}, resources={"nodes": 2})}
    expected = {}
    for name, manifest in job.items():
        try:
            checks.check_claims(validation.validate(manifest).spec,
                                lambda claim: kube.get("PersistentVolumeClaim", namespace, claim))
        except checks.Unrealisable as refused:
            expected[name] = f"cannot run on this cluster ({refused.reason}): {refused.message}"
        assert validate(manifest) == 1
        assert expected[name] in capsys.readouterr().err
    assert "claim zonal-disk is ReadWriteOnce: the head and 2 worker pods mount it on different nodes; use a " \
        "ReadWriteMany claim" in expected["two-nodes"]
    assert "claim one-pod is ReadWriteOncePod" in expected["one-pod"]
