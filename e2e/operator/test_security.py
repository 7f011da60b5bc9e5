"""Secrets stay secret, and the trainer's pods pass PodSecurity "restricted".

Real KubeRay makes the Ray cluster's pods (kwok runs them); the real API server enforces
PodSecurity on a namespace labelled for it. The trainer's own output comes from a real run whose
head pod e2e/pods/head.py plays (real KubeRay paused meanwhile).
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import wandb
import yaml
from kubernetes import client
from kubernetes import config as kconfig
from kubernetes.client.exceptions import ApiException

from e2e.fixtures import wait_for
from e2e.operator.jobs import create_job, get_job, rlhf_job, wait_gone, wait_phase
from e2e.operator.test_operator_rbac import token_kubeconfig
from e2e.operator.tiny import reward_config_map, tiny_job
from e2e.pods.head import HeadPod
from e2e.storage import local_claim
from rlhf_api import v1alpha1 as api
from rlhf_operator import names
from rlhf_trainer import learning_signal
from rlhf_trainer.kube_status import KubernetesStatusReporter

pytestmark = pytest.mark.trains  # its head pods run the trainer (e2e/parallel.py)

ROLES = ("head", "worker", "submitter")


def pods(kube, namespace: str, job: str, role: str | None = None) -> list[dict]:
    selector = f"rlhf.dev/job={job}" + (f",rlhf.dev/role={role}" if role else "")
    return kube._request("GET", f"/api/v1/namespaces/{namespace}/pods", query=[("labelSelector", selector)])["items"]


def operator_logs(operator) -> str:
    """Everything every start of the operator logged (verbose: each request and patch)."""
    return "\n".join(path.read_text() for path in sorted(operator.log_dir.glob("operator-*.log")))


def create_secret(kube, namespace: str, name: str) -> str:
    value = f"rlhf-e2e-secret-{secrets.token_hex(16)}"
    kube._request("POST", f"/api/v1/namespaces/{namespace}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": {"token": value}})
    return value


def secret_job(name: str, **resources) -> dict:
    """GRPO with an HTTP reward whose bearer token and the Hugging Face token come from Secrets."""
    return rlhf_job(
        name, algorithm="grpo",
        data={"prompts": {"sources": [{"path": "org/tiny-prompts"}]}},
        rollout={"samplesPerPrompt": 4},
        reward={"sources": [{"name": "judge", "type": "http", "http": {
            "url": "https://judge.example.com/score", "authSecretRef": {"name": "judge-token", "key": "token"}}}]},
        resources={"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}],
                   **resources},
    )


def test_no_secret_value_leaves_its_secret(kube, namespace, kuberay_operator, operator, control_plane):
    values = [create_secret(kube, namespace, "judge-token"), create_secret(kube, namespace, "hf-token")]
    operator.start()
    create_job(kube, namespace, secret_job("secretive"))
    wait_phase(kube, namespace, "secretive", "Provisioning", timeout=120)
    wait_for(lambda: len({p["metadata"]["labels"]["rlhf.dev/role"] for p in pods(kube, namespace, "secretive")}) >= 2,
             120, "the head and worker pods")

    # The trainer's status reporter writes what the trainer reports.
    api_client = control_plane.api_client()
    reporter = KubernetesStatusReporter("secretive", namespace, client.CustomObjectsApi(api_client), min_interval=0)
    reporter.start(total_steps=4)
    # A step that is the third in a row without learning signal: the trainer's condition, beside the operator's.
    reporter.log(1, {"reward_mean": 0.5, "kl": 0.01, learning_signal.METRIC: learning_signal.STALL_STEPS})
    reporter.checkpoint(1, "/checkpoints/step-1")
    assert reporter.wait(30)
    reporter.close()
    api_client.close()

    # Suspend (KubeRay deletes the cluster) and resume: more status, events and pods to look at.
    kube.patch(api.KIND, namespace, "secretive", {"spec": {"suspend": True}})
    wait_phase(kube, namespace, "secretive", "Suspended", "Suspended", timeout=120)
    kube.patch(api.KIND, namespace, "secretive", {"spec": {"suspend": False}})
    wait_phase(kube, namespace, "secretive", "Provisioning", timeout=120)
    wait_for(lambda: pods(kube, namespace, "secretive", "head"), 120, "the head pod after the resume")

    ray_job = kube.get("RayJob", namespace, names.ray_job("secretive"))
    head_env = {var["name"]: var for var in ray_job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
                ["containers"][0]["env"]}
    # By reference only: the Secret's name and key, never its value.
    assert head_env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    assert head_env["RLHF_REWARD_JUDGE_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "judge-token", "key": "token"}}

    places = {
        "RLHFJob (spec and status)": get_job(kube, namespace, "secretive"),
        "events": kube._request("GET", f"/api/v1/namespaces/{namespace}/events")["items"],
        "ConfigMaps": kube._request("GET", f"/api/v1/namespaces/{namespace}/configmaps")["items"],
        "RayJob": ray_job,
        "RayClusters": kube._request("GET", f"/apis/ray.io/v1/namespaces/{namespace}/rayclusters")["items"],
        "pods": pods(kube, namespace, "secretive"),
        "operator logs": operator_logs(operator),
    }
    for place, content in places.items():
        text = content if isinstance(content, str) else json.dumps(content)
        for value in values:
            assert value not in text, f"a Secret's value is in the {place}"
    assert "secretive" in places["operator logs"] and places["events"] and places["ConfigMaps"]  # looked in real places

    kube.delete(api.KIND, namespace, "secretive", get_job(kube, namespace, "secretive")["metadata"]["uid"])
    wait_gone(kube, api.KIND, namespace, "secretive")
    assert all(value not in operator_logs(operator) for value in values)


@pytest.fixture
def restricted(kube, namespace) -> str:
    """The namespace under PodSecurity "restricted", enforced by the API server's admission."""
    kube._request("PATCH", f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}},
        content_type="application/merge-patch+json")
    return namespace


