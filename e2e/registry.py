"""An OCI distribution registry on this machine's loopback, as a release's destination: Debian's
`docker-registry` (the reference registry, distribution 2.8; apt-get installs it when missing), serving
plain HTTP on 127.0.0.1 from a storage directory of the caller's. Images (`buildah push`) and OCI charts
(`helm push`) go to it; `helm install oci://...` and the pod runtime (e2e/pods/rootfs.py) take from it.
Its log (`log`) holds one line per request."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import yaml

from e2e import images
from e2e.fixtures import answers
from e2e.controlplane.process import free_ports


class Registry:
    def __init__(self, root: Path):
        self.root = root
        self.log = root / "registry.log"
        self.host = ""  # 127.0.0.1:PORT once started
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> Registry:
        images.apt_install(("docker-registry",), ("docker-registry",))
        self.host = f"127.0.0.1:{free_ports(1)[0]}"
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.yml"
        config.write_text(yaml.safe_dump({
            "version": 0.1, "log": {"level": "info"}, "http": {"addr": self.host},
            "storage": {"filesystem": {"rootdirectory": str(self.root / "storage")}}}))
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not answers(f"http://{self.host}/v2/"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the registry did not answer on {self.host}:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
