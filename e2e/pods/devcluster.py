"""`make dev-cluster` (`python -m e2e.pods.devcluster`): a local cluster that trains.

The dev control plane (`python -m e2e.controlplane up --no-kwok`: the real API server, controllers,
scheduler and KubeRay) with one Node whose pods run for real: the pod runtime as a process of its own
(`python -m e2e.pods`), running containers from the images built from the Dockerfiles. The chart installs
the operator from its image, with the trainer image as the jobs' default; the tiny example's model and
prompts go on a claim and its reward in a ConfigMap of the default namespace, under the names that
manifests/examples/tiny-grpo-cluster-job.yaml reads. With `--chart oci://HOST:PORT/ORG/charts/rlhf-operator
--version X.Y.Z` the chart comes from a registry instead (a release's: `make release`), with its own CRD and
default images, which the node pulls from that registry. Then:

    kubectl apply -f manifests/examples/tiny-grpo-cluster-job.yaml
    kubectl get rlhfjobs -w
    rlhf logs -f tiny-grpo

Stopped, pods and all, with `make dev-cluster-down`. Needs root (the runtime's network namespaces and mounts).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, Iterator

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e import images
from e2e.controlplane import ControlPlane
from e2e.controlplane.binaries import built
from e2e.controlplane.cli import dev_state_dir
from e2e.controlplane.cluster import POD_RUNTIME
from e2e.controlplane.cli import main as controlplane
from e2e.controlplane.errors import ControlPlaneError
from e2e.storage import local_claim
from rlhf_api import v1alpha1 as api

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "manifests" / "examples" / "tiny-grpo-cluster-job.yaml"
TINY = ROOT / "manifests" / "examples" / "tiny"  # `make demo` builds its model
CHART = ROOT / "helm" / "rlhf-operator"
RELEASE, RELEASE_NAMESPACE, NAMESPACE = "rlhf", "rlhf-system", "default"


def helm_install(cp: ControlPlane, operator_image: str, trainer_image: str, namespace: str,
                 values: dict[str, Any], values_file: Path) -> None:
    """`helm install` of this checkout's chart with the operator image the suite built (never pulled) and the
    (CPU) trainer image as the jobs' default; the control plane has the CRDs installed already. `values` add
    to these."""
    repository, tag = operator_image.rsplit(":", 1)
    trainer_repository, trainer_tag = trainer_image.rsplit(":", 1)
    _helm_install(cp, namespace, [str(CHART)], values_file, {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "trainer": {"repository": trainer_repository, "tag": trainer_tag.removesuffix("-cpu")},  # the chart adds it
        "crds": {"install": False}, **values})


def helm_install_released(cp: ControlPlane, chart: str, version: str, plain_http: bool, namespace: str,
                          values_file: Path, values: dict[str, Any]) -> None:
    """`helm install` of a released chart from its registry, with its own CRDs and images (and `values`): the
    control plane's CRDs (installed from crds/ at its start) are handed to the release first, as helm adopts an
    object."""
    crds = [name for name in cp.kubectl("get", "crd", "-o", "name").stdout.split() if name.endswith(f".{api.GROUP}")]
    cp.kubectl("label", *crds, "app.kubernetes.io/managed-by=Helm", "--overwrite")
    cp.kubectl("annotate", *crds, f"meta.helm.sh/release-name={RELEASE}", f"meta.helm.sh/release-namespace={namespace}",
               "--overwrite")
    _helm_install(cp, namespace, [chart, "--version", version, *(["--plain-http"] if plain_http else [])],
                  values_file, values)


def _helm_install(cp: ControlPlane, namespace: str, chart: list[str], values_file: Path, values: dict[str, Any]) -> None:
    values_file.write_text(yaml.safe_dump(values))
    subprocess.run([built("helm", "HELM"), "--kubeconfig", str(cp.kubeconfig), "-n", namespace, "upgrade", "--install",
                    RELEASE, *chart, "--create-namespace", "-f", str(values_file)],
                   check=True, capture_output=True, text=True)


def example_names() -> tuple[str, str, str]:
    """The example job's model claim, checkpoint claim and reward ConfigMap: made here under its names."""
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    return (spec["models"]["actor"]["pvc"]["claimName"], spec["checkpoint"]["pvc"],
            spec["reward"]["sources"][0]["function"]["configMap"])


def start_pod_runtime(cp: ControlPlane, state: Path) -> str:
    """The pod runtime's process (again, if a former one died); returns its Node's name once Ready."""
    if (running := cp.processes.get(POD_RUNTIME)) is None or not running.alive():
        # (the control plane's processes run in its state dir: this checkout on the path finds e2e)
        cp.launcher.spawn(POD_RUNTIME, ["env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "e2e.pods",
                                        "--state-dir", str(state)])
    core = client.CoreV1Api(cp.api_client())

    def ready_node() -> str | None:
        for node in core.list_node().items:
            if any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or []):
                return node.metadata.name
        return None

    cp.launcher.wait(lambda: ready_node() is not None, 120, "the pod runtime's Node to be Ready")
    return ready_node()


