"""The trainer's status reporter on a real API server: throttled, merge-patched, never fatal."""

from __future__ import annotations

import pytest
from kubernetes import client

from e2e.controlplane import free_ports
from e2e.operator.jobs import create_job, get_job, rlhf_job
from rlhf_operator.kube import Kube
from rlhf_trainer.backoff import Backoff
from rlhf_trainer.kube_status import KubernetesStatusReporter


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def job(control_plane, namespace):
    kube = Kube(control_plane.api_client())
    create_job(kube, namespace, rlhf_job("reported"))
    # What the operator owns; the reporter must leave it as it is.
    kube.patch("RLHFJob", namespace, "reported", {"status": {"phase": "Running", "reason": "Training"}},
               subresource="status")
    yield kube
    kube.api_client.close()


def test_progress_and_metrics_are_throttled_and_leave_the_operators_fields(job, control_plane, namespace):
    clock = Clock()
    api_client = control_plane.api_client()
    reporter = KubernetesStatusReporter("reported", namespace, client.CustomObjectsApi(api_client),
                                        min_interval=5.0, clock=clock)
    reporter.start(total_steps=10)
    assert reporter.wait(30)  # the sender thread has delivered it
    status = get_job(job, namespace, "reported")["status"]
    assert status["progress"]["summary"] == "0/10" and status["phase"] == "Running"

    clock.now += 6
    reporter.log(1, {"reward_mean": 0.1, "kl": 0.01, "not_a_status_field": 3.0})
    clock.now += 1
    reporter.log(2, {"reward_mean": 0.2, "kl": 0.02})  # within 5 s of the last write: held back
    assert reporter.wait(30)
    status = get_job(job, namespace, "reported")["status"]
    assert status["progress"]["step"] == 1 and status["metrics"] == {"rewardMean": 0.1, "kl": 0.01}

    clock.now += 10
    reporter.log(5, {"reward_mean": 0.5, "kl": 0.05})
    reporter.checkpoint(5, "/checkpoints/step-5")  # written at once
    assert reporter.wait(30)
    status = get_job(job, namespace, "reported")["status"]
    assert status["progress"]["step"] == 5 and status["progress"]["percent"] == 50.0
    assert status["progress"]["etaSeconds"] >= 0
    assert status["metrics"]["rewardMean"] == 0.5
    assert status["lastCheckpoint"]["step"] == 5 and status["lastCheckpoint"]["path"] == "/checkpoints/step-5"
    assert (status["phase"], status["reason"]) == ("Running", "Training")

    clock.now += 1
    reporter.log(6, {"reward_mean": 0.6})
    reporter.finish("succeeded")  # the final numbers are written whatever the throttle says
    progress = get_job(job, namespace, "reported")["status"]["progress"]
    assert progress["step"] == 6 and progress["result"] == "Succeeded"  # the operator's evidence of the end
    reporter.start(total_steps=10)  # a retried attempt starts without the previous one's result
    assert reporter.wait(30)
    assert "result" not in get_job(job, namespace, "reported")["status"]["progress"]
    reporter.close()
    api_client.close()


def test_an_interrupted_run_reports_its_last_step_and_no_result(job, control_plane, namespace):
    """SIGTERM (rlhf run's exit 143): no progress.result, which would make the operator record the run as
    ended once its RayJob is gone; the job is to be rerun and resume."""
    api_client = control_plane.api_client()
    reporter = KubernetesStatusReporter("reported", namespace, client.CustomObjectsApi(api_client))
    reporter.start(total_steps=10)
    reporter.log(3, {"reward_mean": 0.3})
    reporter.finish("interrupted", "stopped after step 3 of 10")
    progress = get_job(job, namespace, "reported")["status"]["progress"]
    assert progress["step"] == 3 and "result" not in progress
    reporter.close()
    api_client.close()


def test_an_unreachable_api_server_never_stops_training(namespace):
    (closed_port,) = free_ports(1)
    configuration = client.Configuration()
    configuration.host = f"https://127.0.0.1:{closed_port}"
    configuration.verify_ssl = False
    configuration.retries = 0
    reporter = KubernetesStatusReporter("reported", namespace, client.CustomObjectsApi(client.ApiClient(configuration)),
                                        backoff=Backoff(base=0.01, cap=0.05))
    reporter.start(total_steps=3)  # no exception: reporting is best effort
    reporter.log(1, {"reward_mean": 0.1})
    assert not reporter.wait(timeout=0.5)  # still pending, retried in the background
    reporter.close()
