"""etcd: one member on loopback, optionally started from a copy of a seed's data dir."""

from __future__ import annotations

import shutil
from pathlib import Path
from .client import http_ok
from .process import Launcher, Process


def start(launch: Launcher, binary: Path, data_dir: Path, client: int, peer: int,
          seed: Path | None = None) -> Process:
    """Start etcd on ports client and peer with data_dir (first a copy of seed's, if given)."""
    extra = []
    if seed is not None:
        shutil.copytree(seed / "etcd", data_dir)
        # A copied data dir remembers the seed's member URLs: start it as a new
        # one-member cluster on this run's ports.
        extra.append("--force-new-cluster")
    proc = launch.spawn("etcd", [
        str(binary),
        "--name=rlhf-e2e",
        f"--data-dir={data_dir}",
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
    launch.wait(lambda: http_ok(f"http://127.0.0.1:{client}/health"), 30, "etcd /health")
    return proc
