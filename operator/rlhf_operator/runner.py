"""Run the operator in this process (`rlhf operator`): kopf with our handlers and settings.

Metrics, /healthz and /readyz, and the admission webhook when given a certificate (admission.py), are served from
the start, by every replica; with leader election, only the replica holding the Lease runs kopf (a standby is
alive, answers admission reviews and waits). A leader that loses
the Lease exits at once with LOST_LEASE_EXIT_CODE, so Kubernetes restarts it as a standby.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass

import kopf
from aiohttp import web

from . import admission, metrics
from .leader import Elector

LOST_LEASE_EXIT_CODE = 3
log = logging.getLogger(__name__)


@dataclass
class Options:
    """What `rlhf operator`'s flags set (their defaults live in cli.py, once)."""

    namespaces: list[str]  # none: the whole cluster
    metrics_port: int
    health_port: int
    verbose: bool
    elector: Elector | None  # None: no leader election (one replica)
    resync_seconds: float  # every unfinished job reconciled again this often (resync.py)
    gpu_hour_prices: dict[str, float]  # GPU product -> price of a GPU-hour (usage.py)
    webhook: admission.Webhook | None = None  # None: no admission webhook served


def run(options: Options) -> int:
    """Returns when the operator stops: 0 on SIGTERM, LOST_LEASE_EXIT_CODE when it lost its Lease."""
    from . import handlers, usage  # noqa: F401  (registers the handlers)

    usage.PRICES.update(options.gpu_hour_prices)
    kopf.configure(verbose=options.verbose)
    return asyncio.run(_serve(options))


async def _serve(options: Options) -> int:
    metrics.serve(options.metrics_port)
    # Before /healthz answers: a replica that reports healthy also answers admission reviews.
    webhook = await admission.serve(options.webhook) if options.webhook else None
    health = await _health_server(options.health_port, options.elector)
    try:
        if options.elector is None:
            metrics.LEADER.set(1)
            await _kopf(options)
            return 0
        return await _lead(options, options.elector)
    finally:
        await health.cleanup()
        if webhook is not None:
            await webhook.cleanup()


async def _lead(options: Options, elector: Elector) -> int:
    await elector.acquire()
    metrics.LEADER.set(1)
    elector.keep(lost=_exit_at_once)
    try:
        await _kopf(options)
    finally:
        await asyncio.to_thread(elector.release)
    return 0


def _exit_at_once() -> None:
    """The Lease is lost: end the process from the renewal thread, whatever the event loop and the
    handler threads are doing (as kube-controller-manager does). A graceful stop of kopf would let
    handlers, the resync and the daemons write on while a standby may already lead."""
    logging.shutdown()  # flush the log first: "lost Lease" is the last line
    os._exit(LOST_LEASE_EXIT_CODE)


async def _kopf(options: Options) -> None:
    await kopf.operator(clusterwide=not options.namespaces, namespaces=options.namespaces, standalone=True,
                        memo=kopf.Memo(resync_seconds=options.resync_seconds))


async def _health_server(port: int, elector: Elector | None) -> web.AppRunner:
    """/healthz: 200 while this process's event loop answers (leader or standby): liveness.
    /readyz: 200 while, besides, the API server answered a Lease read within the renew deadline
    (always, without leader election): a replica cut off from the API server is not ready."""
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def readyz(_: web.Request) -> web.Response:
        if elector is None or elector.ready():
            return web.Response(text="ok")
        return web.Response(status=503, text="no answer from the API server to a Lease read within the renew deadline")

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz), web.get("/readyz", readyz)])
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner
