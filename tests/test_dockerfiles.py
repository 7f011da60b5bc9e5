"""Static checks of the Dockerfiles: lint, and the install the tests use (e2e/test_images.py builds and starts them)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from e2e import images

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = [ROOT / "operator" / "Dockerfile", ROOT / "trainer_image" / "Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_passes_hadolint(dockerfile: Path):
    hadolint = shutil.which("hadolint") or str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "hadolint")
    result = subprocess.run([hadolint, "--config", str(ROOT / ".hadolint.yaml"), str(dockerfile)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_installs_through_the_pinned_install_script(dockerfile: Path):
    steps = images.instructions(dockerfile)
    assert "COPY requirements/ requirements/" in steps
    assert [step for step in steps if step.startswith("RUN ") and "bash requirements/install.sh" in step]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_image_runs_as_a_numeric_non_root_user(dockerfile: Path):
    users = re.findall(r"^USER (\S+)$", dockerfile.read_text(), flags=re.M)
    assert users and users[-1].isdigit() and int(users[-1]) != 0


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_the_sources_are_copied_after_the_dependency_layer(dockerfile: Path):
    """A change to the code or the README rebuilds only the project's own layer: the trainer's
    dependency layer took 8-13 minutes to rebuild after any such change."""
    steps = images.instructions(dockerfile)
    install = next(i for i, step in enumerate(steps) if "DEPS_ONLY=1 bash requirements/install.sh" in step)
    before = [path for step in steps[:install] if step.startswith("COPY ") for path in step.split()[1:-1]]
    assert sorted(before) == ["pyproject.toml", "requirements/"]
    assert any(step.startswith("RUN pip install --no-deps") for step in steps[install:])
