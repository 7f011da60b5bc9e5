"""kopf settings for production: our own finalizer and annotations, bounded watches, backoff."""

from __future__ import annotations

import logging
import socket
from typing import Any

import kopf

from rlhf_api import v1alpha1 as api
from .kube import CONNECT_TIMEOUT, HANDLER_THREADS, REQUEST_TIMEOUT
from .names import JOB_LABEL, LABEL_MANAGED_BY, MANAGED_BY

PREFIX = api.GROUP  # rlhf.dev/...: kopf's marks on our objects carry our name
FINALIZER = f"{PREFIX}/finalizer"


class DiffBase(kopf.AnnotationsDiffBaseStorage):
    """kopf's diff base (the spec, labels and annotations last handled), built from those parts only.

    kopf's own build deep-copies the whole object on every event, then drops its metadata and
    status: at 300 jobs in a burst, copying managedFields and status was a fifth of the operator's
    CPU (benchmarks/README.md). Same essence, less copied."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        if extra_fields:  # a handler that follows status fields needs them in the essence
            return super().build(body=body, extra_fields=extra_fields)
        meta = body.get("metadata", {})
        trimmed = {key: value for key, value in body.items() if key not in ("metadata", "status")}
        trimmed["metadata"] = {key: meta[key] for key in ("labels", "annotations", "ownerReferences") if key in meta}
        return super().build(body=kopf.Body(trimmed))


def configure(settings: kopf.OperatorSettings) -> None:
    persistence = settings.persistence
    persistence.finalizer = FINALIZER
    persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    persistence.diffbase_storage = DiffBase(prefix=PREFIX, key="last-handled-configuration")

    # Reconnect watches before the API server or a load balancer silently drops them.
    settings.watching.server_timeout = 270
    settings.watching.client_timeout = 300
    settings.watching.connect_timeout = CONNECT_TIMEOUT
    settings.watching.reconnect_backoff = 1.0
    # Only RayJobs we created: filtered by the API server, not after the fact.
    settings.watching.label_selectors["ray.io", "rayjobs"] = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
    settings.watching.label_selectors["v1", "pods"] = JOB_LABEL  # our Ray clusters' pods only

    settings.networking.request_timeout = REQUEST_TIMEOUT
    settings.networking.connect_timeout = CONNECT_TIMEOUT
    settings.networking.error_backoffs = (1, 2, 5, 10, 30, 60)
    settings.execution.default_backoff = 10  # retry of a failed handler (API errors, conflicts)
    settings.execution.max_workers = HANDLER_THREADS

    # Events only from explicit kopf.event() calls (one per status transition), not from logs.
    settings.posting.loggers = False
    settings.posting.level = logging.INFO
    settings.posting.reporting_component = MANAGED_BY
    settings.posting.reporting_instance = socket.gethostname()  # the pod's name in a cluster

    # One replica (the Helm chart's Deployment uses the Recreate strategy): no peering objects.
    settings.peering.standalone = True
