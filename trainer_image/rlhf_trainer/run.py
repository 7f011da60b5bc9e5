"""`rlhf run JOB.yaml`: run an RLHFJob on Ray, locally or inside its RayJob.

Locally it starts a private Ray instance (CPU, or the machine's GPUs) and stops it at the end;
inside a RayJob (RAY_ADDRESS set by Ray's job submission) or with an address it joins that
cluster. Exit status: 0 done, 1 the run failed, 2 the job file is invalid (nothing was loaded):
the schema, CEL rules and checks.check, which also refuses missing local dataset files and reward
functions that cannot be imported or called, all before Ray starts; 143 (128 + SIGTERM, as a shell
reports a process SIGTERM ended) it was stopped by SIGTERM (a pod deleted, preempted or suspended):
it finished the step under way and saved a checkpoint of it, which running the job again resumes
from. Not 0: Ray and KubeRay must not record an interrupted run as succeeded (KubeRay retries a
failed RayJob up to its backoffLimit, and each retry resumes).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import yaml

from rlhf_api import contract, pipeline
from rlhf_api.algorithms import ALGORITHMS
from rlhf_api.v1alpha1 import RLHFJob
from rlhf_api.validation import FieldError, InvalidJob, validate

from .loop import Interrupted
from .node_checks import check_image
from .paths import checkpoint_dir, logs_dir
from .reporting import MultiReporter, Reporter, RunInfo, build_reporters

EXIT_OK, EXIT_FAILED, EXIT_INVALID = 0, 1, 2
EXIT_INTERRUPTED = 128 + signal.SIGTERM
WORKERS_TIMEOUT = 300  # seconds a joined cluster's workers get to register before the job is refused


def run_pipeline(paths: list[str | Path], *, output_dir: str | Path | None = None, **options) -> int:
    """Run the jobs of several files (a directory: its *.yaml files), each after the jobs whose models it
    names (models.<role>.fromJob), which it loads from their output directories: a pipeline, as the operator
    runs one. Stops at the first stage that does not succeed, with its exit status. Each stage writes to
    output_dir/<job name> (default runs/<job name>; one job alone: output_dir itself). options: run's."""
    stages: dict[str, tuple[Path, RLHFJob]] = {}
    for job_file in _job_files(paths):
        try:
            job = validate(yaml.safe_load(job_file.read_text()))
        except (InvalidJob, *READ_ERRORS) as error:
            return _refused(job_file, error)
        name = job.metadata.get("name", job_file.stem)
        if name in stages:
            print(f"{job_file}: RLHFJob {name} is also defined in {stages[name][0]}: name each job once", file=sys.stderr)
            return EXIT_INVALID
        stages[name] = (job_file, job)
    try:
        order = pipeline.in_order({name: job.spec for name, (_, job) in stages.items()})
    except pipeline.Cycle as cycle:
        print(f"rlhf run: {cycle}", file=sys.stderr)
        return EXIT_INVALID
    if len(order) == 1 and output_dir is not None:
        return run(stages[order[0]][0], job=stages[order[0]][1], output_dir=output_dir, **options)
    base = Path(output_dir or "runs")
    for name in order:
        job_file, job = stages[name]
        models = {}
        for role, ref in pipeline.inputs(job.spec).items():
            if ref.name not in stages:
                print(f"{job_file}: models.{role}.fromJob names RLHFJob {ref.name}, which none of the files defines: "
                      "run the pipeline's files together (rlhf run FILE... or a directory)", file=sys.stderr)
                return EXIT_INVALID
            source = stages[ref.name][1].spec
            problem = pipeline.unexported(source, on_a_claim=False) or pipeline.problem(
                role, ref, pipeline.exported_kind(source), has_best=bool(source.evaluation and source.evaluation.best_metric))
            if problem:
                print(f"{job_file}: RLHFJob {ref.name}: {problem}", file=sys.stderr)
                return EXIT_INVALID
            models[role] = str(checkpoint_dir(source, base / ref.name) / pipeline.exported_dir(source, ref.model))
        staged = job.model_copy(update={"spec": pipeline.at_paths(job.spec, models)})
        code = run(job_file, job=staged, output_dir=base / name, **options)
        if code != EXIT_OK:
            return code
    return EXIT_OK


READ_ERRORS = (OSError, UnicodeDecodeError, yaml.YAMLError)  # a job file that cannot be read


def _refused(job_file: Path, error: Exception) -> int:
    """Say why the job file cannot run (invalid, or unreadable); the exit status for that."""
    print(f"{job_file}: {error}" if isinstance(error, InvalidJob) else f"{job_file}: cannot read: {error}",
          file=sys.stderr)
    return EXIT_INVALID


