"""Per-job series of the operator: each RLHFJob's phase and reason, and since when it is in that
phase (what the stuck-job alerts of the chart's PrometheusRule measure)."""

from __future__ import annotations

from datetime import datetime

from rlhf_operator import metrics


def series(jobs: metrics.JobsByPhase, name: str) -> dict[tuple, float]:
    family = next(f for f in jobs.collect() if f.name == name)
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples}


def labels(job: str, **extra: str) -> tuple:
    return tuple(sorted({"rlhf_job": job, "rlhf_namespace": "ml", **extra}.items()))


def condition(kind: str, status: str, at: str) -> dict:
    return {"type": kind, "status": status, "reason": "R", "message": "m", "lastTransitionTime": at}


def test_each_job_reports_its_phase_and_reason_under_the_trainer_s_job_labels():
    jobs = metrics.JobsByPhase()
    jobs.seen("u1", "ml", "ppo", {})
    jobs.seen("u2", "ml", "grpo", {"phase": "Suspended", "reason": "Queued"})
    assert series(jobs, metrics.JOB_PHASE) == {
        labels("ppo", phase="Pending", reason=""): 1,  # not reconciled yet
        labels("grpo", phase="Suspended", reason="Queued"): 1,
    }
    jobs.gone("u2")
    assert list(series(jobs, metrics.JOB_PHASE)) == [labels("ppo", phase="Pending", reason="")]
    assert list(series(jobs, metrics.JOB_PHASE_ENTERED)) == [labels("ppo", phase="Pending")]


def test_a_phase_with_a_condition_of_its_own_was_entered_at_its_transition_time():
    jobs = metrics.JobsByPhase()
    at = "2026-11-22T10:00:00Z"
    jobs.seen("u1", "ml", "ppo", {"phase": "Running", "reason": "Training", "conditions": [
        condition("Ready", "True", "2026-11-22T09:00:00Z"), condition("Running", "True", at),
        condition("Suspended", "False", "2026-11-22T08:00:00Z")]})
    assert series(jobs, metrics.JOB_PHASE_ENTERED) == {
        labels("ppo", phase="Running"): datetime.fromisoformat(at).timestamp()}


def test_the_entered_time_stays_while_the_reason_changes_and_moves_with_the_phase():
    jobs = metrics.JobsByPhase()
    jobs.seen("u1", "ml", "ppo", {"phase": "Provisioning", "reason": "StartingRayCluster"})
    [entered] = series(jobs, metrics.JOB_PHASE_ENTERED).values()
    # A pod problem replaces the reason: still the same stretch of Provisioning.
    jobs.seen("u1", "ml", "ppo", {"phase": "Provisioning", "reason": "Unschedulable"})
    assert series(jobs, metrics.JOB_PHASE_ENTERED) == {labels("ppo", phase="Provisioning"): entered}
    assert series(jobs, metrics.JOB_PHASE) == {labels("ppo", phase="Provisioning", reason="Unschedulable"): 1}
    at = "2026-11-22T11:30:00Z"
    jobs.seen("u1", "ml", "ppo", {"phase": "Failed", "reason": "AppFailed", "conditions": [condition("Failed", "True", at)]})
    assert series(jobs, metrics.JOB_PHASE_ENTERED) == {labels("ppo", phase="Failed"): datetime.fromisoformat(at).timestamp()}
    assert series(jobs, "rlhf_operator_jobs")[(("phase", "Failed"),)] == 1
