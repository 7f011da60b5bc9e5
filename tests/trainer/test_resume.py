"""A run killed after a checkpoint resumes at that step, at the same data position, with its weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(600)

STEPS, INTERVAL, BATCHES_PER_EPOCH = 8, 3, 16  # the toy job: 256 prompts, 16 per rollout


def _rlhf_run(job, out, **popen):
    command = [sys.executable, "-m", "rlhf_cli.cli", "run", str(job), "--output-dir", str(out)]
    return subprocess.Popen(command, env={**os.environ, "RAY_AUTH_MODE": "disabled"}, **popen)


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "checkpoints" / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_killed_run_resumes_at_its_checkpoint(toy_job, tmp_path):
    job = toy_job(**{"training.maxSteps": STEPS, "checkpoint.intervalSteps": INTERVAL, "checkpoint.keep": 2})
    out, checkpoints = tmp_path / "out", tmp_path / "out" / "checkpoints"
    log = (tmp_path / "first.log").open("w")
    # Its own session: the kill takes the whole process group, Ray's processes included.
    first = _rlhf_run(job, out, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not (checkpoints / "step-00000003" / "trainer_state.json").exists():
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
            time.sleep(0.2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    killed = _metrics(out)
    saved = json.loads(max(checkpoints.glob("step-*/trainer_state.json")).read_text())
    step = saved["step"]
    assert step in (3, 6) and len(killed) < STEPS
    assert saved["prompts"]["position"] == step  # batches of the first epoch consumed

    second = _rlhf_run(job, out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = second.communicate(timeout=540)
    assert second.returncode == 0, output[-4000:]
    resumed = _metrics(out)[len(killed):]

    assert [m["step"] for m in resumed] == list(range(step + 1, STEPS + 1))
    # The next batch after the checkpoint's data position, as the killed run saw it.
    assert resumed[0]["epoch"] == pytest.approx((step + 1) / BATCHES_PER_EPOCH)
    same_step = [m for m in killed if m["step"] == step + 1]
    if same_step:
        assert resumed[0]["epoch"] == same_step[0]["epoch"]
    # The trained weights came back: the policy's entropy continues from the checkpoint's, well
    # below the untrained model's.
    at_checkpoint = next(m for m in killed if m["step"] == step)["entropy"]
    untrained = killed[0]["entropy"]
    assert abs(resumed[0]["entropy"] - at_checkpoint) < abs(resumed[0]["entropy"] - untrained), (
        resumed[0]["entropy"], at_checkpoint, untrained)
    # The newest two checkpoints are kept: every INTERVAL steps and at the end.
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000006", "step-00000008"]
