"""Ways for a test to look into a running `rlhf run`: its Ray actors' processes, its newest checkpoint."""

from __future__ import annotations

import json
import subprocess
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