def example_storage(cp: ControlPlane, state: Path, node: str) -> None:
    """The example's model and prompts on its model claim, an empty checkpoint claim, its reward ConfigMap."""
    models, checkpoints, reward = example_names()
    core = client.CoreV1Api(cp.api_client())
    volumes = state / "volumes"
    for claim in (models, checkpoints):
        try:
            core.read_namespaced_persistent_volume_claim(claim, NAMESPACE)
        except ApiException as error:
            if error.status != 404:
                raise
            # ReadWriteOnce, as a single box's or a cloud's default storage class has it: the example is one node's.
            local_claim(core, NAMESPACE, claim, volumes / claim, access_modes=("ReadWriteOnce",), node=node)
    if not (TINY / "model" / "config.json").exists():
        from rlhf_trainer.tiny import build_tiny_model

        build_tiny_model(TINY / "model")
    shutil.copytree(TINY / "model", volumes / models / "model", dirs_exist_ok=True)
    shutil.copy(TINY / "prompts.jsonl", volumes / models / "prompts.jsonl")
    manifest = cp.kubectl("-n", NAMESPACE, "create", "configmap", reward, f"--from-file=reward.py={TINY / 'reward.py'}",
                          "--dry-run=client", "-o", "yaml").stdout
    cp.kubectl("apply", "-f", "-", input=manifest)


def log(line: str) -> None:
    print(f"# {line}", file=sys.stderr)  # stdout is the KUBECONFIG export alone


@contextlib.contextmanager
def stdout_for_the_export() -> Iterator[IO[str]]:
    """The real stdout, for the KUBECONFIG export alone (`eval "$(make -s dev-cluster-up)"` runs it); meanwhile
    whatever else reaches file descriptor 1, from this process or its children, goes to stderr: a library
    that logs to stdout on import (DeepSpeed's accelerator warning, when transformers loads it to build the
    tiny model on a fresh clone) would otherwise be run by the shell."""
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        yield real
    finally:
        real.flush()
        os.dup2(real.fileno(), 1)  # fd 1 is stdout again
        real.close()


def up(state: Path, export: IO[str], released: argparse.Namespace) -> int:
    if controlplane(["--state-dir", str(state), "up", "--no-kwok"]) != 0:  # its export line goes to stderr here
        return 1
    cp = ControlPlane.attach(state)
    values = yaml.safe_load(released.values.read_text()) if released.values else {}
    if released.chart is None:  # the operator's pod waits for the node, started next
        helm_install(cp, images.build(images.OPERATOR, log), images.build(images.TRAINER_CPU, log), RELEASE_NAMESPACE,
                     values, state / "values.yaml")
    else:
        helm_install_released(cp, released.chart, released.version, released.plain_http, RELEASE_NAMESPACE,
                              state / "values.yaml", values)
    images.base(log)  # the runtime's image store
    node = start_pod_runtime(cp, state)
    example_storage(cp, state, node)
    cp.kubectl("-n", RELEASE_NAMESPACE, "rollout", "status", f"deployment/{RELEASE}", "--timeout=300s",
               timeout=330)
    print(f"# the operator of chart {released.chart or CHART.relative_to(ROOT)} runs on node {node}\n"
          f"# then: kubectl apply -f {EXAMPLE.relative_to(ROOT)}; kubectl get rlhfjobs -w; rlhf logs -f tiny-grpo\n"
          f"# stop with: make dev-cluster-down", file=sys.stderr)
    print(f"export KUBECONFIG={cp.kubeconfig}", file=export)  # only once the cluster is ready to use
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.pods.devcluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-dir", type=Path, default=dev_state_dir(),
                        help="the control plane's state dir (default: %(default)s)")
    parser.add_argument("--chart", help="a released chart (oci://HOST:PORT/ORG/charts/rlhf-operator) instead of this "
                                        "checkout's with the images built from it")
    parser.add_argument("--version", help="the released chart's version (with --chart)")
    parser.add_argument("--plain-http", action="store_true", help="the chart's registry speaks HTTP (with --chart)")
    parser.add_argument("--values", type=Path, help="a values file for the chart (helm's -f), e.g. webhook.enabled")
    args = parser.parse_args()
    if args.chart is not None and args.version is None:
        parser.error("--chart needs --version")
    try:
        with stdout_for_the_export() as export:
            return up(args.state_dir, export, args)
    except (ControlPlaneError, subprocess.CalledProcessError, RuntimeError) as error:
        print(f"error: {error}{getattr(error, 'stderr', '') or ''}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
