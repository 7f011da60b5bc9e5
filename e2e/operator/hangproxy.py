"""A TCP proxy in front of the API server that a test can make hang, as a half-open connection does.

Until hang(), bytes are copied both ways. After it, nothing more is forwarded on any connection,
open or new, and none is closed: every request through it waits for an answer that never comes
(a dead NAT entry, a peer gone without a FIN). The client sees neither an error nor a reset.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import yaml


class HangingProxy:
    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.forwarding = True
        self.sockets: list[socket.socket] = []  # kept open (half-open after hang()) until close()
        threading.Thread(target=self._accept, name="hang-proxy", daemon=True).start()

    def kubeconfig(self, original: Path, path: Path) -> Path:
        """A copy of the kubeconfig at original whose server is this proxy (the API server's certificate
        names 127.0.0.1, whatever the port)."""
        config = yaml.safe_load(original.read_text())
        for cluster in config["clusters"]:
            cluster["cluster"]["server"] = f"https://127.0.0.1:{self.port}"
        path.write_text(yaml.safe_dump(config))
        return path

    def hang(self) -> None:
        self.forwarding = False

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            self.sockets.append(client)
            if not self.forwarding:
                continue  # accepted, never answered
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            self.sockets.append(server)
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        while True:
            try:
                data = source.recv(65536)
                if not self.forwarding:
                    return  # hung: the bytes go nowhere, both sockets stay open
                if not data:
                    target.shutdown(socket.SHUT_WR)
                    return
                target.sendall(data)
            except OSError:
                return
