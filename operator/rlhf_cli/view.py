"""One RLHFJob from a terminal: `rlhf status JOB`, `rlhf logs JOB [-f]`, `rlhf tensorboard JOB`.

Installed as the kubectl plugin kubectl-rlhf too (`kubectl rlhf status JOB`): the same commands.
They read what the API server has (the job's status; the trainer's log through pods/log) with the
kubeconfig's credentials (cluster.py), or what a run left in a local directory (metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException

from rlhf_api import contract
from rlhf_api import v1alpha1 as api
from rlhf_operator import names
from rlhf_operator.kube import Kube

from . import cluster

SPARKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40  # points of a curve shown: the last ones


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def status_lines(job: dict[str, Any], namespace_jobs: list[dict[str, Any]] = ()) -> list[str]:
    """What `rlhf status` prints: phase, lineage (the jobs it starts from, its exported model, the jobs of
    namespace_jobs that start from it), progress, checkpoint, usage, the latest metrics as a table."""
    meta, spec, status = job["metadata"], job["spec"], job.get("status") or {}
    lines = [f"RLHFJob {meta['namespace']}/{meta['name']} ({spec['algorithm']})",
             f"Phase:      {status.get('phase', 'Pending')}" + (f" ({status['reason']})" if status.get("reason") else "")]
    if status.get("message"):
        lines.append(f"Message:    {status['message']}")
    lines += _lineage_lines(job, namespace_jobs)
    progress = status.get("progress") or {}
    if progress:
        eta = f", about {_duration(progress['etaSeconds'])} left" if progress.get("etaSeconds") is not None else ""
        lines.append(f"Progress:   step {progress.get('step', 0)}/{progress.get('totalSteps', 0)} "
                     f"({progress.get('percent', 0):.0f}%){eta}")
    checkpoint = status.get("lastCheckpoint")
    if checkpoint:
        lines.append(f"Checkpoint: step {checkpoint['step']} at {checkpoint['path']} ({checkpoint['time']})")
    usage = status.get("usage")
    if usage:
        cost = f", estimated cost {usage['estimatedCost']:.2f}" if usage.get("estimatedCost") is not None else ""
        lines.append(f"Usage:      {usage['gpuSeconds'] / 3600:.2f} GPU-hours, {usage['cpuSeconds'] / 3600:.2f} "
                     f"CPU-hours{cost} (up to {usage.get('countedUntil')})")
        for number, attempt in enumerate(usage.get("attempts") or [], 1):
            lines.append(f"  attempt {number}: {attempt['rayClusterName']}, {len(attempt['pods'])} pods, "
                         f"{attempt['gpuSeconds'] / 3600:.2f} GPU-hours")
    metrics = {key: value for key, value in (status.get("metrics") or {}).items() if key != "evaluation"}
    metrics.update((status.get("metrics") or {}).get("evaluation") or {})
    if metrics:
        width = max(map(len, metrics))
        lines.append("Metrics:")
        lines += [f"  {key:<{width}}  {_number(metrics[key])}" for key in sorted(metrics)]
    return lines


def _lineage_lines(job: dict[str, Any], namespace_jobs: list[dict[str, Any]]) -> list[str]:
    """A pipeline stage's place: what each fromJob model came from, where its own model is, what uses it."""
    status, lines = job.get("status") or {}, []
    seen = {entry["role"]: entry for entry in status.get("inputs") or []}
    for role, model in sorted((job["spec"].get("models") or {}).items()):
        if "fromJob" in (model or {}):
            ref = model["fromJob"]
            phase = seen.get(role, {}).get("phase") or "not seen yet"
            lines.append(f"From:       models.{role} <- RLHFJob {ref['name']} ({phase}), its {ref.get('model', 'final')} model")
    if output := status.get("outputModel"):
        lines.append(f"Output:     {output['kind']} model on claim {output['claimName']} at {output['subPath']}/"
                     f"{output['final']}" + (f", best at {output['subPath']}/{output['best']}" if output.get("best") else ""))
    name = job["metadata"]["name"]
    for other in namespace_jobs:
        for role, model in sorted((other["spec"].get("models") or {}).items()):
            if (model or {}).get("fromJob", {}).get("name") == name:
                phase = (other.get("status") or {}).get("phase") or "Pending"
                lines.append(f"Used by:    RLHFJob {other['metadata']['name']} (models.{role}, {phase})")
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    namespace, kube = cluster.namespace(args), cluster.connect(args)
    job = cluster.job(kube, namespace, args.job)
    print("\n".join(status_lines(job, kube.list(api.KIND, namespace, ""))))
    return 0


