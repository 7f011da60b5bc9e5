"""The project's two images, built from their Dockerfiles as a user builds them (`buildah bud`), on
a machine with no Docker daemon and no registry (../shared/ENVIRONMENT.md, "OCI images").

- The OCI tools come from Debian (apt-get, when missing). Their state lives under
  $RLHF_CACHE/images: a containers.conf for this host's two quirks and a storage.conf with its own
  storage root, passed through CONTAINERS_CONF / CONTAINERS_STORAGE_CONF (`env()`), so nothing of
  the system's container state is read or changed.
- The Dockerfiles' FROM image is made here with mmdebstrap from Debian packages
  (base-packages.txt) plus this machine's CA certificates, and tagged with the FROM name.
- Each image is rebuilt only when its content key changes: the Dockerfile, its build arguments,
  the base image and every file its COPY lines take from the context (less .dockerignore). Builds
  use `--layers` and hold a file lock (pytest workers may ask at once); pip's cache is the
  Dockerfiles' cache mount, kept between builds under $RLHF_CACHE/images/tmp.

`python -m e2e.images [operator|trainer-cpu|trainer-cuda]...` builds them (default: the first
two) and lists the images with their sizes.
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STATE = Path(os.environ.get("RLHF_CACHE") or Path.home() / ".cache" / "rlhf-operator") / "images"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

TOOLS = ("buildah", "podman", "skopeo", "umoci", "mmdebstrap", "runc")  # commands and Debian packages alike
BASE = "docker.io/library/python:3.11-slim-bookworm"  # what both Dockerfiles' FROM names
CA_CERTIFICATES = Path("/usr/local/share/ca-certificates")  # this machine's own CAs (its egress proxy's among them)
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# The base's config: python:3.11-slim-bookworm's PATH, LANG and CMD, and the CA bundle for pip and requests.
BASE_CONFIG = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
               f"ENV SSL_CERT_FILE={CA_BUNDLE}", f"ENV PIP_CERT={CA_BUNDLE}", f"ENV REQUESTS_CA_BUNDLE={CA_BUNDLE}",
               'CMD ["python3"]']


@dataclass(frozen=True)
class Image:
    name: str
    dockerfile: Path
    build_args: dict[str, str] = field(default_factory=dict)


OPERATOR = Image(f"localhost/rlhf-operator:{VERSION}", ROOT / "operator" / "Dockerfile")
TRAINER_CPU = Image(f"localhost/rlhf-trainer:{VERSION}-cpu", ROOT / "trainer_image" / "Dockerfile", {"DEVICE": "cpu"})
TRAINER_CUDA = Image(f"localhost/rlhf-trainer:{VERSION}-cuda", ROOT / "trainer_image" / "Dockerfile", {"DEVICE": "cuda"})
BY_NAME = {"operator": OPERATOR, "trainer-cpu": TRAINER_CPU, "trainer-cuda": TRAINER_CUDA}

# crun, podman's default runtime, fails on this host's hybrid cgroups; podman's default ulimits
# exceed the sandbox's hard limits.
CONTAINERS_CONF = """\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
"""


def env() -> dict[str, str]:
    """The environment for buildah and podman: this project's configuration and storage, and a
    temporary directory beside it for their layer tars (several GB for the trainer's install step)
    and for the builds' cache mounts (pip's cache, kept between builds)."""
    return {**os.environ, "CONTAINERS_CONF": str(STATE / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(STATE / "storage.conf"), "TMPDIR": str(STATE / "tmp")}


def run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """Runs a container tool on the project's storage; raises with its output when it fails."""
    result = subprocess.run(args, env=env(), capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-4000:]}{result.stderr[-4000:]}")
    return result


