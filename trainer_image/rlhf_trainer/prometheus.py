"""Prometheus metrics of a training run, served on RLHF_METRICS_PORT (the head pod's `metrics` port).

Every series carries the RLHFJob it measures (labels rlhf_job and rlhf_namespace, from the pod's
environment), so dashboards and alerts group by job whatever pod or cluster serves it.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from rlhf_api import contract


JOB_LABELS = contract.METRIC_JOB_LABELS
# trainer metric key -> (Prometheus name, help). Names follow Prometheus conventions: a prefix,
# base units (seconds), _total only for counters.
GAUGES = {
    "reward_mean": ("rlhf_reward_mean", "Mean total reward of the last rollout batch"),
    "reward_std": ("rlhf_reward_std", "Standard deviation of the total reward of the last rollout batch"),
    "kl": ("rlhf_kl", "Mean per-token KL divergence to the reference model"),
    "policy_loss": ("rlhf_policy_loss", "Actor (policy) loss"),
    "value_loss": ("rlhf_value_loss", "Critic (value) loss"),
    "loss": ("rlhf_loss", "Training loss of offline algorithms"),
    "entropy": ("rlhf_entropy", "Mean token entropy of the policy"),
    "response_length": ("rlhf_response_length_tokens", "Mean completion length"),
    "tokens_per_second": ("rlhf_rollout_tokens_per_second", "Generated tokens per second in the last rollout"),
    "rollout_seconds": ("rlhf_rollout_duration_seconds", "Duration of the last rollout (generation and scoring)"),
    "update_seconds": ("rlhf_update_duration_seconds", "Duration of the last policy/critic update"),
    "learning_rate": ("rlhf_learning_rate", "Current actor learning rate"),
}


class PrometheusReporter:
    """A Reporter that keeps gauges for the latest step and metrics, served over HTTP."""

    def __init__(self, port: int | None, job: str = "", namespace: str = "", registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()

        def gauge(name: str, help: str) -> Gauge:
            return Gauge(name, help, JOB_LABELS, registry=self.registry).labels(job, namespace)

        self.step = gauge("rlhf_step", "Completed training steps")
        self.total_steps = gauge("rlhf_total_steps", "Planned training steps")
        self.checkpoint_step = gauge("rlhf_last_checkpoint_step", "Step of the newest checkpoint")
        # What the no-progress alert watches: a hung rollout or collective leaves it behind. Set
        # now too, so a run still loading its models is not taken for one stuck since 1970.
        self.progress_time = gauge("rlhf_last_progress_timestamp_seconds",
                                   "Unix time of the run's last progress: the trainer's start, a step, a checkpoint")
        self.progress_time.set_to_current_time()
        self.gauges = {key: gauge(name, help) for key, (name, help) in GAUGES.items()}
        if port is not None:
            start_http_server(port, registry=self.registry)

    @classmethod
    def from_environment(cls) -> PrometheusReporter | None:
        port = os.environ.get(contract.METRICS_PORT_ENV)
        if not port:
            return None
        return cls(int(port), os.environ.get(contract.JOB_NAME_ENV, ""), os.environ.get(contract.JOB_NAMESPACE_ENV, ""))

    def start(self, total_steps: int) -> None:
        self.total_steps.set(total_steps)
        self.step.set(0)
        self.progress_time.set_to_current_time()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.step.set(step)
        self.progress_time.set_to_current_time()
        for key, value in metrics.items():
            if key in self.gauges:
                self.gauges[key].set(value)

    def checkpoint(self, step: int, path: str) -> None:
        self.checkpoint_step.set(step)
        self.progress_time.set_to_current_time()

    def finish(self, status: str, message: str = "") -> None:
        pass  # the gauges keep their last values until the pod goes
