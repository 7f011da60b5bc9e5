"""A TCP proxy in front of the API server that a test controls, for the network faults a client meets.

The operator reaches the API server through it (`kubeconfig`). TLS passes through untouched (the
API server's certificate names 127.0.0.1, as the proxy listens). Three states:

- passing: bytes are copied both ways;
- cut(): every connection is dropped, with whatever the API server was sending on it, and new ones
  are held unanswered until release(): kopf's watches then resume from the last resourceVersion they
  saw, as after a network partition (so a test can make the operator miss events);
- hang(): nothing more is forwarded on any connection, open or new, and none is closed: every request
  waits for an answer that never comes (a dead NAT entry, a peer gone without a FIN); the client sees
  neither an error nor a reset.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import yaml

CHUNK = 65536


class ApiProxy:
    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._state = threading.Condition()
        self._passing, self._hung, self._closed = True, False, False
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="api-proxy", daemon=True).start()

    def kubeconfig(self, original: Path, path: Path) -> Path:
        """A copy of the kubeconfig whose server is this proxy."""
        config = yaml.safe_load(original.read_text())
        for cluster in config["clusters"]:
            cluster["cluster"]["server"] = f"https://127.0.0.1:{self.port}"
        path.write_text(yaml.safe_dump(config))
        return path

    def cut(self) -> None:
        with self._state:
            self._passing = False
            for sock in self._open:
                _end(sock)  # its relay threads stop and close it
            self._open.clear()

    def release(self) -> None:
        with self._state:
            self._passing = True
            self._state.notify_all()

    def hang(self) -> None:
        with self._state:
            self._hung = True

    def close(self) -> None:
        with self._state:
            self._closed, self._hung = True, False
            self._state.notify_all()
        self.listener.close()
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._state:
            self._open.add(client)  # a hung one stays open, unanswered, until close()
            self._state.wait_for(lambda: (self._passing and not self._hung) or self._closed)
            if self._closed:
                client.close()
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:  # the API server is down: as if it refused this connection itself
                self._open.discard(client)
                client.close()
                return
            self._open.add(upstream)
        back = threading.Thread(target=self._relay, args=(upstream, client), daemon=True)
        back.start()
        self._relay(client, upstream)
        back.join()
        with self._state:
            self._open -= {client, upstream}
        client.close()
        upstream.close()

    def _relay(self, source: socket.socket, sink: socket.socket) -> None:
        """Copy until either side ends, then end both (the other relay of the pair stops too); once hung,
        drop what arrives and keep both open."""
        try:
            while data := source.recv(CHUNK):
                if self._hung:
                    with self._state:
                        self._state.wait_for(lambda: not self._hung)
                    return  # closed meanwhile
                sink.sendall(data)
        except OSError:
            pass
        _end(source)
        _end(sink)


def _end(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already ended
        pass