def _job_files(paths: list[str | Path]) -> list[Path]:
    """The files named, a directory standing for its YAML files in name order (kubectl apply -f's)."""
    files = []
    for path in map(Path, paths):
        files += sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml")) if path.is_dir() else [path]
    return files


def run(job_file: str | Path, *, job: RLHFJob | None = None, output_dir: str | Path | None = None,
        address: str | None = None, num_cpus: int | None = None, reporters: list[Reporter] | None = None) -> int:
    """Run the job in `job_file` (or `job`, read from it already: relative paths in it are relative to the
    file); returns the exit status. output_dir defaults to runs/<job name>; the run writes under
    checkpoint.path, relative to it (paths.checkpoint_dir, paths.logs_dir)."""
    from .checks import check, check_cluster

    job_file = Path(job_file)
    try:
        job = job or validate(yaml.safe_load(job_file.read_text()))
        if inputs := pipeline.inputs(job.spec):
            raise InvalidJob([FieldError(f"spec.models.{role}.fromJob", f"RLHFJob {ref.name}'s model: run the "
                                         "pipeline's files together (rlhf run FILE... or a directory)")
                              for role, ref in inputs.items()])
        placement = check(job.spec, job_file.parent)
    except (InvalidJob, *READ_ERRORS) as error:
        return _refused(job_file, error)

    logging.getLogger("rlhf_trainer").setLevel(logging.INFO)  # e.g. "resumed from ..."
    logging.basicConfig(format="%(message)s")
    name = job.metadata.get("name", job_file.stem)
    output_dir = Path(output_dir or Path("runs") / name)
    output_dir.mkdir(parents=True, exist_ok=True)
    try:  # a tracker the job names whose package is missing is refused here, before anything loads
        run_info = RunInfo.of(job, logs_dir(job.spec, output_dir), name)
        reporter = MultiReporter(reporters if reporters is not None else build_reporters(run_info))
    except InvalidJob as invalid:
        print(f"{job_file}: {invalid}", file=sys.stderr)
        return EXIT_INVALID

    import ray

    local_node, trainer, joined = None, None, False
    exit_code, said = EXIT_OK, ""  # said: the run's last stderr line, printed after everything else
    previous_handler = signal.getsignal(signal.SIGTERM)
    try:
        address = address or os.environ.get("RAY_ADDRESS")
        if ray.is_initialized():
            pass  # this process is connected already (tests, notebooks): run there
        elif address:
            ray.init(address=address)
            joined = True
        else:
            # A private instance: own temp dir (short, for Ray's socket paths), stopped at the end.
            # CPUs are logical here: enough for one per rank and engine, however many cores there are.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray_dir = tempfile.mkdtemp(prefix="rlhf-ray-", dir="/tmp")
            local_node = _start_local_ray(num_cpus or max(os.cpu_count() or 1, placement.bundles), ray_dir)
        # Connecting made Ray's native crash handler this process's SIGTERM handler: it prints a stack
        # dump and arms a 3 s alarm that aborts the process (exit 134), whatever Python does meanwhile.
        # Ours replace it: before the first step there is nothing to save, so stop at once.
        signal.signal(signal.SIGTERM, _stop_now)
        if pid_file := os.environ.get(contract.DRIVER_PID_FILE_ENV):  # the head pod's preStop hook signals us
            Path(pid_file).write_text(str(os.getpid()))
        check_cluster(job.spec, placement, _cluster_resources(placement, wait=0 if local_node else WORKERS_TIMEOUT))
        check_image(placement.use_gpu)  # a cluster without the GPUs is the job's to fix first (InvalidJob)

        trainer_class = _trainer_class(job.spec.algorithm)
        trainer = trainer_class(job, placement, base_dir=job_file.parent, output_dir=output_dir, reporter=reporter)
        signal.signal(signal.SIGTERM, lambda *_: _stop_after_step(trainer))
        reporter.start(trainer.total_steps)
        trainer.fit()
    except InvalidJob as invalid:
        exit_code, said = EXIT_INVALID, str(invalid)
    except Interrupted as interrupted:
        exit_code, said = EXIT_INTERRUPTED, f"the run was interrupted: {interrupted}"
        if trainer is not None:
            reporter.finish("interrupted", str(interrupted))
    except Exception as error:  # noqa: BLE001 - whatever broke, say what and exit non-zero
        traceback.print_exc()
        message = f"{failure(error)}{_resume_hint(trainer)}"
        exit_code, said = EXIT_FAILED, f"{contract.RUN_FAILED}{message}"
        if trainer is not None:  # the reporters were started
            reporter.finish("failed", message)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        if trainer is not None:
            trainer.close()
        if joined or local_node:  # disconnected, Ray forwards no more of the workers' lines into our log
            ray.shutdown()
        if local_node:
            local_node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
            shutil.rmtree(ray_dir, ignore_errors=True)
    if exit_code != EXIT_OK:  # last, after the teardown and the workers' lines: the job's log tail ends with it
        print(f"{job_file}: {said}", file=sys.stderr)
        return exit_code
    reporter.finish("succeeded", f"{trainer.step} steps; outputs in {output_dir}")
    return EXIT_OK


