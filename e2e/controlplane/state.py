"""state.json of a state dir: ports, versions, timings, fake nodes and the processes (PID +
start time) — what lets another Python process (`python -m e2e.controlplane down|status`)
attach to a running control plane and stop it by PID."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import yaml

from .process import Process

if TYPE_CHECKING:
    from .cluster import ControlPlane


def save_state(cp: ControlPlane) -> None:
    if not cp.state_dir.exists():
        return
    state = {
        "server": cp.server if "kube-apiserver" in cp.ports else None,
        "kubeconfig": str(cp.kubeconfig),
        "ports": cp.ports,
        "versions": cp.versions,
        "timings": cp.timings,
        "fake_nodes": cp.fake_nodes,
        "processes": [p.to_json() for p in cp.processes.values()],
    }
    tmp = cp.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(cp.state_file)


def load_state(cp: ControlPlane) -> None:
    """Fill a fresh ControlPlane from its state dir: ports, processes, the admin token."""
    state = json.loads(cp.state_file.read_text())
    cp.ports = state["ports"]
    cp.timings = state.get("timings", {})
    cp.fake_nodes = state.get("fake_nodes", [])
    cp.processes = {p["name"]: Process.from_json(p) for p in state["processes"]}
    cfg = yaml.safe_load(cp.kubeconfig.read_text()) if cp.kubeconfig.exists() else {}
    users = (cfg or {}).get("users") or [{}]
    cp.token = users[0].get("user", {}).get("token", "")
