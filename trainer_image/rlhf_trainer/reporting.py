"""Where a run's progress and metrics go: the terminal, a JSONL file, TensorBoard (and, later, the RLHFJob status).

Metric names are the snake_case fields of the API's Metrics (reward_mean, kl, policy_loss, loss,
tokens_per_second, ...) plus whatever else the loop reports (e.g. reward/<source>).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Protocol, runtime_checkable


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
