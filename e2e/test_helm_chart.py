"""The Helm chart on a real API server: its values schema and render-time checks, every rendered
object accepted by a server-side dry-run (the trainers' NetworkPolicy, the PodDisruptionBudget of
replicas > 1 too), and the CRD's lifecycle (installed and upgraded with the chart, kept on
uninstall together with the users' RLHFJobs)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from e2e.controlplane.binaries import built
from rlhf_operator import admission, names, render

pytestmark = pytest.mark.needs_build  # helm and CRDs from e2e/build/build.sh

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "rlhf-operator"
CRD_FILE = ROOT / "crds" / "rlhf.dev_rlhfjobs.yaml"
CRD = "rlhfjobs.rlhf.dev"
RELEASE, RELEASE_NS = "rlhf-helm-e2e", "rlhf-helm-e2e"

VALUE_SETS = {
    "default": {},
    "scoped-and-annotated": {
        "watchNamespaces": ["team-a", "team-b"],
        "replicas": 3,  # leader election (on by default) makes the standbys safe
        "image": {"repository": "registry.example.com/rlhf/operator", "tag": "2.0.0-rc1", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "registry"}],
        "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/rlhf"}},
        "podAnnotations": {"prometheus.io/scrape": "true"},
        "podLabels": {"team": "ml-platform"},
        "priorityClassName": "system-cluster-critical",
        "trainer": {"repository": "registry.example.com/rlhf/trainer", "tag": "2.0.0-rc1"},
        "resources": {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "control", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]}]}]}}},
    },
    "crd-elsewhere-own-security": {
        "crds": {"install": False},
        "createNamespace": True,
        "replicas": 0,
        "leaderElection": {"enabled": False},
        "metricsPort": 9090,
        "healthPort": 9091,
        "podSecurityContext": {"runAsNonRoot": True, "runAsUser": 65532, "fsGroup": 65532,
                               "seccompProfile": {"type": "RuntimeDefault"}},
        "securityContext": {"runAsUser": 65532, "privileged": False},
        "podMonitor": {"enabled": True},
        # a default runtime: its CRD is installed beside the chart here (crds.install false)
        "defaultRuntime": {"name": "h100-infiniband", "trainerImages": {"cuda": "registry.example.com/t:1-cuda"},
                           "resources": {"gpuProduct": "NVIDIA-H100-80GB-HBM3", "rdma": {"hca": "=mlx5_0"}},
                           "locked": ["rdma"]},
    },
    "monitoring": {  # as kube-prometheus-stack's selectors and Grafana's sidecar want them
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}, "interval": "1m",
                           "scrapeTimeout": "20s"},
        "podMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}, "interval": "15s"},
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack", "role": "alert-rules"},
                           "thresholds": {"queuedMinutes": 600}},
        "grafanaDashboard": {"enabled": True, "labels": {"grafana_dashboard": "1", "team": "ml-platform"},
                             "annotations": {"grafana_folder": "RLHF"}},
    },
    "webhook": {"watchNamespaces": ["team-a"], "webhook": {"enabled": True, "port": 8443}},
    "trainer-network-policy": {
        "watchNamespaces": ["team-a", "team-b"],
        "replicas": 2,
        "trainerNetworkPolicy": {
            "enabled": True,
            "apiServer": {"cidrs": ["10.96.0.1/32", "172.18.0.2/32"]},
            "services": [{"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rewards"}},
                                  "podSelector": {"matchLabels": {"app": "reward"}}}],
                          "ports": [{"port": 8000}]}],
            "trackers": [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["169.254.0.0/16", "10.0.0.0/8"]}}],
                          "ports": [{"port": 443}]}],
        },
    },
}
MONITORING_KINDS = ("ServiceMonitor", "PodMonitor", "PrometheusRule")
CHART_APP_VERSION = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]


@pytest.fixture(scope="module")
def helm(tmp_path_factory):
    binary = built("helm", "HELM")
    home = tmp_path_factory.mktemp("helm-home")  # helm's config, cache and data stay out of $HOME
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_CACHE_HOME": str(home / "cache"), "HELM_DATA_HOME": str(home / "data")}

    def run(*args: str, kubeconfig: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
        extra = ["--kubeconfig", str(kubeconfig)] if kubeconfig else []
        proc = subprocess.run([binary, *args, *extra], capture_output=True, text=True, env=env, timeout=300)
        if check and proc.returncode != 0:
            pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}{proc.stdout}")
        return proc

    return run


def values_file(tmp_path: Path, values: dict) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


@pytest.fixture(scope="module")
def monitoring_crds(control_plane):
    """The prometheus-operator's CRDs of the kinds the chart renders, from its pinned Go module
    (build.sh prometheus-operator-crds), for this module's tests; removed after them."""
    crds = Path(built("prometheus-operator-crds", "PROMETHEUS_OPERATOR_CRDS"))
    files = [crds / f"monitoring.coreos.com_{kind.lower()}s.yaml" for kind in MONITORING_KINDS]
    names = control_plane.install_crds(files)
    yield control_plane
    control_plane.kubectl("delete", "crd", *names, "--ignore-not-found")


