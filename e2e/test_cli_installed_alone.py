"""The `rlhf` command as a stranger installs it (issue 51): the wheel alone in a fresh virtualenv, no extras, its
dependencies from the package index. It validates and plans a GPU job's memory with no torch, Ray or DeepSpeed
installed, lists a real cluster's RLHFJobs, and names the extra a command of a half needs.

One venv for the module (about a minute: the index's downloads; pip's cache serves what it may)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from e2e.operator.jobs import create_job, rlhf_job
from rlhf_operator.kube import Kube

REPO = Path(__file__).resolve().parents[1]
# What the distribution is built from (pyproject.toml's package-dir); built from a copy, so that setuptools'
# build/ never meets another build in the checkout.
SOURCES = ("pyproject.toml", "README.md", "operator", "trainer_image/rlhf_trainer")
STACKS = ("torch", "ray", "deepspeed", "vllm", "transformers", "kopf")


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """bin/ of a fresh Python 3.11 venv holding the wheel built from this checkout and what it requires."""
    root = tmp_path_factory.mktemp("cli-alone")
    for source in SOURCES:
        (root / "src" / source).parent.mkdir(parents=True, exist_ok=True)
        if (REPO / source).is_dir():
            shutil.copytree(REPO / source, root / "src" / source, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO / source, root / "src" / source)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", root / "dist", root / "src"],
                   check=True, timeout=300)
    [wheel] = (root / "dist").glob("*.whl")
    # No pip of its own (ensurepip's copy adds seconds): this checkout's pip installs into it.
    subprocess.run(["python3.11", "-m", "venv", "--without-pip", root / "venv"], check=True, timeout=120)
    subprocess.run([*pip, "--python", root / "venv" / "bin" / "python", "install", wheel], check=True, timeout=600)
    return root / "venv" / "bin"


def run(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([venv / args[0], *args[1:]], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={"PATH": f"{venv}:/usr/bin:/bin", "HOME": str(venv.parent)})


def test_version_is_the_chart_s_app_version(venv):
    chart = yaml.safe_load((REPO / "helm" / "rlhf-operator" / "Chart.yaml").read_text())
    assert run(venv, "rlhf", "--version").stdout == f"rlhf {chart['appVersion']}\n"


def test_validate_plans_a_gpu_job_s_memory_without_any_ml_stack(venv):
    planned = run(venv, "rlhf", "validate", "--gpu", "H100", "--model-configs", "manifests/examples/model-configs",
                  "manifests/examples/ppo-job.yaml")
    assert planned.returncode == 0, planned.stderr
    assert "valid (ppo job" in planned.stdout and "peak: GPU 0 in" in planned.stdout
    found = run(venv, "python", "-c", "import importlib.util, sys; import rlhf_cli.cli; "
                f"print([name for name in {STACKS!r} if name in sys.modules or importlib.util.find_spec(name)])")
    assert found.stdout == "[]\n", found.stderr  # not imported, not even installed


def test_a_half_s_command_names_its_extra(venv):
    trainer = run(venv, "rlhf", "run", "manifests/examples/tiny-grpo-cpu-job.yaml")
    assert trainer.returncode == 1 and "pip install 'rlhf-operator[trainer]'" in trainer.stderr
    operator = run(venv, "kubectl-rlhf", "operator")
    assert operator.returncode == 1 and "pip install 'rlhf-operator[operator]'" in operator.stderr


def test_list_reads_the_cluster(venv, control_plane, namespace):
    kube = Kube(control_plane.api_client())
    create_job(kube, namespace, rlhf_job("installed"))
    listed = run(venv, "rlhf", "list", "-n", namespace, "--kubeconfig", str(control_plane.kubeconfig))
    assert listed.returncode == 0, listed.stderr
    assert [line.split()[:2] for line in listed.stdout.splitlines()] == [["NAME", "ALGORITHM"], ["installed", "sft"]]
    unconfigured = run(venv, "rlhf", "list")
    assert unconfigured.returncode == 1 and "no cluster configured" in unconfigured.stderr
