"""The trainer's Prometheus endpoint serves the latest step and metrics under conventional names."""

from __future__ import annotations

import socket
import urllib.request

from rlhf_trainer.prometheus import PrometheusReporter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_are_served_over_http():
    port = free_port()
    reporter = PrometheusReporter(port)
    reporter.start(total_steps=30)
    reporter.log(3, {"reward_mean": 0.25, "kl": 0.01, "tokens_per_second": 120.0, "rollout_seconds": 1.5, "unknown": 7})
    reporter.checkpoint(3, "/checkpoints/step-3")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples["rlhf_step"]) == 3 and float(samples["rlhf_total_steps"]) == 30
    assert float(samples["rlhf_reward_mean"]) == 0.25
    assert float(samples["rlhf_rollout_tokens_per_second"]) == 120.0
    assert float(samples["rlhf_rollout_duration_seconds"]) == 1.5
    assert float(samples["rlhf_last_checkpoint_step"]) == 3
    assert not any("unknown" in name for name in samples)
