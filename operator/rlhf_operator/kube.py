"""The few Kubernetes API calls the operator makes, on plain dicts.

One ApiClient (in-cluster credentials, else the kubeconfig) and the REST paths of the kinds the
operator touches; errors are kubernetes' ApiException (status 404, 409, ...).
"""

from __future__ import annotations

import json
import os
from functools import cache
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from rlhf_api import v1alpha1 as api

# kind -> (API path prefix, plural)
RESOURCES = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "RayJob": ("/apis/ray.io/v1", "rayjobs"),
    "Pod": ("/api/v1", "pods"),  # read only: why a Ray cluster is not up, which pods still exist (usage)
    "Node": ("/api/v1", "nodes"),  # read only, cluster-scoped (namespace ""): a GPU's product for usage prices
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),  # read only: can every pod mount it
    "RLHFRuntime": (f"/apis/{api.API_VERSION}", "rlhfruntimes"),  # read only: a job's conventions (runtimes.py)
    "ClusterRLHFRuntime": (f"/apis/{api.API_VERSION}", "clusterrlhfruntimes"),  # cluster-scoped: namespace ""
    "Lease": ("/apis/coordination.k8s.io/v1", "leases"),  # leader election among replicas  # Kueue's admission unit of a queued RayJob
    api.KIND: (f"/apis/{api.API_VERSION}", api.PLURAL),
}
MERGE_PATCH = "application/merge-patch+json"


# Threads running the operator's sync handlers (kopf's, settings.py); the connection pool has at
# least as many connections, so no handler opens (and TLS-handshakes) a connection that the full
# pool then throws away. A handler mostly waits on the API server (a new job: five creates and a
# status write in a row), so more threads than CPUs: at 300 jobs in a burst, 32 cut apply->RayJob
# p99 from 29 s to 18 s (benchmarks/README.md).
HANDLER_THREADS = 32
# Every API request's bounds (seconds), kopf's and this client's alike: a connection gone half-open
# fails the call after these instead of holding a handler thread forever. Watches have their own.
CONNECT_TIMEOUT = 10
REQUEST_TIMEOUT = 60

class Kube:
    def __init__(self, api_client: k8s.ApiClient, timeout: tuple[float, float] = (CONNECT_TIMEOUT, REQUEST_TIMEOUT)):
        """timeout: (connect, read) seconds of every request, so that no call waits forever on a dead connection."""
        self.api_client, self.timeout = api_client, timeout

    @classmethod
    def from_environment(cls, **kwargs: Any) -> Kube:
        configuration = k8s.Configuration()
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            k8s_config.load_incluster_config(client_configuration=configuration)
        else:
            k8s_config.load_kube_config(client_configuration=configuration)
        # A connection for each handler thread at least (the default is 5 per CPU).
        configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize, HANDLER_THREADS)
        return cls(k8s.ApiClient(configuration), **kwargs)

    def _request(self, method: str, path: str, body: Any = None, *, query: list[tuple[str, str]] | None = None,
                 content_type: str = "application/json") -> Any:
        request = self.api_client.param_serialize(
            method, path, query_params=query or [], body=body, auth_settings=["BearerToken"],
            header_params={"Accept": "application/json", "Content-Type": content_type},
        )
        response = self.api_client.call_api(*request, _request_timeout=self.timeout)
        data = response.read()
        if not 200 <= response.status <= 299:
            self.api_client.response_deserialize(response, {})  # raises the matching ApiException
        return json.loads(data) if data else None

    @staticmethod
    def _path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        prefix, plural = RESOURCES[kind]
        return "/".join(part for part in (prefix, namespace and "namespaces", namespace, plural, name, subresource) if part)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", self._path(kind, namespace, name))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        found = self._request("GET", self._path(kind, namespace), query=[("labelSelector", label_selector)])
        return found["items"]

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", self._path(obj["kind"], obj["metadata"].get("namespace", "")), obj)

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        """A JSON merge patch; a metadata.resourceVersion in it makes the write conditional (409 if stale)."""
        return self._request("PATCH", self._path(kind, namespace, name, subresource), patch, content_type=MERGE_PATCH)

    def delete(self, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete that very object (not a newer one of the same name); children go in the background."""
        options = {"preconditions": {"uid": uid}, "propagationPolicy": "Background"}
        try:
            self._request("DELETE", self._path(kind, namespace, name), options)
        except ApiException as error:
            if error.status not in (404, 409):  # gone, or replaced by a newer object
                raise


@cache
def client() -> Kube:
    return Kube.from_environment()


def exists(kind: str, namespace: str, name: str) -> bool:
    return client().get(kind, namespace, name) is not None
