"""`rlhf run`: exit status 0 / 1 / 2, invalid combinations refused before anything loads, outputs written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import ray
from transformers import AutoModelForCausalLM

from rlhf_api import contract
from rlhf_cli.cli import main
from rlhf_trainer.loop import RunLoop
from rlhf_trainer.workers.rollout import ENGINE_PROCESS_ENV

pytestmark = pytest.mark.timeout(600)

INVALID = {
    # spec overrides -> the field the error must name
    "hybrid engine running ahead": ({"training.colocation": "all", "training.asyncQueueSize": 1},
                                    "spec.training.asyncQueueSize"),
    "micro-batches that do not divide": ({"training.microTrainBatchSize": 48}, "spec.training.trainBatchSize"),
    "QLoRA on CPU": ({"models.actor.lora": {"rank": 8, "quantization": "nf4"}}, "spec.models.actor.lora.quantization"),
    "LoRA on a frozen model (CEL)": ({"models.reward": {"path": "x", "lora": {"rank": 8}}}, "spec.models.reward.lora"),
    "offline prompt leaving no room for the response": ({"algorithm": "sft", "reward": None, "data.prompts": None,
                                                         "data.sft": {"sources": [{"path": "tiny/prompts.jsonl"}]},
                                                         "data.maxTokens": 64}, "spec.data.maxPromptTokens"),
    "schema rule (CEL)": ({"rollout.samplesPerPrompt": 1}, "spec.rollout.samplesPerPrompt"),
    "GPUs the cluster lacks": ({"resources.gpusPerNode": 4}, "spec.resources.gpusPerNode"),
}


@pytest.mark.parametrize("case", INVALID)
def test_invalid_combination_is_refused_before_any_model_loads(case, toy_job, tmp_path, capsys):
    overrides, field = INVALID[case]
    # No model at the actor's path: a run that got as far as loading one would fail there (exit 1).
    job = toy_job(**{"models.actor.path": str(tmp_path / "no-such-model"), **overrides})
    assert main(["run", str(job), "--output-dir", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert field in error, error
    assert not ray.is_initialized()


def test_context_longer_than_the_model_is_refused(toy_job, tmp_path, capsys):
    job = toy_job(**{"rollout.maxNewTokens": 1000})  # the tiny model has 512 positions
    assert main(["run", str(job), "--output-dir", str(tmp_path / "out")]) == 2
    assert "spec.rollout.maxNewTokens" in capsys.readouterr().err


def test_offline_context_longer_than_the_model_is_refused(toy_job, tmp_path, capsys):
    job = toy_job(**{"algorithm": "sft", "reward": None, "data.prompts": None, "data.maxTokens": 1024,
                     "data.sft": {"sources": [{"path": "tiny/prompts.jsonl"}], "outputKey": "label"}})
    assert main(["run", str(job), "--output-dir", str(tmp_path / "out")]) == 2
    assert "spec.data.maxTokens" in capsys.readouterr().err


def test_failed_run_exits_1_and_says_why_on_its_last_line(toy_job, tmp_path, capsys, monkeypatch):
    # A function that imports and has the right parameters passes the checks; it fails when called.
    (tmp_path / "broken.py").write_text("def score(prompts, completions, labels):\n    raise RuntimeError('judge down')\n")
    job = toy_job(**{"reward.sources": [{"name": "broken", "type": "function",
                                         "function": {"entrypoint": "broken.py:score"}}]})
    # The teardown speaks (as dying workers' forwarded lines do): Ray's job supervisor quotes only the
    # log's last 10 lines, where the operator looks for the failure line, so it must come after.
    close = RunLoop.close
    monkeypatch.setattr(RunLoop, "close", lambda loop: [print(f"(ModelWorker) line {n}", file=sys.stderr)
                                                         for n in range(12)] and close(loop))
    assert main(["run", str(job), "--output-dir", str(tmp_path / "out")]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert contract.RUN_FAILED in last and "reward source 'broken'" in last and "judge down" in last, last
    assert not ray.is_initialized()


def test_run_writes_metrics_tensorboard_checkpoints_and_the_final_model(toy_job, tiny_model, tmp_path):
    # The hybrid engine's placement, as on GPUs: every model on bundle 0 and a vLLM engine of two
    # tensor-parallel workers on bundles 0 and 1 (worker 0 takes the actor's weights through handles, worker 1
    # by broadcast), the engine core in a process of its own.
    job = toy_job(**{"training.maxSteps": 3, "checkpoint.intervalSteps": 2, "training.colocation": "all",
                     "rollout.tensorParallelSize": 2})
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "rlhf_cli.cli", "run", str(job), "--output-dir", str(out)],
        capture_output=True, text=True, timeout=540,
        env={**os.environ, "RAY_AUTH_MODE": "disabled", ENGINE_PROCESS_ENV: "own"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "succeeded" in result.stdout

    metrics = [json.loads(line) for line in (out / "checkpoints" / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert {"reward_mean", "kl", "policy_loss", "entropy", "tokens_per_second", "learning_rate"} <= m.keys()
    # Steps 2 and 3 sampled from the weights synced to both tensor-parallel workers: vLLM and the trainer agree.
    assert all(m["logprob_diff"] < 1e-3 for m in metrics[1:]), metrics
    assert list((out / "checkpoints" / "logs" / "tensorboard").glob("events.out.tfevents.*"))

    checkpoints = out / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000002", "step-00000003"]
    final = AutoModelForCausalLM.from_pretrained(checkpoints / "final")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert final.state_dict().keys() == initial.state_dict().keys()
    assert any((final.state_dict()[k] != v).any() for k, v in initial.state_dict().items()), "the actor trained"
