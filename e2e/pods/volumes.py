"""A pod's volumes made on this machine, as the kubelet makes them before the containers start,
and the shell lines that mount them inside the pod's private mount namespace.

- configMap and secret volumes: their keys (or `items`) written out as files, mounted read-only;
- persistentVolumeClaim volumes: the claim must be Bound to a PersistentVolume whose `local` or
  `hostPath` directory is on this machine (e2e/storage.py), else VolumeNotReady (a real pod stays
  Pending); a missing subPath directory is created in the volume, as the kubelet does;
- emptyDir volumes: a fresh directory per pod, with a tmpfs of the sizeLimit for medium Memory;
- projected volumes (the `kube-api-access-*` volume the ServiceAccount admission adds to a pod
  that automounts its token): serviceAccountToken (a real TokenRequest), configMap, secret and
  downwardAPI fieldRef sources;
- for HeadPod, which plays a template no admission saw: the same token, with the cluster CA.

File modes and `optional` references are not played; other volume types raise NotImplementedError.
"""

from __future__ import annotations

import base64
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from kubernetes.utils import parse_quantity

from e2e.pods.rootfs import inside
from e2e.storage import VolumeNotReady, claim_directory, sub_path  # noqa: F401 - VolumeNotReady re-exported

SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"


class Mount(NamedTuple):
    source: Path  # a file or directory on this machine
    target: str  # the container's mountPath
    read_only: bool = False


class Volume(NamedTuple):
    path: Path  # the volume's root directory on this machine
    read_only: bool = False  # forced by the volume's source (ConfigMap and Secret data, a read-only claim)
    tmpfs: str | None = None  # mount options of the tmpfs backing a memory emptyDir


def bind_script(mounts: Iterable[tuple], tmpfs: Iterable[tuple[Path, str]] = (), root: Path | None = None) -> str:
    """Shell lines that mount the pod's volumes inside the private mount namespace.

    mounts: Mount or (source, target) pairs, shallowest target first. tmpfs: (directory, options)
    of each memory emptyDir, mounted first so that its mounts bind the tmpfs. A missing directory
    source is created (a subPath the volume lacks, as the kubelet does). root: the container's root
    (rootfs.py), its own writable copy of the image, under which each target is made. Without one,
    targets are on this machine's filesystem, so the parent of each mountPath gets a private tmpfs
    first: files and directories created as mount points stay in the namespace (the host keeps at
    most the empty parent directory).
    """
    lines = [f"mount -t tmpfs -o {shlex.quote(options)} tmpfs {shlex.quote(str(path))}" for path, options in tmpfs]
    for source, target, read_only in (Mount(*mount) for mount in mounts):
        target = str(inside(root, target)) if root is not None else target
        src, dst, parent = (shlex.quote(str(path)) for path in (source, target, Path(target).parent))
        point = f"touch {dst}" if source.is_file() else f"mkdir -p {src} {dst}"
        lines.append(f"mkdir -p {parent}")
        if root is None:
            lines.append(f"mountpoint -q {parent} || mount -t tmpfs tmpfs {parent}")
        lines += [point, f"mount --bind {src} {dst}"]
        if read_only:  # a bind mount takes the read-only flag only on a remount
            lines.append(f"mount -o remount,bind,ro {dst}")
    return "".join(line + "\n" for line in lines)


def data(core: Any, namespace: str, kind: str, name: str) -> dict[str, str]:
    """The keys of a ConfigMap or Secret (decoded)."""
    if kind == "Secret":
        secret = core.read_namespaced_secret(name, namespace)
        return {k: base64.b64decode(v).decode() for k, v in (secret.data or {}).items()}
    return core.read_namespaced_config_map(name, namespace).data or {}


def make_volumes(core: Any, namespace: str, pod_spec: dict[str, Any], root: Path,
                 fields: dict[str, str] | None = None) -> dict[str, Volume]:
    """Every volume of the pod, made under root/volumes; a claim that is not Bound raises VolumeNotReady.

    fields: the pod's fieldRef values, for downwardAPI sources."""
    return {volume["name"]: _volume(core, namespace, volume, root / "volumes" / volume["name"], fields or {})
            for volume in pod_spec.get("volumes", [])}


