"""A release as a stranger installs it: `make release` pushes the images and the chart to an OCI registry on this
machine's loopback (e2e/registry.py), and a new dev cluster (`make dev-cluster-up`'s, e2e/pods/devcluster.py)
installs the chart from that registry, with no path into this checkout: its node pulls the operator's and the
trainer's images from there. The chart runs two operator replicas and its admission webhook. The cluster example
applied with kubectl trains to Succeeded through the leader's death (the standby takes the Lease over), with its
reward in `kubectl get rlhfjobs` and `rlhf logs` printing the run; the webhook, served by the pods through its
Service, refuses a job naming a runtime that does not exist. Then the release's other install path: the chart
uninstalled, the release's install.yaml applied with kubectl runs the operator, which makes a job's Ray cluster of
the release's trainer image, and `rlhf dashboard` forwards a local port to that head pod's Ray dashboard (the pod
runtime's kubelet serves the port-forward: e2e/pods/portforward.py). `make dev-cluster-down` stops it, pods and
all."""

from __future__ import annotations

import base64
import json
import re
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from e2e import images
from e2e.controlplane import ControlPlane
from e2e.controlplane.binaries import built
from e2e.fixtures import wait_for
from e2e.pods.devcluster import EXAMPLE, RELEASE, RELEASE_NAMESPACE, ROOT
from e2e.registry import Registry
from rlhf_operator import names

pytestmark = [pytest.mark.timeout(1800), pytest.mark.needs_build]  # the control plane's binaries, helm
STEPS = 4
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
PLAIN_OPERATOR = "rlhf-operator"  # install.yaml's Deployment (helm template's release name)
# Two replicas (a leader and a standby: the lease's default periods, a quicker retry) and the admission webhook.
CHART_VALUES = {"replicas": 2, "leaderElection": {"enabled": True, "retryPeriod": 1}, "webhook": {"enabled": True}}
# The Ray the CPU trainer image installs (its lock), which its head's dashboard reports.
RAY_VERSION = re.search(r"^ray==(\S+)$", (ROOT / "requirements" / "constraints.txt").read_text(), re.M)[1]


class Release(NamedTuple):
    repository: str  # REGISTRY, host:port/org
    install: Path  # its install.yaml


@pytest.fixture
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    root = tmp_path_factory.mktemp("registry")
    registry = Registry(root).start()
    try:
        yield registry
    finally:
        registry.stop()
        shutil.rmtree(root / "storage", ignore_errors=True)  # GBs of pushed layers
        # The names the node pulled, from the suite's image store (their layers are the built images').
        names = images.run("buildah", "images", "--format", "{{.Name}}:{{.Tag}}").stdout.split()
        if pulled := [name for name in names if name.startswith(f"{registry.host}/")]:
            images.run("buildah", "rmi", *pulled)


