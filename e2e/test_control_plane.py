"""Acceptance tests of the local control plane itself: real kube-apiserver + etcd,
kube-controller-manager, kube-scheduler, kwok fake nodes and the real KubeRay operator."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

import e2e.controlplane
from e2e.controlplane import BUILD_SH, BUILD_TARGETS, Binaries, ControlPlane, read_versions
from e2e.fixtures import KubeAPI, wait_for

H100 = "NVIDIA-H100-80GB-HBM3"
A100 = "NVIDIA-A100-SXM4-80GB"
GPU_TOLERATION = client.V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")


def _pod(name: str, *, gpus: int = 0, product: str | None = None, tolerate: bool = False,
         rdma: bool = False) -> client.V1Pod:
    limits = {}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    if rdma:
        limits["rdma/rdma_shared_device_a"] = "1"
    affinity = None
    if product:
        affinity = client.V1Affinity(node_affinity=client.V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=client.V1NodeSelector(
                node_selector_terms=[client.V1NodeSelectorTerm(match_expressions=[
                    client.V1NodeSelectorRequirement(
                        key="nvidia.com/gpu.product", operator="In", values=[product]),
                ])])))
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            containers=[client.V1Container(
                name="main", image="registry.example/trainer:0",
                resources=client.V1ResourceRequirements(
                    requests={"cpu": "1", "memory": "1Gi", **limits}, limits=limits or None))],
            affinity=affinity,
            tolerations=[GPU_TOLERATION] if tolerate else None,
        ),
    )


def _running_on(kube_api: KubeAPI, ns: str, name: str) -> str:
    def running():
        pod = kube_api.core.read_namespaced_pod(name, ns)
        return pod if pod.status.phase == "Running" else None

    return wait_for(running, 60, f"pod {ns}/{name} Running").spec.node_name


def _unschedulable_message(kube_api: KubeAPI, ns: str, name: str) -> str:
    def unschedulable():
        pod = kube_api.core.read_namespaced_pod(name, ns)
        for c in pod.status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                return c.message
        return None

    return wait_for(unschedulable, 60, f"scheduler to mark {ns}/{name} Unschedulable")


# --------------------------------------------------------------------------- API server
def test_versions_are_the_pinned_ones(kube_api: KubeAPI) -> None:
    info = client.VersionApi(kube_api.api_client).get_code()
    assert info.git_version == read_versions()["KUBERNETES_VERSION"]


def test_the_control_plane_s_build_leaves_kueue_s_binary_to_the_clusters_that_run_kueue(
        control_plane: ControlPlane, tmp_path: Path) -> None:
    """Every test that starts a control plane waits for its build; Kueue's binary (about 6 minutes of a
    fresh machine's build) is not part of it. With every other step cached and no module to download,
    the control plane's build succeeds without building anything, and leaves no Go build cache behind (a
    run's own, removed at exit: the binaries are what is kept)."""
    built = Binaries.default()
    (tmp_path / "bin").mkdir()
    for target in BUILD_TARGETS:  # each step's directory (with its stamp), linked into a cache of our own
        step_dir = built.root / built.outputs(target)[0].relative_to(built.root).parts[0]
        (tmp_path / "bin" / step_dir.name).symlink_to(step_dir)
    offline = {**{k: v for k, v in os.environ.items() if k != "GOCACHE"},
               "RLHF_CACHE": str(tmp_path), "GOPROXY": "off", "GOMODCACHE": str(tmp_path / "mod")}
    result = subprocess.run(["bash", str(BUILD_SH), "control-plane"], env=offline, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "building" not in result.stderr and not (tmp_path / "bin" / built.kueue.parent.name).exists()
    assert [path.name for path in tmp_path.iterdir()] == ["bin"]  # no go-build.* left


def test_rbac_denies_service_account_until_bound(kube_api: KubeAPI, control_plane: ControlPlane,
                                                 namespace: str) -> None:
    """RBAC is enforced, and tokens signed with the service-account key authenticate."""
    kube_api.core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="robot")))
    token = kube_api.core.create_namespaced_service_account_token(
        "robot", namespace, client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600))).status.token

    cfg = client.Configuration()
    cfg.host = kube_api.api_client.configuration.host
    cfg.ssl_ca_cert = kube_api.api_client.configuration.ssl_ca_cert
    cfg.api_key = {"authorization": f"Bearer {token}"}
    with client.ApiClient(cfg) as robot_client:
        robot = client.CoreV1Api(robot_client)
        review = client.AuthenticationV1Api(robot_client).create_self_subject_review(
            client.V1SelfSubjectReview())
        assert review.status.user_info.username == f"system:serviceaccount:{namespace}:robot"

        with pytest.raises(ApiException) as denied:
            robot.list_namespaced_config_map(namespace)
        assert denied.value.status == 403

        kube_api.rbac.create_namespaced_role(namespace, client.V1Role(
            metadata=client.V1ObjectMeta(name="read-configmaps"),
            rules=[client.V1PolicyRule(api_groups=[""], resources=["configmaps"],
                                       verbs=["get", "list"])]))
        kube_api.rbac.create_namespaced_role_binding(namespace, client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="robot-reads-configmaps"),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="Role",
                                      name="read-configmaps"),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name="robot",
                                           namespace=namespace)]))

        def allowed():
            try:
                return robot.list_namespaced_config_map(namespace) is not None
            except ApiException as e:
                if e.status == 403:
                    return False
                raise

        wait_for(allowed, 30, "RoleBinding to take effect")
        with pytest.raises(ApiException) as still_denied:
            robot.list_namespaced_secret(namespace)
        assert still_denied.value.status == 403


