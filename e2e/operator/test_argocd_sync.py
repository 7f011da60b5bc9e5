"""A job synced by Argo CD stays in sync after the operator ran.

Argo CD's server-side diff applies the Git manifest in a dry run with its own field manager and
compares the result with the live object: a difference would show the Application OutOfSync and,
with auto-sync, make Argo CD write the spec back in a loop. Here each example is applied the way
Argo CD syncs it (server-side, field manager argocd-controller), the operator reconciles it
(its annotations, status, children), and the same dry run must return the live object.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from e2e.fixtures import example_jobs, wait_for
from e2e.operator.jobs import get_job, wait_phase

EXAMPLES = example_jobs()
RUNTIMES = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "runtimes"
ARGOCD = ["--server-side", "--field-manager", "argocd-controller"]
VOLATILE = ("managedFields", "resourceVersion", "generation")  # not compared by Argo CD either


def comparable(obj: dict) -> dict:
    return {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k not in VOLATILE}}


def one_version(control_plane, namespace: str, name: str, text: str):
    """The dry run of the manifest, the live job and `kubectl diff`'s verdict, or None when the operator wrote
    between two of their reads (kopf retries a job that waits for a ConfigMap every 15 s, annotating it): the
    sides are then of two versions, and what differs is that write, not a diff Argo CD would keep seeing."""
    dry_run = json.loads(control_plane.kubectl("apply", *ARGOCD, "--dry-run=server", "-o", "json", "-f", "-",
                                               input=text).stdout)
    live = json.loads(control_plane.kubectl("get", "rlhfjob", name, "-n", namespace, "-o", "json").stdout)
    diff = control_plane.kubectl("diff", *ARGOCD, "-f", "-", input=text, check=False)
    moved = any(line[:1] in "+-" and "resourceVersion:" in line for line in diff.stdout.splitlines())
    if moved or dry_run["metadata"]["resourceVersion"] != live["metadata"]["resourceVersion"]:
        return None
    return dry_run, live, diff


def test_synced_examples_have_no_diff_after_the_operator_ran(control_plane, kube, namespace, operator,
                                                              kuberay_paused):
    # The runtimes the examples name, which a platform team applies before any job (else the jobs wait for them,
    # kopf's retries annotating them meanwhile: never in sync).
    control_plane.kubectl("apply", "-f", str(RUNTIMES))
    manifests = {}
    for example in EXAMPLES:
        manifest = yaml.safe_load(example.read_text())
        manifest["metadata"]["namespace"] = namespace
        manifest["metadata"].setdefault("annotations", {})["argocd.argoproj.io/tracking-id"] = (
            f"examples:rlhf.dev/RLHFJob:{namespace}/{manifest['metadata']['name']}")
        manifests[manifest["metadata"]["name"]] = text = yaml.safe_dump(manifest)
        control_plane.kubectl("apply", *ARGOCD, "-f", "-", input=text)
    operator.start()
    for name, text in manifests.items():
        # Pending: with its RayJob, or waiting for a reward ConfigMap the example names (not created here);
        # a pipeline's later stage: Waiting for the stage it names.
        phase = "Waiting" if "fromJob" in text else "Pending"
        wait_phase(kube, namespace, name, phase)
        wait_for(lambda name=name: any(key.startswith("rlhf.dev/") for key in  # kopf's, after the handler
                                       get_job(kube, namespace, name)["metadata"].get("annotations") or {}),
                 30, f"kopf's annotations on {name}")
        dry_run, live, diff = wait_for(lambda name=name, text=text: one_version(control_plane, namespace, name, text),
                                       60, f"a dry run, a live copy and a diff of one version of {name}")
        assert comparable(dry_run) == comparable(live), name
        assert live["status"]["phase"] == phase  # the operator did write
        assert diff.returncode == 0, f"{name}:\n{diff.stdout}"
