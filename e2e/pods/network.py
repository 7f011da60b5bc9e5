"""The pod network: a Linux bridge on this machine, a network namespace, veth pair and IP per pod.

Every pod gets its own loopback and an address on the bridge's subnet, so it binds Ray's fixed
ports (6379, 8265, 8080, 52365 ...) as a real pod does, and the pods, KubeRay and the API server
(all on this machine's side of the bridge) reach each other at pod IPs.

There is no kube-proxy:
- the `kubernetes` Service's ClusterIP (10.96.0.1:443, already in the API server's certificate) is
  an address of the bridge, where a forwarder passes connections to the API server on loopback,
  so in-cluster config works as the kubelet sets it up (KUBERNETES_SERVICE_HOST/PORT).

Cluster DNS is a small DNS server on the bridge (port 53, A records only), named in each pod's
/etc/resolv.conf with the cluster's search path: a Service's name resolves to the pod IP of its
EndpointSlices (a headless Service's answer; KubeRay's head Service is headless), anything else is
NXDOMAIN (no upstream: the pods are offline). A hosts file per namespace, bind-mounted over the pods'
/etc/hosts and rewritten in place (a bind mount keeps the inode), maps each pod's name to its IP (its
hostname, as the kubelet's hosts file has it; gloo resolves it) and the Services' names too. The DNS
server is needed all the same: gRPC's resolver (Ray's GCS client) asks DNS and ignores /etc/hosts.
KubeRay, outside the pods, reads Service names from the control plane's hosts file (cluster_hosts).

One runtime per machine at a time: the bridge, its subnet and 10.96.0.1:443 are fixed. A second waits for the
first to end (a lock file held while the network is up) instead of deleting its bridge under its pods, as
happened between two sessions' test runs: the first's pods were cut off from everything outside them.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

from e2e.controlplane.binaries import cache_dir

BRIDGE = "rlhf-pods0"
SUBNET = ipaddress.ip_network("10.245.0.0/24")  # apart from kwok's 10.244.0.0/16 and the Services' 10.96.0.0/16
GATEWAY = str(SUBNET.network_address + 1)
KUBERNETES_SERVICE = ("10.96.0.1", 443)
CLUSTER_DOMAIN = "cluster.local"
MACHINE_WAIT_SECONDS = 1200  # for another runtime's network to go (its test module, or a dev cluster's life)


def ip(*args: str, netns: str | None = None) -> None:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip()}")


class PodNetwork:
    def __init__(self, api_port: int):
        self.api_port = api_port
        self.free = [str(address) for address in list(SUBNET.hosts())[1:]]
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.dns: socket.socket | None = None
        self.names: dict[str, str] = {}
        self.held: IO[str] | None = None  # the machine's lock file, locked while the network is up

    def resolve(self, name: str) -> str | None:
        """The cluster DNS answer (set by the kubelet: fully qualified Service name -> IP)."""
        return self.names.get(name.rstrip(".").lower())

    def up(self) -> PodNetwork:
        self.held = hold_the_machine()
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)  # a crashed run's bridge
        ip("link", "add", BRIDGE, "type", "bridge")
        ip("addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE)
        ip("addr", "add", f"{KUBERNETES_SERVICE[0]}/32", "dev", BRIDGE)
        ip("link", "set", BRIDGE, "up")
        self.listener = socket.create_server(KUBERNETES_SERVICE, reuse_port=False)
        threading.Thread(target=self._accept, daemon=True, name="kubernetes-service").start()
        self.dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.dns.bind((GATEWAY, 53))
        threading.Thread(target=self._answer, daemon=True, name="cluster-dns").start()
        return self

    def down(self) -> None:
        for sock in (self.listener, self.dns):
            if sock is not None:
                # shutdown first: a socket closed while a thread waits in accept() or recvfrom() on it stays
                # bound (10.96.0.1:443 then refused the next runtime of this process: the dev cluster's).
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        if self.held is not None:
            self.held.close()  # the lock goes with it

    def attach(self, name: str) -> str:
        """Network namespace `name` with a veth on the bridge; returns the pod's IP."""
        with self.lock:
            address = self.free.pop(0)
        host_end = f"rp{address.split('.')[-1]}"  # interface names are at most 15 characters
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        ip("netns", "add", name)
        ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", name)
        ip("link", "set", host_end, "master", BRIDGE)
        ip("link", "set", host_end, "up")
        ip("addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", "eth0", netns=name)
        ip("link", "set", "eth0", "up", netns=name)
        ip("link", "set", "lo", "up", netns=name)
        ip("route", "add", "default", "via", GATEWAY, netns=name)
        return address

    @staticmethod
    def pids(name: str) -> list[int]:
        """Every process in the network namespace: all a pod's containers ran, whatever sessions they made."""
        out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def detach(self, name: str, address: str) -> None:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)  # its veth pair goes with it
        if address:
            with self.lock:
                self.free.append(address)

    # The `kubernetes` Service without kube-proxy: bytes copied both ways to the API server.
    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed by down()
            try:
                server = socket.create_connection(("127.0.0.1", self.api_port), timeout=10)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=_pump, args=(source, target), daemon=True).start()


    def _answer(self) -> None:
        while True:
            try:
                query, client = self.dns.recvfrom(512)
                self.dns.sendto(dns_answer(query, self.resolve), client)
            except OSError:
                return  # closed by down()
            except (IndexError, ValueError):
                continue  # not a query we can read


