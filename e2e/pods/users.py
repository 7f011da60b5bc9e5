"""Who a container runs as: the pod's and container's securityContext, else the image's USER
(rootfs.py; root when it names none). As the kubelet does with
fsGroup, the pod's volumes are made group-owned by it (group rwX, setgid directories) before the
containers start, and fsGroup and supplementalGroups are the process's supplementary groups.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

class Identity(NamedTuple):
    uid: int
    gid: int
    groups: tuple[int, ...]
    fs_group: int | None


def identity(pod_spec: dict[str, Any], container: dict[str, Any], image: tuple[int, int]) -> Identity:
    """image: the image's USER as (uid, gid) (rootfs.Rootfs.user)."""
    pod = pod_spec.get("securityContext") or {}
    own = {**pod, **(container.get("securityContext") or {})}  # the container's fields win
    uid = own.get("runAsUser", image[0])
    if uid == 0 and own.get("runAsNonRoot"):
        raise PermissionError("runAsNonRoot and the container's user is root: the kubelet refuses to start it")
    # A runAsUser without runAsGroup drops the image's group: root's, as the runtime resolves a bare uid.
    gid = own.get("runAsGroup", 0 if "runAsUser" in own else image[1])
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