def dry_run_pod(kube, namespace: str, spec: dict) -> None:
    kube._request("POST", f"/api/v1/namespaces/{namespace}/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "dry-run-"}, "spec": spec},
        query=[("dryRun", "All")])


def test_trainer_pods_pass_pod_security_restricted(kube, restricted, kuberay_operator, operator):
    namespace = restricted
    # The namespace really refuses what "restricted" forbids.
    with pytest.raises(ApiException) as refused:
        dry_run_pod(kube, namespace, {"containers": [{"name": "c", "image": "busybox"}]})
    assert refused.value.status == 403 and "violates PodSecurity" in str(refused.value.body)

    operator.start()
    create_job(kube, namespace, rlhf_job("restricted"))
    # KubeRay creates the head and the worker; once kwok reports them running, the submitter Job's pod.
    for role in ROLES:
        wait_for(lambda r=role: pods(kube, namespace, "restricted", r), 180, f"the {role} pod to be admitted")
    for pod in pods(kube, namespace, "restricted"):
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        for container in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}, container["name"]


def test_rdma_workers_are_admitted_under_restricted(kube, restricted, kuberay_operator, operator):
    """RDMA adds the adapters' resource and NCCL's settings, and no capability: IPC_LOCK, which the
    operator once added, never reached the uid-1000 process and made "restricted" (and "baseline")
    refuse the worker; its ranks check the memlock limit instead (tests/trainer/test_distributed_limits.py)."""
    operator.start()
    create_job(kube, restricted, rlhf_job("rdma", resources={
        "gpusPerNode": 1, "rdma": {"resourceName": "rdma/rdma_shared_device_a", "resourceCount": 1}}))
    [worker] = wait_for(lambda: pods(kube, restricted, "rdma", "worker"), 180, "the RDMA worker pod to be admitted")
    container = next(c for c in worker["spec"]["containers"] if c["name"] == "ray-worker")
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"


