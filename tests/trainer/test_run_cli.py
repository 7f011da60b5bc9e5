"""`rlhf run`: exit status 0 / 1 / 2 and invalid combinations refused before anything loads. What a whole run
writes (metrics, TensorBoard, checkpoints, the final model) is test_tracking.py's tracked run's."""

from __future__ import annotations

import sys

import pytest
import ray

from rlhf_api import contract
from rlhf_cli.cli import main
from rlhf_trainer.loop import RunLoop

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


