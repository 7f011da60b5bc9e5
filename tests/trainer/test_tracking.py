"""Experiment tracking end to end on the tiny model: a real `rlhf run` reporting to Weights & Biases
(offline mode) and MLflow (a file store) at once, read back from W&B's run file and MLflow's store
API; metrics.jsonl and TensorBoard under checkpoint.path/logs, the run's checkpoints and final model;
gradient norms (checked against a hand computation under ZeRO-0, 2 and 3) and phase timings; trackers
refused up front when their package is missing or their settings are incomplete."""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf_api.v1alpha1 import DataSpec, DatasetSpec
from rlhf_api.validation import InvalidJob, validate
from rlhf_trainer.losses import token_log_probs
from rlhf_trainer.offline_data import OfflineDataset, pack
from rlhf_trainer.reporting import JsonlWriter
from rlhf_trainer.run import EXIT_INVALID, run
from rlhf_trainer.tiny import toy_prompts
from rlhf_trainer.workers.engine import position_ids
from rlhf_trainer.workers.rollout import ENGINE_PROCESS_ENV

pytestmark = pytest.mark.timeout(600)

ONLINE_PHASES = ("time/generation", "time/rewards", "time/experience", "time/update", "time/weight_sync")
STEPS = 3  # the tracked run's: checkpoints at 2 and 3, steps 2 and 3 sampled from synced weights


# -- reading W&B's offline run file ------------------------------------------------------------------

