"""The Argo CD health check for RLHFJobs (manifests/argocd/health.lua), run in gopher-lua.

e2e/build/argocd-lua is a small Go program that runs a health script as Argo CD's util/lua does
(no standard libraries unless asked, obj decoded from the live object, the returned table
encoded with layeh.com/gopher-json). It is built once into
${RLHF_CACHE:-$HOME/.cache/rlhf-operator}/bin/argocd-lua-<gopher-lua version>/, next to a .stamp
of its inputs, like e2e/build/build.sh's binaries. The objects' statuses come from the operator's
own state machine (rlhf_operator.status), so the script is checked against what it writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from rlhf_operator import status

ROOT = Path(__file__).resolve().parents[1]
MODULE = ROOT / "e2e" / "build" / "argocd-lua"
ARGOCD = ROOT / "manifests" / "argocd"
SCRIPT = ARGOCD / "health.lua"
CM_KEY = "resource.customizations.health.rlhf.dev_RLHFJob"
T0 = "2026-11-22T10:00:00Z"


def _go() -> str | None:
    go = os.environ.get("GO") or shutil.which("go") or "/usr/local/go/bin/go"
    return go if os.access(go, os.X_OK) else None


@pytest.fixture(scope="module")
def argocd_lua() -> Path:
    """The runner, built on first use (about 2 s with a warm module cache), cached by input stamp."""
    go = _go()
    if go is None:
        pytest.skip("no Go toolchain")
    env = {**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": "-buildvcs=false"}
    gomod = (MODULE / "go.mod").read_text()
    version = re.search(r"github\.com/yuin/gopher-lua (v\S+)", gomod).group(1)
    ldflags = "-s -w"
    goversion = subprocess.run([go, "env", "GOVERSION"], env=env, check=True, capture_output=True,
                               text=True).stdout.strip()
    h = hashlib.sha256(f"argocd-lua {version} {ldflags} {goversion}\n".encode())
    for name in ("go.mod", "go.sum", "main.go"):
        h.update((MODULE / name).read_bytes())
    key = h.hexdigest()[:16]
    cache = Path(os.environ.get("RLHF_CACHE") or Path.home() / ".cache" / "rlhf-operator")
    out = cache / "bin" / f"argocd-lua-{version}"
    binary = out / "argocd-lua"
    stamp = out / ".stamp"
    if binary.exists() and stamp.exists() and stamp.read_text().strip() == key:
        return binary
    tmp = cache / "bin" / f".tmp-argocd-lua-{version}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    start = time.monotonic()
    # -mod=readonly: go.mod/go.sum pin the modules; only the module cache/proxy supplies them.
    subprocess.run(["nice", "-n", "10", go, "build", "-mod=readonly", "-trimpath", "-ldflags", ldflags,
                    "-o", str(tmp / "argocd-lua"), "."], cwd=MODULE, env=env, check=True)
    secs = round(time.monotonic() - start)
    (tmp / ".stamp").write_text(key + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    with open(cache / "build-times.log", "a") as log:
        now = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        log.write(f"{now} argocd-lua built in {secs}s (go {goversion}, {os.cpu_count()} cpus) -> {out}\n")
    return binary


def health(runner: Path, obj: dict, tmp_path: Path, script: Path = SCRIPT, *flags: str) -> dict:
    path = tmp_path / "obj.json"
    path.write_text(json.dumps(obj))
    result = subprocess.run([str(runner), *flags, str(script), str(path)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def rlhf_job(job_status: dict | None = None, generation: int = 1) -> dict:
    obj = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
           "metadata": {"name": "ppo", "namespace": "default", "generation": generation, "uid": "u-1"},
           "spec": {"algorithm": "ppo", "suspend": False}}
    if job_status is not None:
        obj["status"] = job_status
    return obj


def operator_status(deployment: str = "", job_status: str = "", *, suspend: bool = False,
                    queue_name: str | None = None, generation: int = 1, **extra) -> dict:
    """The status the operator writes for a RayJob in this state (trainer fields added, as in a live job)."""
    ray_job = {"metadata": {"name": "ppo"}, "spec": {"suspend": suspend, "backoffLimit": 2},
               "status": {"jobDeploymentStatus": deployment, "jobStatus": job_status,
                          "rayClusterName": "ppo-raycluster-abc", **extra}}
    obs = status.observe(ray_job, suspend=False, queue_name=queue_name)
    written = {k: v for k, v in status.next_status({}, obs, T0, generation).items() if v is not None}
    return {**written, "progress": {"step": 10, "totalSteps": 100}, "metrics": {"reward": 0.5}}


WAITING = status.Observation("Waiting", "WaitingForJob", "waiting for its input jobs to succeed: RLHFJob sft is Running")

CASES = [
    # (id, status, health, message)
    ("Waiting", {k: v for k, v in status.next_status({}, WAITING, T0, 1).items() if v is not None}, "Progressing",
     "waiting for its input jobs to succeed: RLHFJob sft is Running"),
    ("Pending", operator_status(""), "Progressing",
     "RayJob ppo created; waiting for KubeRay to start the Ray cluster"),
    ("Provisioning", operator_status("Initializing"), "Progressing",
     "Starting Ray cluster ppo-raycluster-abc: waiting for its pods to be scheduled and ready"),
    ("Running", operator_status("Running", "RUNNING"), "Progressing", "Training on Ray cluster ppo-raycluster-abc"),
    ("Succeeded", operator_status("Complete", "SUCCEEDED"), "Healthy", "Training finished successfully"),
    ("Failed", operator_status("Failed", "FAILED", reason="AppFailed", message="exit code 1"), "Degraded",
     "Training failed: exit code 1"),
    ("Suspended-Queued", operator_status("Suspended", suspend=True, queue_name="team-a"), "Suspended",
     "Waiting for Kueue to admit the job from LocalQueue team-a"),
    ("Suspended", operator_status("Suspended", suspend=True), "Suspended",
     "Suspended (spec.suspend is true); set it to false to resume from the newest checkpoint"),
]


@pytest.mark.parametrize("job_status, want, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_phase(argocd_lua, tmp_path, job_status, want, message):
    assert health(argocd_lua, rlhf_job(job_status), tmp_path) == {"status": want, "message": message}


def test_queued_status_says_kueue(argocd_lua, tmp_path):
    """Queued without a message (e.g. an older operator) still says what it waits for."""
    queued = {"phase": "Suspended", "reason": "Queued", "observedGeneration": 1}
    assert health(argocd_lua, rlhf_job(queued), tmp_path) == {
        "status": "Suspended", "message": "Waiting for Kueue to admit the job"}


@pytest.mark.parametrize("job_status", [None, {}, {"progress": {"step": 3}}], ids=["none", "empty", "trainer-only"])
def test_no_status_waits_for_the_operator(argocd_lua, tmp_path, job_status):
    assert health(argocd_lua, rlhf_job(job_status), tmp_path) == {
        "status": "Progressing", "message": "Waiting for the operator to report the job's status"}


def test_stale_observed_generation(argocd_lua, tmp_path):
    """A spec edit (generation 2) the operator has not acted on yet: its Running is about generation 1."""
    stale = operator_status("Running", "RUNNING", generation=1)
    assert health(argocd_lua, rlhf_job(stale, generation=2), tmp_path) == {
        "status": "Progressing", "message": "Waiting for the operator to observe generation 2"}
    current = operator_status("Running", "RUNNING", generation=2)
    assert health(argocd_lua, rlhf_job(current, generation=2), tmp_path)["status"] == "Progressing"
    suspended = operator_status("Suspended", suspend=True, queue_name="q", generation=1)
    assert health(argocd_lua, rlhf_job(suspended, generation=3), tmp_path)["status"] == "Progressing"


@pytest.mark.parametrize("phase, want", [("Succeeded", "Healthy"), ("Failed", "Degraded")])
def test_final_phases_ignore_later_generations(argocd_lua, tmp_path, phase, want):
    """The operator no longer writes a finished job's status, so its observedGeneration stays behind."""
    final = {"phase": phase, "reason": "x", "message": "done", "observedGeneration": 1}
    assert health(argocd_lua, rlhf_job(final, generation=4), tmp_path) == {"status": want, "message": "done"}


