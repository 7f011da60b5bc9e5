"""Ways for a test to start `rlhf run` and look into it: its Ray actors' processes, its logged steps, its
newest checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from rlhf_trainer import checkpoint


def ray_actor_pids(run: subprocess.Popen, actor: str) -> list[int]:
    """PIDs of the run's Ray worker processes serving `actor` (their title is ray::<Actor>...)."""
    ps = subprocess.run(["ps", "-eo", "pid=,sid=,args="], capture_output=True, text=True, check=True).stdout
    found = []
    for line in ps.splitlines():
        pid, sid, args = line.split(None, 2)
        if int(sid) == run.pid and args.startswith(f"ray::{actor}"):
            found.append(int(pid))
    return found


def newest(checkpoints: Path) -> int | None:
    """The step of the newest complete checkpoint under `checkpoints`, None before the first."""
    found = checkpoint.latest(checkpoints)
    return json.loads((found / checkpoint.STATE_FILE).read_text())["step"] if found else None


def start(job: Path, out: Path, log: Path, **env: str) -> subprocess.Popen:
    # Its own session: its Ray processes are found by session id and all killed at the end.
    return subprocess.Popen([sys.executable, "-m", "rlhf_cli.cli", "run", str(job), "--output-dir", str(out)],
                            env={**os.environ, "RAY_AUTH_MODE": "disabled", **env}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def metrics_logged(out: Path) -> list[dict]:
    """Every row of the run's metrics.jsonl (all runs of that output directory, in order); none before the first."""
    path = out / "checkpoints" / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def steps_logged(out: Path) -> list[int]:
    return [row["step"] for row in metrics_logged(out)]


def finish(run: subprocess.Popen, timeout: float = 300) -> int:
    try:
        return run.wait(timeout)
    finally:
        try:
            os.killpg(run.pid, signal.SIGKILL)  # what is left of its Ray instance
        except ProcessLookupError:
            pass
