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


# What a package named in a RUN step brings that a C build needs (Debian bookworm): g++ depends on gcc and,
# through libstdc++-12-dev, on libc6-dev (stdio.h and the other C headers Triton's launcher includes).
BRINGS = {"g++": {"g++", "gcc", "libc6-dev"}}


def apt_packages(dockerfile: Path, device: str) -> set[str]:
    """The Debian packages the Dockerfile's RUN steps leave installed beyond the base for a DEVICE build
    argument: each step run by bash as written, its shell conditions evaluated, with apt-get recorded and
    every other command found on no PATH (a no-op)."""
    stub = "apt-get() { echo \"$*\"; }\ncommand_not_found_handle() { return 0; }\n"
    steps = [re.sub(r"^RUN (--\S+ )*", "", step) for step in images.instructions(dockerfile)
             if step.startswith("RUN ") and "apt-get" in step]
    calls = subprocess.run([shutil.which("bash"), "-ec", stub + "\n".join(steps)],
                           env={"DEVICE": device, "PATH": "/none"}, capture_output=True, text=True, check=True).stdout
    installed = set()
    for command, *words in (line.split() for line in calls.splitlines()):
        named = {word for word in words if not word.startswith("-")}
        brought = {package for name in named for package in BRINGS.get(name, {name})}
        if command == "install":
            installed |= brought
        elif command == "purge":
            installed -= brought if "--auto-remove" in words else named
    return installed


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_only_the_cuda_trainer_image_keeps_a_c_compiler(device):
    """Triton builds its CUDA launcher with gcc (or $CC) against Python.h the first time a kernel runs, and vLLM
    runs Triton kernels every step: without a compiler the CUDA image fails at its first rollout ("Failed to
    find C compiler"). The CPU image keeps none (e2e/test_images.py checks the built one). Python.h comes from
    the base: the official image's /usr/local/include, the e2e stand-in's libpython3.11-dev."""
    left = apt_packages(ROOT / "trainer_image" / "Dockerfile", device)
    if device == "cuda":
        assert {"gcc", "libc6-dev"} <= left and "libpython3.11-dev" in images.base_packages(), left
    else:
        assert not left & {"gcc", "g++", "clang", "libc6-dev"}, left
