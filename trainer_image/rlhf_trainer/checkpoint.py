"""Checkpoints of a run: `<root>/step-<N>/` holding a DeepSpeed checkpoint per trained model group
(`actor/`, `critic/` or `rm/`: weights, optimizer and scheduler state), the weights of the frozen groups
that a run changes (`reference/` of training.referenceRefresh, in Hugging Face format) and `trainer_state.json` (the
step and the data loader's position, under "prompts" or "data": loop.RunLoop.data_key). The state
file is written last, so a directory without it is an interrupted save and is never resumed from.
The newest `keep` checkpoints are kept.

Every rank writes its own shards, on whichever Ray node it runs, and the driver writes the state
file, prunes and resumes: the directory must be one that every node holding a model group shares
(in a cluster, the claim of checkpoint.pvc that every pod mounts). `require_shared` checks that
before any model loads.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

STATE_FILE = "trainer_state.json"
PREFIX = "step-"
# Test seam: RLHF_TRAINER_CRASH_IN_SAVE=<step> ends the driver as abruptly as a SIGKILL would, after
# the model groups wrote that step's checkpoint and before its state file: an interrupted save
# (tests/trainer/test_faults_kill.py resumes from the checkpoint before it).
CRASH_IN_SAVE_ENV = "RLHF_TRAINER_CRASH_IN_SAVE"
CRASH_EXIT_CODE = 137


class CheckpointNotShared(RuntimeError):
    """The checkpoint directory is not one directory that the driver and every model group's node share."""


def require_shared(root: Path, group: PlacementGroup) -> None:
    """Create `root` and check that every node holding a bundle of `group` reads what this process wrote
    there and writes what this process reads: else the ranks' shards, the state file, `final/` and
    `best/` would be split over the nodes' own disks, and a resume would find none of them whole."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        token = uuid.uuid4().hex
        (root / f".shared-{token}").write_text(token)
    except OSError as error:
        raise CheckpointNotShared(f"checkpoint.path {root} cannot be written: {error.strerror}. Point it at a "
                                  "directory this user may create and write (in a cluster, on the checkpoint.pvc "
                                  "claim)") from None
    here = ray.get_runtime_context().get_node_id()
    nodes = sorted(set(placement_group_table(group)["bundles_to_node_id"].values()) - {here})
    probe = ray.remote(num_cpus=0)(_write_back)
    answers = ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                      .remote(str(root), token, node) for node in nodes])
    echoed = {path.name.rsplit("-", 1)[1] for path in root.glob(f".shared-{token}-*") if path.read_text() == token}
    unshared = [f"{node[:12]} ({answer or 'its file is not here'})" for node, answer in zip(nodes, answers)
                if node not in echoed]
    for leftover in root.glob(f".shared-{token}*"):
        leftover.unlink()
    if unshared:
        raise CheckpointNotShared(
            f"checkpoint.path {root} is not one directory shared by the Ray nodes: the nodes "
            f"{', '.join(unshared)} do not see it as the driver does, yet their ranks write checkpoint shards "
            "there. Put it on storage every node mounts: in a cluster set checkpoint.pvc to a ReadWriteMany "
            "claim (ReadWriteOnce will do for a job of one node); outside one, a shared filesystem")


def _write_back(root: str, token: str, node: str) -> str:
    """On a model group's node: "" once the driver's token was read and echoed beside it, else what went wrong."""
    try:
        if Path(root, f".shared-{token}").read_text() != token:
            return "reads another file"
        Path(root, f".shared-{token}-{node}").write_text(token)
    except OSError as error:
        return error.strerror or type(error).__name__
    return ""


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def _complete(root: Path) -> list[Path]:
    """Finished checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"{PREFIX}*") if (p / STATE_FILE).is_file())


def latest(root: Path) -> Path | None:
    complete = _complete(root)
    return complete[-1] if complete else None


def save(root: Path, step: int, groups: dict, state: dict[str, Any], keep: int, frozen: dict | None = None) -> Path:
    """Write the groups' DeepSpeed checkpoints and the `frozen` groups' weights, then the trainer state; drop all
    but the newest `keep`."""
    path = step_dir(root, step)
    if path.exists():
        shutil.rmtree(path)  # an interrupted save of this very step
    path.mkdir(parents=True)
    ray.get([ref for role, group in groups.items() for ref in group.call("save_checkpoint", str(path), role)] +
            [ref for role, group in (frozen or {}).items() for ref in group.call("save_pretrained", str(path / role))])
    if os.environ.get(CRASH_IN_SAVE_ENV) == str(step):
        os._exit(CRASH_EXIT_CODE)
    temporary = path / f"{STATE_FILE}.tmp"
    temporary.write_text(json.dumps({"step": step, **state}, indent=2))
    os.replace(temporary, path / STATE_FILE)
    _prune(root, keep)
    return path


def load(path: Path, groups: dict, frozen: dict | None = None) -> dict[str, Any]:
    """Restore the groups (and the `frozen` groups' weights) from a checkpoint directory; returns the trainer
    state (with "step")."""
    ray.get([ref for role, group in groups.items() for ref in group.call("load_checkpoint", str(path), role)] +
            [ref for role, group in (frozen or {}).items() for ref in group.call("load_weights", str(path / role))])
    return json.loads((path / STATE_FILE).read_text())


def _prune(root: Path, keep: int) -> None:
    complete = _complete(root)
    newest = complete[-1]
    stale = complete[:-keep] + [p for p in root.glob(f"{PREFIX}*") if p not in complete and p.name < newest.name]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


# -- the best checkpoint (spec.evaluation.bestMetric) ----------------------------------------------

BEST = "best"  # <root>/best/: the actor in Hugging Face format, and BEST_FILE
BEST_FILE = "best.json"  # {"step", "metric", "value"}


def save_best(root: Path, group, record: dict[str, Any]) -> Path:
    """Export the group's model to <root>/best (through a temporary directory, so a crash leaves the previous
    best whole) with `record` (step, metric, value) beside it."""
    path, temporary = root / BEST, root / f"{BEST}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    ray.get(group.call("save_pretrained", str(temporary)))
    (temporary / BEST_FILE).write_text(json.dumps(record, indent=2))
    shutil.rmtree(path, ignore_errors=True)
    os.replace(temporary, path)
    return path


def best_record(root: Path) -> dict[str, Any] | None:
    """The record of the best checkpoint so far (a resumed run compares with it), or None."""
    file = root / BEST / BEST_FILE
    return json.loads(file.read_text()) if file.is_file() else None
