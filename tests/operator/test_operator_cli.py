"""`rlhf operator`: arguments to kopf, settings, metrics."""

from __future__ import annotations

import logging
import subprocess
import sys

import kopf
import pytest
from prometheus_client import REGISTRY

from rlhf_operator import metrics, settings
from rlhf_cli.cli import operator_options, parser
from rlhf_operator.leader import Timing


def options(*argv: str):
    args = parser().parse_args(["operator", *argv])
    return operator_options(args)


def test_default_is_cluster_wide_with_the_default_ports_and_no_election():
    got = options()
    assert got.namespaces == [] and (got.metrics_port, got.health_port) == (8080, 8081)
    assert got.elector is None
    assert options("--all-namespaces").namespaces == []


def test_namespaces_and_ports():
    got = options("--namespace", "team-a", "--namespace", "team-b", "--metrics-port", "9000", "--health-port", "9001")
    assert got.namespaces == ["team-a", "team-b"] and (got.metrics_port, got.health_port) == (9000, 9001)


def test_the_resync_period_is_two_minutes_unless_given(capsys):
    assert options().resync_seconds == 120 and options("--resync-seconds", "30").resync_seconds == 30
    with pytest.raises(SystemExit):
        options("--resync-seconds", "0")
    assert "expected a positive number of seconds" in capsys.readouterr().err


def test_namespace_and_all_namespaces_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        options("--namespace", "a", "--all-namespaces")


def test_leader_election_takes_the_pods_namespace_and_client_go_timing(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "rlhf-system")
    elector = options("--leader-elect").elector
    assert (elector.namespace, elector.name) == ("rlhf-system", "rlhf-operator")
    assert elector.timing == Timing(lease_duration=15, renew_deadline=10, retry_period=2)
    elector = options("--leader-elect", "--leader-elect-resource-namespace", "ops", "--leader-elect-resource-name",
                      "ours", "--leader-elect-lease-duration", "4", "--leader-elect-renew-deadline", "3",
                      "--leader-elect-retry-period", "0.5").elector
    assert (elector.namespace, elector.name, elector.timing) == ("ops", "ours", Timing(4, 3, 0.5))


def test_leader_election_refuses_inconsistent_timing(monkeypatch):
    monkeypatch.setenv("POD_NAMESPACE", "rlhf-system")
    with pytest.raises(ValueError, match="renew deadline < lease duration"):
        options("--leader-elect", "--leader-elect-renew-deadline", "20")


def test_leader_election_needs_a_namespace(monkeypatch):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    with pytest.raises(SystemExit, match="--leader-elect-resource-namespace"):
        options("--leader-elect")


def test_settings_use_our_prefix_and_bounded_watches():
    config = kopf.OperatorSettings()
    settings.configure(config)
    assert config.persistence.finalizer == "rlhf.dev/finalizer"
    assert config.persistence.progress_storage.prefix == "rlhf.dev"
    assert config.persistence.diffbase_storage.prefix == "rlhf.dev"
    assert config.watching.server_timeout < config.watching.client_timeout
    assert config.posting.level == logging.INFO and config.posting.loggers is False
    # Only our RayJobs and our Ray clusters' pods are watched, filtered by the API server.
    assert sorted(config.watching.label_selectors.values()) == ["app.kubernetes.io/managed-by=rlhf-operator",
                                                                "rlhf.dev/job"]


def test_the_diff_base_is_kopfs_essence_built_without_copying_metadata_and_status():
    """settings.DiffBase builds the same essence as kopf's storage (what on.update compares), so a
    status write is still no change and a spec or label edit still is one."""
    ours = settings.DiffBase(prefix="rlhf.dev", key="last-handled-configuration")
    kopfs = kopf.AnnotationsDiffBaseStorage(prefix="rlhf.dev", key="last-handled-configuration")
    body = {
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
        "metadata": {"name": "j", "namespace": "n", "uid": "u", "resourceVersion": "7", "generation": 2,
                     "finalizers": ["rlhf.dev/finalizer"], "labels": {"team": "a"},
                     "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
                     "annotations": {"rlhf.dev/last-handled-configuration": "{}", "note": "kept",
                                     "kubectl.kubernetes.io/last-applied-configuration": "{}"}},
        "spec": {"algorithm": "grpo", "rollout": {"samplesPerPrompt": [4, {"n": 2}]}},
        "status": {"phase": "Running", "progress": {"step": 3}},
    }
    essence = ours.build(body=kopf.Body(body))
    assert essence == kopfs.build(body=kopf.Body(body))
    assert essence == {"spec": body["spec"], "metadata": {"labels": {"team": "a"}, "annotations": {"note": "kept"}}}
    assert essence["spec"] is not body["spec"]  # a copy: later changes to the object do not move it
    extra = ours.build(body=kopf.Body(body), extra_fields=["status.phase"])
    assert extra == kopfs.build(body=kopf.Body(body), extra_fields=["status.phase"])
    assert extra["status"] == {"phase": "Running"}


def sample(name: str, labels: dict) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_jobs_by_phase_counts_each_job_once():
    jobs = metrics.JobsByPhase()
    jobs.seen("a", "ns", "a", {})
    jobs.seen("b", "ns", "b", {"phase": "Running"})
    jobs.seen("a", "ns", "a", {"phase": "Running"})
    jobs.seen("c", "ns", "c", {"phase": "Failed"})
    jobs.gone("c")
    family = next(jobs.collect())
    counts = {s.labels["phase"]: s.value for s in family.samples}
    assert counts == {"Waiting": 0, "Pending": 0, "Provisioning": 0, "Running": 2, "Succeeded": 0, "Failed": 0, "Suspended": 0}


def test_handler_errors_are_counted_by_kind_and_still_raised():
    before = sample("rlhf_operator_errors_total", {"kind": "TimeoutError"}) or 0
    runs = sample("rlhf_operator_reconcile_duration_seconds_count", {"handler": "unit"}) or 0
    with pytest.raises(TimeoutError), metrics.measured("unit"):
        raise TimeoutError
    assert sample("rlhf_operator_errors_total", {"kind": "TimeoutError"}) == before + 1
    assert sample("rlhf_operator_reconcile_duration_seconds_count", {"handler": "unit"}) == runs + 1


def test_rlhf_run_needs_none_of_the_operator_s_dependencies():
    """The trainer image installs the trainer and tracking extras, not the operator's: there every Ray
    job died at `rlhf run`'s start importing kopf (the CLI's parser imported the leader election's
    defaults, and with them kopf's settings)."""
    code = ("import sys; sys.modules['kopf'] = None  # as if not installed\n"
            "from rlhf_cli import cli; print(cli.parser().parse_args(['run', 'job.yaml']).command)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout == "run\n", result.stderr[-2000:]
