"""Processes of a run killed mid-step, and a kill in the middle of a checkpoint save: `rlhf run`
fails saying so, and running it again resumes from the newest complete checkpoint, losing at most
one checkpoint interval. One toy run, broken three ways in turn:

1. a model worker (a DeepSpeed process) SIGKILLed once a checkpoint exists;
2. the driver ended while it saves the next one (checkpoint.CRASH_IN_SAVE_ENV): that one is
   incomplete, the one before stays usable;
3. the vLLM engine SIGKILLed a step after the resume;
then a last run resumes from the newest complete checkpoint and finishes: at the data position that
checkpoint saved, with its trained weights, keeping the newest checkpoint.keep.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rlhf_trainer import checkpoint
from run_probes import finish, metrics_logged, newest, ray_actor_pids, start, steps_logged

pytestmark = pytest.mark.timeout(900)

STEPS, INTERVAL, BATCHES_PER_EPOCH = 8, 3, 16  # the toy job: 256 prompts, 16 per rollout


def wait(run: subprocess.Popen, log: Path, condition, what: str, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert run.poll() is None, f"the run ended before {what}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout}s:\n{log.read_text()[-4000:]}"
        time.sleep(0.2)


def test_killed_workers_and_an_interrupted_save_cost_at_most_one_interval(toy_job, tmp_path):
    job = toy_job(**{"training.maxSteps": STEPS, "checkpoint.intervalSteps": INTERVAL, "checkpoint.keep": 2})
    out = tmp_path / "out"
    checkpoints = out / "checkpoints"

    # 1. A model worker dies after the step-3 checkpoint.
    log = tmp_path / "1.log"
    run = start(job, out, log)
    wait(run, log, lambda: newest(checkpoints) is not None, "the first checkpoint")
    workers = ray_actor_pids(run, "ModelWorker")
    assert workers, "no ModelWorker process found"
    os.kill(workers[0], signal.SIGKILL)
    assert finish(run) == 1, log.read_text()[-4000:]
    saved = newest(checkpoints)
    assert saved in (3, 6) and max(steps_logged(out)) - saved < INTERVAL + 1
    said = log.read_text()
    assert "the run failed: ActorDiedError" in said, said[-4000:]
    assert f"its newest checkpoint is {checkpoint.step_dir(checkpoints, saved)}: running the job again" in said

    # 2. The driver ends in the middle of saving the next checkpoint: the one before stays usable.
    log = tmp_path / "2.log"
    interrupted = min(saved + INTERVAL, STEPS)
    run = start(job, out, log, **{checkpoint.CRASH_IN_SAVE_ENV: str(interrupted)})
    assert finish(run) == checkpoint.CRASH_EXIT_CODE, log.read_text()[-4000:]
    assert (checkpoint.step_dir(checkpoints, interrupted) / "actor").exists()  # the models were written ...
    assert not (checkpoint.step_dir(checkpoints, interrupted) / checkpoint.STATE_FILE).exists()  # ... the save not
    assert newest(checkpoints) == saved

    # 3. The vLLM engine dies mid-run, a step after the run resumed.
    log = tmp_path / "3.log"
    logged_before = len(steps_logged(out))
    run = start(job, out, log)
    wait(run, log, lambda: saved + 1 in steps_logged(out)[logged_before:], f"step {saved + 1}")
    engines = ray_actor_pids(run, "RolloutEngine")
    assert engines, "no RolloutEngine process found"
    os.kill(engines[0], signal.SIGKILL)
    assert finish(run) == 1, log.read_text()[-4000:]
    resumed_from = newest(checkpoints)
    assert resumed_from >= saved and max(steps_logged(out)) - resumed_from <= INTERVAL

    # The last run resumes from the newest complete checkpoint and finishes.
    log = tmp_path / "4.log"
    logged_before = len(steps_logged(out))
    run = start(job, out, log)
    assert finish(run, timeout=600) == 0, log.read_text()[-4000:]
    assert steps_logged(out)[logged_before:] == list(range(resumed_from + 1, STEPS + 1))
    assert newest(checkpoints) == STEPS
    metrics = metrics_logged(out)
    before, resumed = metrics[:logged_before], metrics[logged_before]
    # The next batch after the checkpoint's data position: the first epoch's batches it had consumed.
    assert resumed["epoch"] == pytest.approx((resumed_from + 1) / BATCHES_PER_EPOCH), resumed
    # The trained weights came back: the policy's entropy goes on from the checkpoint's step, not the untrained model's.
    at_checkpoint = [m for m in before if m["step"] == resumed_from][-1]["entropy"]
    untrained = before[0]["entropy"]
    assert abs(resumed["entropy"] - at_checkpoint) < abs(resumed["entropy"] - untrained), (resumed, at_checkpoint, untrained)
    # checkpoint.keep 2: the newest two complete ones (every INTERVAL steps and at the end), no incomplete one left.
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000006", "step-00000008"]
