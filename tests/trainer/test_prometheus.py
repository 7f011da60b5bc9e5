"""The trainer's Prometheus endpoint serves the latest step and metrics under conventional names."""

from __future__ import annotations

import socket
import time
import urllib.request

from rlhf_trainer.prometheus import PrometheusReporter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_are_served_over_http():
    port = free_port()
    reporter = PrometheusReporter(port, job="tiny-grpo", namespace="team-a")
    reporter.start(total_steps=30)
    reporter.log(3, {"reward_mean": 0.25, "kl": 0.01, "tokens_per_second": 120.0, "rollout_seconds": 1.5, "unknown": 7})
    reporter.checkpoint(3, "/checkpoints/step-3")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    # Every series names the job it measures (dashboards and alerts group by it).
    labels = '{rlhf_job="tiny-grpo",rlhf_namespace="team-a"}'
    assert all(name.endswith(labels) for name in samples if name.startswith("rlhf_"))
    value = {name.removesuffix(labels): float(v) for name, v in samples.items() if name.startswith("rlhf_")}
    assert value["rlhf_step"] == 3 and value["rlhf_total_steps"] == 30
    assert value["rlhf_reward_mean"] == 0.25
    assert value["rlhf_rollout_tokens_per_second"] == 120.0
    assert value["rlhf_rollout_duration_seconds"] == 1.5
    assert value["rlhf_last_checkpoint_step"] == 3
    assert not any("unknown" in name for name in samples)


def test_in_a_pod_the_job_comes_from_the_operator_s_environment(monkeypatch):
    from prometheus_client import generate_latest

    from rlhf_api import contract

    monkeypatch.setenv(contract.METRICS_PORT_ENV, str(free_port()))
    monkeypatch.setenv(contract.JOB_NAME_ENV, "ppo-llama")
    monkeypatch.setenv(contract.JOB_NAMESPACE_ENV, "ml")
    reporter = PrometheusReporter.from_environment()
    reporter.start(total_steps=5)
    assert 'rlhf_total_steps{rlhf_job="ppo-llama",rlhf_namespace="ml"} 5.0' in generate_latest(reporter.registry).decode()


def test_progress_time_moves_with_the_start_each_step_and_each_checkpoint():
    """What the no-progress alert reads: set when the exporter starts (models may still be loading),
    then at the run's start, every step and every checkpoint."""
    reporter = PrometheusReporter(None, job="tiny-grpo", namespace="team-a")

    def progress() -> float:
        return reporter.registry.get_sample_value(
            "rlhf_last_progress_timestamp_seconds", {"rlhf_job": "tiny-grpo", "rlhf_namespace": "team-a"})

    created = progress()
    assert created > 0
    for event in (lambda: reporter.start(total_steps=3), lambda: reporter.log(1, {"kl": 0.1}),
                  lambda: reporter.checkpoint(1, "/checkpoints/step-1")):
        reporter.progress_time.set(0)
        before = time.time()
        event()
        assert before <= progress() <= time.time()
