"""etcd: one member on loopback, optionally started from a copy of a seed's data dir."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from .client import http_ok

if TYPE_CHECKING:
    from .cluster import ControlPlane


def start(cp: ControlPlane, seed: Path | None = None) -> None:
    client, peer = cp.ports["etcd-client"], cp.ports["etcd-peer"]
    extra = []
    if seed is not None:
        shutil.copytree(seed / "etcd", cp.state_dir / "etcd")
        cp.seeded_from = seed
        # A copied data dir remembers the seed's member URLs: start it as a new
        # one-member cluster on this run's ports.
        extra.append("--force-new-cluster")
    cp._spawn("etcd", [
        str(cp.binaries.etcd),
        "--name=rlhf-e2e",
        f"--data-dir={cp.state_dir / 'etcd'}",
        f"--listen-client-urls=http://127.0.0.1:{client}",
        f"--advertise-client-urls=http://127.0.0.1:{client}",
        f"--listen-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
        f"--initial-cluster=rlhf-e2e=http://127.0.0.1:{peer}",
        "--initial-cluster-state=new",
        # Throwaway clusters: skip fsync (etcd's documented testing switch).
        "--unsafe-no-fsync",
        "--quota-backend-bytes=4294967296",
        "--log-level=warn",
        *extra,
    ])
    cp._wait(lambda: http_ok(f"http://127.0.0.1:{client}/health"), 30, "etcd /health")
