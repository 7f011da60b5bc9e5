"""Reporters: the terminal progress bar, the JSONL file, TensorBoard, and fan-out to several."""

from __future__ import annotations

import io
import json
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlhf_api.validation import validate
from rlhf_trainer.reporting import (
    REPORTERS, JsonlWriter, MLflowReporter, MultiReporter, ProgressBar, Reporter, RunInfo, TensorBoardWriter,
    WandbReporter, build_reporters,
)
from rlhf_trainer.timing import PhaseTimer

STEPS = [
    (1, {"reward_mean": 0.25, "kl": 0.0, "policy_loss": -0.5, "tokens_per_second": 1234.56, "reward/letter": 0.25}),
    (2, {"reward_mean": 0.5, "kl": 0.001, "policy_loss": -0.25, "tokens_per_second": 1500.0, "reward/letter": 0.5}),
]


def run(reporter: Reporter, steps=STEPS, total: int = 4) -> None:
    reporter.start(total)
    for step, metrics in steps:
        reporter.log(step, metrics)
    reporter.checkpoint(2, "/ckpt/step-2")
    reporter.finish("Succeeded", "2 steps")


def test_every_reporter_follows_the_protocol(tmp_path):
    for reporter in [ProgressBar(), JsonlWriter(tmp_path / "m.jsonl"), TensorBoardWriter(tmp_path / "tb"), MultiReporter([])]:
        assert isinstance(reporter, Reporter)


