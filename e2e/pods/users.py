"""Who a container runs as: the pod's and container's securityContext, else the image's user.

The "image" is this machine with the project's virtualenv standing in for the trainer image, whose
USER is 1000 (trainer_image/Dockerfile, `useradd` gives it group 1000). As the kubelet does with
fsGroup, the pod's volumes are made group-owned by it (group rwX, setgid directories) before the
containers start, and fsGroup and supplementalGroups are the process's supplementary groups.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

IMAGE_USER = 1000
IMAGE_GROUP = 1000


class Identity(NamedTuple):
    uid: int
    gid: int
    groups: tuple[int, ...]
    fs_group: int | None


def identity(pod_spec: dict[str, Any], container: dict[str, Any]) -> Identity:
    pod = pod_spec.get("securityContext") or {}
    own = {**pod, **(container.get("securityContext") or {})}  # the container's fields win
    uid = own.get("runAsUser", IMAGE_USER)
    if uid == 0 and own.get("runAsNonRoot"):
        raise PermissionError("runAsNonRoot and runAsUser 0: the kubelet refuses to start this container")
    gid = own.get("runAsGroup", IMAGE_GROUP)
    fs_group = pod.get("fsGroup")
    groups = tuple(dict.fromkeys([gid, *([fs_group] if fs_group is not None else []),
                                  *pod.get("supplementalGroups", [])]))
    return Identity(uid, gid, groups, fs_group)


def own_volume(path: Path, fs_group: int, policy: str = "Always") -> None:
    """What the kubelet's SetVolumeOwnership does: group fs_group, group-writable, setgid directories.
    policy OnRootMismatch: nothing when the volume's root already is so."""
    root = path.stat()
    if policy == "OnRootMismatch" and root.st_gid == fs_group and root.st_mode & 0o2070 == 0o2070:
        return
    for directory, dirs, files in os.walk(path):
        for name in [directory, *(os.path.join(directory, f) for f in files)]:
            mode = os.lstat(name).st_mode
            os.lchown(name, -1, fs_group)
            if not os.path.islink(name):
                extra = 0o2070 if name == directory else (0o060 | (0o010 if mode & 0o100 else 0))
                os.chmod(name, (mode & 0o7777) | extra)


def home(root: Path, who: Identity) -> Path:
    """A writable HOME for the image's user (Ray writes its session files there)."""
    path = root / "home"
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, who.uid, who.gid)
    return path
