"""The kubelet's log endpoint, which the API server calls for `kubectl logs` (a pods/log read):
GET /containerLogs/<namespace>/<pod>/<container>[?follow=true], over TLS with a serving
certificate the cluster CA signed (the API server checks it: --kubelet-certificate-authority).

A pod's log is its container.log: every run of its containers (init containers first, restarts
appended), each opened by the runtime's one-line header. `follow=true` streams it until the pod's
container has exited for good. Not played: `previous`, `tailLines`, `sinceSeconds`, `timestamps`,
`limitBytes`, and client authentication (any caller that reaches the port may read).
"""

from __future__ import annotations

import http.server
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qs, urlsplit

from e2e.controlplane.certs import make_serving_cert

CERT_NAME = "pod-runtime-kubelet"
POLL_SECONDS = 0.2  # how often a followed log is read again while its container runs


class LoggedPod(Protocol):
    log: Path
    ended: threading.Event  # set once the pod's containers have exited for good


class LogServer:
    def __init__(self, find: Callable[[str, str], LoggedPod | None], pki: Path, address: str, node: str):
        """find(namespace, name): the pod running here under that name, if any."""
        make_serving_cert(pki, CERT_NAME, node, [f"IP:{address}", f"DNS:{node}"])
        handler = type("Handler", (_Handler,), {"find": staticmethod(find)})
        self.server = http.server.ThreadingHTTPServer((address, 0), handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki / f"{CERT_NAME}.crt", pki / f"{CERT_NAME}.key")
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]

    def start(self) -> LogServer:
        threading.Thread(target=self.server.serve_forever, daemon=True, name="kubelet-logs").start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    find: Callable[[str, str], LoggedPod | None]

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        url = urlsplit(self.path)
        parts = url.path.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "containerLogs":
            self.send_error(404, "only /containerLogs/<namespace>/<pod>/<container> is served here")
            return
        pod = self.find(parts[1], parts[2])
        if pod is None or not pod.log.exists():
            self.send_error(404, f"no log of pod {parts[1]}/{parts[2]} on this node")
            return
        follow = parse_qs(url.query).get("follow") == ["true"]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()  # HTTP/1.0: the body ends where the connection closes
        try:
            with open(pod.log, "rb") as log:
                while True:
                    ended = pod.ended.is_set()  # before the read: what was written before the exit is read
                    chunk = log.read(1 << 16)
                    if chunk:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    elif not follow or ended:
                        return
                    else:
                        pod.ended.wait(POLL_SECONDS)
        except (BrokenPipeError, ConnectionResetError):
            return  # the reader went away

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the http.server signature
        pass
