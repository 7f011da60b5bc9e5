"""Two operator replicas with leader election (rlhf_operator/leader.py) on the real API server.

Only the Lease holder reconciles; when it is SIGKILLed mid-lifecycle the standby takes over once
the Lease has run out, finishes every job with exactly one set of children, and the old leader
reconciled nothing after its death while the standby reconciled nothing before it. A leader whose
Lease is taken stops with LOST_LEASE_EXIT_CODE; a leader stopped with SIGTERM hands over.
A leader whose API connections go half-open (e2e/operator/apiproxy.py) stops before the standby
takes over, a handler's call on such a connection fails instead of waiting forever, and renewals go on while every thread of asyncio's default executor is busy.
Timings are client-go's lease and renew deadline (15 s, 10 s), which a renewal thread meets on a
machine at load 16 (with a 3 s deadline, a standby that had just taken over missed a renewal and exited
under CI's load), and a 0.5 s retry so that a free Lease is taken at once.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from e2e.fixtures import wait_for
from e2e.operator.conftest import OperatorProcess
from e2e.operator.apiproxy import ApiProxy
from e2e.operator.jobs import children, create_job, rlhf_job, wait_phase
from e2e.operator.kuberay import RayJobStatus
from e2e.operator.test_operator_crash import assert_one_of_each
from rlhf_operator.kube import Kube
from rlhf_operator.leader import Elector, Timing
from rlhf_operator.runner import LOST_LEASE_EXIT_CODE

LEASE = "rlhf-operator-ha"
HANDLER_RUN = re.compile(r"Handler '\w+' (succeeded|failed)")


def election(namespace: str, lease_duration: str = "15") -> list[str]:
    return ["--leader-elect", "--leader-elect-resource-namespace", namespace, "--leader-elect-resource-name", LEASE,
            "--leader-elect-lease-duration", lease_duration, "--leader-elect-renew-deadline", "10",
            "--leader-elect-retry-period", "0.5"]


def leads(operator: OperatorProcess) -> bool:
    return "rlhf_operator_leader 1.0" in operator.metrics()


def take_over(kube: Kube, namespace: str, holder: str) -> bool:
    """One conditional write of the Lease naming `holder`, at the version just read; False when a renewal
    came first (409)."""
    current = kube.get("Lease", namespace, LEASE)
    try:
        kube.patch("Lease", namespace, LEASE, {"metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
                                               "spec": {"holderIdentity": holder, "leaseDurationSeconds": 60}})
    except ApiException as error:
        if error.status != 409:
            raise
        return False
    return True


def handler_runs(operator: OperatorProcess) -> int:
    return len(HANDLER_RUN.findall(operator.log.read_text()))


def ready(operator: OperatorProcess) -> int:
    """The status of the replica's /readyz."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{operator.health_port}/readyz", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


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

    wait_for(lambda: leads(standby), 60, "the standby to take the Lease over")
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
    # Another candidate that believes the Lease expired wins the conditional write (reading it again, as a
    # candidate does, when a renewal came between its read and its write).
    wait_for(lambda: take_over(kube, namespace, "intruder"), 30, "the intruder's write of the Lease")
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


@pytest.fixture
def api_proxy(control_plane):
    proxy = ApiProxy(control_plane.ports["kube-apiserver"])
    yield proxy
    proxy.close()