def hold_the_machine(timeout: float = MACHINE_WAIT_SECONDS) -> IO[str]:
    """The machine's pod-network lock file, locked (the kernel unlocks it when its holder dies)."""
    path = cache_dir() / ".pod-network.lock"
    held = open(path, "a")
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return held
        except BlockingIOError:
            if time.monotonic() > deadline:
                held.close()
                raise RuntimeError(f"another pod runtime has held this machine's pod network for {timeout:.0f}s "
                                   f"({path}): stop it (make dev-cluster-down) or wait for its tests") from None
            time.sleep(1)


def dns_answer(query: bytes, resolve) -> bytes:
    """The reply to a one-question DNS query: an A record for a known name (NOERROR without one for other
    types of a known name), else NXDOMAIN."""
    labels, at = [], 12
    while query[at]:
        labels.append(query[at + 1:at + 1 + query[at]].decode())
        at += 1 + query[at]
    qtype = int.from_bytes(query[at + 1:at + 3], "big")
    question = query[12:at + 5]
    address = resolve(".".join(labels))
    answers = b""
    if address and qtype == 1:
        answers = b"\xc0\x0c" + (1).to_bytes(2, "big") + (1).to_bytes(2, "big") + (5).to_bytes(4, "big") \
            + (4).to_bytes(2, "big") + socket.inet_aton(address)
    flags = 0x8180 if address else 0x8183  # a response, recursion desired and available; rcode 3: NXDOMAIN
    header = query[:2] + flags.to_bytes(2, "big") + (1).to_bytes(2, "big") + (1 if answers else 0).to_bytes(2, "big") \
        + bytes(4)
    return header + question + answers


def resolv_conf(namespace: str) -> str:
    """A pod's /etc/resolv.conf, as the kubelet writes it for dnsPolicy ClusterFirst."""
    return (f"nameserver {GATEWAY}\nsearch {namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\n"
            "options ndots:5\n")


def _pump(source: socket.socket, target: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            target.sendall(chunk)
    except OSError:
        pass
    finally:
        for sock in (source, target):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def service_names(service: str, namespace: str) -> list[str]:
    """What cluster DNS answers for a Service, from a pod of its namespace (search path applied)."""
    return [f"{service}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{service}.{namespace}.svc", f"{service}.{namespace}",
            service]


class HostsFile:
    """The /etc/hosts of every pod of one namespace."""

    def __init__(self, path: Path, namespace: str):
        self.path, self.namespace = path, namespace
        self.text = ""
        self.services: dict[str, str] = {}  # Service -> the IP its names resolve to
        self.update({}, [])

    def update(self, pods: dict[str, str], slices: list[Any]) -> None:
        """pods: name -> IP of the namespace's running pods; slices: its EndpointSlices."""
        self.services = {}
        for endpoint_slice in slices:
            service = (endpoint_slice.metadata.labels or {}).get("kubernetes.io/service-name")
            ready = [e.addresses[0] for e in endpoint_slice.endpoints or []
                     if e.addresses and (e.conditions is None or e.conditions.ready is not False)]
            if service and ready:
                self.services[service] = ready[0]
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
                 *(f"{address} {name}" for name, address in sorted(pods.items())),
                 *(f"{address} {' '.join(service_names(service, self.namespace))}"
                   for service, address in sorted(self.services.items()))]
        self.text = write_in_place(self.path, "".join(line + "\n" for line in lines), self.text)


def cluster_hosts(base: str, files: list[HostsFile]) -> str:
    """A hosts file for processes outside the pods (KubeRay): this machine's, and every Service's full name."""
    lines = [f"{address} {service_names(service, f.namespace)[0]}" for f in files
             for service, address in sorted(f.services.items())]
    return base + "".join(line + "\n" for line in lines)


def write_in_place(path: Path, text: str, old: str | None = None) -> str:
    """Rewrite the file keeping its inode (bind mounts of it see the new text); returns text."""
    if text != old:
        with open(path, "a+") as hosts:
            hosts.truncate(0)
            hosts.write(text)
    return text
