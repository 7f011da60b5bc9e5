"""Evaluation during training (spec.evaluation): pass@k by hand, the schedule, the API's refusals, and a
run whose eval metrics reach metrics.jsonl, TensorBoard and the status, keeping the best actor."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from rlhf_api.v1alpha1 import DataSpec, EvaluationSpec
from rlhf_api.validation import InvalidJob, validate
from rlhf_trainer.evaluation import Evaluation, pass_at_k
from rlhf_trainer.kube_status import status_metrics
from rlhf_trainer.reporting import JsonlWriter, TensorBoardWriter
from rlhf_trainer.rewards import RewardResult
from rlhf_trainer.run import run


def test_pass_at_k_is_the_chance_that_one_of_k_draws_passes():
    """Against enumeration: of all k-subsets of a prompt's n samples, the fraction containing a pass."""
    passed = torch.tensor([[1, 0, 0, 0, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 0, 0]], dtype=torch.bool)
    for k in range(1, 6):
        enumerated = [sum(any(row[list(s)]) for s in itertools.combinations(range(5), k)) /
                      len(list(itertools.combinations(range(5), k))) for row in passed]
        assert pass_at_k(passed, k) == pytest.approx(sum(enumerated) / len(enumerated))
    assert pass_at_k(passed, 1) == pytest.approx((0.4 + 0 + 1 + 0.2) / 4)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(passed, 6)


def _evaluation(tmp_path, **spec) -> Evaluation:
    from rlhf_trainer.tiny import build_tokenizer

    (tmp_path / "e.jsonl").write_text('{"prompt": "Say a.", "label": "a"}\n')
    datasets = [{"name": "held-out", "sources": [{"path": "e.jsonl"}], "labelKey": "label"}]
    return Evaluation(EvaluationSpec.model_validate({"datasets": datasets, **spec}), DataSpec(), build_tokenizer(),
                      base_dir=tmp_path, seed=0)


def test_evaluations_are_due_every_interval_and_after_the_last_step(tmp_path):
    every3 = _evaluation(tmp_path, intervalSteps=3, atStart=True)
    assert [s for s in range(11) if every3.due(s, 10)] == [0, 3, 6, 9, 10]
    at_end = _evaluation(tmp_path)
    assert [s for s in range(11) if at_end.due(s, 10)] == [10]
    assert len(at_end.sets["held-out"]) == 1 and at_end.sets["held-out"][0].label == "a"


def test_metric_names_status_and_the_best(tmp_path):
    evaluation = _evaluation(tmp_path, samplesPerPrompt=2, temperature=1.0, passThreshold=0.5, bestMetric="held-out/pass@k",
                             bestMode="min")
    metrics = evaluation.metrics("held-out", RewardResult(torch.zeros(4), {}, torch.tensor([0.4, 0.6, 0.1, 0.2])))
    assert metrics == {"eval/held-out/mean_reward": pytest.approx(0.325), "eval/held-out/pass@2": 0.5}  # k written out
    assert evaluation.best_value(metrics) == 0.5
    assert evaluation.better(0.4, 0.5) and not evaluation.better(0.6, 0.5) and evaluation.better(0.6, None)
    status = status_metrics({"reward_mean": 0.3, **metrics, "eval/best/step": 4.0})
    assert status.pop("evaluation") == {"held-out/mean_reward": pytest.approx(0.325), "held-out/pass@2": 0.5,
                                        "best/step": 4.0}
    assert status == {"rewardMean": 0.3}
    # What `kubectl get rlhfjobs` shows: four significant digits, not a float's seventeen.
    assert status_metrics({"reward_mean": 0.25182831287384033, "kl": 1.23456e-5}) == {"rewardMean": 0.2518, "kl": 1.235e-5}


def test_bad_evaluation_settings_are_refused():
    def job(**evaluation):
        return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "e"},
                "spec": {"algorithm": "grpo", "models": {"actor": {"path": "m"}},
                         "reward": {"sources": [{"name": "r", "type": "function", "function": {"entrypoint": "r.py:f"}}]},
                         "data": {"prompts": {"sources": [{"path": "p.jsonl"}]}}, "rollout": {"samplesPerPrompt": 2},
                         "evaluation": {"datasets": [{"name": "a", "sources": [{"path": "a.jsonl"}]}], **evaluation}}}

    with pytest.raises(InvalidJob, match="bestMetric must start with the name of one of evaluation.datasets"):
        validate(job(bestMetric="b/mean_reward"))
    with pytest.raises(InvalidJob, match="set passK <= samplesPerPrompt"):
        validate(job(samplesPerPrompt=2, passK=3, temperature=1.0))
    with pytest.raises(InvalidJob, match="greedy decoding .* set samplesPerPrompt 1"):
        validate(job(samplesPerPrompt=4))
    with pytest.raises(InvalidJob, match="spec.evaluation.bestMetric"):
        validate(job(bestMetric="a/accuracy"))
    assert validate(job(bestMetric="a/pass@k", samplesPerPrompt=4, passK=2, temperature=0.6)).spec.evaluation.pass_k == 2


@pytest.mark.timeout(900)
def test_a_run_reports_evaluations_and_keeps_the_best_actor(toy_job, tiny_model, local_ray, tmp_path):
    """Evaluations at steps 0, 2 and 4 (greedy, so each is deterministic), in metrics.jsonl and TensorBoard;
    checkpoint.path/best holds the actor of the evaluation with the best mean reward."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = 4
    job = toy_job(**{"training.maxSteps": steps, "checkpoint.intervalSteps": 0, "evaluation": {
        "datasets": [{"name": "letters", "sources": [{"path": "tiny/prompts.jsonl"}], "labelKey": "label",
                      "maxSamples": 32}],
        "intervalSteps": 2, "atStart": True, "samplesPerPrompt": 1, "temperature": 0.0, "passThreshold": 0.5,
        "bestMetric": "letters/mean_reward"}})
    out = tmp_path / "out"
    assert run(job, output_dir=out, reporters=[JsonlWriter(out / "metrics.jsonl"),
                                               TensorBoardWriter(out / "tensorboard")]) == 0

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in rows if "eval/letters/mean_reward" in m]
    assert [m["step"] for m in evals] == [0, 2, 4]
    for m in evals:
        assert 0.0 <= m["eval/letters/mean_reward"] <= 1.0 and 0.0 <= m["eval/letters/pass@1"] <= 1.0
    best = max(evals, key=lambda m: m["eval/letters/mean_reward"])
    assert evals[-1]["eval/best/step"] == best["step"]
    assert evals[-1]["eval/best/value"] == pytest.approx(best["eval/letters/mean_reward"])

    record = json.loads((out / "checkpoints" / "best" / "best.json").read_text())
    assert record == {"step": best["step"], "metric": "letters/mean_reward",
                      "value": pytest.approx(best["eval/letters/mean_reward"])}
    # The weights are that step's: the initial model's at step 0, the final one's at the last step.
    saved = load_file(out / "checkpoints" / "best" / "model.safetensors")
    for other, step in ((tiny_model, 0), (out / "checkpoints" / "final", steps)):
        weights = load_file(other / "model.safetensors")
        assert all(torch.equal(saved[name], weights[name]) for name in saved) == (record["step"] == step)

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("eval/letters/pass@1")] == [0, 2, 4]