def failure(error: Exception) -> str:
    """What broke, as "<Error>: <its first line>": what an actor or task raised rather than Ray's wrapper
    (RayTaskError(<Error>), whose message is a traceback), so that its type can be the job's status reason
    (contract.FAILURE_REASONS)."""
    from ray.exceptions import RayTaskError

    while isinstance(error, RayTaskError) and error.cause is not None:
        error = error.cause
    first_line = next(iter(str(error).strip().splitlines()), "")  # Ray's errors run to pages
    return f"{type(error).__name__}: {first_line}"


START_ATTEMPTS = 3


def _start_local_ray(num_cpus: int, temp_dir: str):
    """A private Ray node holding only what a run uses, this process connected to it: GCS, raylet (with
    the dashboard and runtime-env agents it cannot run without) and the log monitor that prints the
    actors' output here. Left out, unlike ray.init's own start: the API server (with the dashboard off
    it only reports usage statistics) and the autoscaler's monitor (a fixed local node has nothing to
    scale), ~0.2 GB and ~2 s of start-up. ray.init has no switch for either, hence Ray's Node class
    (Ray is pinned to 2.60.x; tests/trainer/test_lean_start.py checks the processes)."""
    import psutil
    import ray
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    class LocalNode(Node):
        def start_api_server(self, **_) -> None:
            pass

    # spawn_reaper: Ray's reaper stops the node's processes if this one dies before kill_all_processes.
    # Ray gives its raylet a fixed 30 s to register (its dashboard agent, a Python process, must start first); a
    # machine busy enough to exceed it gets START_ATTEMPTS tries in all.
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            node = LocalNode(RayParams(num_cpus=num_cpus, include_dashboard=False, temp_dir=temp_dir,
                                       no_monitor=True), head=True, shutdown_at_exit=False, spawn_reaper=True)
            break
        except Exception as error:  # noqa: BLE001 - Ray raises a bare Exception for this
            if attempt == START_ATTEMPTS or "timed out during startup" not in str(error):
                raise
            print("Ray's node did not register in time (a busy machine): starting it again", flush=True)
            for process in psutil.Process().children(recursive=True):  # the first node's GCS, raylet ...
                if _runs_in(process, temp_dir):  # (not other children: a test runner's image build, say)
                    process.kill()
    try:
        ray.init(address=node.address)
    except BaseException:
        node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
        raise
    return node


def _runs_in(process, temp_dir: str) -> bool:
    """Whether a process of Ray's names the node's temp dir on its command line (each does: logs, sockets)."""
    import psutil

    try:
        return any(temp_dir in arg for arg in process.cmdline())
    except psutil.Error:  # gone already
        return False


def _stop_now(*_) -> None:
    raise Interrupted("SIGTERM while the run was starting: no step was trained, there is nothing to save")


def _stop_after_step(trainer) -> None:
    if trainer.stop_requested:  # signalled again (the preStop hook and `ray job stop`)
        return
    # os.write: the handler may run while the main thread is inside a print to stderr (the progress bar).
    os.write(sys.stderr.fileno(), (
        f"\nSIGTERM: finishing step {trainer.step + 1}, saving a checkpoint of it and stopping (in Kubernetes the "
        f"job's pods get {contract.TERMINATION_GRACE_SECONDS}s for that before they are killed)\n").encode())
    trainer.request_stop()


def _resume_hint(trainer) -> str:
    """Where running the job again (or KubeRay's retry, spec.backoffLimit) resumes from."""
    from . import checkpoint

    found = checkpoint.latest(trainer.checkpoint_dir) if trainer is not None else None
    return f"; its newest checkpoint is {found}: running the job again resumes from it" if found else ""


def _trainer_class(algorithm: str):
    """The online loop (rollouts, rewards, advantages) or the offline one (a dataset and an objective)."""
    if ALGORITHMS[algorithm].online:
        from .trainer import Trainer

        return Trainer
    from .offline import OfflineTrainer

    return OfflineTrainer


def _cluster_resources(placement, wait: float) -> dict[str, float]:
    """The Ray cluster's resources, once it has what the bundles need in all (Placement.needs) or
    after `wait` seconds (a RayJob's entrypoint may start before every worker pod has joined)."""
    import ray

    deadline = time.monotonic() + wait
    while True:
        resources = ray.cluster_resources()
        enough = all(resources.get(kind, 0) >= needed for kind, needed in placement.needs.items())
        if enough or time.monotonic() >= deadline:
            return resources
        time.sleep(2)