def trainer_pods(kube: Kube, namespace: str, job_name: str) -> list[dict[str, Any]]:
    """The pods whose log is the trainer's, oldest first: KubeRay's submitter (`ray job submit`
    follows the driver's output), one per attempt while its pods are kept."""
    found = kube.list("Pod", namespace, f"{names.JOB_LABEL}={names.label_value(job_name)},{names.ROLE_LABEL}=submitter")
    return sorted(found, key=lambda pod: pod["metadata"]["creationTimestamp"])


def cmd_logs(args: argparse.Namespace) -> int:
    namespace, kube = cluster.namespace(args), cluster.connect(args)
    job = cluster.job(kube, namespace, args.job)
    pods = trainer_pods(kube, namespace, args.job)
    if not pods:
        print(f"rlhf logs: RLHFJob {args.job} has no trainer pod now (phase {(job.get('status') or {}).get('phase')}): "
              "its log appears once the Ray cluster is up and the job submitted; pods of finished attempts are "
              "gone with their Ray clusters", file=sys.stderr)
        return 1
    core = k8s.CoreV1Api(kube.api_client)
    for pod in pods:
        name = pod["metadata"]["name"]
        follow = args.follow and pod is pods[-1]
        print(f"==> pod {name} (started {pod['metadata']['creationTimestamp']}) <==", flush=True)
        try:
            response = core.read_namespaced_pod_log(name, namespace, follow=follow, _preload_content=False)
            for chunk in response.stream():
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
        except ApiException as error:
            print(f"rlhf logs: the API server could not serve the log of pod {name} ({error.status} {error.reason}): "
                  f"{cluster.api_message(error)}", file=sys.stderr)
            return 1
    return 0


def sparkline(values: list[float]) -> str:
    shown = [v for v in values[-SPARK_WIDTH:] if math.isfinite(v)]
    if not shown:
        return ""
    low, high = min(shown), max(shown)
    span = (high - low) or 1.0
    return "".join(SPARKS[round((v - low) / span * (len(SPARKS) - 1))] for v in shown)


def curves(metrics_file: Path) -> dict[str, list[float]]:
    """Each metric's values by step, from a run's metrics.jsonl (a resumed run's repeated steps: the last)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in metrics_file.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    series: dict[str, list[float]] = {}
    for step in sorted(by_step):
        for key, value in by_step[step].items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                series.setdefault(key, []).append(float(value))
    return series


def cmd_tensorboard(args: argparse.Namespace) -> int:
    """The run's curves from its metrics.jsonl, read locally, and the TensorBoard command for its events."""
    if args.logdir:
        logs = Path(args.logdir)
    else:
        job = cluster.job(cluster.connect(args), cluster.namespace(args), args.job)
        logs = Path(job["spec"]["checkpoint"]["path"]) / contract.LOGS_DIR
    metrics_file = logs / "metrics.jsonl"
    if not metrics_file.exists():
        print(f"rlhf tensorboard: {metrics_file} does not exist: pass --logdir, the logs/ directory under the job's "
              "checkpoint.path (on its checkpoint volume, or the --output-dir of `rlhf run`)", file=sys.stderr)
        return 1
    series = curves(metrics_file)
    width = max(map(len, series), default=0)
    print(f"{args.job}: {metrics_file}")
    for key, values in series.items():
        print(f"  {key:<{width}}  {sparkline(values)}  last {_number(values[-1])}")
    print(f"TensorBoard: tensorboard --logdir {logs / 'tensorboard'}")
    return 0


def register(commands: Any) -> None:
    """The view's subcommands on `rlhf`'s parser."""
    def job_command(name: str, help: str) -> argparse.ArgumentParser:
        command = cluster.command(commands.add_parser(name, help=help))
        command.add_argument("job", metavar="JOB", help="the RLHFJob's name")
        return command

    job_command("status", "an RLHFJob at a glance: phase, progress, checkpoint, usage, latest metrics").set_defaults(
        func=cluster.reported(cmd_status))
    logs = job_command("logs", "the trainer's log (every attempt whose pods are kept, oldest first)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep streaming the newest attempt's log")
    logs.set_defaults(func=cluster.reported(cmd_logs))
    board = job_command("tensorboard", "a run's metric curves from its metrics.jsonl, and the TensorBoard command")
    board.add_argument("--logdir", help="the run's logs/ directory, read locally (default: logs/ under the job's "
                                        "checkpoint.path, where its checkpoint volume is mounted)")
    board.set_defaults(func=cluster.reported(cmd_tensorboard))