def test_jsonl_has_one_line_per_step_and_continues_after_a_restart(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    run(JsonlWriter(path))
    run(JsonlWriter(path), steps=[(3, {"reward_mean": 0.75, "kl": math.nan, "loss": math.inf})])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert {k: v for k, v in rows[1].items() if k != "time"} == {"step": 2, **STEPS[1][1]}
    assert rows[2]["kl"] is None and rows[2]["loss"] is None  # NaN and inf are not JSON
    assert rows[0]["time"] <= rows[1]["time"] <= rows[2]["time"]


def test_jsonl_lines_are_readable_while_the_run_goes_on(tmp_path):
    writer = JsonlWriter(tmp_path / "m.jsonl")
    writer.start(10)
    writer.log(1, {"reward_mean": 1.0})
    assert json.loads((tmp_path / "m.jsonl").read_text())["reward_mean"] == 1.0
    writer.finish("Failed", "killed")


def test_tensorboard_has_a_scalar_series_per_metric(tmp_path):
    run(TensorBoardWriter(tmp_path / "tb"))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(STEPS[0][1])
    series = events.Scalars("reward_mean")
    assert [(e.step, e.value) for e in series] == [(1, 0.25), (2, 0.5)]
    assert events.Scalars("reward/letter")[1].value == 0.5


def test_progress_bar_shows_reward_kl_loss_and_throughput(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr("sys.stderr", out)
    monkeypatch.setattr("sys.stdout", out)
    bar = ProgressBar("grpo")
    bar.start(4)
    bar.log(*STEPS[0])
    assert bar.bar.n == 1 and bar.bar.total == 4
    assert bar.bar.postfix == "reward=0.25, kl=0, loss=-0.5, tok/s=1235"
    bar.log(3, {"loss": 0.125})  # offline runs report loss; steps may jump
    assert bar.bar.n == 3 and bar.bar.postfix == "loss=0.125"
    bar.checkpoint(3, "/ckpt/step-3")
    bar.finish("Succeeded")
    text = out.getvalue()
    assert "step 3: checkpoint saved to /ckpt/step-3" in text and text.rstrip().endswith("Succeeded")
    assert "grpo" in text and "3/4" in text


def test_progress_bar_prefers_policy_loss_over_loss(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    bar = ProgressBar()
    bar.start(2)
    bar.log(1, {"loss": 9.0, "policy_loss": 0.5})
    assert bar.bar.postfix == "loss=0.5"


class Recorder:
    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def start(self, total_steps):
        self.calls.append((self.name, "start", total_steps))

    def log(self, step, metrics):
        self.calls.append((self.name, "log", step, metrics))

    def checkpoint(self, step, path):
        self.calls.append((self.name, "checkpoint", step, path))

    def finish(self, status, message=""):
        self.calls.append((self.name, "finish", status, message))


def test_multi_reporter_forwards_every_call_in_order(tmp_path):
    calls = []
    run(MultiReporter([Recorder(calls, "a"), JsonlWriter(tmp_path / "m.jsonl"), Recorder(calls, "b")]))
    assert calls == [
        ("a", "start", 4), ("b", "start", 4),
        ("a", "log", *STEPS[0]), ("b", "log", *STEPS[0]),
        ("a", "log", *STEPS[1]), ("b", "log", *STEPS[1]),
        ("a", "checkpoint", 2, "/ckpt/step-2"), ("b", "checkpoint", 2, "/ckpt/step-2"),
        ("a", "finish", "Succeeded", "2 steps"), ("b", "finish", "Succeeded", "2 steps"),
    ]
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("value", [math.nan, 1e30])
def test_progress_bar_survives_odd_values(monkeypatch, value):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    bar = ProgressBar()
    bar.start(1)
    bar.log(1, {"reward_mean": value, "tokens_per_second": value})
    assert bar.bar.postfix.startswith("reward=")


def _job(**spec):
    doc = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "tiny"},
           "spec": {"algorithm": "sft", "models": {"actor": {"path": "org/model"}},
                    "data": {"sft": {"sources": [{"path": "org/data"}]}}, **spec}}
    return validate(doc)


def test_a_run_without_trackers_gets_the_terminal_jsonl_and_tensorboard_in_its_logs_dir(tmp_path, monkeypatch):
    for name in ("RLHF_JOB_NAME", "RLHF_JOB_NAMESPACE", "RLHF_METRICS_PORT"):
        monkeypatch.delenv(name, raising=False)  # not in a cluster: no status or Prometheus reporter
    reporters = build_reporters(RunInfo.of(_job(), tmp_path / "logs", "ignored"))
    assert [type(r) for r in reporters] == [ProgressBar, JsonlWriter, TensorBoardWriter]
    assert reporters[1].path == tmp_path / "logs" / "metrics.jsonl"
    assert reporters[2].logdir == tmp_path / "logs" / "tensorboard"
    assert list(REPORTERS) == ["progress", "jsonl", "tensorboard", "wandb", "mlflow", "status", "prometheus"]


def test_configured_trackers_join_the_reporters(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # restored after: the reporter opts the process in
    job = _job(tracking={"wandb": {"project": "p"}, "mlflow": {"trackingUri": (tmp_path / "mlruns").as_uri()}})
    kinds = [type(r) for r in build_reporters(RunInfo.of(job, tmp_path, "tiny"))]
    assert WandbReporter in kinds and MLflowReporter in kinds


def test_the_run_is_named_namespace_slash_name_in_a_cluster_and_carries_the_spec(tmp_path):
    job = _job(tracking={"wandb": {"project": "p", "apiKeySecret": {"name": "wandb", "key": "key"}}})
    local = RunInfo.of(job, tmp_path, "tiny")
    assert (local.name, local.uid) == ("tiny", None)
    job.metadata.update(namespace="ml-team", uid="1234")
    cluster = RunInfo.of(job, tmp_path, "tiny")
    assert (cluster.name, cluster.uid) == ("ml-team/tiny", "1234")
    assert cluster.config["algorithm"] == "sft"
    assert cluster.config["tracking"]["wandb"]["apiKeySecret"] == {"name": "wandb", "key": "key"}


def test_phase_timer_sums_each_phase_and_starts_over_after_take():
    timer = PhaseTimer()
    with timer.phase("step"):
        for _ in range(2):
            with timer.phase("generation"):
                pass
        with timer.phase("evaluation", split=False):
            with timer.phase("generation"):  # an evaluation's own sampling: not the step's generation
                with timer.phase("rewards"):
                    pass
    taken = timer.take()
    assert set(taken) == {"time/step", "time/generation", "time/evaluation"}
    assert taken["time/generation"] + taken["time/evaluation"] <= taken["time/step"]
    assert timer.take() == {}
    with timer.phase("rewards"):  # split=False ended: phases are timed apart again
        pass
    assert set(timer.take()) == {"time/rewards"}