@pytest.fixture
def release(registry: Registry, operator_image: str, trainer_image: str,
            tmp_path_factory: pytest.TempPathFactory) -> Release:
    """`make release` of this checkout to the registry. Only the CPU trainer (the CUDA image is
    about 10 GB); the images are the suite's, built already, so the release builds nothing and pushes them."""
    repository, dist = f"{registry.host}/rlhf", tmp_path_factory.mktemp("dist")
    made = subprocess.run(["make", "-s", "release", f"VERSION={VERSION}", f"REGISTRY={repository}", "DEVICES=cpu",
                           "PLAIN_HTTP=1", f"DIST={dist}"], cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert made.returncode == 0, made.stderr[-4000:]
    assert sorted(p.name for p in dist.iterdir() if not p.name.startswith(".")) == [
        "install.yaml", f"rlhf-operator-{VERSION}.tgz", f"rlhf_operator-{VERSION}-py3-none-any.whl",
        f"rlhf_operator-{VERSION}.tar.gz"]
    install = (dist / "install.yaml").read_text()
    assert f"image: \"{repository}/operator:{VERSION}\"" in install and f"{repository}/trainer:{VERSION}-cpu" in install
    return Release(repository, dist / "install.yaml")


@pytest.fixture
def dev_cluster(release: Release, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A new dev cluster in a state dir of the test's, its chart from the release's registry."""
    assert not any(images.image_id(f"{release.repository}/{image}")
                   for image in (f"operator:{VERSION}", f"trainer:{VERSION}-cpu"))
    state = tmp_path_factory.mktemp("dev-cluster") / "state"
    (values := state.parent / "values.yaml").write_text(yaml.safe_dump(CHART_VALUES))
    up = subprocess.run([sys.executable, "-m", "e2e.pods.devcluster", "--state-dir", str(state),
                         "--chart", f"oci://{release.repository}/charts/rlhf-operator", "--version", VERSION,
                         "--plain-http", "--values", str(values)],
                        cwd=ROOT, capture_output=True, text=True, timeout=900)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip() == f"export KUBECONFIG={state / 'kubeconfig'}"
        yield ControlPlane.attach(state)
    finally:
        down = subprocess.run([sys.executable, "-m", "e2e.controlplane", "--state-dir", str(state), "down"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert down.returncode == 0, down.stderr
        assert subprocess.run(["ip", "link", "show", "rlhf-pods0"], capture_output=True).returncode != 0  # network gone


def test_the_release_installed_from_its_registry_trains_the_cluster_example_to_succeeded(
        dev_cluster: ControlPlane, release: Release, tmp_path: Path):
    cp = dev_cluster
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["training"]["maxSteps"] = STEPS  # the example's 30 steps learn; 4 show the path
    (job := tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    # Admitted once the webhook's Service has a Ready replica's endpoint (failurePolicy Fail refuses until then).
    wait_for(lambda: cp.kubectl("apply", "-f", str(job), check=False).returncode == 0, 120,
             "the webhook to admit the example job")
    name = manifest["metadata"]["name"]

    seen: set[str] = set()  # "namespace image" of every pod seen running (the job's are gone once it ends)

    def phase() -> str:
        seen.update(cp.kubectl("get", "pods", "-A", "-o", "jsonpath={range .items[*]}{.metadata.namespace} "
                               "{.spec.containers[0].image}{'\\n'}{end}").stdout.splitlines())
        return cp.kubectl("get", "rlhfjob", name, "-o", "jsonpath={.status.phase}").stdout

    # The leader dies once it has created the job's RayJob: the standby takes the Lease over and runs the job on.
    wait_for(lambda: cp.kubectl("get", "rlhfjob", name, "-o", "jsonpath={.status.rayJobName}").stdout, 600,
             "the leader to create the job's RayJob")
    leader = lease_holder(cp)
    cp.kubectl("-n", RELEASE_NAMESPACE, "delete", "pod", leader, "--grace-period=0", "--force")
    wait_for(lambda: lease_holder(cp) not in ("", leader), 120, "the standby to take the Lease over")
    try:
        wait_for(lambda: phase() in ("Succeeded", "Failed"), 1200, f"job {name} to end")
    finally:
        logs = subprocess.run([sys.executable, "-m", "rlhf_cli.cli", "logs", name], env=cp.env(),
                              capture_output=True, text=True, timeout=120)
        print(logs.stdout[-3000:], logs.stderr[-2000:])
    assert phase() == "Succeeded"
    header, row = cp.kubectl("get", "rlhfjobs").stdout.splitlines()
    columns = dict(zip(header.split(), row.split()))
    assert columns["PHASE"] == "Succeeded" and columns["PROGRESS"] == f"{STEPS}/{STEPS}", row
    reward = float(columns["REWARD"])
    assert 0 < reward <= 1 and reward == float(f"{reward:.4g}"), row  # rounded for reading
    assert f"Job '{name}-" in logs.stdout and "succeeded" in logs.stdout, logs.stdout[-3000:]
    # The released chart's images, which the node lacked and pulled from the registry.
    operator, trainer = f"{release.repository}/operator:{VERSION}", f"{release.repository}/trainer:{VERSION}-cpu"
    assert {f"{RELEASE_NAMESPACE} {operator}", f"default {trainer}"} <= seen, seen
    pulled = cp.kubectl("get", "events", "-A", "--field-selector", "reason=Pulled",
                        "-o", "jsonpath={range .items[*]}{.message}{'\\n'}{end}").stdout
    assert all(f'Successfully pulled image "{image}"' in pulled for image in (operator, trainer)), pulled
    assert cp.kubectl("get", "rayjobs", "-o", "name").stdout.count("\n") == 1  # the standby made none of its own

    # The webhook, through its Service to a replica: a job naming no existing runtime is never stored.
    manifest["metadata"]["name"], manifest["spec"]["runtimeRef"] = "no-runtime", {"name": "no-such-runtime"}
    refused = cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), check=False)
    assert refused.returncode and "denied the request" in refused.stderr and \
        "ClusterRLHFRuntime no-such-runtime, which does not exist" in refused.stderr, refused.stderr
    del manifest["spec"]["runtimeRef"]

    # The plain manifests: the chart's release gone (its CRDs and the job stay: resource-policy keep), the
    # release's install.yaml applied as the install guide says; --force-conflicts takes the kept CRDs over from
    # helm, whose labels name its release.
    subprocess.run([built("helm", "HELM"), "--kubeconfig", str(cp.kubeconfig), "-n", RELEASE_NAMESPACE, "uninstall",
                    RELEASE], check=True, capture_output=True, text=True)
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(release.install))
    cp.kubectl("-n", RELEASE_NAMESPACE, "rollout", "status", f"deployment/{PLAIN_OPERATOR}", "--timeout=300s",
               timeout=330)
    cp.kubectl("-n", RELEASE_NAMESPACE, "wait", "--for=delete", "pod", "-l", f"app.kubernetes.io/instance={RELEASE}",
               "--timeout=120s", timeout=150)  # the chart's operator: none is left to reconcile the next job
    operators = cp.kubectl("-n", RELEASE_NAMESPACE, "get", "pods", "-o", "jsonpath={range .items[*]}"
                           "{.metadata.labels.app\\.kubernetes\\.io/instance} {.spec.containers[0].image}{'\\n'}{end}")
    assert operators.stdout.splitlines() == [f"{PLAIN_OPERATOR} {operator}"], operators.stdout
    managers = json.loads(cp.kubectl("-n", RELEASE_NAMESPACE, "get", "deployment", PLAIN_OPERATOR,
                                     "--show-managed-fields", "-o", "json").stdout)["metadata"]["managedFields"]
    assert {(m["manager"], m["operation"]) for m in managers} >= {("kubectl", "Apply")}, managers

    manifest["metadata"]["name"] = plain = "tiny-plain"
    manifest["spec"]["training"]["maxSteps"] = 30  # still training while its dashboard is read: it need not end
    (job := tmp_path / "plain-job.yaml").write_text(yaml.safe_dump(manifest))
    cp.kubectl("apply", "-f", str(job))
    heads = f"{names.JOB_LABEL}={names.label_value(plain)},{names.ROLE_LABEL}=head"

    def ready_head() -> str | None:
        """The head pod's name once it is Ready, of the release's CPU trainer image (the operator's choice)."""
        pods = cp.kubectl("get", "pods", "-l", heads, "-o", "jsonpath={range .items[*]}{.metadata.name} "
                          "{.spec.containers[0].image} {.status.conditions[?(@.type=='Ready')].status}{end}").stdout
        return pods.split()[0] if pods.split()[1:] == [trainer, "True"] else None

    check_dashboard(cp, plain, wait_for(ready_head, 600, f"the head pod of {plain} to be Ready"))


def lease_holder(cp: ControlPlane) -> str:
    """The operator pod that leads: the Lease (named after the release) holds its name and a suffix
    (rlhf_operator/leader.py)."""
    holder = cp.kubectl("-n", RELEASE_NAMESPACE, "get", "lease", RELEASE, "-o", "jsonpath={.spec.holderIdentity}",
                        check=False).stdout
    return holder.rsplit("_", 1)[0]


def check_dashboard(cp: ControlPlane, job: str, head: str) -> None:
    """`rlhf dashboard JOB -p 0` serves, on the local port it prints, the head pod's Ray dashboard (through the API
    server's pods/portforward to the node's kubelet), each connection a stream of its own, and says where the
    token is that the dashboard asks for; Ctrl-C ends it with 0."""
    dashboard = subprocess.Popen([sys.executable, "-m", "rlhf_cli.cli", "dashboard", job, "-p", "0"], env=cp.env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line, token_line = dashboard.stdout.readline(), dashboard.stdout.readline()
        if (found := re.search(rf"\(pod {head}\): (http://127\.0\.0\.1:\d+) ", line)) is None:
            dashboard.wait(30)
            raise AssertionError(f"rlhf dashboard printed {line!r}, not head pod {head}'s URL: {dashboard.stderr.read()}")
        url = found[1]
        secret, key = re.search(r"get secret (\S+) -o jsonpath='\{\.data\.(\w+)\}' \| base64 -d$", token_line).groups()
        token = base64.b64decode(cp.kubectl("get", "secret", secret, "-o", f"jsonpath={{.data.{key}}}").stdout).decode()
        with pytest.raises(urllib.error.HTTPError) as refused:  # Ray's own answer without the token
            urllib.request.urlopen(f"{url}/api/version", timeout=60)
        body = refused.value.read()
        assert refused.value.code == 401 and b"Missing authentication token" in body, body
        request = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=60) as response:  # a second connection: a second stream
            assert json.load(response)["ray_version"] == RAY_VERSION
    finally:
        dashboard.send_signal(signal.SIGINT)
        try:
            out, err = dashboard.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # where it waits, for the report (py-spy: Ray's, in the venv)
            stacks = subprocess.run([str(Path(sys.executable).with_name("py-spy")), "dump", "--pid", str(dashboard.pid)],
                                    capture_output=True, text=True)
            dashboard.kill()
            raise AssertionError(f"rlhf dashboard went on after Ctrl-C; its threads:\n{stacks.stdout}{stacks.stderr}")
    assert dashboard.returncode == 0, err
