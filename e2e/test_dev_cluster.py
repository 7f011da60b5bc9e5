"""A release as a stranger installs it: `make release` pushes the images and the chart to an OCI registry on this
machine's loopback (e2e/registry.py), and a new dev cluster (`make dev-cluster-up`'s, e2e/pods/devcluster.py)
installs the chart from that registry, with no path into this checkout: its node pulls the operator's and the
trainer's images from there. The cluster example applied with kubectl trains to Succeeded, with its reward in
`kubectl get rlhfjobs` and `rlhf logs` printing the run; `make dev-cluster-down` stops it, pods and all."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from e2e import images
from e2e.controlplane import ControlPlane
from e2e.fixtures import wait_for
from e2e.pods.devcluster import EXAMPLE, RELEASE_NAMESPACE, ROOT
from e2e.registry import Registry

pytestmark = [pytest.mark.timeout(1800), pytest.mark.needs_build]  # the control plane's binaries, helm
STEPS = 4
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


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
            tmp_path_factory: pytest.TempPathFactory) -> str:
    """`make release` of this checkout to the registry; returns REGISTRY. Only the CPU trainer (the CUDA image is
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
    return repository


@pytest.fixture
def dev_cluster(release: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A new dev cluster in a state dir of the test's, its chart from the release's registry."""
    assert not any(images.image_id(f"{release}/{image}") for image in (f"operator:{VERSION}", f"trainer:{VERSION}-cpu"))
    state = tmp_path_factory.mktemp("dev-cluster") / "state"
    up = subprocess.run([sys.executable, "-m", "e2e.pods.devcluster", "--state-dir", str(state),
                         "--chart", f"oci://{release}/charts/rlhf-operator", "--version", VERSION, "--plain-http"],
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
        dev_cluster: ControlPlane, release: str, tmp_path: Path):
    cp = dev_cluster
    manifest = yaml.safe_load(EXAMPLE.read_text())
    manifest["spec"]["training"]["maxSteps"] = STEPS  # the example's 30 steps learn; 4 show the path
    (job := tmp_path / "job.yaml").write_text(yaml.safe_dump(manifest))
    cp.kubectl("apply", "-f", str(job))
    name = manifest["metadata"]["name"]

    seen: set[str] = set()  # "namespace image" of every pod seen running (the job's are gone once it ends)

    def phase() -> str:
        seen.update(cp.kubectl("get", "pods", "-A", "-o", "jsonpath={range .items[*]}{.metadata.namespace} "
                               "{.spec.containers[0].image}{'\\n'}{end}").stdout.splitlines())
        return cp.kubectl("get", "rlhfjob", name, "-o", "jsonpath={.status.phase}").stdout

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
    operator, trainer = f"{release}/operator:{VERSION}", f"{release}/trainer:{VERSION}-cpu"
    assert {f"{RELEASE_NAMESPACE} {operator}", f"default {trainer}"} <= seen, seen
    pulled = cp.kubectl("get", "events", "-A", "--field-selector", "reason=Pulled",
                        "-o", "jsonpath={range .items[*]}{.message}{'\\n'}{end}").stdout
    assert all(f'Successfully pulled image "{image}"' in pulled for image in (operator, trainer)), pulled
