"""SIGTERM mid-run: `rlhf run` finishes the step under way, saves a checkpoint of it and exits 143 saying so;
running the job again resumes at the next step, with the batch after the last one trained (the rollouts
generated ahead of training, paused mid-sample, are drawn again: none lost, none trained twice). In a RayJob the signal comes from the head pod's preStop
hook (the pods deleted: preempted by Kueue, suspended) or from `ray job stop` (KubeRay's, the RayJob
deleted): both are played here. The worker pods' `ray start` keeping their actors while it drains is
e2e/operator/test_multipod.py's (a suspended job on KubeRay's own pods)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from e2e.fixtures import wait_for
from e2e.pods import processes
from e2e.pods.head import ray_head_command
from rlhf_api import contract
from rlhf_operator.render import RAY_JOB_STOP_ENV, STOP_DRIVER
from rlhf_trainer import checkpoint
from rlhf_trainer.run import EXIT_INTERRUPTED
from run_probes import finish, start, steps_logged

pytestmark = pytest.mark.timeout(600)

# Steps take about a second here: the signal lands long before the last step, even on a loaded machine.
STEPS, INTERVAL, BATCHES_PER_EPOCH = 100, 2, 16  # the toy job: 256 prompts, 16 per rollout


def test_sigterm_saves_a_checkpoint_and_the_next_run_resumes_from_it(toy_job, tmp_path):
    # A rollout is always in flight when the signal lands: one runs ahead of training, taking each
    # update mid-sample (partial rollouts).
    job = toy_job(**{"training.episodes": 7, "training.maxSteps": STEPS, "checkpoint.intervalSteps": INTERVAL,
                     "checkpoint.keep": 2, "training.asyncQueueSize": 1, "rollout.partial": True})
    out, first_log = tmp_path / "out", tmp_path / "first.log"
    checkpoints = out / "checkpoints"
    pid_file = {contract.DRIVER_PID_FILE_ENV: str(tmp_path / "driver.pid")}
    first = start(job, out, first_log, **pid_file)

    def past_a_checkpoint() -> bool:
        assert first.poll() is None, first_log.read_text()[-4000:]
        return any(step > INTERVAL for step in steps_logged(out))

    wait_for(past_a_checkpoint, 400, "a step past the first checkpoint interval")
    # The hook, as the kubelet runs it in the head container; it returns once the driver is gone (reaped:
    # here by finish, in the pod by Ray's job supervisor).
    hook = subprocess.Popen(["/bin/sh", "-c", STOP_DRIVER], env={**os.environ, **pid_file})
    code = finish(first, 240)
    assert hook.wait(30) == 0
    said = first_log.read_text()
    assert code == EXIT_INTERRUPTED, said[-4000:]

    reached = max(steps_logged(out))
    assert reached < STEPS, "the run ended before the signal"
    assert checkpoint.latest(checkpoints) == checkpoint.step_dir(checkpoints, reached), said[-4000:]
    assert f"SIGTERM: finishing step {reached}" in said, said[-4000:]
    assert f"the run was interrupted: stopped after step {reached} of {STEPS}" in said, said[-4000:]

    # The second run resumes there; a few steps of it show that (SIGTERM again ends it, as tested above).
    second_log = tmp_path / "second.log"
    second = start(job, out, second_log)

    def resumed() -> bool:
        assert second.poll() is None, second_log.read_text()[-4000:]
        return max(steps_logged(out)) > reached

    wait_for(resumed, 400, "the resumed run's first step")
    second.send_signal(signal.SIGTERM)  # the driver alone, as `rlhf run` in a terminal may get it
    assert finish(second, 240) == EXIT_INTERRUPTED, second_log.read_text()[-4000:]
    assert f"resumed from {checkpoint.step_dir(checkpoints, reached)} at step {reached}" in second_log.read_text()
    logged = steps_logged(out)
    assert logged[logged.index(reached) + 1] == reached + 1
    metrics = [json.loads(line) for line in (checkpoints / "logs" / "metrics.jsonl").read_text().splitlines()]
    resumed_step = metrics[logged.index(reached) + 1]
    assert resumed_step["epoch"] == pytest.approx((reached + 1) / BATCHES_PER_EPOCH), resumed_step


def test_ray_job_stop_lets_the_driver_save_its_checkpoint(toy_job, tmp_path):
    """`ray job stop`, as KubeRay sends it when a running RayJob is deleted: Ray's job supervisor signals the
    driver and waits as long as the head pod's RAY_JOB_STOP_WAIT_TIME_S says before it kills it."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    job = toy_job(**{"training.episodes": 7, "training.maxSteps": STEPS, "checkpoint.intervalSteps": INTERVAL})
    out = tmp_path / "out"
    checkpoints = out / "checkpoints"
    temp_dir = tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp")  # short: Ray's socket paths
    bystander = hold_ports(8265, 52365)  # another head on this machine: its agent never registers on a taken port
    command, dashboard_port = ray_head_command(3, Path(temp_dir))
    env = {**os.environ, RAY_JOB_STOP_ENV["name"]: RAY_JOB_STOP_ENV["value"],  # the head's, inherited by the supervisor
           "RAY_AUTH_MODE": "disabled", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    with (tmp_path / "head.log").open("wb") as log:
        head = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        entrypoint = f"{sys.executable} -m rlhf_cli.cli run {job} --output-dir {out}"

        def submitted() -> tuple[JobSubmissionClient, str] | None:
            assert head.poll() is None, (tmp_path / "head.log").read_text()[-4000:]
            try:
                client = JobSubmissionClient(f"http://127.0.0.1:{dashboard_port}")
                return client, client.submit_job(entrypoint=entrypoint)
            except ConnectionError:  # the dashboard is not up yet
                return None
            except RuntimeError as error:  # the head's job agent registers after its dashboard
                if "No available agent" not in str(error):
                    raise
                return None

        client, submission = wait_for(submitted, 300, "the head's job agent to accept the submission")

        def past_a_checkpoint() -> bool:
            assert not client.get_job_status(submission).is_terminal(), client.get_job_logs(submission)[-4000:]
            return any(step > INTERVAL for step in steps_logged(out))

        wait_for(past_a_checkpoint, 400, "a step past the first checkpoint interval")
        client.stop_job(submission)
        wait_for(lambda: client.get_job_status(submission).is_terminal(), 240, "the job to stop")
        assert client.get_job_status(submission) == JobStatus.STOPPED
        said = client.get_job_logs(submission)
    finally:
        processes.stop(head, grace=30)
        bystander.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
    reached = max(steps_logged(out))
    assert f"the run was interrupted: stopped after step {reached} of {STEPS}" in said, said[-4000:]
    assert checkpoint.latest(checkpoints) == checkpoint.step_dir(checkpoints, reached)


def hold_ports(*ports: int) -> contextlib.ExitStack:
    """Listen on each port that is free (one already taken is held by someone else: as good)."""
    held = contextlib.ExitStack()
    for port in ports:
        sock = held.enter_context(socket.socket())
        with contextlib.suppress(OSError):
            sock.bind(("0.0.0.0", port))
            sock.listen()
    return held
