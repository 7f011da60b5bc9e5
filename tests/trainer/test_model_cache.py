"""A model named by hub id is downloaded into HF_HOME once, and the next attempt (a retry, or the next job on the
model cache claim: resources.modelCache, which the operator mounts with HF_HOME pointing at it) reads it from there.

No hub is reachable here: a small HTTP server in the test plays one (HF_ENDPOINT), serving the tiny model with the
few endpoints huggingface_hub calls (file_download.py: HEAD and GET of /{repo}/resolve/{revision}/{file} answered
with X-Repo-Commit, ETag and Content-Length; hf_api.py: the repository's info and file tree), and counts the GETs of
each whole file. Each attempt is `rlhf run` of the tiny GRPO job with a model cache, in the environment the operator
gives its pods (HF_HOME at the cache's mount, which a directory of the test stands for): its driver (tokenizer),
actor rank (from_pretrained) and vLLM engine (snapshot_download) each load the actor by its hub id.
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
import subprocess
import sys
from urllib.parse import unquote, urlsplit

import pytest
import yaml
from local_http import LocalServer, QuietHandler, reply

from rlhf_api import contract
from rlhf_api.validation import validate
from rlhf_operator import render

pytestmark = pytest.mark.timeout(600)

REPO = "rlhf-test/tiny"
COMMIT = "c0ffee" * 6 + "c0ff"  # what the hub's X-Repo-Commit names: any 40 hex digits
WEIGHTS = "model.safetensors"


class Hub(QuietHandler):
    """One model repository at one commit. self.server.files: name -> bytes; self.server.downloads: the GETs of a
    whole file by name (a GET with a Range reads a part: vLLM reads a safetensors file's header so)."""

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        path, files = unquote(urlsplit(self.path).path), self.server.files
        if match := re.fullmatch(rf"/{REPO}/resolve/[^/]+/(.+)", path):
            self._file(match[1], body)
        elif match := re.fullmatch(rf"/api/models/{REPO}/tree/[^/]+/?(.*)", path):
            inside = [name for name in files if name.startswith(f"{match[1]}/" if match[1] else "")]
            if not inside:
                return reply(self, 404, "", {"X-Error-Code": "EntryNotFound"})
            reply(self, 200, [{"type": "file", "path": name, "size": len(files[name]),
                               "oid": hashlib.sha1(files[name]).hexdigest()} for name in inside])
        elif re.fullmatch(rf"/api/models/{REPO}(/revision/[^/]+)?", path):
            reply(self, 200, {"id": REPO, "sha": COMMIT, "siblings": [{"rfilename": name} for name in files]})
        else:
            reply(self, 404, "", {"X-Error-Code": "RepoNotFound"})

    def _file(self, name: str, body: bool) -> None:
        data = self.server.files.get(name)
        if data is None:
            return reply(self, 404, "", {"X-Error-Code": "EntryNotFound"})
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"'}
        status, part = 200, data
        if ranged := re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", "")):
            first, last = int(ranged[1]), min(int(ranged[2] or len(data) - 1), len(data) - 1)
            status, part = 206, data[first:last + 1]
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
        elif body:
            self.server.downloads[name] += 1
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(part))}.items():
            self.send_header(key, value)
        self.end_headers()
        if body:
            self.wfile.write(part)


def hf_home_on_pods(job_file) -> list[tuple[str | None, str | None]]:
    """(HF_HOME, the model cache's mount path) on the head and on the workers, as the operator renders the job."""
    manifest = yaml.safe_load(job_file.read_text())
    manifest["metadata"] |= {"namespace": "ml-team", "uid": "6b1c6c2e-0000-4000-8000-000000000001"}
    cluster = render.ray_job(validate(manifest))["spec"]["rayClusterSpec"]
    found = []
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        [container] = group["template"]["spec"]["containers"]
        home = {var["name"]: var.get("value") for var in container["env"]}.get("HF_HOME")
        mount = next((m["mountPath"] for m in container["volumeMounts"] if m["name"] == "model-cache"), None)
        found.append((home, mount))
    return found


def test_a_second_attempt_loads_the_model_from_the_cache_without_fetching_it(tiny_model, toy_job, tmp_path):
    hub = LocalServer(Hub)
    hub.server.files = {path.name: path.read_bytes() for path in tiny_model.iterdir() if path.is_file()}
    hub.server.downloads = collections.Counter()
    # One step, no reference (kl.coef 0) and no checkpoint but the export: the loading is what is measured.
    job = toy_job(**{"models.actor.path": REPO, "training.maxSteps": 1, "training.kl.coef": 0.0,
                     "checkpoint.intervalSteps": 0, "checkpoint.keep": 0, "resources.modelCache": {"pvc": "hf-cache"}})
    assert hf_home_on_pods(job) == [(contract.MODEL_CACHE_DIR, contract.MODEL_CACHE_DIR)] * 2
    claim = tmp_path / "model-cache"  # the claim's directory, which the pods see at the mount HF_HOME names
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HF_", "TRANSFORMERS_"))}
    env |= {"HF_HOME": str(claim), "HF_ENDPOINT": hub.url, "RAY_AUTH_MODE": "disabled"}
    fetched = []
    try:
        for attempt in (1, 2):
            done = subprocess.run([sys.executable, "-m", "rlhf_cli.cli", "run", str(job),
                                   "--output-dir", str(tmp_path / f"attempt-{attempt}")],
                                  env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            fetched.append(dict(hub.server.downloads))
            hub.server.downloads.clear()
    finally:
        hub.close()
    # The first attempt's three loaders fetched each file once between them: under the cache's file lock, one
    # downloads and the others find it there (what lets the pods of a job share a ReadWriteMany claim).
    assert WEIGHTS in fetched[0] and set(fetched[0].values()) == {1}, fetched[0]
    assert fetched[1] == {}, fetched[1]  # asked the hub what is current (HEAD), fetched nothing
    assert (claim / "hub" / "models--rlhf-test--tiny" / "refs" / "main").read_text() == COMMIT  # under HF_HOME
