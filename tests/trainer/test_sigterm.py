"""SIGTERM (a pod deleted, preempted by Kueue or suspended: the head pod's preStop hook sends it) mid-run:
`rlhf run` finishes the step under way, saves a checkpoint of it and exits 143 saying so; running the job
again resumes at the next step."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from e2e.fixtures import wait_for
from rlhf_api import contract
from rlhf_operator.render import STOP_DRIVER
from rlhf_trainer import checkpoint
from rlhf_trainer.run import EXIT_INTERRUPTED
from run_probes import finish, start, steps_logged

pytestmark = pytest.mark.timeout(600)

# Steps take about a second here: the signal lands long before the last step, even on a loaded machine.
STEPS, INTERVAL = 100, 2


def test_sigterm_saves_a_checkpoint_and_the_next_run_resumes_from_it(toy_job, tmp_path):
    job = toy_job(**{"training.episodes": 7, "training.maxSteps": STEPS, "checkpoint.intervalSteps": INTERVAL,
                     "checkpoint.keep": 2})
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
