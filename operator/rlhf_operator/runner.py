"""Run the operator in this process (`rlhf operator`): kopf with our handlers and settings.

Metrics and /healthz are served from the start, by every replica; with leader election, only the
replica holding the Lease runs kopf (a standby is alive and waits). A leader that loses the Lease
stops reconciling and exits with LOST_LEASE_EXIT_CODE, so Kubernetes restarts it as a standby.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import kopf
from aiohttp import web

from . import metrics
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


def run(options: Options) -> int:
    """Returns when the operator stops: 0 on SIGTERM, LOST_LEASE_EXIT_CODE when it lost its Lease."""
    from . import handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=options.verbose)
    return asyncio.run(_serve(options))


async def _serve(options: Options) -> int:
    metrics.serve(options.metrics_port)
    health = await _health_server(options.health_port)
    try:
        if options.elector is None:
            metrics.LEADER.set(1)
            await _kopf(options, stop_flag=None)
            return 0
        return await _lead(options, options.elector)
    finally:
        await health.cleanup()


async def _lead(options: Options, elector: Elector) -> int:
    await elector.acquire()
    metrics.LEADER.set(1)
    stop_flag = asyncio.Event()
    operator = asyncio.create_task(_kopf(options, stop_flag))
    keep = asyncio.create_task(elector.keep())
    await asyncio.wait({operator, keep}, return_when=asyncio.FIRST_COMPLETED)
    if keep.done():  # the Lease is lost: stop before a standby may take over
        stop_flag.set()
        await operator
        return LOST_LEASE_EXIT_CODE
    keep.cancel()
    await asyncio.to_thread(elector.release)
    operator.result()  # re-raise what ended kopf, if anything did
    return 0


async def _kopf(options: Options, stop_flag: asyncio.Event | None) -> None:
    await kopf.operator(clusterwide=not options.namespaces, namespaces=options.namespaces, standalone=True,
                        stop_flag=stop_flag, memo=kopf.Memo(resync_seconds=options.resync_seconds))


async def _health_server(port: int) -> web.AppRunner:
    """200 on /healthz while this process's event loop answers (leader or standby)."""
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.get("/healthz", healthz)])
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner
