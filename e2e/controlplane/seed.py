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
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from .binaries import cache_dir
from .process import prune

SEED_FORMAT = "1"
SEEDS_KEPT = 4


def seed_key(versions: dict[str, str], crd_files: Iterable[Path]) -> str:
    h = hashlib.sha256(f"seed-{SEED_FORMAT}".encode())
    h.update(json.dumps(versions, sort_keys=True).encode())
    for f in crd_files:
        h.update(f"{f.name}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


# Installs the CRDs in a control plane of its own in the directory given, stops it gracefully
# (etcd's files are consistent) and returns its CRD names and refusals (see crds.install_all).
MakeSeed = Callable[[Path], tuple[Sequence[str], dict[str, str]]]


def etcd_seed(key: str, make: MakeSeed, log: Callable[[str], None]) -> Path:
    """The seed of that key (see seed_key), made first with make(<dir>) if there is none yet."""
    seeds = cache_dir() / "etcd-seeds"
    seeds.mkdir(parents=True, exist_ok=True)
    seed = seeds / key
    if (seed / "crds.json").exists():
        os.utime(seed)
        return seed
    log(f"making etcd seed {key} (installs the CRDs once for this set of CRD files)")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=seeds))
    names, errors = make(tmp / "run")
    (tmp / "run" / "etcd").rename(tmp / "etcd")
    (tmp / "crds.json").write_text(json.dumps({"names": list(names), "errors": errors}, indent=2))
    shutil.rmtree(tmp / "run")
    try:
        tmp.rename(seed)
    except OSError:  # another session made the same seed meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    prune(seeds, keep=SEEDS_KEPT)
    return seed


def crds_from_seed(seed: Path) -> tuple[list[str], dict[str, str]]:
    """The CRD names and refusals recorded in the seed."""
    info = json.loads((seed / "crds.json").read_text())
    return list(info["names"]), dict(info["errors"])
