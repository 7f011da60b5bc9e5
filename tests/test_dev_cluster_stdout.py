"""`eval "$(make -s dev-cluster-up)"` runs whatever the command writes on stdout: only the export may be there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# devcluster.main with its `up` replaced by one that writes as the real one's libraries and children can
# (a print, a child process on the inherited stdout) before it exports the cluster's kubeconfig.
NOISY_UP = """
import os, sys
from e2e.pods import devcluster

def up(state, *export):
    print("[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.")
    os.system("echo a child process speaking")
    print(f"export KUBECONFIG={state}/kubeconfig", file=export[0] if export else sys.stdout)
    return 0

devcluster.up = up
sys.argv = ["devcluster", "--state-dir", "/tmp/dev-state"]
sys.exit(devcluster.main())
"""


def test_the_up_commands_stdout_is_the_export_alone_whatever_else_is_printed():
    """A fresh clone's `make dev-cluster-up` printed DeepSpeed's accelerator warning on stdout (transformers
    loads DeepSpeed to build the tiny model), which the shell's eval would have run."""
    result = subprocess.run([sys.executable, "-c", NOISY_UP], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "export KUBECONFIG=/tmp/dev-state/kubeconfig\n", result.stdout
    assert "Setting accelerator to CPU" in result.stderr and "a child process speaking" in result.stderr