@contextlib.contextmanager
def judge(token: str) -> Iterator[tuple[str, list[int]]]:
    """An HTTP reward service on this machine that scores only requests bearing the token (any
    other gets a 401, which fails the run): its URL and the batch sizes it scored."""
    scored: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.headers.get("Authorization") != f"Bearer {token}":
                self.send_response(401)
                self.end_headers()
                return
            scored.append(len(body["completions"]))
            reply = json.dumps({"rewards": [0.0] * len(body["completions"])}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score", scored
    finally:
        server.shutdown()
        server.server_close()


def files_holding(values: list[str], root: Path) -> list[str]:
    """Every regular file under root that holds one of the values (bytes, so binary files count too)."""
    needles = [value.encode() for value in values]
    return [str(path) for path in sorted(root.rglob("*"))
            if path.is_file() and not path.is_symlink() and any(n in path.read_bytes() for n in needles)]


def test_no_secret_value_in_what_the_trainer_writes(control_plane, kube, kube_api, namespace, operator,
                                                   kuberay_paused, tmp_path):
    """A real run with an HTTP reward token, HF_TOKEN and a W&B API key and MLflow token from Secrets
    (the trainer really sends the reward token: the judge scores nothing without it). Grepped: the
    Ray job's driver output and job info, everything the head pod wrote on this machine (Ray's
    session logs: every worker's, the raylet's, the dashboard's and the job driver's), everything
    on the checkpoint claim (checkpoints, metrics.jsonl, TensorBoard, the W&B offline run, the
    MLflow file store), and the RLHFJob, events, ConfigMaps and the operator's log."""
    from rlhf_trainer.tiny import build_tiny_model

    secret_names = ("judge-token", "hf-token", "wandb-key", "mlflow-token")
    values = [create_secret(kube, namespace, name) for name in secret_names]
    volume = local_claim(kube_api.core, namespace, "checkpoints", tmp_path / "checkpoints-volume")
    operator.start()
    checkpoints = "/var/lib/rlhf/checkpoints"
    job_file = tiny_job(tmp_path, "secretive", reward_config_map(control_plane, namespace),
                        actor={"path": str(build_tiny_model(tmp_path / "model"))}, steps=2,
                        checkpoint={"pvc": "checkpoints", "path": checkpoints, "intervalSteps": 1, "keep": 1,
                                    "exportHf": False})
    with judge(values[0]) as (url, scored):
        manifest = yaml.safe_load(job_file.read_text())
        spec = manifest["spec"]
        spec["reward"]["sources"].append({"name": "judge", "type": "http", "http": {
            "url": url, "authSecretRef": {"name": "judge-token", "key": "token"}}})
        spec["resources"]["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token",
                                                                                          "key": "token"}}}]
        spec["tracking"] = {
            "wandb": {"project": "e2e", "mode": "offline", "apiKeySecret": {"name": "wandb-key", "key": "token"}},
            "mlflow": {"trackingUri": f"file://{checkpoints}/mlruns",
                       "tokenSecret": {"name": "mlflow-token", "key": "token"}}}
        job_file.write_text(yaml.safe_dump(manifest, sort_keys=False))
        control_plane.kubectl("-n", namespace, "apply", "-f", str(job_file))
        ray_job = wait_phase(kube, namespace, "secretive", "Pending")["status"]["rayJobName"]
        head = HeadPod(control_plane, kube, kube_api.core, namespace, ray_job)
        # A W&B service in this process, as an earlier test leaves one (its socket in WANDB_SERVICE):
        # the pod must not inherit it, or the pod's W&B run is written by a process outside the pod.
        wandb.setup()
        try:
            head.start()
            state, logs = head.run_job()
            job_info = head.client.get_job_info(head.job_id)
        finally:
            head.stop()
    assert state == "SUCCEEDED", logs[-4000:]
    assert scored, "the judge scored nothing: the reward token never reached it"
    run_dir = volume / "secretive"
    assert {"logs", "mlruns", "step-00000002"} <= {path.name for path in run_dir.iterdir()}
    assert {"metrics.jsonl", "tensorboard", "wandb"} <= {path.name for path in (run_dir / "logs").iterdir()}
    # The grep finds what is there: the submission id in Ray's session logs, the run's name in W&B's files.
    assert files_holding([head.job_id], head.root / "ray") and files_holding(["secretive"], run_dir / "logs" / "wandb")

    places = {
        "Ray job's logs": logs,
        "Ray job's info": json.dumps(job_info.__dict__, default=str),
        "RLHFJob (spec and status)": json.dumps(get_job(kube, namespace, "secretive")),
        "events": json.dumps(kube._request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]),
        "ConfigMaps": json.dumps(kube._request("GET", f"/api/v1/namespaces/{namespace}/configmaps")["items"]),
        "operator logs": operator_logs(operator),
    }
    for place, text in places.items():
        leaked = [name for name, value in zip(secret_names, values) if value in text]
        assert not leaked, f"the value of Secret {leaked} is in the {place}"
    assert files_holding(values, head.root) == [], "Secret values in what the head pod wrote"
    assert files_holding(values, volume) == [], "Secret values on the checkpoint claim"


