"""`make dev-cluster-up` (e2e/pods/devcluster.py) as a new user meets it: one command gives a cluster whose
node runs pods from the images built from the Dockerfiles and the chart's operator from its image; the
cluster example applied with kubectl trains to Succeeded, with its reward in `kubectl get rlhfjobs` and
`rlhf logs` printing the run; `make dev-cluster-down` stops it, pods and all."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from e2e.controlplane import ControlPlane
from e2e.fixtures import wait_for
from e2e.pods.devcluster import EXAMPLE, RELEASE_NAMESPACE, ROOT

pytestmark = [pytest.mark.timeout(1500), pytest.mark.needs_build]  # the control plane's binaries
STEPS = 4


@pytest.fixture
def dev_cluster(operator_image: str, trainer_image: str, base_image: str,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """The dev cluster in a state dir of the test's (the images are the suite's, already built)."""
    state = tmp_path_factory.mktemp("dev-cluster") / "state"
    up = subprocess.run([sys.executable, "-m", "e2e.pods.devcluster", "--state-dir", str(state)], cwd=ROOT,
                        capture_output=True, text=True, timeout=900)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.strip() == f"export KUBECONFIG={state / 'kubeconfig'}"
        yield ControlPlane.attach(state)
    finally:
        down = subprocess.run([sys.executable, "-m", "e2e.controlplane", "--state-dir", str(state), "down"], cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
        assert down.returncode == 0, down.stderr
        assert subprocess.run(["ip", "link", "show", "rlhf-pods0"], capture_output=True).returncode != 0  # network gone


def test_the_cluster_example_applied_with_kubectl_trains_to_succeeded(dev_cluster: ControlPlane, operator_image: str,
                                                                      trainer_image: str, tmp_path: Path):
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
    assert {f"{RELEASE_NAMESPACE} {operator_image}", f"default {trainer_image}"} <= seen, seen