def wandb_records(path: Path):
    """The protobuf records of a .wandb file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log framing: 32 KiB blocks of chunks, each (crc32 u32, length u16, type u8) + data,
    where type 1 is a whole record and 2/3/4 its first/middle/last parts."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    pos, parts = header, b""
    while pos + header <= len(data):
        if block - pos % block < header:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if kind == 0:
            break  # zeroes: the end of what was written
        parts += data[pos + header:pos + header + length]
        pos += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def read_wandb_run(logs: Path) -> tuple[dict, dict, dict[int, dict]]:
    """(the run record's fields, its config, history by step) of the one offline run under logs/wandb."""
    [run_file] = logs.glob("wandb/offline-run-*/run-*.wandb")
    run, config, history = {}, {}, {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run = {"name": r.display_name, "project": r.project, "group": r.run_group, "tags": list(r.tags)}
            config.update({c.key: json.loads(c.value_json) for c in r.config.update})
        elif kind == "config":
            config.update({c.key: json.loads(c.value_json) for c in record.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[record.history.step.num] = items
    return run, config, history


# -- the online run with both trackers ----------------------------------------------------------------

def test_a_tracked_run_reports_to_wandb_mlflow_jsonl_and_tensorboard(toy_job, tiny_model, tmp_path, monkeypatch):
    """One 3-step tiny GRPO `rlhf run` reporting to W&B (offline) and MLflow (file store); each check_* below
    reads one of its outputs back. The hybrid engine's placement, as on GPUs: every model on bundle 0 and a vLLM
    engine of two tensor-parallel workers on bundles 0 and 1 (worker 0 takes the actor's weights through handles,
    worker 1 by broadcast), the engine core in a process of its own. (test_run_cli.py's run checks were this
    run's before it: one `rlhf run` of the same job for both.)"""
    mlruns = tmp_path / "mlruns"
    job = toy_job(**{
        "training.maxSteps": STEPS, "training.colocation": "all", "rollout.tensorParallelSize": 2,
        "checkpoint.intervalSteps": 2,
        "tracking": {
            "wandb": {"project": "rlhf-tests", "group": "tiny", "tags": ["cpu", "grpo"], "mode": "offline",
                      "apiKeySecret": {"name": "wandb", "key": "api-key"}},
            "mlflow": {"trackingUri": mlruns.as_uri(), "experiment": "tiny-grpo"},
        },
    })
    out = tmp_path / "out"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", ENGINE_PROCESS_ENV: "own", "WANDB_MODE": "offline",
           "WANDB_DIR": str(tmp_path / "wandb-dir"), "WANDB_SILENT": "true"}
    result = subprocess.run([sys.executable, "-m", "rlhf_cli.cli", "run", str(job), "--output-dir", str(out)],
                            capture_output=True, text=True, timeout=540, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "succeeded" in result.stdout
    logs = out / "checkpoints" / "logs"
    rows = {row["step"]: row for row in map(json.loads, (logs / "metrics.jsonl").read_text().splitlines())}
    learning_rate = yaml.safe_load(job.read_text())["spec"]["training"]["learningRate"]

    check_metrics_checkpoints_and_the_final_model(rows, out / "checkpoints", tiny_model)
    check_tensorboard_under_the_checkpoint_path(logs, rows)
    check_grad_norm_and_phases(rows)
    check_wandb_offline_run(logs, rows, learning_rate)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    spec = validate(yaml.safe_load(job.read_text())).spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    check_mlflow_file_store(mlruns, rows, learning_rate, spec)


def check_metrics_checkpoints_and_the_final_model(rows: dict[int, dict], checkpoints: Path,
                                                  initial_model: Path) -> None:
    for row in rows.values():
        assert {"reward_mean", "kl", "policy_loss", "entropy", "tokens_per_second", "learning_rate"} <= row.keys()
    # Steps 2 and 3 sampled from the weights synced to both tensor-parallel workers: vLLM and the trainer agree.
    assert all(rows[step]["logprob_diff"] < 1e-3 for step in range(2, STEPS + 1)), rows
    assert sorted(p.name for p in checkpoints.glob("step-*")) == ["step-00000002", "step-00000003"]
    final = AutoModelForCausalLM.from_pretrained(checkpoints / "final").state_dict()
    initial = AutoModelForCausalLM.from_pretrained(initial_model).state_dict()
    assert final.keys() == initial.keys()
    assert any((final[k] != v).any() for k, v in initial.items()), "the actor trained"


def check_tensorboard_under_the_checkpoint_path(logs: Path, rows: dict[int, dict]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert sorted(rows) == list(range(1, STEPS + 1))
    events = EventAccumulator(str(logs / "tensorboard"))
    events.Reload()
    assert {"reward_mean", "actor/grad_norm", "time/step", *ONLINE_PHASES} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("actor/grad_norm")] == sorted(rows)


def check_grad_norm_and_phases(rows: dict[int, dict]) -> None:
    for row in rows.values():
        assert math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0, row
        phases = [row[key] for key in ONLINE_PHASES]
        assert all(seconds > 0 for seconds in phases), row
        # The phases are measured inside the step: together they cannot exceed it.
        assert sum(phases) <= row["time/step"], row


def check_wandb_offline_run(logs: Path, rows: dict[int, dict], learning_rate: float) -> None:
    run, config, history = read_wandb_run(logs)
    assert run == {"name": "tiny-grpo-cpu", "project": "rlhf-tests", "group": "tiny", "tags": ["cpu", "grpo"]}
    assert config["algorithm"] == "grpo"
    assert config["training"]["learningRate"] == learning_rate
    assert config["tracking"]["wandb"]["apiKeySecret"] == {"name": "wandb", "key": "api-key"}  # the reference only
    assert config["total_steps"] == STEPS
    assert sorted(history) == sorted(rows)
    for step, items in history.items():
        for key in ("reward_mean", "actor/grad_norm", "time/generation"):
            assert items[key] == pytest.approx(rows[step][key]), key


def dotted_leaves(tree: dict, prefix: str = "") -> set[str]:
    return set().union(*[dotted_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {prefix + k}
                         for k, v in tree.items()])


def check_mlflow_file_store(mlruns: Path, rows: dict[int, dict], learning_rate: float, spec: dict) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlruns.as_uri())
    experiment = client.get_experiment_by_name("tiny-grpo")
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tiny-grpo-cpu" and run.info.status == "FINISHED"
    assert run.data.tags["rlhf.dev/job"] == "tiny-grpo-cpu"
    params = run.data.params
    assert params["algorithm"] == "grpo" and params["total_steps"] == str(STEPS)
    assert float(params["training.learningRate"]) == learning_rate
    assert params["tracking.mlflow.experiment"] == "tiny-grpo"
    assert set(params) == dotted_leaves(spec) | {"total_steps"}  # the whole spec, in more than one batch of 100
    for key in ("reward_mean", "actor/grad_norm", "time/weight_sync"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in history] == [(s, pytest.approx(rows[s][key])) for s in sorted(rows)], key


def test_ppo_reports_actor_and_critic_gradient_norms_under_zero3(toy_job, local_ray, tmp_path):
    job = toy_job(**{"algorithm": "ppo", "training.zeroStage": 3, "training.maxSteps": 2,
                     "training.colocation": "actor-reference", "checkpoint.intervalSteps": 0,
                     "checkpoint.exportHf": False})
    metrics_file = tmp_path / "metrics.jsonl"
    assert run(job, output_dir=tmp_path / "out", reporters=[JsonlWriter(metrics_file)]) == 0
    for row in map(json.loads, metrics_file.read_text().splitlines()):
        for key in ("actor/grad_norm", "critic/grad_norm"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
        assert set(ONLINE_PHASES) <= row.keys()


# -- gradient norms under ZeRO-0, 2 and 3, against the hand computation ---------------------------------

def _sft_job(directory: Path, model: Path, zero_stage: int, records: list[dict]) -> Path:
    data = directory / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    job = {
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": f"norm-zero{zero_stage}"},
        "spec": {
            "algorithm": "sft",
            "models": {"actor": {"path": str(model), "dtype": "float32"}},
            "data": {"sft": {"sources": [{"path": data.name}]}, "maxPromptTokens": 48, "maxTokens": 64},
            # One optimizer step over the whole dataset, split over two ranks: its gradient is the
            # gradient of the token-mean NLL of every record, whatever the shuffle.
            "training": {"zeroStage": zero_stage, "bf16": False, "trainBatchSize": len(records),
                         "microTrainBatchSize": len(records) // 2, "lossAggregation": "token-mean",
                         "maxSteps": 1, "maxGradNorm": 1.0e-3, "seed": 7},
            "resources": {"nodes": 1, "gpusPerNode": 0, "gpus": {"actor": 2}},
            "checkpoint": {"path": "checkpoints", "exportHf": False},
        },
    }
    path = directory / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _hand_grad_norm(model_dir: Path, records: list[dict], tmp_path: Path) -> float:
    """The global norm of the gradient of the token-mean response NLL over all records, by plain torch."""
    data = tmp_path / "hand.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = OfflineDataset.from_spec(DatasetSpec(sources=[{"path": str(data)}]),
                                       DataSpec(max_prompt_tokens=48, max_tokens=64), tokenizer,
                                       response_keys=("response",), base_dir=tmp_path, seed=0, name="sft")
    batch = pack(dataset.items, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    logits = model(input_ids=batch.sequences, attention_mask=batch.attention_mask,
                   position_ids=position_ids(batch.attention_mask)).logits[:, -batch.num_actions - 1:-1]
    log_probs = token_log_probs(logits.float(), batch.sequences[:, -batch.num_actions:])
    mask = batch.action_mask.float()
    (-(log_probs * mask).sum() / mask.sum()).backward()
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_offline_grad_norm_is_the_global_pre_clip_norm_under_every_zero_stage(
        zero_stage, tiny_model, local_ray, tmp_path):
    records = [{"prompt": r["prompt"], "response": r["label"] * 3} for r in toy_prompts(8, seed=3)]
    job = _sft_job(tmp_path, tiny_model, zero_stage, records)
    metrics_file = tmp_path / "metrics.jsonl"
    assert run(job, output_dir=tmp_path / "out", reporters=[JsonlWriter(metrics_file)]) == 0
    [row] = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    # maxGradNorm is far below the norm: a clipped norm would show here as 1e-3.
    assert row["actor/grad_norm"] == pytest.approx(_hand_grad_norm(tiny_model, records, tmp_path), rel=1e-3)
    assert {"time/update", "time/step"} <= row.keys()


# -- refused up front ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tracker, module, spec", [
    ("wandb", "wandb", {"project": "p"}),
    ("mlflow", "mlflow", {"trackingUri": "http://mlflow.example"}),
])
def test_a_tracker_whose_package_is_missing_is_refused_naming_the_extra(
        tracker, module, spec, toy_job, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # what `import` sees when the package is not installed
    job = toy_job(**{f"tracking.{tracker}": spec})
    assert run(job, output_dir=tmp_path / "out") == EXIT_INVALID
    error = capsys.readouterr().err
    assert f"spec.tracking.{tracker}" in error and "rlhf-operator[tracking]" in error, error


def test_mlflow_basic_auth_needs_both_secrets():
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "manifests/examples/tiny-grpo-cpu-job.yaml").read_text())
    doc["spec"]["tracking"] = {"mlflow": {"trackingUri": "https://mlflow.example",
                                          "usernameSecret": {"name": "mlflow", "key": "user"}}}
    with pytest.raises(InvalidJob, match="passwordSecret"):
        validate(doc)
    doc["spec"]["tracking"]["mlflow"]["trackingUri"] = "mlflow.example"  # no scheme
    with pytest.raises(InvalidJob, match="trackingUri"):
        validate(doc)


def test_a_retried_attempt_of_a_cluster_job_continues_its_tracker_runs(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from rlhf_trainer.reporting import MLflowReporter, RunInfo, WandbReporter

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_SILENT", "true")
    uid = "6b1c6c2e-0000-4000-8000-000000000001"
    job = validate({
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "tiny", "namespace": "ml", "uid": uid},
        "spec": {"algorithm": "sft", "models": {"actor": {"path": "org/model"}},
                 "data": {"sft": {"sources": [{"path": "org/data"}]}},
                 "tracking": {"mlflow": {"trackingUri": (tmp_path / "mlruns").as_uri(), "experiment": "e"},
                              "wandb": {"project": "p", "mode": "offline"}}}})
    info = RunInfo.of(job, tmp_path / "logs", "unused")
    for attempt, status in enumerate(["failed", "succeeded"], start=1):  # KubeRay's retry after a failure
        for reporter in (MLflowReporter(info, job.spec.tracking.mlflow), WandbReporter(info, job.spec.tracking.wandb)):
            reporter.start(4)
            reporter.log(attempt, {"loss": 1.0 / attempt})
            reporter.finish(status)
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert (run.info.run_name, run.info.status) == ("ml/tiny", "FINISHED")
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 1.0), (2, 0.5)]
    runs = sorted((tmp_path / "logs" / "wandb").glob("offline-run-*"))
    # one W&B run id (`wandb sync` joins them), read from the run file: a directory's name gains a suffix when both
    # attempts start within the same second
    assert len(runs) == 2 and all((run_dir / f"run-{uid}.wandb").is_file() for run_dir in runs)