def test_the_trainer_writes_only_its_own_progress(control_plane, kube, namespace, operator, tmp_path):
    """The job's ServiceAccount (its token is the head's: the trainer, its reward functions, environment
    and dependencies) may patch its job's status, and the chart's ValidatingAdmissionPolicy keeps it to
    the trainer's fields: it cannot end the job by setting phase, nor write another job's status."""
    operator.start()
    for name in ("policed", "neighbour"):
        create_job(kube, namespace, rlhf_job(name))
    wait_phase(kube, namespace, "policed", "Pending")
    trainer = kconfig.new_client_from_config(config_file=str(token_kubeconfig(
        control_plane, names.trainer("policed"), tmp_path / "kubeconfig", namespace)))
    status = client.CustomObjectsApi(trainer)

    def patch(name: str, body: dict, **options) -> ApiException | None:
        try:
            status.patch_namespaced_custom_object_status(api.GROUP, api.VERSION, namespace, api.PLURAL, name,
                                                         {"status": body}, **options)
        except ApiException as refused:
            return refused
        return None

    # The API server loads a new policy in the background: until a dry run is refused, it is not in force.
    wait_for(lambda: patch("policed", {"phase": "Succeeded"}, dry_run="All"), 30, "the policy in force")
    for forged in ({"phase": "Succeeded"}, {"progress": {"step": 1}, "conditions": [], "message": "done"}):
        refused = patch("policed", forged)
        assert refused is not None and refused.status == 403, forged
        assert "may change only status.progress, status.metrics, status.lastCheckpoint and its condition Stalled" in refused.body
        assert all(f"status.{field}" in refused.body for field in forged if field != "progress"), refused.body
    refused = patch("neighbour", {"progress": {"step": 1}})
    assert refused is not None and refused.status == 403 and "neighbour" in refused.body

    # What the trainer writes goes through.
    reporter = KubernetesStatusReporter("policed", namespace, status, min_interval=0)
    reporter.start(total_steps=4)
    # A step that is the third in a row without learning signal: the trainer's condition, beside the operator's.
    reporter.log(1, {"reward_mean": 0.5, "kl": 0.01, learning_signal.METRIC: learning_signal.STALL_STEPS})
    reporter.checkpoint(1, "/checkpoints/step-1")
    reporter.finish("succeeded")
    reporter.close()
    trainer.close()
    written = get_job(kube, namespace, "policed")["status"]
    assert written["progress"]["step"] == 1 and written["progress"]["result"] == "Succeeded"
    assert written["metrics"]["kl"] == 0.01 and written["lastCheckpoint"]["step"] == 1
    assert written["phase"] == "Pending" and "progress" not in (get_job(kube, namespace, "neighbour").get("status") or {})
    conditions = {c["type"]: c for c in written["conditions"]}
    assert set(conditions) == {"Ready", "Running", "Succeeded", "Failed", "Suspended", learning_signal.CONDITION}
    stalled = conditions[learning_signal.CONDITION]
    assert stalled["status"] == "True" and stalled["reason"] == learning_signal.STALLED, stalled
    assert "rollout.samplesPerPrompt" in stalled["message"] and conditions["Ready"]["reason"] != learning_signal.STALLED


def test_the_trainer_of_a_job_with_a_long_name_writes_its_progress(control_plane, kube, namespace, operator, tmp_path):
    """Past 245 characters, the job's ServiceAccount's name ends in a hash (names.trainer): the policy knows it."""
    name = "long-" + "n" * 245
    operator.start()
    create_job(kube, namespace, rlhf_job(name))
    wait_phase(kube, namespace, name, "Pending")
    assert names.trainer(name) != f"{name}-trainer"
    trainer = kconfig.new_client_from_config(config_file=str(token_kubeconfig(
        control_plane, names.trainer(name), tmp_path / "kubeconfig", namespace)))
    client.CustomObjectsApi(trainer).patch_namespaced_custom_object_status(
        api.GROUP, api.VERSION, namespace, api.PLURAL, name, {"status": {"progress": {"step": 1}}})
    trainer.close()
    assert get_job(kube, namespace, name)["status"]["progress"]["step"] == 1
