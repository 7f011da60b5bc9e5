"""`rlhf dashboard JOB`: the Ray dashboard of a job's running Ray cluster on a local port, until Ctrl-C.

Through the API server's pods/portforward to the head pod, as `kubectl port-forward` does, so that kubectl
need not be installed: each local connection gets a stream of its own.
"""

from __future__ import annotations

import argparse
import json
import select
import signal
import socket
import sys
import threading
from typing import Any, Callable

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from kubernetes.stream import portforward

from rlhf_operator import names

from . import cluster

RAY_DASHBOARD_PORT = 8265  # Ray's default, the head container's port named "dashboard" (rlhf_operator.render)
RAY_CLUSTER_LABEL = "ray.io/cluster"  # KubeRay's, on every pod of a Ray cluster
RAY_AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"  # KubeRay sets it from its Secret where the cluster has token authentication
CHUNK = 1 << 16


def head_pod(kube: Any, namespace: str, job: dict[str, Any]) -> dict[str, Any] | None:
    """The job's running head pod: of its current Ray cluster (status.rayClusterName) when there is one,
    else the newest."""
    name, current = job["metadata"]["name"], (job.get("status") or {}).get("rayClusterName")
    pods = kube.list("Pod", namespace, f"{names.JOB_LABEL}={names.label_value(name)},{names.ROLE_LABEL}=head")
    running = [pod for pod in pods if (pod.get("status") or {}).get("phase") == "Running"]
    return max(running, key=lambda pod: (pod["metadata"].get("labels", {}).get(RAY_CLUSTER_LABEL) == current,
                                         pod["metadata"]["creationTimestamp"]), default=None)


def dashboard_port(pod: dict[str, Any]) -> int:
    ports = [port for container in pod["spec"]["containers"] for port in container.get("ports") or []]
    return next((port["containerPort"] for port in ports if port.get("name") == "dashboard"), RAY_DASHBOARD_PORT)


def auth_token_secret(pod: dict[str, Any]) -> tuple[str, str] | None:
    """The Secret and key of the Ray cluster's token, which its dashboard asks for (authOptions mode token, as
    the operator renders every job: KubeRay's Secret named after the RayCluster, key auth_token)."""
    env = [var for container in pod["spec"]["containers"] for var in container.get("env") or []]
    ref = next((((var.get("valueFrom") or {}).get("secretKeyRef") or {}) for var in env
                if var["name"] == RAY_AUTH_TOKEN_ENV), {})
    return (ref["name"], ref["key"]) if ref.get("name") and ref.get("key") else None


def cmd_dashboard(args: argparse.Namespace) -> int:
    namespace, kube = cluster.namespace(args), cluster.connect(args)
    job = cluster.job(kube, namespace, args.job)
    pod = head_pod(kube, namespace, job)
    if pod is None:
        print(f"rlhf dashboard: RLHFJob {args.job} has no running Ray head now (phase "
              f"{(job.get('status') or {}).get('phase', 'Pending')}): its dashboard is there while its Ray cluster "
              "is up", file=sys.stderr)
        return 1
    core, pod_name, port = k8s.CoreV1Api(kube.api_client), pod["metadata"]["name"], dashboard_port(pod)

    def tunnel() -> Any:
        return portforward(core.connect_get_namespaced_pod_portforward, pod_name, namespace, ports=str(port))

    try:
        tunnel().close()  # the API server can reach the pod: say so now, not at the browser's first request
    except ApiException as error:
        print(f"rlhf dashboard: the API server cannot forward to pod {pod_name} port {port}: "
              f"{_refusal(error.reason)}", file=sys.stderr)
        return 1
    try:
        server = socket.create_server((args.address, args.port))
    except OSError as error:
        print(f"rlhf dashboard: cannot listen on {args.address}:{args.port} ({error.strerror}): pass another --port",
              file=sys.stderr)
        return 1
    with server:
        print(f"Ray dashboard of RLHFJob {namespace}/{args.job} (pod {pod_name}): "
              f"http://{args.address}:{server.getsockname()[1]} (Ctrl-C stops)", flush=True)
        if (secret := auth_token_secret(pod)) is not None:
            print(f"It asks for the Ray cluster's token: kubectl -n {namespace} get secret {secret[0]} "
                  f"-o jsonpath='{{.data.{secret[1]}}}' | base64 -d", flush=True)
        try:
            accept_until_interrupted(server, lambda local: _forward(local, tunnel, port))
        except KeyboardInterrupt:
            return 0


def accept_until_interrupted(server: socket.socket, handle: Callable[[socket.socket], None]) -> None:
    """Each connection to `server` handed to `handle` on a thread of its own, until Ctrl-C (KeyboardInterrupt).

    SIGINT raises KeyboardInterrupt here even when the process started with it ignored, as a script's background
    job does (Python then leaves it ignored), as kubectl port-forward stops on it. The wait is a select on the
    server and on Python's signal wakeup fd, not a blocking accept: the kernel may hand the SIGINT to a forwarding
    thread, and Python runs its handler only in the main thread, which a blocking accept keeps in the kernel until
    the next connection. The C handler writes to the wakeup fd from any thread."""
    wake_read, wake_write = socket.socketpair()
    wake_write.setblocking(False)
    previous = signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with wake_read, wake_write:
            while True:
                readable, _, _ = select.select([server, wake_read], [], [])
                if wake_read in readable:
                    wake_read.recv(CHUNK)  # the signal's number; its handler runs in this thread next
                if server in readable:
                    local, _ = server.accept()
                    threading.Thread(target=handle, args=(local,), daemon=True).start()
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        signal.set_wakeup_fd(previous)


def _refusal(reason: str) -> str:
    """The API server's message in a refused websocket handshake, whose text (websocket-client's) ends with the
    response's body, a Status; else the whole text."""
    try:
        return json.loads(reason.rsplit(" -+-+- ", 1)[-1])["message"]
    except (ValueError, KeyError, TypeError):
        return reason


def _forward(local: socket.socket, tunnel: Any, port: int) -> None:
    """One local connection through a stream of its own, bytes both ways until either side closes."""
    try:
        forwarded = tunnel()
    except ApiException as error:
        print(f"rlhf dashboard: a connection failed: {_refusal(error.reason)}", file=sys.stderr)
        local.close()
        return
    remote = forwarded.socket(port)
    try:
        while True:
            readable, _, _ = select.select([local, remote], [], [])
            for source in readable:
                data = source.recv(CHUNK)
                if not data:
                    return
                (remote if source is local else local).sendall(data)
    except OSError:
        return
    finally:
        local.close()
        forwarded.close()


def register(commands: Any) -> None:
    command = cluster.command(commands.add_parser(
        "dashboard", help="the Ray dashboard of a running job on a local port (a port-forward; Ctrl-C stops)"))
    command.add_argument("job", metavar="JOB", help="the RLHFJob's name")
    command.add_argument("-p", "--port", type=int, default=RAY_DASHBOARD_PORT,
                         help="the local port (%(default)s; 0: any free one)")
    command.add_argument("--address", default="127.0.0.1", help="the local address to listen on (%(default)s)")
    command.set_defaults(func=cluster.reported(cmd_dashboard))
