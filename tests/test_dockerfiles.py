"""The images cannot be built here (no Docker engine): lint them and check they install like the tests do."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

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
    text = dockerfile.read_text()
    assert "COPY requirements/ requirements/" in text
    assert "RUN bash requirements/install.sh" in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_image_runs_as_a_numeric_non_root_user(dockerfile: Path):
    users = re.findall(r"^USER (\S+)$", dockerfile.read_text(), flags=re.M)
    assert users and users[-1].isdigit() and int(users[-1]) != 0
