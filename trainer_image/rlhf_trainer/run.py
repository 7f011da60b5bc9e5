"""`rlhf run JOB.yaml`: run an RLHFJob on Ray, locally or inside its RayJob.

Locally it starts a private Ray instance (CPU, or the machine's GPUs) and stops it at the end;
inside a RayJob (RAY_ADDRESS set by Ray's job submission) or with an address it joins that
cluster. Exit status: 0 done, 1 the run failed, 2 the job file is invalid (nothing was loaded).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import yaml

from rlhf_api.algorithms import ALGORITHMS
from rlhf_api.validation import InvalidJob, validate

from .reporting import JsonlWriter, MultiReporter, ProgressBar, Reporter, TensorBoardWriter

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
WORKERS_TIMEOUT = 300  # seconds a joined cluster's workers get to register before the job is refused


def default_reporters(output_dir: Path, job_name: str) -> list[Reporter]:
    """The terminal, metrics.jsonl and TensorBoard; in a cluster also the job's status and Prometheus."""
    from .kube_status import KubernetesStatusReporter
    from .prometheus import PrometheusReporter

    local = [ProgressBar(job_name), JsonlWriter(output_dir / "metrics.jsonl"), TensorBoardWriter(output_dir / "tensorboard")]
    in_cluster = [KubernetesStatusReporter.from_environment(), PrometheusReporter.from_environment()]
    return local + [reporter for reporter in in_cluster if reporter is not None]


def run(job_file: str | Path, *, output_dir: str | Path | None = None, address: str | None = None,
        num_cpus: int | None = None, reporters: list[Reporter] | None = None) -> int:
    """Run the job in `job_file`; returns the exit status. output_dir defaults to runs/<job name>."""
    from .checks import check, check_cluster

    job_file = Path(job_file)
    try:
        job = validate(yaml.safe_load(job_file.read_text()))
        placement = check(job.spec, job_file.parent)
    except InvalidJob as invalid:
        print(f"{job_file}: {invalid}", file=sys.stderr)
        return EXIT_INVALID
    except (OSError, yaml.YAMLError) as error:
        print(f"{job_file}: cannot read: {error}", file=sys.stderr)
        return EXIT_INVALID

    logging.getLogger("rlhf_trainer").setLevel(logging.INFO)  # e.g. "resumed from ..."
    logging.basicConfig(format="%(message)s")
    name = job.metadata.get("name", job_file.stem)
    output_dir = Path(output_dir or Path("runs") / name)
    output_dir.mkdir(parents=True, exist_ok=True)
    reporter = MultiReporter(reporters if reporters is not None else default_reporters(output_dir, name))

    import ray

    started_ray, trainer = False, None
    try:
        address = address or os.environ.get("RAY_ADDRESS")
        if ray.is_initialized():
            pass  # this process is connected already (tests, notebooks): run there
        elif address:
            ray.init(address=address)
        else:
            # A private instance: own temp dir (short, for Ray's socket paths), stopped at the end.
            # CPUs are logical here: enough for one per rank and engine, however many cores there are.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray_dir = tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp")
            ray.init(num_cpus=num_cpus or max(os.cpu_count() or 1, placement.bundles), include_dashboard=False,
                     _temp_dir=ray_dir)
            started_ray = True
        check_cluster(job.spec, placement, _cluster_resources(placement, wait=0 if started_ray else WORKERS_TIMEOUT))

        trainer_class = _trainer_class(job.spec.algorithm)
        trainer = trainer_class(job, placement, base_dir=job_file.parent, output_dir=output_dir, reporter=reporter)
        reporter.start(trainer.total_steps)
        trainer.fit()
    except InvalidJob as invalid:
        print(f"{job_file}: {invalid}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as error:  # noqa: BLE001 - whatever broke, say what and exit non-zero
        traceback.print_exc()
        message = f"{type(error).__name__}: {error}"
        print(f"{job_file}: the run failed: {message}", file=sys.stderr)
        if trainer is not None:  # the reporters were started
            reporter.finish("failed", message)
        return EXIT_FAILED
    finally:
        if trainer is not None:
            trainer.close()
        if started_ray:
            ray.shutdown()
            shutil.rmtree(ray_dir, ignore_errors=True)
    reporter.finish("succeeded", f"{trainer.step} steps; outputs in {output_dir}")
    return EXIT_OK


def _trainer_class(algorithm: str):
    """The online loop (rollouts, rewards, advantages) or the offline one (a dataset and an objective)."""
    if ALGORITHMS[algorithm].online:
        from .trainer import Trainer

        return Trainer
    from .offline import OfflineTrainer

    return OfflineTrainer


def _cluster_resources(placement, wait: float) -> dict[str, float]:
    """The Ray cluster's resources, once it has a bundle's worth per rank or after `wait` seconds
    (a RayJob's entrypoint may start before every worker pod has joined)."""
    import ray

    kind = "GPU" if placement.use_gpu else "CPU"
    deadline = time.monotonic() + wait
    while True:
        resources = ray.cluster_resources()
        if resources.get(kind, 0) >= placement.bundles or time.monotonic() >= deadline:
            return resources
        time.sleep(2)
