"""The kubelet's port-forward endpoint, which `rlhf dashboard` (the kubernetes Python client's `portforward`)
reaches through the API server's pods/portforward?ports=P: GET /portForward/<namespace>/<pod>?port=P[,Q...]
(the API server names the parameter `port` for the kubelet), upgraded to a websocket of subprotocol
v4.channel.k8s.io. kube-apiserver v1.37 unwraps only SPDY tunnelled in a websocket
(SPDY/3.1+portforward.k8s.io, kubectl's); any other websocket its upgrade-aware proxy passes, as it came, to
the node's kubelet, which is this.

The stream is framed as the kubelet's streaming server frames it (k8s.io/cri-streaming,
portforward/websocket.go): port i of the request gets a data channel 2i and an error channel 2i+1; each
message's first byte names its channel; the first message on each channel carries its port (2 bytes,
little-endian); then the data channel carries the connection's bytes both ways, and the error channel the
reason, should the pod's port refuse. Once every port's connection has ended, the websocket is closed
(a close message, the client's answer awaited for a moment, then the connection).

Not played: SPDY (so not `kubectl port-forward`, whose SPDY the API server hands the kubelet as such), the
base64 subprotocol, fragmented messages, POST, idle timeouts, and client authentication (as logs.py). The
pod's port is dialled at the pod's IP on the pod network (network.py); a real runtime dials localhost inside
the pod's network namespace, so a server that listens on the pod's loopback alone is reachable by a real
port-forward and not by this one.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import http.server
import select
import socket
import ssl
import time
from typing import Protocol
from urllib.parse import parse_qs

PROTOCOL = "v4.channel.k8s.io"
WEBSOCKET_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455's, hashed into every handshake's answer
DATA, ERROR = 0, 1  # a port's two channels: 2i + DATA, 2i + ERROR
CHUNK = 1 << 16
CONNECT_SECONDS = 10
CLOSE_WAIT_SECONDS = 2  # how long the client's answer to our close message is awaited


class Opcode(enum.IntEnum):
    BINARY = 0x2
    CLOSE = 0x8
    PING = 0x9
    PONG = 0xA


class ForwardedPod(Protocol):
    name: str
    uid: str
    ip: str  # on the pod network; "" until it has one


def requested_ports(query: str) -> list[int]:
    """The `port` query parameter(s), each a port or a comma-separated list, as the kubelet reads them."""
    values = parse_qs(query, keep_blank_values=True).get("port", [])
    if not values:
        raise ValueError('query parameter "port" is required')
    ports = [int(port) if port.isdigit() else -1 for value in values for port in value.split(",")]
    if any(not 0 < port < 1 << 16 for port in ports):
        raise ValueError(f"ports {values}: each must be a number from 1 to 65535")
    return ports


def serve(request: http.server.BaseHTTPRequestHandler, pod: ForwardedPod, query: str) -> None:
    """Answer one port-forward request: the websocket handshake, then the tunnel until it ends."""
    try:
        ports = requested_ports(query)
    except ValueError as error:
        request.send_error(400, str(error))
        return
    if request.headers.get("Upgrade", "").lower() != "websocket" or not request.headers.get("Sec-WebSocket-Key"):
        request.send_error(400, "port-forward is served here to websocket clients only (SPDY is not played)")
        return
    offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
    if offered and PROTOCOL not in offered:
        request.send_error(400, f"websocket subprotocols {offered}: only {PROTOCOL} is played here")
        return
    if not pod.ip:
        request.send_error(404, f"pod {pod.name} has no network yet")
        return
    accept = base64.b64encode(hashlib.sha1(request.headers["Sec-WebSocket-Key"].encode() + WEBSOCKET_GUID).digest())
    request.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                        b"Sec-WebSocket-Accept: " + accept + b"\r\n"
                        + (f"Sec-WebSocket-Protocol: {PROTOCOL}\r\n".encode() if offered else b"") + b"\r\n")
    _Tunnel(request, pod, ports).run()


def frame(opcode: Opcode, payload: bytes) -> bytes:
    """One unfragmented, unmasked message (a server's)."""
    size = len(payload)
    if size < 126:
        length = bytes([size])
    elif size < 1 << 16:
        length = bytes([126]) + size.to_bytes(2, "big")
    else:
        length = bytes([127]) + size.to_bytes(8, "big")
    return bytes([0x80 | opcode]) + length + payload


def unmask(payload: bytes, mask: bytes) -> bytes:
    key = (mask * (len(payload) // 4 + 1))[:len(payload)]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(key, "little")).to_bytes(len(payload), "little")


class _Tunnel:
    """Bytes between the websocket and the pod's connections, on the request's thread alone (a TLS connection
    is never read and written by two threads at once). The client sends nothing before our handshake's answer,
    so the request's reader holds no byte beyond the headers: the websocket is read from the connection."""

    def __init__(self, request: http.server.BaseHTTPRequestHandler, pod: ForwardedPod, ports: list[int]):
        self.client: socket.socket = request.connection
        self.pod, self.ports = pod, ports
        self.unread = b""  # the client's bytes not yet a whole message
        self.closed = False  # our close message is sent: nothing more goes out
        self.connections: dict[socket.socket, int] = {}  # each open connection to the pod -> its port's index

    def run(self) -> None:
        try:
            self._run()
        except OSError:
            pass  # the client went away
        finally:
            for connection in self.connections:
                connection.close()

    def send(self, opcode: Opcode, payload: bytes) -> None:
        if not self.closed:
            self.closed = opcode == Opcode.CLOSE
            self.client.sendall(frame(opcode, payload))

    def _run(self) -> None:
        for index, port in enumerate(self.ports):
            for channel in (2 * index + DATA, 2 * index + ERROR):
                self.send(Opcode.BINARY, bytes([channel]) + port.to_bytes(2, "little"))
            try:
                connection = socket.create_connection((self.pod.ip, port), timeout=CONNECT_SECONDS)
            except OSError as error:
                self.send(Opcode.BINARY, bytes([2 * index + ERROR]) + f"error forwarding port {port} to pod "
                          f"{self.pod.name}, uid {self.pod.uid}: {error}".encode())
                continue
            connection.settimeout(None)
            self.connections[connection] = index
        deadline = None
        while True:
            if not self.connections and not self.closed:  # every port's connection has ended
                self.send(Opcode.CLOSE, (1000).to_bytes(2, "big"))
                deadline = time.monotonic() + CLOSE_WAIT_SECONDS  # for the client's answer
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return
            # Bytes TLS has decrypted already are not the socket's to select on.
            pending = isinstance(self.client, ssl.SSLSocket) and self.client.pending()
            readable = [self.client] if pending else select.select([self.client, *self.connections], [], [], wait)[0]
            for source in readable:
                if source is self.client:
                    if not self._from_client():
                        return
                else:
                    self._from_pod(source)

    def _from_client(self) -> bool:
        """The client's messages read so far: data to its port's connection, pings answered. False: it ended."""
        data = self.client.recv(CHUNK)
        if not data:
            return False
        self.unread += data
        while (message := self._message()) is not None:
            final, opcode, payload = message
            if opcode == Opcode.CLOSE:
                self.send(Opcode.CLOSE, payload[:2])
                return False
            if opcode == Opcode.PING:
                self.send(Opcode.PONG, payload)
            elif opcode == Opcode.BINARY and final and payload:
                channel, data = payload[0], payload[1:]
                index = channel // 2
                connection = next((c for c, i in self.connections.items() if i == index), None)
                if channel % 2 == DATA and connection is not None and data:  # an error channel only speaks
                    try:
                        connection.sendall(data)
                    except OSError:
                        self._drop(connection)
            elif opcode != Opcode.PONG:
                self.send(Opcode.CLOSE, (1003).to_bytes(2, "big") + b"only whole binary messages are played")
                return False
        return True

    def _message(self) -> tuple[bool, int, bytes] | None:
        """The first whole message of the client's bytes, taken off them: (final, opcode, payload)."""
        unread = self.unread
        if len(unread) < 2:
            return None
        size, at = unread[1] & 0x7F, 2
        if size >= 126:
            at += 2 if size == 126 else 8
            if len(unread) < at:
                return None
            size = int.from_bytes(unread[2:at], "big")
        mask = unread[at:at + 4] if unread[1] & 0x80 else b""
        at += len(mask)
        if len(mask) not in (0, 4) or len(unread) < at + size:
            return None
        payload, self.unread = unread[at:at + size], unread[at + size:]
        return bool(unread[0] & 0x80), unread[0] & 0x0F, unmask(payload, mask) if mask else payload

    def _from_pod(self, connection: socket.socket) -> None:
        try:
            data = connection.recv(CHUNK)
        except OSError:
            data = b""
        if data:
            self.send(Opcode.BINARY, bytes([2 * self.connections[connection] + DATA]) + data)
        else:
            self._drop(connection)

    def _drop(self, connection: socket.socket) -> None:
        self.connections.pop(connection, None)
        connection.close()
