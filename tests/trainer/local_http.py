"""A real HTTP server on 127.0.0.1, serving from a thread, for the tests of the trainer's HTTP
clients (reward services, the API server the status reporter patches)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class LocalServer:
    """Serves `handler` on 127.0.0.1:port (0: a free one) until close(). Handlers that hold a
    request wait on `release`, which close() sets."""

    def __init__(self, handler: type[BaseHTTPRequestHandler], port: int = 0):
        self.release = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def reply(handler: BaseHTTPRequestHandler, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
    """Answer with status and payload (JSON; a str is sent as it is), plus headers."""
    data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
    handler.send_response(status)
    for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
        handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    try:
        handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the client gave up waiting and left


class QuietHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def read_json(handler: BaseHTTPRequestHandler) -> Any:
    return json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
