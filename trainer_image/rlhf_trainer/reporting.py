"""Where a run's progress and metrics go: the terminal, metrics.jsonl and TensorBoard (under
checkpoint.path/logs), Weights & Biases and MLflow (spec.tracking), and in a cluster the RLHFJob
status and Prometheus. REPORTERS names each; `build_reporters` makes those a run has.

Metric names are the snake_case fields of the API's Metrics (reward_mean, kl, policy_loss, loss,
tokens_per_second, ...) plus whatever else the loop reports: reward/<source>, <role>/grad_norm,
time/<phase> (timing.py).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, runtime_checkable

from rlhf_api.v1alpha1 import MLflowSpec, RLHFJob, WandbSpec
from rlhf_api.validation import FieldError, InvalidJob

from . import redact
from .losses import Registry

log = logging.getLogger(__name__)


def _json_number(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None  # JSON has no NaN or infinity


@runtime_checkable
class Reporter(Protocol):
    def start(self, total_steps: int) -> None: ...

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def checkpoint(self, step: int, path: str) -> None: ...

    def finish(self, status: str, message: str = "") -> None: ...


class ProgressBar:
    """A tqdm bar over steps whose postfix shows reward, KL, loss and tokens per second."""

    # postfix label -> metric names, first present wins (online runs report policy_loss, offline loss)
    POSTFIX = {"reward": ("reward_mean",), "kl": ("kl",), "loss": ("policy_loss", "loss"), "tok/s": ("tokens_per_second",)}

    def __init__(self, description: str = "training"):
        self.description = description
        self.bar = None

    def start(self, total_steps: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total_steps, desc=self.description, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        postfix = {}
        for label, names in self.POSTFIX.items():
            value = next((float(metrics[name]) for name in names if name in metrics), None)
            if value is not None:
                postfix[label] = f"{value:.0f}" if label == "tok/s" else f"{value:.4g}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(step - self.bar.n)  # steps may jump (resume, logging every k steps)

    def checkpoint(self, step: int, path: str) -> None:
        self.bar.write(f"step {step}: checkpoint saved to {path}")

    def finish(self, status: str, message: str = "") -> None:
        self.bar.close()
        print(f"{status}{': ' + message if message else ''}")


class JsonlWriter:
    """One JSON object per logged step, {"step", "time", <metrics>...}, appended (a resumed run continues the file)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.file = None

    def start(self, total_steps: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        values = {name: _json_number(value) for name, value in metrics.items()}
        self.file.write(json.dumps({"step": step, "time": time.time(), **values}) + "\n")
        self.file.flush()  # readable while the run goes on

    def checkpoint(self, step: int, path: str) -> None:
        pass

    def finish(self, status: str, message: str = "") -> None:
        self.file.close()


class TensorBoardWriter:
    """Every metric as a TensorBoard scalar at its step."""

    def __init__(self, logdir: str | Path):
        self.logdir = Path(logdir)
        self.writer = None

    def start(self, total_steps: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.logdir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, float(value), step)
        self.writer.flush()

    def checkpoint(self, step: int, path: str) -> None:
        pass

    def finish(self, status: str, message: str = "") -> None:
        self.writer.close()


class MultiReporter:
    """Sends every call to each reporter in turn."""

    def __init__(self, reporters: list[Reporter]):
        self.reporters = reporters

    def start(self, total_steps: int) -> None:
        for reporter in self.reporters:
            reporter.start(total_steps)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for reporter in self.reporters:
            reporter.log(step, metrics)

    def checkpoint(self, step: int, path: str) -> None:
        for reporter in self.reporters:
            reporter.checkpoint(step, path)

    def finish(self, status: str, message: str = "") -> None:
        for reporter in self.reporters:
            reporter.finish(status, message)


# -- experiment trackers (spec.tracking) ------------------------------------------------------------

TRACKING_EXTRA = "pip install 'rlhf-operator[tracking]' (or use a trainer image built with the tracking extra)"


def _require(module: str, field: str):
    """Import a tracker's client, or refuse the job up front naming the package to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise InvalidJob([FieldError(field, f"needs the Python package {error.name or module!r}, which is not "
                                            f"installed: {TRACKING_EXTRA}, or remove {field}")]) from error


@dataclass(frozen=True)
class RunInfo:
    """What reporters are built from: the job, the run's name, where its logs go."""

    job: RLHFJob
    name: str  # namespace/name for a job with a namespace (every job in a cluster), else its name
    logs_dir: Path

    @classmethod
    def of(cls, job: RLHFJob, logs_dir: Path, default_name: str) -> RunInfo:
        name = job.metadata.get("name", default_name)
        namespace = job.metadata.get("namespace")
        return cls(job, f"{namespace}/{name}" if namespace else name, Path(logs_dir))

    @property
    def config(self) -> dict[str, Any]:
        """The job's spec: a tracker's run config (Secrets appear as their references, never values; literal
        environment values and URLs' credentials are redacted: a tracker's readers are not the job's)."""
        return redact.config(self.job.spec.model_dump(mode="json", by_alias=True, exclude_none=True))

    @property
    def uid(self) -> str | None:
        """The RLHFJob's uid in a cluster: a retried or resumed attempt continues the same tracker run."""
        return self.job.metadata.get("uid")


class WandbReporter:
    """Weights & Biases: one run per RLHFJob, named after it, its spec as the config, every metric at its step.
    Offline mode writes the run under <logs>/wandb (`wandb sync` uploads it later)."""

    def __init__(self, run: RunInfo, spec: WandbSpec):
        self.wandb = _require("wandb", "spec.tracking.wandb")
        self.info, self.spec, self.run = run, spec, None

    def start(self, total_steps: int) -> None:
        spec, info = self.spec, self.info
        info.logs_dir.mkdir(parents=True, exist_ok=True)
        settings = self.wandb.Settings(base_url=spec.base_url) if spec.base_url else None
        self.run = self.wandb.init(
            project=spec.project, entity=spec.entity, group=spec.group, tags=spec.tags or None, mode=spec.mode,
            name=info.name, config=info.config, dir=str(info.logs_dir), settings=settings,
            id=info.uid, resume="allow" if info.uid else None,
        )
        self.run.config.update({"total_steps": total_steps}, allow_val_change=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({name: float(value) for name, value in metrics.items()}, step=step)

    def checkpoint(self, step: int, path: str) -> None:
        self.run.summary["last_checkpoint"] = path

    def finish(self, status: str, message: str = "") -> None:
        if self.run is not None:  # None: start failed (and the run with it)
            self.run.finish(exit_code=0 if status == "succeeded" else 1)


class MLflowReporter:
    """MLflow: a run per RLHFJob in spec.experiment, named after it and tagged with it, its spec as
    params (dotted keys), every metric at its step. A tracking server that fails mid-run costs its
    metrics, not the run."""

    UID_TAG, JOB_TAG = "rlhf.dev/uid", "rlhf.dev/job"
    MAX_PARAM = 6000  # characters MLflow keeps of a param value

    def __init__(self, run: RunInfo, spec: MLflowSpec):
        _require("mlflow", "spec.tracking.mlflow")
        from mlflow.tracking import MlflowClient

        if spec.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store otherwise
        self.client, self.info, self.spec, self.run_id = MlflowClient(spec.tracking_uri), run, spec, None

    def start(self, total_steps: int) -> None:
        from mlflow.entities import Param

        client, info = self.client, self.info
        experiment = "0"  # MLflow's Default experiment
        if self.spec.experiment:
            found = client.get_experiment_by_name(self.spec.experiment)
            experiment = found.experiment_id if found else client.create_experiment(self.spec.experiment)
        earlier = client.search_runs([experiment], f"tags.`{self.UID_TAG}` = '{info.uid}'") if info.uid else []
        if earlier:  # a retried or resumed attempt of the same RLHFJob
            self.run_id = earlier[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
            return
        tags = {self.JOB_TAG: info.name, **({self.UID_TAG: info.uid} if info.uid else {})}
        self.run_id = client.create_run(experiment, run_name=info.name, tags=tags).info.run_id
        params = {**_flatten(info.config), "total_steps": total_steps}
        client.log_batch(self.run_id, params=[Param(key, str(value)[:self.MAX_PARAM]) for key, value in params.items()])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._send(f"step {step}'s metrics", self.client.log_batch, self.run_id,
                   metrics=[Metric(name, float(value), now, step) for name, value in metrics.items()])

    def checkpoint(self, step: int, path: str) -> None:
        self._send(f"step {step}'s checkpoint", self.client.set_tag, self.run_id, "last_checkpoint", path)

    @staticmethod
    def _send(what: str, call: Callable, *args: Any, **kwargs: Any) -> None:
        try:
            call(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the tracker is a reporter: training goes on
            log.warning("MLflow did not take %s: %s", what, error)

    def finish(self, status: str, message: str = "") -> None:
        if self.run_id is not None:  # None: start failed (and the run with it)
            self._send("the run's end", self.client.set_terminated, self.run_id,
                       "FINISHED" if status == "succeeded" else "FAILED")


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys (training.kl.coef); lists stay whole, as JSON."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, dict)) else value
    return flat


# -- the registry: every reporter a run may have, each built from the run or None when it does not apply

REPORTERS: Registry[Callable[[RunInfo], "Reporter | None"]] = Registry("reporter")
REPORTERS.register("progress")(lambda run: ProgressBar(run.name))
REPORTERS.register("jsonl")(lambda run: JsonlWriter(run.logs_dir / "metrics.jsonl"))
REPORTERS.register("tensorboard")(lambda run: TensorBoardWriter(run.logs_dir / "tensorboard"))
REPORTERS.register("wandb")(lambda run: run.job.spec.tracking.wandb and WandbReporter(run, run.job.spec.tracking.wandb))
REPORTERS.register("mlflow")(lambda run: run.job.spec.tracking.mlflow and MLflowReporter(run, run.job.spec.tracking.mlflow))


@REPORTERS.register("status")
def _status(run: RunInfo) -> Reporter | None:
    """The RLHFJob's status, in a cluster (the operator sets the job's name and namespace)."""
    from .kube_status import KubernetesStatusReporter

    return KubernetesStatusReporter.from_environment()


@REPORTERS.register("prometheus")
def _prometheus(run: RunInfo) -> Reporter | None:
    """Prometheus gauges on the head pod's metrics port, in a cluster."""
    from .prometheus import PrometheusReporter

    return PrometheusReporter.from_environment()


def build_reporters(run: RunInfo) -> list[Reporter]:
    """Every registered reporter that applies to the run; raises InvalidJob when a configured
    tracker's package is missing."""
    return [reporter for build in REPORTERS.values() if (reporter := build(run)) is not None]