def test_controller_manager_issues_service_account_token_secrets(kube_api: KubeAPI,
                                                                 namespace: str) -> None:
    kube_api.core.create_namespaced_secret(namespace, client.V1Secret(
        metadata=client.V1ObjectMeta(
            name="default-token", annotations={"kubernetes.io/service-account.name": "default"}),
        type="kubernetes.io/service-account-token"))

    def filled():
        data = kube_api.core.read_namespaced_secret("default-token", namespace).data or {}
        return data if "token" in data and "ca.crt" in data else None

    wait_for(filled, 30, "tokens controller to fill the Secret")


# --------------------------------------------------------------------------- garbage collection
def _owned_by(owner) -> list[client.V1OwnerReference]:
    return [client.V1OwnerReference(api_version="v1", kind="ConfigMap", name=owner.metadata.name,
                                    uid=owner.metadata.uid, controller=True,
                                    block_owner_deletion=True)]


@pytest.mark.parametrize("propagation", ["Background", "Foreground"])
def test_deleting_an_owner_deletes_its_children(kube_api: KubeAPI, namespace: str,
                                                propagation: str) -> None:
    core = kube_api.core
    owner = core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="owner"), data={"role": "owner"}))
    refs = _owned_by(owner)
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="child-config", owner_references=refs)))
    core.create_namespaced_service_account(namespace, client.V1ServiceAccount(
        metadata=client.V1ObjectMeta(name="child-sa", owner_references=refs)))
    core.create_namespaced_config_map(namespace, client.V1ConfigMap(
        metadata=client.V1ObjectMeta(name="bystander")))

    core.delete_namespaced_config_map("owner", namespace, body=client.V1DeleteOptions(
        propagation_policy=propagation))

    def gone() -> bool:
        names = {c.metadata.name for c in core.list_namespaced_config_map(namespace).items}
        sas = {s.metadata.name for s in core.list_namespaced_service_account(namespace).items}
        return not ({"owner", "child-config"} & names) and "child-sa" not in sas

    wait_for(gone, 60, "garbage collector to delete the owner's children")
    assert core.read_namespaced_config_map("bystander", namespace).metadata.name == "bystander"


# --------------------------------------------------------------------------- scheduling on kwok
def test_fake_nodes_look_like_gpu_nodes(kube_api: KubeAPI, kwok_nodes: list[str]) -> None:
    nodes = {n.metadata.name: n for n in kube_api.core.list_node(
        label_selector="type=kwok").items}
    assert set(kwok_nodes) <= set(nodes)
    gpu = [n for n in nodes.values() if n.metadata.labels.get("nvidia.com/gpu.present") == "true"]
    assert {n.metadata.labels["nvidia.com/gpu.product"] for n in gpu} == {H100, A100}
    for n in gpu:
        assert n.status.allocatable["nvidia.com/gpu"] == "8"
        assert n.metadata.labels["nvidia.com/gpu.count"] == "8"
        assert "rdma/rdma_shared_device_a" in n.status.allocatable
        assert [(t.key, t.value, t.effect) for t in n.spec.taints] == [
            ("nvidia.com/gpu", "present", "NoSchedule")]
    for n in nodes.values():
        ready = {c.type: c.status for c in n.status.conditions}["Ready"]
        assert ready == "True", n.metadata.name


@pytest.mark.parametrize("product,node", [(H100, "kwok-gpu-h100-0"), (A100, "kwok-gpu-a100-0")])
def test_gpu_pod_lands_on_the_matching_gpu_node(kube_api: KubeAPI, kwok_nodes: list[str],
                                                namespace: str, product: str, node: str) -> None:
    kube_api.core.create_namespaced_pod(namespace, _pod(
        "trainer", gpus=8, product=product, tolerate=True, rdma=True))
    assert _running_on(kube_api, namespace, "trainer") == node


def test_pod_without_toleration_stays_off_gpu_nodes(kube_api: KubeAPI, kwok_nodes: list[str],
                                                    namespace: str) -> None:
    # Asks for a GPU product but does not tolerate the GPU taint: nowhere to go.
    kube_api.core.create_namespaced_pod(namespace, _pod("no-toleration", gpus=1, product=H100))
    message = _unschedulable_message(kube_api, namespace, "no-toleration")
    # Both GPU nodes refuse it for the taint, the CPU node for the affinity.
    assert "2 node(s) had untolerated taint" in message, message
    assert "1 node(s) didn't match Pod's node affinity/selector" in message, message
    assert kube_api.core.read_namespaced_pod("no-toleration", namespace).spec.node_name is None

    # A plain pod (no toleration, no affinity) can only go to the untainted CPU node.
    kube_api.core.create_namespaced_pod(namespace, _pod("plain"))
    assert _running_on(kube_api, namespace, "plain") == "kwok-cpu-0"


