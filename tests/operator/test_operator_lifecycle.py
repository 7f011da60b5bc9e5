"""Suspend, deadlines and TTL as the RayJob and the TTL daemon see them."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from operator_jobs import as_job, tiny

from rlhf_operator import lifecycle, render


def existing_ray_job(**spec_overrides):
    ray_job = render.ray_job(as_job(tiny()))
    ray_job["spec"].update(spec_overrides)
    return ray_job


def test_an_unchanged_job_needs_no_patch():
    job = as_job(tiny())
    assert lifecycle.ray_job_patch(job.spec, render.ray_job(job)) is None


def test_suspend_and_resume_flip_the_ray_job_flag():
    assert lifecycle.ray_job_patch(as_job(tiny(suspend=True)).spec, existing_ray_job()) == {"spec": {"suspend": True}}
    assert lifecycle.ray_job_patch(as_job(tiny()).spec, existing_ray_job(suspend=True)) == {"spec": {"suspend": False}}


@pytest.mark.parametrize("kueue_flag", [True, False])
@pytest.mark.parametrize("user_suspends", [True, False])
def test_kueue_alone_writes_the_flag_of_a_queued_job(kueue_flag: bool, user_suspends: bool):
    """Writing it back against Kueue's admission made KubeRay delete and recreate the cluster on every
    resync; a queued job is suspended through its Workload instead (kueue.active_patch)."""
    queued = existing_ray_job(suspend=kueue_flag)
    queued["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = "team-a"
    assert lifecycle.ray_job_patch(as_job(tiny(queueName="team-a", suspend=user_suspends)).spec, queued) is None


def test_changed_deadline_backoff_and_ttl_are_patched():
    spec = as_job(tiny(activeDeadlineSeconds=60, backoffLimit=3, ttlSecondsAfterFinished=10,
                       startupDeadlineSeconds=900, queueName="q")).spec
    ray_job = existing_ray_job(suspend=True)
    assert lifecycle.ray_job_patch(spec, ray_job) == {"spec": {
        "backoffLimit": 3, "activeDeadlineSeconds": 60, "preRunningDeadlineSeconds": 900, "ttlSecondsAfterFinished": 10,
    }}
    # Removing the deadline removes it from the RayJob (null in a merge patch).
    with_deadline = existing_ray_job(activeDeadlineSeconds=60)
    assert lifecycle.ray_job_patch(as_job(tiny()).spec, with_deadline) == {"spec": {"activeDeadlineSeconds": None}}


def test_suspending_a_job_that_keeps_its_cluster_restores_shutdown_in_the_same_patch():
    keeping = as_job(tiny(keepFailedCluster={"seconds": 60}))
    running = render.ray_job(keeping)
    del running["spec"]["shutdownAfterJobFinishes"]  # KubeRay writes a false boolean back as absent
    assert lifecycle.ray_job_patch(keeping.spec, running) is None
    assert lifecycle.ray_job_patch(as_job(tiny(keepFailedCluster={"seconds": 60}, suspend=True)).spec, running) == {
        "spec": {"shutdownAfterJobFinishes": True, "deletionStrategy": None, "suspend": True}}


def test_the_kept_cluster_and_its_deadline_are_read_from_the_matching_deletion_rule():
    ray_job = render.ray_job(as_job(tiny(keepFailedCluster={"seconds": 600})))
    ray_job["status"] = {"rayClusterName": "tiny-x", "jobDeploymentStatus": "Failed", "jobStatus": "FAILED",
                         "endTime": "2026-11-22T12:00:00Z"}
    assert lifecycle.kept_cluster(ray_job) == {"name": "tiny-x", "until": "2026-11-22T12:10:00Z"}
    forever = render.ray_job(as_job(tiny(keepFailedCluster={})))
    forever["status"] = ray_job["status"]
    assert lifecycle.kept_cluster(forever) == {"name": "tiny-x"}
    assert lifecycle.kept_cluster({**render.ray_job(as_job(tiny())), "status": ray_job["status"]}) is None


NOW = datetime(2026, 11, 22, 12, 0, 0, tzinfo=timezone.utc)


def finished_at(seconds_ago: int, phase: str = "Succeeded") -> dict:
    return {"phase": phase, "completionTime": lifecycle.timestamp(NOW - timedelta(seconds=seconds_ago))}


def test_ttl_counts_from_completion():
    spec = {"ttlSecondsAfterFinished": 100}
    assert lifecycle.seconds_until_expiry(spec, finished_at(30), NOW) == 70
    assert lifecycle.seconds_until_expiry(spec, finished_at(130, "Failed"), NOW) == -30


@pytest.mark.parametrize("spec, status", [
    ({}, finished_at(30)),  # no TTL: kept forever
    ({"ttlSecondsAfterFinished": 0}, {"phase": "Running"}),  # not finished
    ({"ttlSecondsAfterFinished": 0}, None),
])
def test_no_expiry_without_ttl_or_before_the_end(spec, status):
    assert lifecycle.seconds_until_expiry(spec, status, NOW) is None


def test_no_expiry_of_a_job_argo_cd_syncs():
    """Auto-sync would recreate a deleted job and run it again: Git decides when it goes."""
    spec, argocd = {"ttlSecondsAfterFinished": 0}, {lifecycle.ARGOCD_TRACKING: "ml:rlhf.dev/RLHFJob:team-a/ppo"}
    assert lifecycle.seconds_until_expiry(spec, finished_at(30), NOW, argocd) is None
    assert lifecycle.seconds_until_expiry(spec, finished_at(30), NOW, {"other": "x"}) == -30


def started(seconds_ago: int, phase: str = "Running") -> dict:
    return {"phase": phase, "startTime": lifecycle.timestamp(NOW - timedelta(seconds=seconds_ago))}


def test_the_deadline_counts_from_the_start_across_attempts():
    """KubeRay restarts its activeDeadlineSeconds with each retry; ours runs from status.startTime, which
    a retry keeps (status.next_status) and only a suspension clears."""
    spec = {"activeDeadlineSeconds": 100}
    assert lifecycle.seconds_until_deadline(spec, started(30), NOW) == 70
    assert lifecycle.seconds_until_deadline(spec, started(130, "Provisioning"), NOW) == -30
    assert lifecycle.seconds_until_deadline(spec, started(130, "Failed"), NOW) is None
    assert lifecycle.seconds_until_deadline({}, started(130), NOW) is None
    assert lifecycle.seconds_until_deadline(spec, {"phase": "Suspended"}, NOW) is None
