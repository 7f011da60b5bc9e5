"""etcd seeds: creating the big KubeRay and Kueue CRDs costs the API server 10-30 s of CPU on
every start (each new CRD rebuilds the OpenAPI of all of them). Instead, a short-lived etcd +
kube-apiserver installs them once per set of CRD files, and later control planes start etcd
from a copy of that data dir. Cluster-specific state is not in the seed: it holds no
ServiceAccounts, tokens or nodes (no controller-manager ran), and the new API server rewrites
its authentication ConfigMap at start."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from .binaries import cache_dir
from .crds import wait_established
from .process import prune

if TYPE_CHECKING:
    from .cluster import ControlPlane

SEED_FORMAT = "1"
SEEDS_KEPT = 4


def seed_key(cp: ControlPlane) -> str:
    h = hashlib.sha256(f"seed-{SEED_FORMAT}".encode())
    h.update(json.dumps(cp.versions, sort_keys=True).encode())
    for f in [*cp.kuberay_crd_files(), *cp.kueue_crd_files(), *cp.repo_crd_files()]:
        h.update(f"{f.name}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def etcd_seed(cp: ControlPlane) -> Path:
    """The seed for cp's versions and CRD files, made first if there is none yet."""
    seeds = cache_dir() / "etcd-seeds"
    seeds.mkdir(parents=True, exist_ok=True)
    key = seed_key(cp)
    seed = seeds / key
    if (seed / "crds.json").exists():
        os.utime(seed)
        return seed
    cp.log(f"making etcd seed {key} (installs the CRDs once for this set of CRD files)")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=seeds))
    seeder = type(cp)(
        tmp / "run", controller_manager=False, scheduler=False, kwok=False, kuberay=False,
        kueue=False, crds=True, build=False, seed=False, crd_paths=cp.extra_crd_paths,
        die_with_parent=cp.die_with_parent, log=cp.log, binaries=cp.binaries)
    try:
        seeder.start()
        seeder.stop(keep_state=True)  # graceful stop: etcd's files are consistent
        (tmp / "run" / "etcd").rename(tmp / "etcd")
        (tmp / "crds.json").write_text(json.dumps(
            {"names": seeder.crd_names, "errors": seeder.crd_errors}, indent=2))
        shutil.rmtree(tmp / "run")
        try:
            tmp.rename(seed)
        except OSError:  # another session made the same seed meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        seeder.stop(keep_state=True)
        raise
    prune(seeds, keep=SEEDS_KEPT)
    return seed


def crds_from_seed(cp: ControlPlane, seed: Path) -> None:
    """Take the CRD names and refusals recorded in the seed; wait until they are Established."""
    info = json.loads((seed / "crds.json").read_text())
    cp.crd_names = list(info["names"])
    cp.crd_errors.update(info["errors"])
    for f, err in cp.crd_errors.items():
        cp.log(f"CRD {f} was refused by the API server:\n{err}")
    wait_established(cp, cp.crd_names)
