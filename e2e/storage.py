"""PersistentVolumes that are directories of this machine: what the pod runtime mounts, and how tests make them.

For the `local` and `hostPath` volume types a PersistentVolume *is* a directory on the node, and
the kubelet mounts a claim's volume only once the claim is Bound. Here the node is this machine:
`claim_directory` follows claim -> PersistentVolume -> directory as the kubelet does, refusing
what would leave a real pod Pending. `local_claim` makes such a volume for a test.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from kubernetes.client.exceptions import ApiException

from e2e.controlplane import KWOK_DIR
from e2e.fixtures import wait_for

STORAGE_CLASS = "local-e2e"


class VolumeNotReady(RuntimeError):
    """A pod mounting this volume would stay Pending: its claim is missing or not Bound to a volume here."""


def claim_directory(core: Any, namespace: str, claim: str) -> Path:
    """The directory on this machine of the PersistentVolume the claim is Bound to."""
    try:
        pvc = core.read_namespaced_persistent_volume_claim(claim, namespace)
    except ApiException as error:
        if error.status == 404:
            raise VolumeNotReady(f"PersistentVolumeClaim {namespace}/{claim} does not exist: "
                                 "a pod mounting it stays Pending") from None
        raise
    if pvc.status.phase != "Bound":
        raise VolumeNotReady(f"PersistentVolumeClaim {namespace}/{claim} is {pvc.status.phase}, not Bound: "
                             "a pod mounting it stays Pending")
    volume = core.read_persistent_volume(pvc.spec.volume_name)
    source = volume.spec.local or volume.spec.host_path
    if source is None or not Path(source.path).is_dir():
        raise VolumeNotReady(f"PersistentVolume {volume.metadata.name} of claim {namespace}/{claim} is not a "
                             "local or hostPath directory of this machine")
    return Path(source.path)


def sub_path(root: Path, sub: str) -> Path:
    """Where a mount's subPath points inside a volume; like the kubelet, refuses one that leaves the volume."""
    relative = PurePosixPath(sub)
    if relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"subPath {sub!r} must be a relative path inside the volume")
    return root / relative


# ------------------------------------------------------------------------------------------ tests


def _cpu_node() -> str:
    """kwok's CPU node (e2e/kwok/nodes.yaml): a `local` volume lives on one node, as the head pod would."""
    nodes = yaml.safe_load_all((KWOK_DIR / "nodes.yaml").read_text())
    return next(n["metadata"]["name"] for n in nodes if "nvidia.com/gpu.present" not in n["metadata"]["labels"])


def local_claim(core: Any, namespace: str, claim: str, directory: Path, size: str = "1Gi",
                access_modes: tuple[str, ...] = ("ReadWriteMany",), node: str | tuple[str, ...] | None = None) -> Path:
    """A `local` PersistentVolume on `directory` (created) of `node` (default kwok's CPU node, where a
    test's head pod runs; several nodes stand for a disk any of them can attach, as a zonal cloud disk)
    and the claim `claim` Bound to it; returns directory.

    The claim names its volume (spec.volumeName), so the real PV controller binds the two at once.
    The volume is owned by the namespace: the garbage collector deletes it with the test's namespace.
    """
    directory.mkdir(parents=True, exist_ok=True)
    owner = core.read_namespace(namespace).metadata
    volume_name = f"{namespace}-{claim}"
    nodes = [node] if isinstance(node, str) else list(node or [_cpu_node()])
    node_term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}
    core.create_persistent_volume({
        "metadata": {"name": volume_name, "ownerReferences": [
            {"apiVersion": "v1", "kind": "Namespace", "name": owner.name, "uid": owner.uid}]},
        "spec": {"capacity": {"storage": size}, "accessModes": list(access_modes), "storageClassName": STORAGE_CLASS,
                 "persistentVolumeReclaimPolicy": "Retain", "local": {"path": str(directory)},
                 "nodeAffinity": {"required": {"nodeSelectorTerms": [node_term]}}},
    })
    core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": claim},
        "spec": {"accessModes": list(access_modes), "storageClassName": STORAGE_CLASS, "volumeName": volume_name,
                 "resources": {"requests": {"storage": size}}},
    })
    wait_for(lambda: core.read_namespaced_persistent_volume_claim(claim, namespace).status.phase == "Bound",
             60, f"PersistentVolumeClaim {namespace}/{claim} to be Bound")
    return directory
