"""Kill the operator mid-reconcile; the restarted operator must converge, with no duplicates.

The crash points come from the RLHF_OPERATOR_CRASH_AFTER seam (rlhf_operator/reconcile.py): the
process ends abruptly right after the named step, as if SIGKILLed there.
"""

from __future__ import annotations

import pytest

from e2e.fixtures import wait_for
from e2e.operator.jobs import children, create_job, rlhf_job, wait_phase
from e2e.operator.kuberay import RayJobStatus
from rlhf_operator.reconcile import CRASH_ENV, CRASH_EXIT_CODE

KINDS = ("ConfigMap", "ServiceAccount", "Role", "RoleBinding", "RayJob")


def assert_one_of_each(kube, namespace: str, name: str, uid: str) -> None:
    found = children(kube, namespace, name)
    assert {kind: len(objs) for kind, objs in found.items()} == dict.fromkeys(KINDS, 1)
    for objs in found.values():
        assert [ref["uid"] for ref in objs[0]["metadata"]["ownerReferences"]] == [uid]


@pytest.mark.parametrize("step", ["ConfigMap", "RoleBinding", "RayJob", "status"])
def test_restart_after_a_crash_converges(kube, namespace, operator, kuberay_paused, step):
    operator.start(**{CRASH_ENV: step})
    uid = create_job(kube, namespace, rlhf_job("crashy"))["metadata"]["uid"]
    assert operator.wait_exit() == CRASH_EXIT_CODE

    made = {kind for kind, objs in children(kube, namespace, "crashy").items() if objs}
    assert made == set(KINDS[:KINDS.index(step) + 1] if step in KINDS else KINDS)

    operator.start()
    wait_phase(kube, namespace, "crashy", "Pending", "RayJobCreated")
    assert_one_of_each(kube, namespace, "crashy", uid)
    # ... and the job goes on.
    RayJobStatus(kube, namespace, "crashy").initializing()
    wait_phase(kube, namespace, "crashy", "Provisioning")
    assert_one_of_each(kube, namespace, "crashy", uid)


def test_sigkill_while_many_jobs_are_reconciled(kube, namespace, operator, kuberay_paused):
    operator.start()
    uids = {f"job-{i}": create_job(kube, namespace, rlhf_job(f"job-{i}"))["metadata"]["uid"] for i in range(6)}
    # Kill as soon as the work has begun, wherever each job's reconcile happens to be.
    wait_for(lambda: any(children(kube, namespace, name)["ConfigMap"] for name in uids), 30, "the first ConfigMap")
    operator.kill()
    operator.start()
    for name, uid in uids.items():
        wait_phase(kube, namespace, name, "Pending", "RayJobCreated")
        assert_one_of_each(kube, namespace, name, uid)
