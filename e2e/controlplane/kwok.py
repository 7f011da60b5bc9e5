"""kwok: fake GPU and CPU nodes (e2e/kwok/nodes.yaml) whose pods kwok marks Running."""

from __future__ import annotations

from pathlib import Path

import yaml

from .binaries import E2E, Binaries
from .client import Api, conditions
from .process import Launcher

KWOK_DIR = E2E / "kwok"


def start(launch: Launcher, binaries: Binaries, state_dir: Path, kubeconfig: Path, api: Api
          ) -> list[str]:
    """Start kwok and create the fake nodes; wait until they are Ready. Returns their names."""
    config = [(KWOK_DIR / "kwok.yaml").read_text()]
    for stage in sorted(binaries.kwok_stages.glob("*.yaml")):
        config.append(stage.read_text())
    cfg = state_dir / "kwok.yaml"
    cfg.write_text("\n---\n".join(c.strip() + "\n" for c in config))
    launch.spawn("kwok", [
        str(binaries.kwok),
        f"--kubeconfig={kubeconfig}",
        f"--config={cfg}",
    ])
    nodes = list(yaml.safe_load_all((KWOK_DIR / "nodes.yaml").read_text()))
    for node in nodes:
        api.request("POST", "/api/v1/nodes", node, ok=(201, 409))
    names = [n["metadata"]["name"] for n in nodes]

    def all_ready() -> bool:
        for name in names:
            status, node = api.get_json(f"/api/v1/nodes/{name}")
            if status != 200 or conditions(node).get("Ready") != "True":
                return False
        return True

    launch.wait(all_ready, 60, "kwok fake nodes Ready")
    return names
