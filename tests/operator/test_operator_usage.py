"""usage.py's arithmetic: a pod's requests as the scheduler counts them, when a pod stops holding them,
and the totals from the records (the end-to-end figures are checked in e2e/operator/test_usage.py)."""

from __future__ import annotations

from rlhf_operator import usage


def container(gpus: str = "0", cpu: str = "0", **extra) -> dict:
    return {"resources": {"requests": {"nvidia.com/gpu": gpus, "cpu": cpu}}, **extra}


def test_a_pods_request_is_the_schedulers():
    spec = {"containers": [container("2", "1"), container("1", "500m")],
            "initContainers": [container("4", "2"), container("0", "250m", restartPolicy="Always")],
            "overhead": {"cpu": "100m"}}
    # GPUs: the init container's 4 beat the 3 the containers ask; CPU: containers plus the sidecar
    # (1.75) beat the init container (2, started before the sidecar), plus the overhead.
    assert usage.pod_request(spec, "nvidia.com/gpu") == 4
    assert usage.pod_request(spec, "cpu") == 2.1
    assert usage.pod_request({"containers": [container(cpu="1")], "resources": {"requests": {"cpu": "3"}}}, "cpu") == 3


def pod(deletion: str | None = None, finished: list[str | None] | None = None) -> dict:
    statuses = [{"state": {"terminated": {"finishedAt": f}} if f else {"running": {}}} for f in finished or [None]]
    return {"metadata": {"name": "p", **({"deletionTimestamp": deletion} if deletion else {})},
            "spec": {"containers": [container("2", "1")]},
            "status": {"startTime": "2026-11-24T10:00:00Z", "containerStatuses": statuses}}


NOW = "2026-11-24T10:10:00Z"


def test_a_pod_ends_when_its_containers_finished_or_its_deletion_came():
    assert usage.observe(pod(), "nvidia.com/gpu", NOW) == {
        "name": "p", "gpus": 2, "cpus": 1.0, "startTime": "2026-11-24T10:00:00Z"}
    # A graceful deletion's timestamp lies ahead (now + grace period): no end until it has come.
    assert "endTime" not in usage.observe(pod("2026-11-24T10:10:30Z"), "nvidia.com/gpu", NOW)
    assert usage.observe(pod("2026-11-24T10:09:00Z"), "nvidia.com/gpu", NOW)["endTime"] == "2026-11-24T10:09:00Z"
    assert usage.observe(pod("2026-11-24T10:10:30Z"), "nvidia.com/gpu", NOW, deleted=True)["endTime"] == NOW
    ended = pod("2026-11-24T10:09:00Z", ["2026-11-24T10:05:00Z", "2026-11-24T10:06:00Z"])
    assert usage.observe(ended, "nvidia.com/gpu", NOW)["endTime"] == "2026-11-24T10:06:00Z"
    assert usage.observe({"metadata": {"name": "p"}, "spec": {}, "status": {}}, "nvidia.com/gpu", NOW) is None


def test_totals_count_records_once_and_close_vanished_pods_at_the_last_count():
    head = {"name": "h", "gpus": 0, "cpus": 1.0, "startTime": "2026-11-24T10:00:00Z"}
    worker = {"name": "w", "gpus": 2, "cpus": 4.0, "startTime": "2026-11-24T10:00:00Z"}
    attempts = usage.with_pod(usage.with_pod([], "c1", head), "c1", worker)
    again = usage.with_pod(attempts, "c1", {**worker, "endTime": "2026-11-24T10:01:00Z"})
    assert usage.with_pod(again, "c1", {**worker, "endTime": "2026-11-24T10:02:00Z"}) == again  # closed stays
    closed = usage.without_vanished(again, existing=set(), until="2026-11-24T10:03:00Z")
    total = usage.totals(closed, NOW)
    assert (total["gpuSeconds"], total["cpuSeconds"], total["estimatedCost"]) == (120, 180 + 240, None)
    assert usage.totals(again, NOW)["cpuSeconds"] == 600 + 240  # the head runs: counted up to now