def apt_install(packages: tuple[str, ...], commands: tuple[str, ...]) -> None:
    """The Debian packages, installed when one of their commands is missing."""
    if all(shutil.which(command) for command in commands):
        return
    sudo = [] if os.geteuid() == 0 else ["sudo"]
    STATE.parent.mkdir(parents=True, exist_ok=True)
    # One apt-get at a time: requirements/install.sh may run its own beside this (tests/run.sh), and apt's
    # lists lock fails the second at once.
    with open(STATE.parent / "apt.lock", "w") as apt_lock:
        fcntl.flock(apt_lock, fcntl.LOCK_EX)
        subprocess.run([*sudo, "apt-get", "update", "-qq"], check=True)
        subprocess.run([*sudo, "apt-get", "install", "-y", "-qq", *packages], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def ensure_toolchain() -> None:
    apt_install(TOOLS, TOOLS)
    (STATE / "tmp").mkdir(parents=True, exist_ok=True)
    (STATE / "containers.conf").write_text(CONTAINERS_CONF)
    (STATE / "storage.conf").write_text(
        f'[storage]\ndriver = "overlay"\ngraphroot = "{STATE / "storage"}"\nrunroot = "{STATE / "run"}"\n')


@contextmanager
def locked() -> Iterator[None]:
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def image_id(name: str) -> str | None:
    result = subprocess.run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", name],
                            env=env(), capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else None


def _cached(name: str, key: str) -> bool:
    """The image exists and was built from content with this key."""
    stamp = STATE / "keys" / name.replace("/", "_")
    return stamp.exists() and stamp.read_text().split() == [key, str(image_id(name))]


def _record(name: str, key: str) -> None:
    (STATE / "keys").mkdir(exist_ok=True)
    (STATE / "keys" / name.replace("/", "_")).write_text(f"{key} {image_id(name)}\n")


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def base_packages() -> list[str]:
    lines = (HERE / "base-packages.txt").read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def ensure_base(log: Callable[[str], None] = print) -> str:
    """The FROM image of both Dockerfiles, made from Debian packages when its inputs changed."""
    certificates = sorted(CA_CERTIFICATES.glob("*.crt"))
    key = _digest((HERE / "base-packages.txt").read_bytes(), repr(BASE_CONFIG).encode(),
                  *(c.read_bytes() for c in certificates))
    if _cached(BASE, key):
        return BASE
    log(f"making {BASE} from Debian packages (mmdebstrap)")
    start = time.monotonic()
    rootfs = STATE / "base-rootfs.tar"
    # The machine's apt source (mirror, suites) serves the base too, where it is Debian's (elsewhere, as on a
    # forge's Ubuntu runner releasing, mmdebstrap's default mirror); its CAs go in, or pip and apt-get in RUN
    # steps fail CERTIFICATE_VERIFY_FAILED behind this machine's egress proxy.
    sources = [s for s in ["/etc/apt/sources.list.d/debian.sources"] if Path(s).exists()]
    subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", "--components=main",
                    f"--include={','.join(base_packages())}",
                    f"--customize-hook=copy-in {CA_CERTIFICATES} /usr/local/share",
                    '--customize-hook=chroot "$1" update-ca-certificates',
                    "bookworm", str(rootfs), *sources], check=True)
    try:
        run("podman", "import", *(arg for change in BASE_CONFIG for arg in ("--change", change)), str(rootfs), BASE)
    finally:
        rootfs.unlink()
    _record(BASE, key)
    log(f"made {BASE} in {time.monotonic() - start:.0f} s")
    return BASE


def instructions(dockerfile: Path) -> list[str]:
    """The Dockerfile's instructions, each on one line (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    return [" ".join(line.split()) for line in joined.splitlines() if line.strip()]


def copied_paths(dockerfile: Path) -> list[str]:
    """The context paths the Dockerfile's COPY lines take (not those from another stage)."""
    paths = []
    for words in (line.split() for line in instructions(dockerfile)):
        if words[0] == "COPY" and not any(w.startswith("--from") for w in words):
            paths += [w for w in words[1:-1] if not w.startswith("--")]
    return paths


def context_files(paths: list[str]) -> list[Path]:
    """The files under those paths that the build sends, less .dockerignore's patterns (each the
    name of a file or directory at any depth, the only form that file uses)."""
    ignored = [line.removeprefix("**/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line and not line.startswith("#")]
    files = []
    for path in paths:
        for file in [ROOT / path] if (ROOT / path).is_file() else (ROOT / path).rglob("*"):
            parts = file.relative_to(ROOT).parts
            if file.is_file() and not any(fnmatch.fnmatch(p, pattern) for p in parts for pattern in ignored):
                files.append(file)
    return sorted(set(files))


def content_key(image: Image) -> str:
    files = context_files(copied_paths(image.dockerfile))
    return _digest(image.dockerfile.read_bytes(), repr(sorted(image.build_args.items())).encode(),
                   str(image_id(BASE)).encode(),
                   *(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() for f in files))


def base(log: Callable[[str], None] = print) -> str:
    """The Dockerfiles' FROM image, made when missing or out of date."""
    with locked():
        ensure_toolchain()
        return ensure_base(log)


def build(image: Image, log: Callable[[str], None] = print) -> str:
    """The image's name, built from its Dockerfile unless its content key is unchanged."""
    with locked():
        ensure_toolchain()
        ensure_base(log)
        key = content_key(image)
        if _cached(image.name, key):
            return image.name
        output = STATE / "logs" / f"{image.name.rsplit('/', 1)[-1]}.log"
        output.parent.mkdir(exist_ok=True)
        log(f"building {image.name} from {image.dockerfile.relative_to(ROOT)} (output: {output})")
        start = time.monotonic()
        build_args = [arg for k, v in image.build_args.items() for arg in ("--build-arg", f"{k}={v}")]
        # --network host: RUN steps reach PyPI without a bridge (no iptables chains added).
        with open(output, "w") as out:
            built = subprocess.run(
                ["buildah", "bud", "--pull=never", "--layers", "--force-rm", "--network", "host",
                 *build_args,
                 "-t", image.name, "-f", str(image.dockerfile), str(ROOT)],
                env=env(), stdout=out, stderr=subprocess.STDOUT)
        if built.returncode != 0:
            raise RuntimeError(f"building {image.name} failed ({output}):\n{output.read_text()[-4000:]}")
        _record(image.name, key)
        log(f"built {image.name} in {time.monotonic() - start:.0f} s")
        # The image this one replaced and its cache layers, now in no image's chain: a trainer
        # image is 8 GB.
        run("buildah", "rmi", "--prune")
        return image.name


def config(name: str) -> dict:
    """The image's OCI config (User, Env, Entrypoint, Cmd, WorkingDir)."""
    import json

    return json.loads(run("buildah", "inspect", "--type", "image", name).stdout)["OCIv1"]["config"]
