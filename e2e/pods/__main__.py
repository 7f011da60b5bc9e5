"""`python -m e2e.pods --state-dir DIR`: the pod runtime as a process of its own, the kubelet of the control
plane whose state DIR holds (the dev cluster's: e2e/pods/devcluster.py starts it, `python -m e2e.controlplane
down` stops it). Its Node is untainted: on a control plane without kwok's nodes, every pod lands here.
Runs until SIGTERM or SIGINT, then stops its pods and removes its Node and network."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from e2e.controlplane import ControlPlane
from e2e.pods.kubelet import Kubelet


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m e2e.pods", description=__doc__)
    parser.add_argument("--state-dir", required=True, type=Path, help="the control plane's state dir")
    state = parser.parse_args().state_dir
    cp = ControlPlane.attach(state)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    kubelet = Kubelet(cp.api_client(), cp.ports["kube-apiserver"], cp.pki / "ca.crt", state / "kubelet",
                      cp.hosts_file, tainted=False).start()
    print(f"pod runtime: node {kubelet.node} Ready", flush=True)
    try:
        stopping.wait()
    finally:
        kubelet.stop()
        print(f"pod runtime: stopped; errors: {kubelet.errors}", flush=True)


if __name__ == "__main__":
    main()
