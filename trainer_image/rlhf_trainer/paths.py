"""Where a run writes (a job file's own paths are read by rlhf_api.paths)."""

from __future__ import annotations

from pathlib import Path

from rlhf_api import contract
from rlhf_api.v1alpha1 import RLHFJobSpec

LOGS = contract.LOGS_DIR  # metrics.jsonl, tensorboard/ and the trackers' local files, inside the checkpoint directory


def checkpoint_dir(spec: RLHFJobSpec, output_dir: Path) -> Path:
    """Where a run writes everything it leaves: checkpoint.path, relative to the run's output
    directory (`rlhf run --output-dir`, default runs/<job name>); an absolute path (the cluster's
    checkpoint volume) stays as it is. Made absolute here: ranks on other Ray nodes run in other
    working directories."""
    return (Path(output_dir) / spec.checkpoint.path).absolute()


def logs_dir(spec: RLHFJobSpec, output_dir: Path) -> Path:
    """metrics.jsonl, TensorBoard events and offline tracker runs: beside the checkpoints, so they
    survive the pod on the checkpoint volume and a resumed run continues them."""
    return checkpoint_dir(spec, output_dir) / LOGS
