"""state.json of a state dir: ports, versions, timings, fake nodes and the processes (PID +
start time) — what lets another Python process (`python -m e2e.controlplane down|status`)
attach to a running control plane and stop it by PID."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from .process import Process


def save_state(state_file: Path, *, server: str | None, kubeconfig: Path, ports: dict[str, int],
               versions: dict[str, str], timings: dict[str, float], fake_nodes: list[str],
               processes: dict[str, Process]) -> None:
    if not state_file.parent.exists():
        return
    state = {
        "server": server,
        "kubeconfig": str(kubeconfig),
        "ports": ports,
        "versions": versions,
        "timings": timings,
        "fake_nodes": fake_nodes,
        "processes": [p.to_json() for p in processes.values()],
    }
    tmp = state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(state_file)


def load_state(state_file: Path, kubeconfig: Path) -> dict[str, Any]:
    """What save_state wrote (ports, timings, fake_nodes, processes) and the admin token of the
    kubeconfig."""
    state = json.loads(state_file.read_text())
    cfg = yaml.safe_load(kubeconfig.read_text()) if kubeconfig.exists() else {}
    users = (cfg or {}).get("users") or [{}]
    return {
        "ports": state["ports"],
        "timings": state.get("timings", {}),
        "fake_nodes": state.get("fake_nodes", []),
        "processes": {p["name"]: Process.from_json(p) for p in state["processes"]},
        "token": users[0].get("user", {}).get("token", ""),
    }
