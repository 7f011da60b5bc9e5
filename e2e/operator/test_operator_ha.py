"""Two operator replicas with leader election (rlhf_operator/leader.py) on the real API server.

Only the Lease holder reconciles; when it is SIGKILLed mid-lifecycle the standby takes over once
the Lease has run out, finishes every job with exactly one set of children, and the old leader
reconciled nothing after its death while the standby reconciled nothing before it. A leader whose
Lease is taken stops with LOST_LEASE_EXIT_CODE; a leader stopped with SIGTERM hands over.
Timings are short (lease 4 s, renew deadline 3 s, retry 0.5 s) so the test does not wait 15 s.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from e2e.fixtures import wait_for
from e2e.operator.conftest import OperatorProcess
from e2e.operator.jobs import children, create_job, rlhf_job, wait_phase
from e2e.operator.kuberay import RayJobStatus
from e2e.operator.test_operator_crash import assert_one_of_each
from rlhf_operator.runner import LOST_LEASE_EXIT_CODE

LEASE = "rlhf-operator-ha"
HANDLER_RUN = re.compile(r"Handler '\w+' (succeeded|failed)")


def election(namespace: str) -> list[str]:
    return ["--leader-elect", "--leader-elect-resource-namespace", namespace, "--leader-elect-resource-name", LEASE,
            "--leader-elect-lease-duration", "4", "--leader-elect-renew-deadline", "3",
            "--leader-elect-retry-period", "0.5"]


def leads(operator: OperatorProcess) -> bool:
    return "rlhf_operator_leader 1.0" in operator.metrics()


def handler_runs(operator: OperatorProcess) -> int:
    return len(HANDLER_RUN.findall(operator.log.read_text()))


def lease(kube, namespace: str) -> dict:
    found = kube.get("Lease", namespace, LEASE)
    assert found is not None, "no Lease"
    return found["spec"]


@pytest.fixture
def standby(control_plane, namespace, tmp_path: Path):
    process = OperatorProcess(control_plane, namespace, tmp_path / "standby")
    process.log_dir.mkdir()
    yield process
    process.stop()


def test_standby_takes_over_when_the_leader_dies_mid_lifecycle(kube, namespace, operator, standby, kuberay_paused):
    operator.start(*election(namespace))
    wait_for(lambda: leads(operator), 30, "the first replica to lead")
    standby.start(*election(namespace))
    first_holder = lease(kube, namespace)["holderIdentity"]

    uids = {f"ha-{i}": create_job(kube, namespace, rlhf_job(f"ha-{i}"))["metadata"]["uid"] for i in range(6)}
    wait_for(lambda: any(children(kube, namespace, name)["ConfigMap"] for name in uids), 30, "the first ConfigMap")
    operator.kill()  # mid-reconcile, wherever each job happens to be
    assert not leads(standby) and handler_runs(standby) == 0  # a standby never reconciles
    runs_of_the_dead = handler_runs(operator)
    assert runs_of_the_dead > 0

    wait_for(lambda: leads(standby), 30, "the standby to take the Lease over")
    spec = lease(kube, namespace)
    assert spec["holderIdentity"] != first_holder and spec["leaseTransitions"] >= 1
    for name, uid in uids.items():
        wait_phase(kube, namespace, name, "Pending", "RayJobCreated")
        assert_one_of_each(kube, namespace, name, uid)
    RayJobStatus(kube, namespace, "ha-0").initializing()  # the lifecycle goes on under the new leader
    wait_phase(kube, namespace, "ha-0", "Provisioning")
    assert_one_of_each(kube, namespace, "ha-0", uids["ha-0"])
    assert handler_runs(operator) == runs_of_the_dead and handler_runs(standby) > 0


def test_a_leader_whose_lease_is_taken_stops_reconciling(kube, namespace, operator, kuberay_paused):
    operator.start(*election(namespace))
    wait_for(lambda: leads(operator), 30, "the replica to lead")
    current = kube.get("Lease", namespace, LEASE)
    # Another candidate that believes the Lease expired wins the conditional write.
    kube.patch("Lease", namespace, LEASE, {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
                                           "spec": {"holderIdentity": "intruder", "leaseDurationSeconds": 60}})
    assert operator.wait_exit(30) == LOST_LEASE_EXIT_CODE
    create_job(kube, namespace, rlhf_job("after-loss"))
    assert "lost Lease" in operator.log.read_text()
    assert not any(children(kube, namespace, "after-loss").values())


def test_sigterm_hands_the_lease_over(kube, namespace, operator, standby, kuberay_paused):
    operator.start(*election(namespace))
    wait_for(lambda: leads(operator), 30, "the first replica to lead")
    standby.start(*election(namespace))
    leader = lease(kube, namespace)["holderIdentity"]
    operator.stop()
    assert operator.proc.returncode == 0 and f"{leader} released" in operator.log.read_text()
    assert lease(kube, namespace).get("holderIdentity") != leader  # released, not left to run out
    wait_for(lambda: leads(standby), 30, "the standby to lead")
    uid = create_job(kube, namespace, rlhf_job("handed-over"))["metadata"]["uid"]
    wait_phase(kube, namespace, "handed-over", "Pending", "RayJobCreated")
    assert_one_of_each(kube, namespace, "handed-over", uid)
