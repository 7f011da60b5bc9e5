"""The API server, then etcd, restarted under a running operator and a reporting trainer.

While the component is down the trainer's status reporter (the real KubernetesStatusReporter, as
the trainer runs it) keeps taking updates without blocking; once /readyz answers again, the
newest state is in the RLHFJob's status within 30 s, and the operator reconciles a job created,
a job suspended and a RayJob that moved, each within 30 s. Each restart keeps etcd's data and
the ports, so the session's control plane is as before for the tests that follow.
"""

from __future__ import annotations

import time

import pytest
from kubernetes import client

from e2e.fixtures import wait_for
from e2e.operator.jobs import create_job, get_job, rlhf_job, wait_phase
from e2e.operator.kuberay import RayJobStatus
from rlhf_api import v1alpha1 as api
from rlhf_trainer.kube_status import KubernetesStatusReporter

RECOVERY_SECONDS = 30  # the bound, counted from /readyz


@pytest.fixture
def reporter(control_plane, kube, namespace):
    create_job(kube, namespace, rlhf_job("reported"))
    api_client = control_plane.api_client()
    reporter = KubernetesStatusReporter("reported", namespace, client.CustomObjectsApi(api_client), min_interval=0)
    yield reporter
    reporter.close()
    api_client.close()


@pytest.fixture(params=["kube-apiserver", "etcd"])
def component(request, control_plane):
    """The component the test restarts; started again after a failed test too (the session shares it)."""
    yield request.param
    if request.param not in control_plane.processes:
        control_plane.start_component(request.param)


def test_operator_and_status_reporter_recover_after_a_restart(control_plane, kube, namespace, operator,
                                                              kuberay_paused, reporter, component):
    operator.start()
    create_job(kube, namespace, rlhf_job("before"))
    create_job(kube, namespace, rlhf_job("moving"))
    wait_phase(kube, namespace, "before", "Pending", "RayJobCreated")
    wait_phase(kube, namespace, "moving", "Pending", "RayJobCreated")
    reporter.start(total_steps=10)
    assert reporter.wait(30)

    stopped_at = time.monotonic()
    control_plane.stop_component(component)
    # Training goes on while the control plane is away: every call hands over and returns.
    for step in range(1, 8):
        reporter.log(step, {"reward_mean": step / 10, "kl": step / 100})
    reporter.checkpoint(5, "/checkpoints/step-5")
    assert not reporter.wait(timeout=1), "an update was delivered while the control plane was down"
    control_plane.start_component(component)
    ready_at = time.monotonic()

    # The operator: a new job, a changed job and a RayJob status change, all after /readyz.
    create_job(kube, namespace, rlhf_job("after"))
    kube.patch(api.KIND, namespace, "before", {"spec": {"suspend": True}})
    RayJobStatus(kube, namespace, "moving").initializing()
    wait_phase(kube, namespace, "after", "Pending", "RayJobCreated", timeout=RECOVERY_SECONDS)
    wait_for(lambda: kube.get("RayJob", namespace, "before")["spec"]["suspend"] is True, RECOVERY_SECONDS,
             "the suspend of job before to reach its RayJob")
    wait_phase(kube, namespace, "before", "Suspended", "Suspending", timeout=RECOVERY_SECONDS)
    wait_phase(kube, namespace, "moving", "Provisioning", "StartingRayCluster", timeout=RECOVERY_SECONDS)
    operator_recovered = time.monotonic() - ready_at

    # The reporter: the newest of everything handed over while down, nothing lost.
    assert reporter.wait(RECOVERY_SECONDS), f"status updates still undelivered {RECOVERY_SECONDS}s after /readyz"
    reporter_recovered = time.monotonic() - ready_at
    status = get_job(kube, namespace, "reported")["status"]
    assert status["progress"]["step"] == 7 and status["progress"]["summary"] == "7/10"
    assert status["metrics"] == {"rewardMean": 0.7, "kl": 0.07}
    assert status["lastCheckpoint"]["step"] == 5 and status["lastCheckpoint"]["path"] == "/checkpoints/step-5"
    assert operator.proc.poll() is None, "the operator exited during the restart"
    assert control_plane.healthy()
    print(f"\n{component} restart: down {ready_at - stopped_at:.1f}s; after /readyz the "
          f"operator reconciled in {operator_recovered:.1f}s, the reporter delivered in {reporter_recovered:.1f}s")