def _volume(core: Any, namespace: str, volume: dict[str, Any], directory: Path, fields: dict[str, str]) -> Volume:
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"]
        return Volume(claim_directory(core, namespace, claim["claimName"]), claim.get("readOnly", False))
    if "emptyDir" in volume:
        directory.mkdir(parents=True)
        empty_dir = volume["emptyDir"] or {}
        if empty_dir.get("medium") != "Memory":
            return Volume(directory)
        size = empty_dir.get("sizeLimit")
        return Volume(directory, tmpfs="mode=1777" + (f",size={int(parse_quantity(size))}" if size else ""))
    if "configMap" in volume or "secret" in volume:
        directory.mkdir(parents=True)
        _data_files(core, namespace, volume, directory)
        return Volume(directory, read_only=True)
    if "projected" in volume:
        directory.mkdir(parents=True)
        for source in volume["projected"]["sources"]:
            if "serviceAccountToken" in source:
                token = source["serviceAccountToken"]
                request = {"spec": {"expirationSeconds": token.get("expirationSeconds", 3600),
                                    **({"audiences": [token["audience"]]} if token.get("audience") else {})}}
                account = fields.get("spec.serviceAccountName", "default")
                _write(directory, token["path"],
                       core.create_namespaced_service_account_token(account, namespace, request).status.token)
            elif "downwardAPI" in source:
                for item in source["downwardAPI"]["items"]:
                    _write(directory, item["path"], fields[item["fieldRef"]["fieldPath"]])
            else:
                _data_files(core, namespace, source, directory)
        return Volume(directory, read_only=True)
    raise NotImplementedError(f"volume {volume['name']}: this pod runtime plays configMap, secret, "
                              "persistentVolumeClaim and emptyDir volumes only")


def _data_files(core: Any, namespace: str, source: dict[str, Any], directory: Path) -> None:
    """A ConfigMap's or Secret's keys (or its `items`) written out as files."""
    kind, ref = ("ConfigMap", source["configMap"]) if "configMap" in source else ("Secret", source["secret"])
    keys = data(core, namespace, kind, ref.get("name") or ref["secretName"])
    for item in ref.get("items") or [{"key": key, "path": key} for key in keys]:
        _write(directory, item["path"], keys[item["key"]])


def _write(directory: Path, relative: str, text: str) -> None:
    path = sub_path(directory, relative)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def service_account_token(core: Any, namespace: str, account: str, ca: Path, target: Path) -> Path:
    """A token of the pod's ServiceAccount in target, as the kubelet's projected volume holds it."""
    token = core.create_namespaced_service_account_token(
        account, namespace, {"spec": {"expirationSeconds": 3600}}).status.token
    target.mkdir(parents=True)
    (target / "token").write_text(token)
    (target / "namespace").write_text(namespace)
    (target / "ca.crt").write_bytes(ca.read_bytes())
    return target


def container_mounts(container: dict[str, Any], volumes: dict[str, Volume], token: Path | None) -> list[Mount]:
    """The container's volumeMounts (subPath and readOnly honoured), the token first, shallowest first."""
    mounts = [Mount(token, SA_MOUNT, read_only=True)] if token is not None else []
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        mounts.append(Mount(sub_path(volume.path, mount.get("subPath", "")), mount["mountPath"],
                            volume.read_only or mount.get("readOnly", False)))
    return sorted(mounts, key=lambda m: m.target.count("/"))


def make_sub_paths(container: dict[str, Any], volumes: dict[str, Volume]) -> None:
    """Create the container's missing subPath directories as the kubelet does before it starts the container:
    with the volume root's mode (after fsGroup: group-writable, setgid, so the group is inherited too)."""
    for mount in container.get("volumeMounts", []):
        root = volumes[mount["name"]].path
        path = sub_path(root, mount.get("subPath", ""))
        if not path.exists():
            path.mkdir(parents=True)
            path.chmod(root.stat().st_mode & 0o7777)


def memory_tmpfs(volumes: dict[str, Volume]) -> list[tuple[Path, str]]:
    return [(volume.path, volume.tmpfs) for volume in volumes.values() if volume.tmpfs]
