"""`rlhf operator`: arguments to kopf, settings, metrics."""

from __future__ import annotations

import logging

import kopf
import pytest
from prometheus_client import REGISTRY

from rlhf_operator import metrics, settings
from rlhf_operator.cli import main


@pytest.fixture
def kopf_run(monkeypatch) -> dict:
    called: dict = {}
    monkeypatch.setattr(kopf, "run", lambda **kwargs: called.update(kwargs))
    monkeypatch.setattr(kopf, "configure", lambda **kwargs: None)
    return called


def test_default_is_cluster_wide_with_the_default_ports(kopf_run):
    assert main(["operator"]) == 0
    assert kopf_run["clusterwide"] is True and list(kopf_run["namespaces"]) == []
    assert kopf_run["liveness_endpoint"] == "http://0.0.0.0:8081/healthz"
    assert kopf_run["memo"]["metrics_port"] == 8080
    assert main(["operator", "--all-namespaces"]) == 0
    assert kopf_run["clusterwide"] is True


def test_namespaces_and_ports(kopf_run):
    assert main(["operator", "--namespace", "team-a", "--namespace", "team-b",
                 "--metrics-port", "9000", "--health-port", "9001"]) == 0
    assert kopf_run["clusterwide"] is False
    assert kopf_run["namespaces"] == ["team-a", "team-b"]
    assert kopf_run["liveness_endpoint"] == "http://0.0.0.0:9001/healthz"
    assert kopf_run["memo"]["metrics_port"] == 9000


def test_namespace_and_all_namespaces_exclude_each_other(kopf_run, capsys):
    with pytest.raises(SystemExit):
        main(["operator", "--namespace", "a", "--all-namespaces"])


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


def sample(name: str, labels: dict) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_jobs_by_phase_counts_each_job_once():
    jobs = metrics.JobsByPhase()
    jobs.seen("a", None)
    jobs.seen("b", "Running")
    jobs.seen("a", "Running")
    jobs.seen("c", "Failed")
    jobs.gone("c")
    [family] = jobs.collect()
    counts = {s.labels["phase"]: s.value for s in family.samples}
    assert counts == {"Pending": 0, "Provisioning": 0, "Running": 2, "Succeeded": 0, "Failed": 0, "Suspended": 0}


def test_handler_errors_are_counted_by_kind_and_still_raised():
    before = sample("rlhf_operator_errors_total", {"kind": "TimeoutError"}) or 0
    runs = sample("rlhf_operator_reconcile_duration_seconds_count", {"handler": "unit"}) or 0
    with pytest.raises(TimeoutError), metrics.measured("unit"):
        raise TimeoutError
    assert sample("rlhf_operator_errors_total", {"kind": "TimeoutError"}) == before + 1
    assert sample("rlhf_operator_reconcile_duration_seconds_count", {"handler": "unit"}) == runs + 1
