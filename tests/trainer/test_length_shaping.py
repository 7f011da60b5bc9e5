"""Length shaping (DAPO, Yu et al. 2025, arXiv:2503.14476): the overlong buffer's soft penalty and the
truncation penalty, by hand and in a run."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_api.v1alpha1 import LengthShapingSpec
from rlhf_api.validation import InvalidJob, validate
from rlhf_trainer.reporting import JsonlWriter
from rlhf_trainer.run import run
from rlhf_trainer.sampling import length_penalty


def test_the_overlong_buffer_penalty_is_dapo_s():
    """L_max 16, buffer 4, factor 2: no penalty up to 12 tokens, then -2 * (L - 12) / 4, -2 at 16 (DAPO eq. 13)."""
    spec = LengthShapingSpec(overlong_buffer_tokens=4, overlong_penalty=2.0)
    lengths = torch.tensor([0, 11, 12, 13, 14, 16])
    penalty = length_penalty(lengths, torch.zeros(6, dtype=torch.bool), 16, spec)
    assert penalty.tolist() == [0.0, 0.0, 0.0, -0.5, -1.0, -2.0]


def test_the_truncation_penalty_hits_truncated_completions_only():
    spec = LengthShapingSpec(truncation_penalty=0.3)
    penalty = length_penalty(torch.tensor([16, 16, 3]), torch.tensor([True, False, False]), 16, spec)
    assert penalty.tolist() == pytest.approx([-0.3, 0.0, 0.0])
    assert not length_penalty(torch.tensor([16]), torch.tensor([True]), 16, LengthShapingSpec()).any()


def test_a_buffer_as_long_as_the_budget_is_refused():
    job = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "l"},
           "spec": {"algorithm": "grpo", "models": {"actor": {"path": "m"}},
                    "reward": {"sources": [{"name": "r", "type": "function", "function": {"entrypoint": "r.py:f"}}]},
                    "data": {"prompts": {"sources": [{"path": "p.jsonl"}]}},
                    "rollout": {"samplesPerPrompt": 4, "maxNewTokens": 8, "lengthShaping": {"overlongBufferTokens": 8}}}}
    with pytest.raises(InvalidJob, match="overlongBufferTokens must be smaller than maxNewTokens"):
        validate(job)


@pytest.mark.timeout(900)
def test_the_penalties_enter_the_reward_of_a_run(toy_job, local_ray, tmp_path):
    """The toy job's answers mostly run to maxNewTokens 8: each truncated one loses 0.5, and each reaching
    into the 4-token buffer loses up to 0.25 more. The reported penalty is that, and the total reward is
    the letter score plus it."""
    steps = 3
    job = toy_job(**{"training.maxSteps": steps, "checkpoint.intervalSteps": 0, "checkpoint.exportHf": False,
                     "rollout.lengthShaping": {"overlongBufferTokens": 4, "overlongPenalty": 0.25,
                                               "truncationPenalty": 0.5}})
    out = tmp_path / "out"
    assert run(job, output_dir=out, reporters=[JsonlWriter(out / "metrics.jsonl")]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps
    for m in rows:
        truncation = -0.5 * m["truncated_fraction"]
        # A truncated answer has all 8 tokens: the full overlong penalty; others lose 0 to 0.25.
        most = truncation - 0.25 * m["truncated_fraction"]
        least = most - 0.25 * (1 - m["truncated_fraction"])
        assert least - 1e-6 <= m["reward/length_penalty"] <= most + 1e-6
        assert m["truncated_fraction"] > 0.5  # the penalties were exercised
        assert m["reward_mean"] == pytest.approx(m["reward/letter"] + m["reward/length_penalty"], abs=1e-5)
