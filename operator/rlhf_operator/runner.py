"""Run the operator in this process (`rlhf operator`): kopf with our handlers and settings."""

from __future__ import annotations

import logging

import kopf


def run(namespaces: list[str], metrics_port: int, health_port: int, verbose: bool = False) -> int:
    """Watch the given namespaces, or the whole cluster when there are none; returns on SIGTERM."""
    from . import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=verbose)
    logging.getLogger("celpy").setLevel(logging.WARNING)  # one line per CEL step when verbose
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=True,
        liveness_endpoint=f"http://0.0.0.0:{health_port}/healthz",
        memo=kopf.Memo(metrics_port=metrics_port),
    )
    return 0