@pytest.mark.parametrize("name", VALUE_SETS)
def test_chart_renders_objects_the_api_server_accepts(helm, monitoring_crds, tmp_path, name):
    control_plane = monitoring_crds
    values = values_file(tmp_path, VALUE_SETS[name])
    helm("lint", str(CHART), "-f", values, "--namespace", RELEASE_NS)
    rendered = helm("template", RELEASE, str(CHART), "-f", values, "--namespace", RELEASE_NS).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    kinds = {d["kind"] for d in docs}
    assert {"ServiceAccount", "Service", "Deployment"} <= kinds
    # Scoped to namespaces: Roles there, and cluster-wide only the reading of cluster runtimes (a cluster-scoped kind).
    cluster_bindings = {d["metadata"]["name"].rsplit("-", 1)[-1] for d in docs if d["kind"] == "ClusterRoleBinding"}
    assert (cluster_bindings == {"runtimes"}) == bool(VALUE_SETS[name].get("watchNamespaces"))
    assert ("CustomResourceDefinition" in kinds) == VALUE_SETS[name].get("crds", {}).get("install", True)
    assert ("ClusterRLHFRuntime" in kinds) == bool(VALUE_SETS[name].get("defaultRuntime"))
    for ns in [RELEASE_NS, *VALUE_SETS[name].get("watchNamespaces", [])]:  # the operator's Roles live there
        control_plane.kubectl("create", "namespace", ns, check=False)
    result = control_plane.kubectl("apply", "--server-side", "--force-conflicts", "--dry-run=server",
                                   "--field-manager", "helm-chart-test", "-f", "-",
                                   input=yaml.safe_dump_all(docs))
    assert result.stdout.count("(server dry run)") == len(docs), result.stdout
    # The trainer-status policy spares the operator's own ServiceAccount, whatever the release is called.
    account = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]
    policy = next(d for d in docs if d["kind"] == "ValidatingAdmissionPolicy")["spec"]
    spared = {c["name"]: c["expression"] for c in policy["matchConditions"]}["not-the-operator"]
    assert f"'system:serviceaccount:{account['namespace']}:{account['name']}'" in spared

    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]
    if name == "default":
        assert pod["spec"]["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
        assert pod["spec"]["containers"][0]["securityContext"] == {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
        assert "priorityClassName" not in pod["spec"] and "annotations" not in pod["metadata"]
        env = pod["spec"]["containers"][0]["env"]
        # Jobs without an image get the trainer of the chart's version for their device: the operator's own default.
        assert env[1:] == [{"name": render.TRAINER_IMAGE_ENV[device],
                            "value": f"{render.DEFAULT_TRAINER_REPOSITORY}:{CHART_APP_VERSION}-{device}"}
                           for device in ("cpu", "cuda")]
        assert CHART_APP_VERSION == render.VERSION
        assert "--leader-elect" in pod["spec"]["containers"][0]["args"]
        assert deployment["spec"]["strategy"] == {"type": "RollingUpdate"}  # standbys wait for the Lease
        container = pod["spec"]["containers"][0]
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
        assert "affinity" not in pod["spec"] and "PodDisruptionBudget" not in kinds  # one replica
    if name == "scoped-and-annotated":
        assert pod["metadata"]["labels"]["team"] == "ml-platform"
        assert pod["metadata"]["labels"]["app.kubernetes.io/name"] == "rlhf-operator"
        assert pod["metadata"]["annotations"] == {"prometheus.io/scrape": "true"}
        assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
        assert pod["spec"]["containers"][0]["env"][1:] == [  # what render reads
            {"name": render.TRAINER_IMAGE_ENV[device], "value": f"registry.example.com/rlhf/trainer:2.0.0-rc1-{device}"}
            for device in ("cpu", "cuda")]
        assert pod["spec"]["containers"][0]["args"][:2] == ["--namespace=team-a", "--namespace=team-b"]
        # The values' node affinity, and the replicas preferably on different nodes.
        assert pod["spec"]["affinity"]["nodeAffinity"] == VALUE_SETS[name]["affinity"]["nodeAffinity"]
        (spread,) = pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert spread["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        assert spread["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        budget = next(d for d in docs if d["kind"] == "PodDisruptionBudget")["spec"]
        assert budget["maxUnavailable"] == 1
        assert budget["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
        sa = next(d for d in docs if d["kind"] == "ServiceAccount")
        assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/rlhf"}
    if name == "crd-elsewhere-own-security":
        assert pod["spec"]["securityContext"]["runAsUser"] == 65532
        container = pod["spec"]["containers"][0]["securityContext"]  # merged over the defaults
        assert container["runAsUser"] == 65532 and container["capabilities"] == {"drop": ["ALL"]}
        assert "PodMonitor" in kinds and "Namespace" in kinds
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # no leader election: one at a time
        assert "--leader-elect" not in pod["spec"]["containers"][0]["args"]
    if name == "monitoring":
        by_kind = {d["kind"]: d for d in docs if d["kind"] in MONITORING_KINDS}
        assert set(by_kind) == set(MONITORING_KINDS)
        for kind, doc in by_kind.items():
            assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack", kind
            assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE, kind
        service = next(d for d in docs if d["kind"] == "Service")
        monitor = by_kind["ServiceMonitor"]["spec"]
        assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert monitor["endpoints"] == [{"port": "metrics", "interval": "1m", "scrapeTimeout": "20s"}]
        assert monitor["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
        assert by_kind["PodMonitor"]["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "interval": "15s"}]
        assert "> 600 * 60" in yaml.safe_dump(by_kind["PrometheusRule"]["spec"])
        dashboard = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == f"{RELEASE}-dashboard")
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert dashboard["metadata"]["labels"]["team"] == "ml-platform"
        assert dashboard["metadata"]["annotations"] == {"grafana_folder": "RLHF"}
        assert json.loads(dashboard["data"]["rlhf-operator.json"])["uid"] == "rlhf-operator"
    if name == "default":
        # monitoring, the policy and the webhook are opt-in
        assert not kinds & {*MONITORING_KINDS, "ConfigMap", "NetworkPolicy", "ValidatingWebhookConfiguration"}
    if name == "webhook":
        assert_webhook_served(docs, pod, VALUE_SETS[name])
    if name == "trainer-network-policy":
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
        spec = policies[0]["spec"]
        assert spec["policyTypes"] == ["Egress"]  # ingress stays open: the metrics scrape, Ray's clients
        # It selects every pod of a job, as the operator labels them, and lets them reach each other.
        assert selects(spec["podSelector"], names.pod_metadata("some-job", "worker")["labels"])
        assert spec["egress"][0] == {"to": [{"podSelector": spec["podSelector"]}]}
        dns, api_server, reward, trackers = spec["egress"][1:]
        assert {port["port"] for port in dns["ports"]} == {53}
        assert [peer["ipBlock"]["cidr"] for peer in api_server["to"]] == ["10.96.0.1/32", "172.18.0.2/32"]
        assert [reward, trackers] == (VALUE_SETS[name]["trainerNetworkPolicy"]["services"]
                                      + VALUE_SETS[name]["trainerNetworkPolicy"]["trackers"])


def assert_webhook_served(docs: list[dict], pod: dict, values: dict) -> None:
    """The API server's path to the webhook: its configuration names the Service, which selects the operator's pods
    and reaches their webhook port, where the operator reads the Secret's certificate, valid for the Service's name
    under the CA the configuration trusts."""
    [configuration] = [d for d in docs if d["kind"] == "ValidatingWebhookConfiguration"]
    [webhook] = configuration["webhooks"]
    assert webhook["failurePolicy"] == "Fail" and webhook["sideEffects"] == "None"
    assert [rule["operations"] for rule in webhook["rules"]] == [["CREATE"]]  # never deletes nor the operator's patches
    assert webhook["namespaceSelector"]["matchExpressions"][0]["values"] == values["watchNamespaces"]
    target = webhook["clientConfig"]["service"]
    assert target["path"] == admission.PATH
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == target["name"])
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    [port] = [p for p in service["spec"]["ports"] if p["port"] == target["port"]]
    container = pod["spec"]["containers"][0]
    assert {"name": port["targetPort"], "containerPort": values["webhook"]["port"]} in container["ports"]
    [mount] = container["volumeMounts"]
    assert f"--webhook-cert-dir={mount['mountPath']}" in container["args"]
    assert f"--webhook-port={values['webhook']['port']}" in container["args"]
    [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == volume["secret"]["secretName"])
    host = f"{target['name']}.{target['namespace']}.svc"
    with tempfile.TemporaryDirectory() as pem:
        for name, data in (("ca.pem", webhook["clientConfig"]["caBundle"]), ("cert.pem", secret["data"]["tls.crt"])):
            (Path(pem) / name).write_bytes(base64.b64decode(data))
        verified = subprocess.run(["openssl", "verify", "-CAfile", "ca.pem", "-verify_hostname", host, "cert.pem"],
                                  cwd=pem, capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_webhook_certificate_from_cert_manager(helm, tmp_path):
    values = values_file(tmp_path, {"webhook": {"enabled": True, "certManager": {"enabled": True}}})
    docs = [d for d in yaml.safe_load_all(helm("template", RELEASE, str(CHART), "-f", values, "-n", RELEASE_NS).stdout)
            if d]
    by_kind = {d["kind"]: d for d in docs}
    certificate = by_kind["Certificate"]
    assert by_kind["ValidatingWebhookConfiguration"]["metadata"]["annotations"] == {
        "cert-manager.io/inject-ca-from": f"{RELEASE_NS}/{certificate['metadata']['name']}"}
    assert "caBundle" not in by_kind["ValidatingWebhookConfiguration"]["webhooks"][0]["clientConfig"]
    assert not [d for d in docs if d["kind"] == "Secret"]  # cert-manager writes it
    pod = by_kind["Deployment"]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["secret"]["secretName"] == certificate["spec"]["secretName"]
    assert certificate["spec"]["issuerRef"]["name"] == by_kind["Issuer"]["metadata"]["name"]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions with Exists) matches these labels."""
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "Exists" for e in expressions), expressions
    return selector.get("matchLabels", {}).items() <= labels.items() and all(e["key"] in labels for e in expressions)


def test_chart_crd_is_the_generated_file_with_keep(helm):
    rendered = helm("template", RELEASE, str(CHART), "--namespace", RELEASE_NS).stdout
    crd = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "CustomResourceDefinition")
    generated = yaml.safe_load(CRD_FILE.read_text())
    assert crd["spec"] == generated["spec"]
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"


def test_packaged_chart_carries_the_crd(helm, tmp_path):
    helm("package", str(CHART), "--destination", str(tmp_path))
    (package,) = tmp_path.glob("rlhf-operator-*.tgz")
    rendered = helm("template", RELEASE, str(package)).stdout
    assert "openAPIV3Schema" in rendered


@pytest.mark.parametrize("values,field,message", [
    ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "/image/pullPolicy", "Always"),
    ({"replicas": 2, "leaderElection": {"enabled": False}}, "/replicas", "maximum"),  # two would reconcile twice
    ({"leaderElection": {"enabled": True, "leaseDuration": 0}}, "/leaderElection/leaseDuration", "exclusiveMinimum"),
    ({"crds": {"install": "yes"}}, "/crds/install", "boolean"),
    ({"podLabels": {"tier": 1}}, "/podLabels/tier", "string"),
    ({"watchNamespaces": ["Team_A"]}, "/watchNamespaces/0", "pattern"),
    ({"metricPort": 9090}, "metricPort", "additional properties"),
    ({"serviceMonitor": {"interval": "30 seconds"}}, "/serviceMonitor/interval", "pattern"),
    ({"prometheusRule": {"thresholds": {"queuedMinutes": 0}}}, "/prometheusRule/thresholds/queuedMinutes", "minimum"),
    ({"grafanaDashboard": {"labels": {"grafana_dashboard": 1}}}, "/grafanaDashboard/labels/grafana_dashboard", "string"),
    ({"trainerNetworkPolicy": {"enabled": True, "namespaces": ["a"], "services": [{"to": [], "port": 80}]}},
     "/trainerNetworkPolicy/services/0", "additional properties"),
    ({"trainerNetworkPolicy": {"enabled": True, "namespaces": ["a"], "apiServer": {"cidrs": ["10.96.0.1"]}}},
     "/trainerNetworkPolicy/apiServer/cidrs/0", "pattern"),
])
def test_bad_values_are_refused_naming_the_field(helm, tmp_path, values, field, message):
    path = values_file(tmp_path, values)
    for command in (["lint", str(CHART)], ["template", RELEASE, str(CHART)]):
        result = helm(*command, "-f", path, check=False)
        output = result.stderr + result.stdout
        assert result.returncode != 0, output
        assert field in output and message in output, output


@pytest.mark.parametrize("values,field,message", [
    # A leader must stop (renew deadline) before a standby may take over (lease duration).
    ({"leaderElection": {"enabled": True, "leaseDuration": 10, "renewDeadline": 10, "retryPeriod": 2}},
     "retryPeriod (2) < renewDeadline (10) < leaseDuration (10)", "does not hold"),
    ({"leaderElection": {"enabled": True, "leaseDuration": 15, "renewDeadline": 10, "retryPeriod": 10}},
     "retryPeriod (10) < renewDeadline (10)", "does not hold"),
    ({"trainerNetworkPolicy": {"enabled": True}}, "trainerNetworkPolicy.namespaces", "namespace only"),
])
def test_values_the_schema_cannot_relate_fail_the_render(helm, tmp_path, values, field, message):
    """Checks across values, made by the templates (helm lint reports a template's fail only as INFO)."""
    result = helm("template", RELEASE, str(CHART), "-f", values_file(tmp_path, values), check=False)
    output = result.stderr + result.stdout
    assert result.returncode != 0 and field in output and message in output, output


def crd_schema_properties(cp) -> dict:
    crd = json.loads(cp.kubectl("get", "crd", CRD, "-o", "json").stdout)
    return crd, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]


@pytest.fixture
def release(control_plane):
    """The CRD as crds/ installs it, without Helm (the control plane's, or plain manifests');
    restored exactly to that afterwards."""
    if control_plane.kubectl("get", "crd", CRD, check=False).returncode != 0:
        control_plane.kubectl("apply", "--server-side", "-f", str(CRD_FILE))
    try:
        yield control_plane
    finally:
        control_plane.kubectl("delete", "namespace", RELEASE_NS, "--ignore-not-found", "--wait=false")
        control_plane.kubectl("delete", "clusterrole,clusterrolebinding", "-l",
                              f"app.kubernetes.io/instance={RELEASE}", "--ignore-not-found")
        live = json.loads(control_plane.kubectl("get", "crd", CRD, "-o", "json").stdout)
        original = yaml.safe_load(CRD_FILE.read_text())
        original["metadata"]["resourceVersion"] = live["metadata"]["resourceVersion"]
        control_plane.kubectl("replace", "-f", "-", input=json.dumps(original))


def test_helm_install_upgrade_uninstall_manages_the_crd(helm, release, tmp_path):
    cp, kubeconfig = release, release.kubeconfig
    install = ("install", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--create-namespace")

    # A CRD installed before (plain manifests, an older chart's crds/) is not Helm's: adopt it.
    refused = helm(*install, kubeconfig=kubeconfig, check=False)
    assert refused.returncode != 0 and "invalid ownership metadata" in refused.stderr, refused.stderr
    crds = (CRD, "rlhfruntimes.rlhf.dev", "clusterrlhfruntimes.rlhf.dev")
    cp.kubectl("label", "crd", *crds, "app.kubernetes.io/managed-by=Helm", "--overwrite")
    cp.kubectl("annotate", "crd", *crds, f"meta.helm.sh/release-name={RELEASE}",
               f"meta.helm.sh/release-namespace={RELEASE_NS}", "--overwrite")
    notes = helm(*install, kubeconfig=kubeconfig).stdout.split("NOTES:\n", 1)[1]
    home = yaml.safe_load((CHART / "Chart.yaml").read_text())["home"]
    for line in (f"rlhf-operator {CHART_APP_VERSION} is installed in namespace {RELEASE_NS}.",  # what to do next
                 f"The operator runs ghcr.io/rlhf-operator/operator:{CHART_APP_VERSION}",
                 f"ghcr.io/rlhf-operator/trainer:{CHART_APP_VERSION}-cuda when they ask for GPUs",
                 f"ghcr.io/rlhf-operator/trainer:{CHART_APP_VERSION}-cpu when they do not",
                 "helm install kuberay-operator kuberay/kuberay-operator",
                 f"kubectl -n {RELEASE_NS} rollout status deployment/{RELEASE}", "kubectl get rlhfjobs -w",
                 f"Documentation: {home}/tree/v{CHART_APP_VERSION}/docs"):
        assert line in notes, notes
    crd, properties = crd_schema_properties(cp)
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert "helmUpgradeProbe" not in properties
    cp.kubectl("get", "deployment", RELEASE, "-n", RELEASE_NS)

    # A newer chart whose CRD has another field: helm upgrade brings it to the API server.
    newer = tmp_path / "rlhf-operator"
    shutil.copytree(CHART, newer)  # follows the files/ symlink: a real copy to modify
    crd_file = newer / "files" / "rlhf.dev_rlhfjobs.yaml"
    assert not crd_file.is_symlink()
    doc = yaml.safe_load(crd_file.read_text())
    spec_schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec_schema["properties"]["helmUpgradeProbe"] = {"type": "string", "description": "added by the upgrade"}
    crd_file.write_text(yaml.safe_dump(doc, sort_keys=False))
    chart = yaml.safe_load((newer / "Chart.yaml").read_text())
    chart["version"] = "99.0.0"
    (newer / "Chart.yaml").write_text(yaml.safe_dump(chart))
    helm("upgrade", RELEASE, str(newer), "--namespace", RELEASE_NS, kubeconfig=kubeconfig)
    _, properties = crd_schema_properties(cp)
    assert properties["helmUpgradeProbe"] == {"type": "string", "description": "added by the upgrade"}

    # An RLHFJob of a user (no operator runs, so it carries no finalizer) outlives the chart.
    job = yaml.safe_load((ROOT / "manifests" / "examples" / "tiny-grpo-cpu-job.yaml").read_text())
    job["metadata"]["namespace"] = RELEASE_NS
    cp.kubectl("apply", "-f", "-", input=json.dumps(job))

    uninstalled = helm("uninstall", RELEASE, "--namespace", RELEASE_NS, kubeconfig=kubeconfig)
    assert CRD in uninstalled.stdout + uninstalled.stderr  # "These resources were kept due to the resource policy"
    crd, properties = crd_schema_properties(cp)
    assert "helmUpgradeProbe" in properties
    cp.kubectl("get", "rlhfjob", job["metadata"]["name"], "-n", RELEASE_NS)
    assert cp.kubectl("get", "deployment", RELEASE, "-n", RELEASE_NS, check=False).returncode != 0
    assert cp.kubectl("get", "clusterrole", RELEASE, check=False).returncode != 0