def test_a_leader_whose_renewals_hang_stops_before_the_standby_takes_over(
        control_plane, kube, namespace, operator, standby, api_proxy, kuberay_paused, tmp_path):
    # The leader reaches the API server through the proxy, the standby directly. A lease of 30 s
    # against a renew deadline of 10: the leader has 20 s to stop between the two (7 s were not enough
    # for its renewal thread to run on a machine at load 16).
    operator.kubeconfig = api_proxy.kubeconfig(control_plane.kubeconfig, tmp_path / "through-proxy")
    operator.start(*election(namespace, lease_duration="30"))
    wait_for(lambda: leads(operator), 30, "the first replica to lead")
    standby.start(*election(namespace, lease_duration="30"))
    leader = lease(kube, namespace)["holderIdentity"]
    before = create_job(kube, namespace, rlhf_job("before-hang"))["metadata"]["uid"]
    wait_phase(kube, namespace, "before-hang", "Pending", "RayJobCreated")

    api_proxy.hang()  # every call of the leader's, its renewals too, now waits forever
    hung_at = time.monotonic()
    # The leader gives up when it logs the lost Lease; its process exits after kopf's shutdown, which
    # under load took longer than the 7 s left before the standby may take over.
    wait_for(lambda: "lost Lease" in operator.log.read_text() or leads(standby), 60,
             "the hung leader to give up or the standby to lead")
    stopped_after = time.monotonic() - hung_at
    # It gave up on its own clock, before its Lease ran out: nobody had taken over nor reconciled.
    assert lease(kube, namespace)["holderIdentity"] == leader and handler_runs(standby) == 0
    wait_for(lambda: operator.proc.poll() is not None, 60, "the leader that gave up to exit")
    assert operator.proc.poll() == LOST_LEASE_EXIT_CODE

    wait_for(lambda: leads(standby), 120, "the standby to take the Lease over")
    assert lease(kube, namespace)["holderIdentity"] != leader
    print(f"\nhalf-open API: the leader stopped {stopped_after:.1f}s after the hang (renew deadline 10 s), "
          f"the standby led after {time.monotonic() - hung_at:.1f}s (lease 30 s)")
    after = create_job(kube, namespace, rlhf_job("after-hang"))["metadata"]["uid"]
    wait_phase(kube, namespace, "after-hang", "Pending", "RayJobCreated")
    assert_one_of_each(kube, namespace, "before-hang", before)
    assert_one_of_each(kube, namespace, "after-hang", after)


def test_a_replica_cut_off_from_the_api_server_is_alive_but_not_ready(
        control_plane, namespace, operator, standby, api_proxy, kuberay_paused, tmp_path):
    operator.start(*election(namespace))
    wait_for(lambda: leads(operator), 30, "the first replica to lead")
    standby.kubeconfig = api_proxy.kubeconfig(control_plane.kubeconfig, tmp_path / "through-proxy")
    standby.start(*election(namespace))
    wait_for(lambda: ready(standby) == 200 and ready(operator) == 200, 30, "both replicas to be ready")
    api_proxy.hang()
    wait_for(lambda: ready(standby) == 503, 30, "the cut-off standby to be unready")
    assert standby.healthy() and ready(operator) == 200  # alive: restarting it would not help


def test_a_call_on_a_half_open_connection_fails_instead_of_hanging(control_plane, namespace, api_proxy, tmp_path):
    """Handlers' calls (kube.py) are bounded as kopf's own are: a hung one frees its thread. Short
    bounds here (the defaults, kube.CONNECT_TIMEOUT and REQUEST_TIMEOUT, make it 90 s)."""
    kubeconfig = api_proxy.kubeconfig(control_plane.kubeconfig, tmp_path / "through-proxy")
    connect, read = 1, 2
    client = Kube(k8s_config.new_client_from_config(config_file=str(kubeconfig)), timeout=(connect, read))
    assert client.get("Lease", namespace, LEASE) is None  # through the proxy, before it hangs
    api_proxy.hang()
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            client.get("Lease", namespace, LEASE)
        except Exception as error:  # noqa: BLE001  (whichever urllib3 raises for a read timeout)
            outcome.append(error)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    # The read times out, then urllib3 retries a GET up to 3 times, each new connection's TLS
    # handshake bounded by the connect timeout.
    bound = read + 3 * connect
    wait_for(lambda: not caller.is_alive(), 2 * bound, "the hung call to fail")
    assert outcome and "timed out" in str(outcome[0]).lower(), outcome
    client.api_client.close()


def test_renewals_go_on_while_the_default_executor_is_busy(control_plane, kube, namespace):
    """The handlers' threads, the resync and the TTL and deadline daemons all wait in asyncio's
    default executor: a burst of them must not hold a renewal back past the renew deadline."""
    elector = Elector(namespace, LEASE, timing=Timing(15, 10, 0.5), kube=Kube(control_plane.api_client()))
    lost = threading.Event()

    async def lead_while_every_worker_waits() -> set[str]:
        loop = asyncio.get_running_loop()
        await elector.acquire()
        busy = threading.Event()
        workers = [loop.run_in_executor(None, busy.wait) for _ in range(64)]  # more than it has threads
        elector.keep(lost.set)
        renewals: set[str] = set()
        try:
            for _ in range(200):  # a poll, yielding to the event loop: at most 40 s
                renewals.add(lease(kube, namespace)["renewTime"])
                if len(renewals) > 3 or lost.is_set():
                    break
                await asyncio.sleep(0.2)
        finally:
            busy.set()
            await asyncio.gather(*workers)
            await asyncio.to_thread(elector.release)
        return renewals

    renewals = asyncio.run(lead_while_every_worker_waits())
    assert not lost.is_set() and len(renewals) > 3, renewals
