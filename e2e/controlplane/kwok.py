"""kwok: fake GPU and CPU nodes (e2e/kwok/nodes.yaml) whose pods kwok marks Running."""

from __future__ import annotations

from typing import TYPE_CHECKING

import yaml

from .binaries import E2E
from .client import conditions

if TYPE_CHECKING:
    from .cluster import ControlPlane

KWOK_DIR = E2E / "kwok"


def start(cp: ControlPlane) -> None:
    """Start kwok and create the fake nodes; wait until they are Ready."""
    config = [(KWOK_DIR / "kwok.yaml").read_text()]
    for stage in sorted(cp.binaries.kwok_stages.glob("*.yaml")):
        config.append(stage.read_text())
    cfg = cp.state_dir / "kwok.yaml"
    cfg.write_text("\n---\n".join(c.strip() + "\n" for c in config))
    cp._spawn("kwok", [
        str(cp.binaries.kwok),
        f"--kubeconfig={cp.kubeconfig}",
        f"--config={cfg}",
    ])
    nodes = list(yaml.safe_load_all((KWOK_DIR / "nodes.yaml").read_text()))
    for node in nodes:
        cp._request("POST", "/api/v1/nodes", node, ok=(201, 409))
    cp.fake_nodes = [n["metadata"]["name"] for n in nodes]

    def all_ready() -> bool:
        for name in cp.fake_nodes:
            status, node = cp._get_json(f"/api/v1/nodes/{name}")
            if status != 200 or conditions(node).get("Ready") != "True":
                return False
        return True

    cp._wait(all_ready, 60, "kwok fake nodes Ready")
