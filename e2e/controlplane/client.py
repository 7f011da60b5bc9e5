"""A raw HTTPS client of the API server (stdlib only, no proxy): what the control plane uses
to wait for readiness and to create objects before any kubeconfig-based client can be used."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ControlPlaneError


def ssl_context(cafile: Path | None) -> ssl.SSLContext:
    """Verifies against cafile; without one, verifies nothing (components' own serving certs)."""
    if cafile is not None:
        return ssl.create_default_context(cafile=str(cafile))
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def request(server: str, token: str, cafile: Path, method: str, path: str, body: Any = None,
            ok: Sequence[int] = (200,), timeout: float = 10) -> tuple[int, Any]:
    """(HTTP status, decoded JSON body); status 0 when unreachable. A status outside a
    non-empty `ok` raises."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server + path, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json",
        "Accept": "application/json"})
    handler = urllib.request.HTTPSHandler(context=ssl_context(cafile))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), handler)
    try:
        with opener.open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, None
    try:
        payload = json.loads(raw) if raw else None
    except ValueError:
        payload = raw.decode(errors="replace")
    if status not in ok and ok:
        raise ControlPlaneError(f"{method} {path}: HTTP {status}: {payload}")
    return status, payload


@dataclass(frozen=True)
class Api:
    """The API server as an admin: where it is, the admin token, the CA that signed it."""
    server: str
    token: str
    cafile: Path

    def request(self, method: str, path: str, body: Any = None, ok: Sequence[int] = (200,),
                timeout: float = 10) -> tuple[int, Any]:
        return request(self.server, self.token, self.cafile, method, path, body, ok, timeout)

    def get_json(self, path: str) -> tuple[int, Any]:
        return self.request("GET", path, ok=())

    def ready(self) -> bool:
        return self.get_json("/readyz")[0] == 200


def http_ok(url: str, cafile: Path | None = None) -> bool:
    """Whether GET url answers 200 (a health endpoint)."""
    handlers: list[Any] = [urllib.request.ProxyHandler({})]
    if url.startswith("https"):
        handlers.append(urllib.request.HTTPSHandler(context=ssl_context(cafile)))
    try:
        with urllib.request.build_opener(*handlers).open(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def conditions(obj: Any) -> dict[str, str]:
    """type -> status of an object's status.conditions (tolerates missing/null parts)."""
    status = (obj or {}).get("status") or {} if isinstance(obj, dict) else {}
    return {c.get("type"): c.get("status") for c in status.get("conditions") or []}


class Session:
    """One keep-alive HTTPS connection to the API server, for many small requests in a row (the
    admission fuzzer sends thousands; a connection per request would cost a TLS handshake each)."""

    def __init__(self, server: str, token: str, cafile: Path, timeout: float = 30):
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(server)
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json",
                         "Accept": "application/json"}
        self._connection = http.client.HTTPSConnection(
            url.hostname, url.port, timeout=timeout, context=ssl_context(cafile))

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """(HTTP status, decoded JSON body); reconnects once if the server closed the connection."""
        import http.client

        data = json.dumps(body).encode() if body is not None else None
        for attempt in (1, 2):
            try:
                self._connection.request(method, path, body=data, headers=self._headers)
                resp = self._connection.getresponse()
                raw = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._connection.close()
                if attempt == 2:
                    raise
        return resp.status, json.loads(raw) if raw else None

    def close(self) -> None:
        self._connection.close()
