"""training.referenceRefresh (TR-DPO's reference updates) on the tiny GRPO job, with the KL penalty in the loss
and one optimizer step per rollout, so that every step's KL is between the policy of the step before and the
reference: refreshed after every step it is that policy (KL 0), half-refreshed it lags behind, never refreshed
it is the initial model. A run resumed from a checkpoint goes on with the refreshed reference it saved."""

from __future__ import annotations

import json

import pytest

from rlhf_trainer.reporting import JsonlWriter
from rlhf_trainer.run import run

pytestmark = pytest.mark.timeout(900)

STEPS = 4
# k3 of two identical models' log-probs: zero up to the float32 noise of two batchings (~1e-14).
SAME_MODEL_KL = 1e-6


def _kl_per_step(toy_job, out, **overrides) -> list[tuple[int, float]]:
    """(step, kl) of every line of the run's metrics file (appended to by a resumed run)."""
    job = toy_job(**{"training.maxSteps": STEPS, "training.trainBatchSize": 128, "checkpoint.exportHf": False,
                     "checkpoint.intervalSteps": 0,
                     "training.kl": {"coef": 0.001, "estimator": "k3", "placement": "loss"}, **overrides})
    metrics_file = out / "metrics.jsonl"
    assert run(job, output_dir=out, reporters=[JsonlWriter(metrics_file)]) == 0
    return [(m["step"], m["kl"]) for m in map(json.loads, metrics_file.read_text().splitlines())]


def test_the_reference_follows_the_policy_by_its_mixup_alpha_and_resumes_refreshed(toy_job, local_ray, tmp_path, capsys):
    never, half, every = ([kl for _, kl in _kl_per_step(toy_job, tmp_path / name, **refresh)] for name, refresh in (
        ("never", {}),
        ("half", {"training.referenceRefresh": {"intervalSteps": 1, "mixupAlpha": 0.5}}),
        ("every", {"training.referenceRefresh": {"intervalSteps": 1}, "checkpoint.intervalSteps": 2})))
    # The same job run on to 2 more steps resumes from step 4's checkpoint: its reference is step 4's policy
    # (the initial model, had the checkpoint not kept the refreshed one: a KL like never's).
    resumed = _kl_per_step(toy_job, tmp_path / "every", **{
        "training.referenceRefresh": {"intervalSteps": 1}, "checkpoint.intervalSteps": 2,
        "training.maxSteps": STEPS + 2})
    with capsys.disabled():
        print(f"\nreference refresh: KL per step never {never}, alpha 0.5 {half}, every step {every}, "
              f"resumed {resumed}")
    assert never[0] < SAME_MODEL_KL  # step 1: the policy is still the initial model
    assert max(every) < SAME_MODEL_KL, every
    assert [step for step, _ in resumed] == list(range(1, STEPS + 3)), resumed  # resumed: steps 5 and 6 only
    assert max(kl for _, kl in resumed[STEPS:]) < SAME_MODEL_KL, resumed
    assert SAME_MODEL_KL < half[-1] < never[-1], (half, never)
