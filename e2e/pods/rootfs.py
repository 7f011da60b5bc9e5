"""A container's filesystem and what its image says to run, as a container runtime takes them from an image.

Each container (each restart too) gets a writable layer of its own over its image's, from the
suite's image store (e2e/images: `buildah from --pull=never` + `buildah mount`, 0.1 s), removed
when the container has exited. An image the store lacks is pulled into it first as its pull policy
says (`pull`, from a registry on this machine's loopback: e2e/registry.py); one it may not pull fails
the pod with ErrImageNeverPull, one that fails to pull with ErrImagePull, as a kubelet reports them.

The image's config gives the defaults the kubelet merges with the container's spec (`command`
replaces the Entrypoint and drops the Cmd, `args` replaces the Cmd; env adds to the image's; the
pod's securityContext wins over its USER); HOME is the user's home in the image's /etc/passwd, as
runc sets it.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import images


class ImageNotPresent(RuntimeError):
    reason = "ErrImageNeverPull"


class ImagePullFailed(RuntimeError):
    reason = "ErrImagePull"


_pulls: dict[str, threading.Lock] = {}  # by image
_pulls_lock = threading.Lock()


@contextmanager
def pulling(image: str) -> Iterator[None]:
    """One pod at a time decides whether to pull an image: the others of a job, started together, wait
    for its pull and find the image present."""
    with _pulls_lock:
        lock = _pulls.setdefault(image, threading.Lock())
    with lock:
        yield


def present(image: str) -> bool:
    return images.image_id(image) is not None


def pull(image: str) -> None:
    """The image from its registry into the suite's store. A registry on this machine's loopback speaks
    plain HTTP (e2e/registry.py); any other is asked over TLS."""
    plain_http = image.startswith("127.0.0.1:")
    result = subprocess.run(["podman", "pull", "--quiet", *(["--tls-verify=false"] if plain_http else []), image],
                            env=images.env(), capture_output=True, text=True)
    if result.returncode != 0:
        raise ImagePullFailed(f'failed to pull image "{image}": {result.stderr.strip()[-500:]}')


@dataclass(frozen=True)
class ImageConfig:
    user: str  # USER: "", "1000", "1000:1000", "ray", "ray:ray"
    env: dict[str, str]
    workdir: str
    entrypoint: list[str]
    cmd: list[str]

    @classmethod
    def of(cls, image: str) -> ImageConfig:
        result = subprocess.run(["buildah", "inspect", "--type", "image", image], env=images.env(),
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise ImageNotPresent(f'image "{image}" is not present on the node and its pull policy is Never '
                                  f"(build it: make images): {result.stderr.strip()[-300:]}")
        config = json.loads(result.stdout)["OCIv1"].get("config") or {}
        return cls(config.get("User", ""), dict(line.split("=", 1) for line in config.get("Env") or []),
                   config.get("WorkingDir") or "/", config.get("Entrypoint") or [], config.get("Cmd") or [])


def inside(root: Path, path: str) -> Path:
    """Where the container's `path` is on this machine: symlinks on the way resolved within its root,
    as a runtime resolves a mount's target (Debian's /var/run is a link to /run: followed outside the
    root, a ServiceAccount token mounted at /var/run/secrets/... landed in this machine's /run)."""
    resolved, parts, hops = root, [p for p in Path(path).parts if p != "/"], 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = resolved.parent if resolved != root else root
            continue
        candidate = resolved / part
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise RuntimeError(f"{path}: too many symbolic links in the image")
            target = Path(os.readlink(candidate))
            resolved = root if target.is_absolute() else resolved
            parts = [p for p in target.parts if p != "/"] + parts
        else:
            resolved = candidate
    return resolved


def command(container: dict[str, Any], image: ImageConfig) -> list[str]:
    """The kubelet's merge of the container's command and args with the image's Entrypoint and Cmd."""
    if "command" in container:
        return [*container["command"], *container.get("args", [])]
    return [*image.entrypoint, *container.get("args", image.cmd)]


class Rootfs:
    """The writable root of one container run: `path` is its root directory on this machine."""

    def __init__(self, image: str, name: str):
        self.config = ImageConfig.of(image)
        self.name = name
        images.run("buildah", "from", "--pull=never", "--name", name, image)
        self.path = Path(images.run("buildah", "mount", name).stdout.strip())

    def remove(self) -> None:
        subprocess.run(["buildah", "rm", self.name], env=images.env(), capture_output=True)

    def user(self, spec: str) -> tuple[int, int]:
        """USER as (uid, gid): names looked up in the image's /etc/passwd and /etc/group; a user without a
        group has its passwd entry's group. (0, 0) when the image names no user (root)."""
        name, _, group = spec.partition(":")
        if not name:
            return 0, 0
        passwd = self._table("passwd")
        entry = next((e for e in passwd if name in (e[0], e[2])), None)
        uid = int(name) if name.isdigit() else int(_found(entry, f"user {name}")[2])
        if group:
            gid = int(group) if group.isdigit() else int(_found(next(
                (e for e in self._table("group") if e[0] == group), None), f"group {group}")[2])
        else:
            gid = int(entry[3]) if entry else uid
        return uid, gid

    def home(self, uid: int) -> str:
        return next((e[5] for e in self._table("passwd") if e[2] == str(uid)), "/")

    def _table(self, name: str) -> list[list[str]]:
        path = self.path / "etc" / name
        return [line.split(":") for line in path.read_text().splitlines() if line] if path.exists() else []


def remove_stale(prefix: str) -> None:
    """The writable layers a crashed run left (its containers' names start with prefix)."""
    names = images.run("buildah", "containers", "--format", "{{.ContainerName}}").stdout.split()
    stale = [name for name in names if name.startswith(prefix)]
    if stale:
        subprocess.run(["buildah", "rm", *stale], env=images.env(), capture_output=True)


def _found(entry: list[str] | None, what: str) -> list[str]:
    if entry is None:
        raise RuntimeError(f"the image's USER names {what}, which its /etc files lack")
    return entry
