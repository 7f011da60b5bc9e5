"""benchmarks/gpu_check.py, the one-GPU check, runs on CPU with the same code (gloo for NCCL, shared
memory for CUDA IPC), so that it is ready when a GPU is at hand: every check passes here, and it
needs neither Ray nor vLLM (the GPU machine has neither). What only a GPU runs (CUDA IPC from a second
device, a Triton kernel) is skipped here with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(600), pytest.mark.trains]  # DeepSpeed ranks and a receiver process

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RUN = """
import sys
import gpu_check
code = gpu_check.main(["--device", "cpu", "--out", *sys.argv[1:]])
print("IMPORTED", [name for name in ("ray", "vllm") if name in sys.modules])
sys.exit(code)
"""


@pytest.mark.parametrize("options", [[], ["--autocast"]], ids=["float32", "autocast"])
def test_the_gpu_check_passes_on_cpu_without_ray_or_vllm(tmp_path, options):
    out = tmp_path / "gpu-check.json"
    run = subprocess.run([sys.executable, "-c", RUN, str(out), *options], cwd=BENCHMARKS, capture_output=True,
                         text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "IMPORTED []" in run.stdout
    report = json.loads(out.read_text())
    assert report["packing"]["log_prob_max_abs_diff"] < 1e-4 and report["packing"]["grad_relative_diff"] < 1e-4
    assert report["zero3_step"]["grad_norm"] > 0
    sync = report["ipc_sync"]
    assert sync["checksums_equal"] and sync["syncs"] == 20 and sync["receiver_growth_bytes"] <= 0
    assert report["broadcast"]["ok"]
    # two model workers in processes of their own take turns, memory read after each step
    turns = report["turns"]
    assert turns["ok"] and [(step["worker"], step["step"]) for step in turns["steps"]] == [
        ("actor", "load"), ("reference", "load"), ("actor", "score"), ("reference", "score"),
        ("actor", "release"), ("reference", "release"), ("actor", "train")]
    assert all(step["rss_gib"] > 0 for step in turns["steps"])
    # only a GPU runs these: skipped with the reason
    assert "2 GPUs" in report["ipc_device"]["skipped"] and "GPU" in report["triton"]["skipped"]
    assert "gcc" in report["triton"]["compiler"]
    # the plan's weights bound the model's parameters as loaded
    weights = report["plan_terms"]["terms"]["weights"]
    assert report["plan_terms"]["ok"] and weights["planned_gib"] >= weights["measured_gib"] > 0
