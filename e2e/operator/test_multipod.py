"""A job as the cluster runs it: KubeRay's own pods (a head, two CPU workers, the submitter), each
played for real by the pod runtime (e2e/pods) from the trainer image the suite built, KubeRay not paused.

KubeRay creates the RayCluster, its pods and head Service and the submitter Job; the Job controller
creates the submitter pod; the runtime runs each pod in its own network and mount namespace as uid
1000 (the pods' securityContext), with the command KubeRay wrote (`ray start` with its
rayStartParams, `ray job submit`); KubeRay follows the Ray job on the head's dashboard and writes
the RayJob status, from which the operator writes the RLHFJob's.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from e2e.fixtures import wait_for
from e2e.operator.jobs import StatusHistory, get_job, wait_events
from e2e.operator.test_usage import requested
from e2e.operator.tiny import EXAMPLE, reward_config_map, tiny_job
from e2e.pods.kubelet import NODE_LABEL
from e2e.pods.volumes import bind_script, container_mounts, make_sub_paths, make_volumes, memory_tmpfs
from e2e.storage import local_claim, sub_path
from rlhf_api import contract
from rlhf_api.contract import model_mount
from rlhf_api import v1alpha1 as api
from tests.trainer.run_probes import newest

STEPS, INTERVAL = 2, 2
CHECKPOINTS = "/var/lib/rlhf/checkpoints"  # spec.checkpoint.path: in every pod, on the shared claim
MODEL_ACTORS = {"ModelWorker", "RolloutEngine"}  # the model groups' ranks and the vLLM engine


class RayState:
    """What Ray itself says, from the head's dashboard while the cluster lives: each actor's class and node IP."""

    def __init__(self, core, namespace: str):
        self.core, self.namespace = core, namespace
        self.actors: dict[str, tuple[str, str]] = {}  # actor id -> (class, node IP)
        self.nodes: dict[str, dict[str, float]] = {}  # node IP -> the resources Ray gives it in all
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._follow, daemon=True)
        self.thread.start()

    def _get(self, head_ip: str, token: str, path: str) -> list[dict]:
        request = urllib.request.Request(f"http://{head_ip}:8265{path}",
                                         headers={"x-ray-authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.load(response)["data"]["result"]["result"]

    def _follow(self) -> None:
        while not self.done.wait(2):
            try:
                head = self.core.list_namespaced_pod(self.namespace, label_selector="ray.io/node-type=head").items
                if not head or not head[0].status.pod_ip:
                    continue
                ref = next(e.value_from.secret_key_ref for e in head[0].spec.containers[0].env
                           if e.name == "RAY_AUTH_TOKEN")
                secret = self.core.read_namespaced_secret(ref.name, self.namespace).data[ref.key]
                token = base64.b64decode(secret).decode()
                listed = self._get(head[0].status.pod_ip, token, "/api/v0/nodes?detail=true")
                nodes = {n["node_id"]: n["node_ip"] for n in listed}
                self.nodes.update({n["node_ip"]: n.get("resources_total", {}) for n in listed})
                for actor in self._get(head[0].status.pod_ip, token, "/api/v0/actors?limit=1000&detail=true"):
                    if actor.get("node_id") in nodes:
                        self.actors[actor["actor_id"]] = (actor["class_name"], nodes[actor["node_id"]])
            except Exception:  # noqa: BLE001 - the head is not up yet, or already gone
                continue


def apply_job(control_plane, core, namespace: str, tmp_path: Path, tiny_model: Path, name: str, steps: int,
              node: str, image: str | None, interval: int = INTERVAL, **spec) -> Path:
    """The tiny GRPO job on a head and two CPU worker pods of the runtime's `node`, from `image` (None: the
    operator's trainer image): the model and the prompts on a claim of that node, the checkpoints on another, which every
    pod mounts; returns the checkpoint volume's directory. (A one-node job on ReadWriteOnce claims, as a single box
    or a cloud's default storage class has them, is e2e/test_dev_cluster.py's.)"""
    models = local_claim(core, namespace, "models", tmp_path / "models-volume", node=node)
    shutil.copytree(tiny_model, models / "tiny")
    shutil.copytree(EXAMPLE.parent / "tiny", models / "data")
    checkpoints = local_claim(core, namespace, "checkpoints", tmp_path / "checkpoints-volume", node=node)
    job_file = tiny_job(tmp_path, name, reward_config_map(control_plane, namespace),
                        actor={"path": "tiny", "pvc": {"claimName": "models"}}, steps=steps,
                        checkpoint={"pvc": "checkpoints", "path": CHECKPOINTS, "intervalSteps": interval, "keep": 2})
    manifest = yaml.safe_load(job_file.read_text())
    manifest["spec"]["data"]["prompts"]["sources"][0]["path"] = f"{model_mount('actor')}/data/prompts.jsonl"
    manifest["spec"]["resources"] = {
        **({"image": image} if image else {}), "gpusPerNode": 0, "head": {"cpu": "1", "memory": "3Gi"},
        "nodes": 2, "worker": {"cpu": "2", "memory": "5Gi"},
        "shmSize": "1Gi", "nodeSelector": {NODE_LABEL: "true"},
        "tolerations": [{"key": NODE_LABEL, "operator": "Exists", "effect": "NoSchedule"}]}
    manifest["spec"].update(spec)
    job_file.write_text(yaml.safe_dump(manifest, sort_keys=False))
    control_plane.kubectl("-n", namespace, "apply", "-f", str(job_file))
    return checkpoints


def wait_end(kube, namespace: str, name: str, pod_runtime, started: float) -> dict:
    """The job once Succeeded or Failed; prints the runtime's figures and the pods' logs either way."""
    try:
        return wait_for(lambda: (j := get_job(kube, namespace, name)).get("status", {}).get("phase")
                        in ("Succeeded", "Failed") and j, 1200, f"job {name} to end")
    finally:
        print(f"\npod runtime: {time.monotonic() - started:.0f}s from apply to the job's end; peak RSS per pod (MiB): "
              f"{ {pod: rss >> 20 for pod, rss in pod_runtime.peak_rss.items() if pod.startswith(name)} }; "
              f"errors: {pod_runtime.errors}")
        for log in sorted((pod_runtime.root / "pods").glob("*/container.log")):
            print(f"--- {log}\n{log.read_text()[-3000:]}")


@pytest.mark.timeout(1500)
def test_a_head_and_two_worker_pods_train_through_kuberays_own_submission(
        control_plane, kube, kube_api, namespace, operator, pod_runtime, trainer_image, tiny_model, tmp_path):
    core = kube_api.core
    operator.start()
    started = time.monotonic()
    ray_state = RayState(core, namespace)
    checkpoints = apply_job(control_plane, core, namespace, tmp_path, tiny_model, "multipod", STEPS, pod_runtime.node,
                            trainer_image)

    # Every pod KubeRay and the Job controller create runs here: head, two workers, the submitter.
    def pods_by_kind() -> dict[str, list]:
        pods = core.list_namespaced_pod(namespace).items
        kinds = {"head": [], "worker": [], "submitter": []}
        for pod in pods:
            labels = pod.metadata.labels or {}
            kind = labels.get("ray.io/node-type") or ("submitter" if "batch.kubernetes.io/job-name" in labels else "")
            if kind in kinds and pod.status.pod_ip:
                kinds[kind].append(pod)
        return kinds if all(kinds.values()) and len(kinds["worker"]) == 2 else None

    seen = wait_for(pods_by_kind, 300, "head, two workers and the submitter running with pod IPs")
    ips = {kind: {pod.status.pod_ip for pod in pods} for kind, pods in seen.items()}
    assert len(set().union(*ips.values())) == 4  # each pod its own IP
    assert all(pod.spec.node_name == pod_runtime.node for pods in seen.values() for pod in pods)
    # `rlhf logs -f`, as a user follows the run: pods/log through the API server to this node's kubelet.
    follower = subprocess.Popen([sys.executable, "-m", "rlhf_cli.cli", "logs", "multipod", "-n", namespace, "-f"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=control_plane.env(dict(os.environ)))

    job = wait_end(kube, namespace, "multipod", pod_runtime, started)
    ray_state.done.set()
    assert job["status"]["phase"] == "Succeeded", job["status"]
    status = job["status"]
    assert status["progress"]["step"] == STEPS
    assert 0.0 <= status["metrics"]["rewardMean"] <= 1.0
    assert status["lastCheckpoint"]["path"] == f"{CHECKPOINTS}/step-{STEPS:08d}"
    rayjob = kube.get("RayJob", namespace, status["rayJobName"])
    assert rayjob["status"]["jobStatus"] == "SUCCEEDED"  # written by KubeRay from the dashboard
    assert rayjob["status"]["jobDeploymentStatus"] == "Complete"
    # The follow ended by itself with the submitter's container; what it streamed is the trainer's log.
    followed, errors = follower.communicate(timeout=120)
    assert follower.returncode == 0, errors
    [submitter] = seen["submitter"]
    assert f"==> pod {submitter.metadata.name} " in followed
    assert f"step {STEPS}: checkpoint saved to {CHECKPOINTS}/step-{STEPS:08d}" in followed, followed[-3000:]

    # Ray's own view, node by node: every model group rank and the engine on a worker pod, none on the head.
    placed = {}
    for kind, node_ip in ray_state.actors.values():
        if kind in MODEL_ACTORS:
            placed.setdefault(kind, set()).add(node_ip)
    assert set(placed) == MODEL_ACTORS, ray_state.actors
    assert set().union(*placed.values()) <= ips["worker"], (placed, ips)
    print(f"Ray placed {placed}; workers {ips['worker']}, head {ips['head']}")
    # CPU and memory as Ray sees them: what KubeRay derived from each pod's limits (the head none: num-cpus 0).
    assert ray_state.nodes[next(iter(ips["head"]))].get("CPU", 0) == 0, ray_state.nodes
    for ip in ips["worker"]:
        assert ray_state.nodes[ip]["CPU"] == 2 and ray_state.nodes[ip]["memory"] == 5 * 2**30, ray_state.nodes
    # The checkpoint every pod wrote to is on the one shared claim.
    assert (checkpoints / "multipod" / f"step-{STEPS:08d}" / "trainer_state.json").is_file()

    # status.usage: one attempt, the head and both workers with the CPUs they requested, each closed once
    # KubeRay deleted the cluster after the job (the submitter pod is not the Ray cluster's).
    ray_pods = {pod.metadata.name: kube_api.api_client.sanitize_for_serialization(pod)
                for pod in seen["head"] + seen["worker"]}
    usage = wait_for(lambda: (u := get_job(kube, namespace, "multipod")["status"].get("usage") or {}).get("attempts")
                     and all(p.get("endTime") for p in u["attempts"][0]["pods"]) and u, 300,
                     "every Ray pod's end in status.usage")
    [attempt] = usage["attempts"]
    assert attempt["rayClusterName"] == rayjob["status"]["rayClusterName"]
    assert {p["name"]: p["cpus"] for p in attempt["pods"]} == {
        name: requested(pod, "cpu") for name, pod in ray_pods.items()}
    assert usage["gpuSeconds"] == 0 and usage["cpuSeconds"] > 0
    print(f"usage: {usage['cpuSeconds']} CPU-seconds over "
          f"{ {p['name']: (p['cpus'], p['startTime'], p['endTime']) for p in attempt['pods']} }")

    # One job, two places, one answer: the job file the trainer read in the cluster, run by `rlhf run` on
    # one local Ray node, reports the same reward, loss and KL at every step.
    here = run_locally(core, namespace, rayjob, tmp_path / "local")
    there = [json.loads(line) for line in (checkpoints / "multipod" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in here] == [m["step"] for m in there] == list(range(1, STEPS + 1))
    for local, cluster in zip(here, there):
        for metric in ("reward_mean", "policy_loss", "kl"):
            assert local[metric] == pytest.approx(cluster[metric], rel=1e-5, abs=1e-7), (metric, local, cluster)


def run_locally(core, namespace: str, rayjob: dict, root: Path) -> list[dict]:
    """`rlhf run` of the job's own file (its ConfigMap), on this machine, in a mount namespace holding the head
    pod's volumes at its mount paths (e2e/pods/volumes.py), but the checkpoint claim swapped for a directory of
    its own (a run on the claim would resume from the cluster's); returns its metrics.jsonl rows."""
    head = copy.deepcopy(rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"])
    for volume in head["volumes"]:
        if volume["name"] == "checkpoints":
            del volume["persistentVolumeClaim"]
            volume["emptyDir"] = {}
    volumes, container = make_volumes(core, namespace, head, root), head["containers"][0]
    make_sub_paths(container, volumes)
    script = bind_script(container_mounts(container, volumes, token=None), memory_tmpfs(volumes))
    command = shlex.join([sys.executable, "-m", "rlhf_cli.cli", "run", contract.JOB_CONFIG_PATH])
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", f"set -e\n{script}exec {command}"],
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"}, cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    [mount] = [mount for mount in container["volumeMounts"] if mount["name"] == "checkpoints"]
    metrics = sub_path(volumes["checkpoints"].path, mount.get("subPath", "")) / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "logs" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(1500)
def test_a_killed_worker_pod_is_retried_and_resumes_from_the_shared_checkpoint(
        control_plane, kube, kube_api, namespace, operator, pod_runtime, trainer_image, tiny_model, tmp_path):
    """backoffLimit 1: a worker pod holding a model rank is SIGKILLed a step past a checkpoint; the Ray job
    fails saying where the run will resume, KubeRay retries on a new cluster (the same submission id), the
    RLHFJob says which attempt it is on (status and a Warning event), and the run resumes from the
    checkpoint on the shared claim, losing at most one interval."""
    core, steps, interval = kube_api.core, 20, 4  # a tiny step takes about half a second: room to kill mid-run
    operator.start()
    started = time.monotonic()
    ray_state = RayState(core, namespace)
    history = StatusHistory(control_plane, namespace, "podkill")
    run_dir = apply_job(control_plane, core, namespace, tmp_path, tiny_model, "podkill", steps, pod_runtime.node,
                        trainer_image, interval, backoffLimit=1) / "podkill"
    victim_ip = wait_for(lambda: next((ip for kind, ip in list(ray_state.actors.values()) if kind == "ModelWorker"),
                                      None), 600, "Ray to place a ModelWorker")
    victim = next(pod for pod in core.list_namespaced_pod(namespace, label_selector="ray.io/node-type=worker").items
                  if pod.status.pod_ip == victim_ip)

    def past_a_checkpoint() -> bool:
        saved = newest(run_dir)
        return saved is not None and max(steps_logged(run_dir), default=0) > saved

    wait_for(past_a_checkpoint, 600, "a step logged past a checkpoint", interval=0.02, max_interval=0.05)
    pod_runtime.kill(namespace, victim.metadata.name)
    rayjob_name = get_job(kube, namespace, "podkill")["status"]["rayJobName"]
    wait_for(lambda: (kube.get("RayJob", namespace, rayjob_name).get("status") or {}).get("failed") == 1, 300,
             "KubeRay to count the failed attempt")
    saved, logged = newest(run_dir), steps_logged(run_dir)
    first_cluster = victim.metadata.labels["ray.io/cluster"]

    try:
        job = wait_end(kube, namespace, "podkill", pod_runtime, started)
    finally:
        ray_state.done.set()
        seen = history.stop()
    assert job["status"]["phase"] == "Succeeded", job["status"]
    assert saved < steps and max(logged) - saved <= interval, (saved, logged)  # at most one interval lost
    assert steps_logged(run_dir)[len(logged):] == list(range(saved + 1, steps + 1))  # resumed after `saved`
    ray_status = kube.get("RayJob", namespace, rayjob_name)["status"]
    assert (ray_status["failed"], ray_status["succeeded"]) == (1, 1)
    assert ray_status["rayClusterName"] != first_cluster  # attempt 2 on a new cluster (the same submission id)
    assert job["status"]["progress"]["step"] == steps and job["status"]["lastCheckpoint"]["step"] == steps

    # The failed attempt's driver said where the next one resumes; the next one did.
    drivers = "\n".join(log.read_text() for log in (pod_runtime.root / "pods").glob("*/container.log"))
    failed = [line for line in drivers.splitlines() if contract.RUN_FAILED in line]
    assert any("running the job again resumes" in line for line in failed), failed
    assert f"resumed from {CHECKPOINTS}/step-{saved:08d} at step {saved}" in drivers
    # Running -> Retrying (attempt 2 of 2) -> ... -> Succeeded, every message of attempt 2 saying so, one
    # startTime from the first attempt to the end (KubeRay restarts its own with each attempt).
    reasons = [s["reason"] for s in seen]
    assert "Retrying" in reasons and reasons[-1] == "Completed", reasons
    assert reasons.index("Training") < reasons.index("Retrying"), reasons
    retried = [s for s in seen[reasons.index("Retrying"):] if s["phase"] != "Succeeded"]
    assert all(s["message"].startswith("Attempt 2 of 2 (1 failed): ") for s in retried), [s["message"] for s in retried]
    assert len({s.get("startTime") for s in seen if s["phase"] != "Pending"}) == 1, [s.get("startTime") for s in seen]
    # The failed attempt is a Warning event that says which attempt comes next.
    wait_events(kube, namespace, "podkill", lambda e: e["type"] == "Warning" and e["reason"] == "Retrying"
                and e["message"].startswith("Attempt 2 of 2"), "a Retrying warning")
    print(f"pod runtime retry: worker pod {victim.metadata.name} killed after step {max(logged)} of {steps}; "
          f"attempt 2 resumed from step {saved}; the retry said: {retried[0]['message'][:300]}")


@pytest.mark.timeout(900)
def test_without_a_checkpoint_claim_the_job_fails_before_any_model_loads(
        control_plane, kube, kube_api, namespace, operator, pod_runtime, trainer_image, tiny_model, tmp_path):
    """Model groups on worker pods and checkpoint.path on each pod's own disk (no claim): the job fails with the
    trainer's reason, saying to set checkpoint.pvc, before any model loads; never a checkpoint split over pods.
    (A path the pod's user cannot even create is refused by the same check: test_multinode.py.)"""
    path = "/home/ray/checkpoints"
    operator.start()
    started = time.monotonic()
    ray_state = RayState(kube_api.core, namespace)
    apply_job(control_plane, kube_api.core, namespace, tmp_path, tiny_model, "nopvc", STEPS, pod_runtime.node,
              trainer_image, checkpoint={"path": path, "intervalSteps": INTERVAL})
    job = wait_end(kube, namespace, "nopvc", pod_runtime, started)
    ray_state.done.set()
    assert job["status"]["phase"] == "Failed", job["status"]
    message = job["status"]["message"]
    assert f"CheckpointNotShared: checkpoint.path {path} is not one directory shared by the Ray nodes" in message, message
    assert "checkpoint.pvc" in message
    assert not {kind for kind, _ in ray_state.actors.values()} & MODEL_ACTORS, ray_state.actors  # nothing loaded


@pytest.mark.timeout(1500)
def test_a_suspended_job_checkpoints_the_step_it_reached_and_resumes_after_it(
        control_plane, kube, kube_api, namespace, operator, pod_runtime, trainer_image, tiny_model, tmp_path):
    """spec.suspend mid-run: KubeRay deletes the cluster without stopping the Ray job (its own comment
    leaves that to a preStop hook). The head's preStop hook sends the driver SIGTERM; it finishes the
    step under way and checkpoints it while the workers' `ray start` drain (they keep the actors the
    driver still needs); resumed, the run goes on from the next step. checkpoint.intervalSteps 0 (save
    only at the end): a checkpoint before the end is the one SIGTERM made."""
    core, steps = kube_api.core, 30  # a tiny step takes about half a second: room for the suspension to land
    operator.start()
    started = time.monotonic()
    run_dir = apply_job(control_plane, core, namespace, tmp_path, tiny_model, "suspend", steps, pod_runtime.node,
                        trainer_image, interval=0) / "suspend"
    wait_for(lambda: len(steps_logged(run_dir)) >= 3, 600, "three steps logged", interval=0.05, max_interval=0.1)
    kube.patch(api.KIND, namespace, "suspend", {"spec": {"suspend": True}})
    wait_for(lambda: get_job(kube, namespace, "suspend").get("status", {}).get("phase") == "Suspended", 600,
             "the job to be Suspended")
    wait_for(lambda: not core.list_namespaced_pod(namespace, label_selector="ray.io/is-ray-node=yes").items, 600,
             "the suspended cluster's pods to be gone")
    logged, saved = steps_logged(run_dir), newest(run_dir)
    assert saved is not None and saved == max(logged) < steps, (saved, logged)  # the step reached, saved
    assert get_job(kube, namespace, "suspend")["status"]["lastCheckpoint"]["step"] == saved  # and reported

    kube.patch(api.KIND, namespace, "suspend", {"spec": {"suspend": False}})
    job = wait_end(kube, namespace, "suspend", pod_runtime, started)
    assert job["status"]["phase"] == "Succeeded", job["status"]
    assert steps_logged(run_dir)[len(logged):] == list(range(saved + 1, steps + 1))  # resumed after `saved`
    print(f"pod runtime suspend: suspended after step {saved} of {steps}; resumed from its checkpoint")
