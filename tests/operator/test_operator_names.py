"""Deterministic child names within Kubernetes' and KubeRay's limits."""

from __future__ import annotations

import re

import pytest

from rlhf_operator import names

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def test_short_valid_names_are_kept():
    assert names.ray_job("ppo-llama3-8b") == "ppo-llama3-8b"
    assert names.config_map("ppo") == "ppo-config"
    assert names.trainer("ppo") == "ppo-trainer"
    assert names.label_value("ppo") == "ppo"


@pytest.mark.parametrize("job_name", [
    "x" * 47, "x" * 48, "x" * 253, "7b-sweep", "llama.v3.run-1", "a" * 40 + "." + "b" * 40, "0" * 100,
])
def test_ray_job_names_are_dns_1035_labels_of_at_most_47(job_name: str):
    name = names.ray_job(job_name)
    assert len(name) <= names.RAY_JOB_NAME_MAX
    assert DNS_1035.match(name), name
    assert names.ray_job(job_name) == name  # stable across calls (and restarts: no randomness)


def test_shortened_names_tell_similar_jobs_apart():
    base = "grpo-qwen2-5-7b-math-sweep-learning-rate-"
    first, second = names.ray_job(base + "0001"), names.ray_job(base + "0002")
    assert first != second
    assert first.startswith("grpo-qwen2-5-7b-math")
    # A rewritten name never equals another job's unrewritten name.
    assert names.ray_job("run.1") != names.ray_job("run-1")


def test_long_names_fit_object_and_label_limits():
    long = "n" * 253
    assert len(names.config_map(long)) <= 253 and len(names.trainer(long)) <= 253
    assert names.config_map(long) != names.trainer(long)
    value = names.label_value(long)
    assert len(value) <= 63 and value[-1].isalnum()
