"""What a release is made of, checked without making one (e2e/test_dev_cluster.py makes one and installs it): the
version written once, the forge's workflow a thin call of `make release`, the chart's kubeVersion. (The chart's
NOTES are what `helm install` prints: e2e/test_helm_chart.py installs it.)"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from e2e.controlplane.binaries import built

pytestmark = pytest.mark.needs_build  # helm from e2e/build/build.sh

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "rlhf-operator"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# Where the version may be typed: its source, the release notes, the chart's two fields (held equal to it below)
# and the manifests rendered from the chart; the other paths hold other projects' versions (Go modules, locks,
# measurements' environments).
WRITTEN = {"pyproject.toml", "CHANGELOG.md", "helm/rlhf-operator/Chart.yaml", "manifests/install.yaml"}
OTHER_PROJECTS = ("e2e/build/", "requirements/", "benchmarks/results/")


def test_the_version_is_written_once_in_pyproject_and_derived_everywhere_else():
    """It was typed in the chart's appVersion, the operator's default trainer image and both Dockerfiles'
    comments, while the chart's own version (0.2.0) moved alone."""
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == VERSION
    typed = re.compile(rf"(?<![\w.]){re.escape(VERSION)}(?![\w.])")  # not v0.1.0, 10.1.0 nor 0.1.0.1
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    found = [f"{path}:{number}: {line.strip()}"
             for path in files if path not in WRITTEN and not path.startswith(OTHER_PROJECTS) and (ROOT / path).is_file()
             for number, line in enumerate((ROOT / path).read_bytes().decode(errors="replace").splitlines(), 1)
             if typed.search(line)]
    assert found == []


def test_a_release_of_another_version_than_pyproject_s_is_refused_before_anything_is_built():
    made = subprocess.run(["make", "-s", "release", "VERSION=0.0.0-other", "REGISTRY=127.0.0.1:1/none"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode != 0
    assert f"VERSION=0.0.0-other, but pyproject.toml's version is {VERSION}" in made.stderr


def test_the_release_workflow_is_a_thin_call_of_the_tested_target():
    """It cannot run here: whatever it did beside `make release` would be untested."""
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "release.yml").read_text())
    assert workflow.get("on", workflow.get(True)) == {"push": {"tags": ["v*"]}}  # YAML 1.1 reads a bare on as true
    runs = [step["run"] for job in workflow["jobs"].values() for step in job["steps"] if "run" in step]
    assert [run for run in runs if "make" in run] == [
        "make release VERSION=${GITHUB_REF_NAME#v} REGISTRY=ghcr.io/${{ github.repository_owner }}"]
    assert not [run for run in runs for tool in ("buildah", "podman", "helm", "docker", "uv", "pip") if tool in run]


def test_helm_refuses_the_chart_for_a_kubernetes_older_than_its_kube_version():
    """Its trainers' status policy is a ValidatingAdmissionPolicy, served as v1 since Kubernetes 1.30 (why that
    floor: tests/test_compatibility.py)."""
    helm = built("helm", "HELM")
    refused = subprocess.run([helm, "template", "rlhf", str(CHART), "--kube-version", "v1.29.9"], capture_output=True,
                             text=True)
    assert refused.returncode != 0 and ">=1.30.0-0" in refused.stderr, refused.stderr
    subprocess.run([helm, "template", "rlhf", str(CHART), "--kube-version", "v1.30.0"], capture_output=True, check=True)