def test_unknown_phase(argocd_lua, tmp_path):
    odd = {"phase": "Exploding", "observedGeneration": 1}
    assert health(argocd_lua, rlhf_job(odd), tmp_path) == {
        "status": "Unknown", "message": "Unknown RLHFJob phase Exploding"}


def test_runner_rejects_invalid_status_like_argocd(argocd_lua, tmp_path):
    """The runner is Argo CD-strict: an invalid code is Unknown, a script error fails."""
    bad = tmp_path / "bad.lua"
    bad.write_text('hs = {}\nhs.status = "Fine"\nreturn hs\n')
    assert health(argocd_lua, rlhf_job(), tmp_path, bad) == {
        "status": "Unknown", "message": "Lua returned an invalid health status"}
    strlib = tmp_path / "strlib.lua"  # the string library is closed unless useOpenLibs
    strlib.write_text('hs = {}\nhs.status = string.upper("healthy")\nreturn hs\n')
    (tmp_path / "obj.json").write_text(json.dumps(rlhf_job()))
    result = subprocess.run([str(argocd_lua), str(strlib), str(tmp_path / "obj.json")], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode != 0 and "string" in result.stderr


def test_open_libs_give_the_same_answers(argocd_lua, tmp_path):
    """Also right with resource.customizations.useOpenLibs (as built-in scripts run)."""
    for _, job_status, want, message in CASES:
        assert health(argocd_lua, rlhf_job(job_status), tmp_path, SCRIPT, "-open-libs") == {
            "status": want, "message": message}


def test_argocd_cm_carries_the_script():
    cm = yaml.safe_load((ARGOCD / "argocd-cm.yaml").read_text())
    assert (cm["kind"], cm["metadata"]["name"]) == ("ConfigMap", "argocd-cm")
    assert cm["data"][CM_KEY] == SCRIPT.read_text()


def test_application_points_at_the_examples():
    app = yaml.safe_load((ARGOCD / "application.yaml").read_text())
    assert app["kind"] == "Application" and app["apiVersion"] == "argoproj.io/v1alpha1"
    path = app["spec"]["source"]["path"]
    assert (ROOT / path).is_dir() and path == "manifests/examples"


def test_the_pipeline_application_syncs_every_stage_of_the_example():
    app = yaml.safe_load((ARGOCD / "pipeline-application.yaml").read_text())
    source = app["spec"]["source"]
    assert app["kind"] == "Application" and source["path"] == "manifests/examples/pipeline"
    stages = sorted((ROOT / source["path"]).glob("*.yaml"))
    assert len(stages) == 4 and "directory" not in source  # every file of the directory, as Argo CD reads it
