"""The kubelet's HTTPS server, which the API server calls, over TLS with a serving certificate the cluster CA
signed (the API server checks it: --kubelet-certificate-authority), for a pod's log and its port-forward
(portforward.py: GET /portForward/<namespace>/<pod>?port=...), and here its log endpoint, which
`kubectl logs` reaches (a pods/log read): GET /containerLogs/<namespace>/<pod>/<container>[?follow=true].

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
from e2e.pods import portforward

CERT_NAME = "pod-runtime-kubelet"
POLL_SECONDS = 0.2  # how often a followed log is read again while its container runs


class LoggedPod(Protocol):
    log: Path
    ended: threading.Event  # set once the pod's containers have exited for good


class ServedPod(LoggedPod, portforward.ForwardedPod, Protocol):
    pass


class KubeletServer:
    def __init__(self, find: Callable[[str, str], ServedPod | None], pki: Path, address: str, node: str):
        """find(namespace, name): the pod running here under that name, if any."""
        make_serving_cert(pki, CERT_NAME, node, [f"IP:{address}", f"DNS:{node}"])
        handler = type("Handler", (_Handler,), {"find": staticmethod(find)})
        self.server = http.server.ThreadingHTTPServer((address, 0), handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki / f"{CERT_NAME}.crt", pki / f"{CERT_NAME}.key")
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]

    def start(self) -> KubeletServer:
        threading.Thread(target=self.server.serve_forever, daemon=True, name="kubelet-server").start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(http.server.BaseHTTPRequestHandler):
    find: Callable[[str, str], ServedPod | None]
    # Errors as a kubelet writes them: the text alone, which the API server hands its client as it came.
    error_message_format, error_content_type = "%(message)s\n", "text/plain; charset=utf-8"

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        url = urlsplit(self.path)
        endpoint, *parts = url.path.strip("/").split("/")
        if (endpoint, len(parts)) not in ENDPOINTS:
            self.send_error(404, f"only {', '.join(form for form, _ in ENDPOINTS.values())} are served here")
            return
        pod = self.find(parts[0], parts[1])
        if pod is None:
            self.send_error(404, f"no pod {parts[0]}/{parts[1]} on this node")
            return
        ENDPOINTS[endpoint, len(parts)][1](self, pod, url.query)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the http.server signature
        pass


def serve_log(request: http.server.BaseHTTPRequestHandler, pod: LoggedPod, query: str) -> None:
    if not pod.log.exists():
        request.send_error(404, "the pod has no log yet")
        return
    follow = parse_qs(query).get("follow") == ["true"]
    request.send_response(200)
    request.send_header("Content-Type", "text/plain")
    request.end_headers()  # HTTP/1.0: the body ends where the connection closes
    try:
        with open(pod.log, "rb") as log:
            while True:
                ended = pod.ended.is_set()  # before the read: what was written before the exit is read
                chunk = log.read(1 << 16)
                if chunk:
                    request.wfile.write(chunk)
                    request.wfile.flush()
                elif not follow or ended:
                    return
                else:
                    pod.ended.wait(POLL_SECONDS)
    except (BrokenPipeError, ConnectionResetError):
        return  # the reader went away


# (first segment, segments after it) -> the path's form and what serves it (request, pod, query)
ENDPOINTS: dict[tuple[str, int], tuple[str, Callable[[http.server.BaseHTTPRequestHandler, ServedPod, str], None]]] = {
    ("containerLogs", 3): ("/containerLogs/NAMESPACE/POD/CONTAINER", serve_log),
    ("portForward", 2): ("/portForward/NAMESPACE/POD", portforward.serve),
}