def test_gpu_request_beyond_capacity_is_unschedulable(kube_api: KubeAPI, kwok_nodes: list[str],
                                                      namespace: str) -> None:
    kube_api.core.create_namespaced_pod(namespace, _pod("too-big", gpus=9, tolerate=True))
    assert "Insufficient nvidia.com/gpu" in _unschedulable_message(kube_api, namespace, "too-big")


# --------------------------------------------------------------------------- KubeRay
def _raycluster(name: str) -> dict:
    def container(kind: str, gpus: int = 0) -> dict:
        resources = {"cpu": "2", "memory": "8Gi"}
        if gpus:
            resources["nvidia.com/gpu"] = str(gpus)
        return {"name": f"ray-{kind}", "image": "rayproject/ray:2.60.0",
                "resources": {"requests": resources, "limits": resources}}

    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayCluster",
        "metadata": {"name": name},
        "spec": {
            "headGroupSpec": {
                "rayStartParams": {"num-gpus": "0"},
                "template": {"spec": {"containers": [container("head")]}},
            },
            "workerGroupSpecs": [{
                "groupName": "gpu",
                "replicas": 2,
                "minReplicas": 2,
                "maxReplicas": 2,
                "rayStartParams": {},
                "template": {"spec": {
                    "containers": [container("worker", gpus=4)],
                    "tolerations": [GPU_TOLERATION.to_dict()],
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{
                            "key": "nvidia.com/gpu.product", "operator": "In",
                            "values": [H100]}]}]}}},
                }},
            }],
        },
    }


def test_raycluster_is_reconciled_into_head_and_worker_pods(
        kube_api: KubeAPI, kuberay_operator: ControlPlane, namespace: str) -> None:
    custom = kube_api.custom
    custom.create_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters",
                                           _raycluster("rc"))

    def pods_running():
        pods = kube_api.core.list_namespaced_pod(namespace, label_selector="ray.io/cluster=rc").items
        if len(pods) == 3 and all(p.status.phase == "Running" for p in pods):
            return pods
        return None

    pods = wait_for(pods_running, 90, "KubeRay to create 1 head + 2 worker pods, Running")
    by_type: dict[str, list] = {}
    for p in pods:
        by_type.setdefault(p.metadata.labels["ray.io/node-type"], []).append(p)
    assert len(by_type["head"]) == 1 and len(by_type["worker"]) == 2
    assert by_type["head"][0].spec.node_name == "kwok-cpu-0"
    assert {p.spec.node_name for p in by_type["worker"]} == {"kwok-gpu-h100-0"}
    for p in pods:
        owner = p.metadata.owner_references[0]
        assert (owner.kind, owner.name) == ("RayCluster", "rc")

    services = kube_api.core.list_namespaced_service(
        namespace, label_selector="ray.io/cluster=rc").items
    assert any(s.metadata.labels.get("ray.io/node-type") == "head" for s in services)

    def status_ready():
        rc = custom.get_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", "rc")
        status = rc.get("status") or {}
        return status if status.get("readyWorkerReplicas") == 2 else None

    status = wait_for(status_ready, 60, "RayCluster status to count 2 ready workers")
    assert status.get("state") == "ready"

    # Owner references made by KubeRay are honoured by the garbage collector.
    custom.delete_namespaced_custom_object("ray.io", "v1", namespace, "rayclusters", "rc")
    wait_for(lambda: not kube_api.core.list_namespaced_pod(
        namespace, label_selector="ray.io/cluster=rc").items, 60, "RayCluster pods to go")


def _imported_modules(path: Path) -> set[str]:
    """The package-relative modules a file of e2e/controlplane imports (".cluster" -> "cluster")."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:
                found.add(base) if base else found.update(a.name for a in node.names)
            elif base.startswith("e2e.controlplane."):
                found.add(base.removeprefix("e2e.controlplane."))
            elif base == "e2e.controlplane":
                found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("e2e.controlplane.") for a in node.names
                         if a.name.startswith("e2e.controlplane."))
    return found


def test_only_init_and_cli_import_the_facade() -> None:
    """The control plane's modules form a tree: components take plain inputs (paths, ports, a
    process.Launcher, a client.Api) and never import cluster.py, which composes them."""
    package = Path(e2e.controlplane.__file__).parent
    importers = sorted(f.name for f in package.glob("*.py") if "cluster" in _imported_modules(f))
    assert importers == ["__init__.py", "cli.py"]


def test_free_ports_are_outside_the_kernels_ephemeral_range_and_apart_per_worker(monkeypatch):
    """A port drawn from the ephemeral range can become an outgoing connection's source port before
    the process it was chosen for binds it (a Ray dashboard failed so under CI's load)."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    drawn = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        drawn[worker] = e2e.controlplane.free_ports(20)
        assert len(set(drawn[worker])) == 20
        assert not any(low <= port <= high for port in drawn[worker]), drawn[worker]
    assert max(drawn["gw0"]) < min(drawn["gw1"])
