"""`rlhf list|suspend|resume|delete|dashboard` and the connection flags, against the test world's API server.

In-process (`main`), the kubeconfig passed as a user passes it (--kubeconfig, --context): the environment's
KUBECONFIG is not read here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from e2e.fixtures import wait_for
from e2e.operator.jobs import create_job, get_job, rlhf_job
from rlhf_api import v1alpha1 as api
from rlhf_cli.cli import main

CPU_NODE = "kwok-cpu-0"


@pytest.fixture
def rlhf(control_plane, capsys):
    """rlhf(*args) -> (exit status, stdout, stderr), with the control plane's kubeconfig."""
    def run(*args: str) -> tuple[int, str, str]:
        try:
            status = main([*args, "--kubeconfig", str(control_plane.kubeconfig)])
        except SystemExit as stop:  # as the interpreter ends with it: a message on stderr and status 1
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
            status = stop.code if isinstance(stop.code, int) else 1
        out, err = capsys.readouterr()
        return status, out, err
    return run


def test_list_prints_the_printer_columns_of_a_namespace_or_of_all(rlhf, kube, namespace):
    assert rlhf("list", "-n", namespace) == (0, f"No RLHFJobs in namespace {namespace}.\n", "")
    create_job(kube, namespace, rlhf_job("first"))
    create_job(kube, namespace, rlhf_job("second", algorithm="dpo", data={"preferences": {"sources": [{"path": "o/p"}]}}))
    kube.patch(api.KIND, namespace, "first", {"status": {
        "phase": "Running", "progress": {"step": 3, "totalSteps": 10, "summary": "3/10"},
        "metrics": {"rewardMean": 0.25, "kl": 0.0125}, "rayJobName": "first"}}, subresource="status")

    status, out, err = rlhf("list", "-n", namespace)
    assert status == 0, err
    header, *rows = [line.split() for line in out.splitlines()]
    assert header == ["NAME", "ALGORITHM", "PHASE", "PROGRESS", "REWARD", "GPU-HOURS", "AGE"]
    assert rows[0][:5] == ["first", "sft", "Running", "3/10", "0.25"] and rows[0][-1].endswith("s")
    assert rows[1][:2] == ["second", "dpo"]  # no status yet: its empty cells left blank, as kubectl leaves them

    _, wide, _ = rlhf("list", "-n", namespace, "-o", "wide")
    assert wide.splitlines()[0].split() == ["NAME", "ALGORITHM", "PHASE", "PROGRESS", "REWARD", "KL", "GPU-HOURS",
                                            "RAY", "JOB", "AGE"]
    assert wide.splitlines()[1].split()[:7] == ["first", "sft", "Running", "3/10", "0.25", "0.0125", "first"]

    _, everywhere, _ = rlhf("list", "-A")
    assert everywhere.splitlines()[0].split()[:2] == ["NAMESPACE", "NAME"]
    assert [namespace, "first", "sft"] in [line.split()[:3] for line in everywhere.splitlines()]


def test_suspend_resume_and_delete(rlhf, kube, namespace):
    for name in ("one", "two"):
        create_job(kube, namespace, rlhf_job(name))
    assert rlhf("suspend", "one", "two", "-n", namespace) == (
        0, f"RLHFJob {namespace}/one suspended\nRLHFJob {namespace}/two suspended\n", "")
    assert get_job(kube, namespace, "one")["spec"]["suspend"] is True
    assert rlhf("resume", "one", "-n", namespace)[:2] == (0, f"RLHFJob {namespace}/one resumed\n")
    assert get_job(kube, namespace, "one")["spec"]["suspend"] is False
    assert get_job(kube, namespace, "two")["spec"]["suspend"] is True

    assert rlhf("delete", "two", "-n", namespace)[:2] == (0, f"RLHFJob {namespace}/two deleted\n")
    assert kube.get(api.KIND, namespace, "two") is None
    status, _, err = rlhf("suspend", "two", "-n", namespace)
    assert status == 1 and f"no RLHFJob two in namespace {namespace}" in err


def test_the_context_and_its_namespace_come_from_the_kubeconfig(control_plane, capsys, kube, namespace, tmp_path):
    """A second context whose namespace is the test's: -n is not needed, and the flags go before or after the
    command (kubectl passes a plugin's flags after its name)."""
    config = yaml.safe_load(Path(control_plane.kubeconfig).read_text())
    current = next(c for c in config["contexts"] if c["name"] == config["current-context"])
    config["contexts"].append({"name": "team", "context": {**current["context"], "namespace": namespace}})
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    create_job(kube, namespace, rlhf_job("theirs"))

    for argv in (["--kubeconfig", str(kubeconfig), "--context", "team", "list"],
                 ["list", "--context", "team", "--kubeconfig", str(kubeconfig)]):
        assert main(argv) == 0
        assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["theirs", "sft"]
    assert main(["--kubeconfig", str(kubeconfig), "--context", "nosuch", "list"]) == 1
    assert "Expected object with name nosuch" in capsys.readouterr().err


def test_dashboard_needs_a_running_head_that_the_api_server_can_reach(rlhf, kube, namespace, kwok_nodes):
    create_job(kube, namespace, rlhf_job("dash"))
    status, _, err = rlhf("dashboard", "dash", "-n", namespace, "-p", "0")
    assert status == 1 and "has no running Ray head now (phase Pending)" in err

    # A head pod as KubeRay makes it from our template (its labels), running on a kwok node: kwok's nodes
    # serve no kubelet, so the API server cannot forward to it, and the command says so before listening.
    kube._request("POST", f"/api/v1/namespaces/{namespace}/pods", {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "dash-head", "labels": {"rlhf.dev/job": "dash", "rlhf.dev/role": "head"}},
        "spec": {"nodeName": CPU_NODE, "containers": [{"name": "ray-head", "image": "rayproject/ray",
                                                        "ports": [{"name": "dashboard", "containerPort": 8265}]}]}})
    wait_for(lambda: (kube.get("Pod", namespace, "dash-head").get("status") or {}).get("phase") == "Running", 60,
             "the kwok head pod to run")
    status, out, err = rlhf("dashboard", "dash", "-n", namespace, "-p", "0")
    assert status == 1 and "the API server cannot forward to pod dash-head port 8265: error dialing backend" in err, err
