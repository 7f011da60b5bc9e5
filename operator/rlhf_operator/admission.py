"""The validating admission webhook of RLHFJobs: the API server asks it before it stores a new job, and it
refuses one whose runtime does not exist or that sets what its runtime locks, with the reason and what to
change (`kubectl apply` prints it). The answer is runtimes.resolve's, the very code the operator runs when the
job starts, so the webhook and the reconcile cannot disagree; the operator's own refusal stays for clusters
installed without the webhook.

Served over HTTPS by every replica, leader or standby (like /healthz and the metrics, not by kopf, which runs on
the leader alone): admission reads and writes nothing of its own, so any replica may answer, and one rollout or
a leader's death leaves the others answering. Only CREATE is asked: spec.runtimeRef and spec.resources are
immutable and queueName cannot be added later (job.py), so an update cannot change the answer; deletes and the
operator's own metadata patches never reach it. The serving certificate is read from CERT_FILE and KEY_FILE in a
directory (a Secret's volume: helm's or cert-manager's) and read again when it changes.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from rlhf_api import v1alpha1 as api
from rlhf_api.validation import InvalidJob, validate

from . import runtimes
from .checks import Unrealisable
from .kube import Kube

PATH = "/validate-rlhfjob"
CERT_FILE, KEY_FILE = "tls.crt", "tls.key"  # a kubernetes.io/tls Secret's keys
# The API server gives up on a webhook after its timeoutSeconds (the chart's: 10): the runtime's read ends first.
READ_TIMEOUT_SECONDS = 5
CERT_CHECK_SECONDS = 30  # cert-manager renews well before expiry: a check every half minute is plenty
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Webhook:
    """Where the webhook listens (`rlhf operator --webhook-port --webhook-cert-dir`)."""

    port: int
    cert_dir: Path


def refusal(job_manifest: dict[str, Any], client: Kube) -> str | None:
    """Why a new RLHFJob may not be stored, or None. A spec the operator's model refuses is let through: the API
    server has checked it against the CRD already, and the operator reports what more it finds (InvalidSpec)."""
    try:
        job = validate(job_manifest)
    except InvalidJob:
        return None
    try:
        runtimes.resolve(job, None, client, waited=None)
    except Unrealisable as refused:
        return f"{refused.message} (reason {refused.reason})"
    return None


def review(body: dict[str, Any], client: Kube) -> dict[str, Any]:
    """An AdmissionReview's response to its request."""
    request = body["request"]
    job = request["object"]
    # The namespace is the request's: a manifest may leave it out of metadata.
    manifest = {**job, "metadata": {**job.get("metadata", {}), "namespace": request["namespace"]}}
    refused = refusal(manifest, client)
    response: dict[str, Any] = {"uid": request["uid"], "allowed": refused is None}
    if refused is not None:
        response["status"] = {"code": 422, "reason": "Invalid", "message": refused}
    return {"apiVersion": body.get("apiVersion", "admission.k8s.io/v1"), "kind": "AdmissionReview",
            "response": response}


async def serve(webhook: Webhook) -> web.AppRunner:
    """The webhook's HTTPS server on webhook.port; stop it with the runner's cleanup()."""
    client = Kube.from_environment(timeout=(READ_TIMEOUT_SECONDS, READ_TIMEOUT_SECONDS))
    cert, key = webhook.cert_dir / CERT_FILE, webhook.cert_dir / KEY_FILE
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def validate_job(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("request", {}).get("kind", {}).get("kind") != api.KIND:
            raise web.HTTPBadRequest(text=f"this webhook reviews {api.KIND}s only")
        return web.json_response(await asyncio.to_thread(review, body, client))

    reloading = asyncio.create_task(_reload_on_change(context, cert, key))
    app = web.Application()
    app.add_routes([web.post(PATH, validate_job)])
    app.on_cleanup.append(lambda _: _cancel(reloading))
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", webhook.port, ssl_context=context).start()
    log.info("admission webhook: https://0.0.0.0:%d%s", webhook.port, PATH)
    return runner


async def _reload_on_change(context: ssl.SSLContext, cert: Path, key: Path) -> None:
    """A renewed certificate (the Secret's volume updated in place) is served from the next handshake on."""
    seen = cert.stat().st_mtime
    while True:
        await asyncio.sleep(CERT_CHECK_SECONDS)
        try:
            if (changed := cert.stat().st_mtime) != seen:
                context.load_cert_chain(cert, key)
                seen = changed
                log.info("admission webhook: serving certificate %s read again", cert)
        except (OSError, ssl.SSLError) as error:  # caught mid-update: the next check reads the pair again
            log.warning("admission webhook: cannot read %s: %s", cert, error)


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
