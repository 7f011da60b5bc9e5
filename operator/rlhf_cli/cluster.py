"""The cluster the commands talk to, as kubectl finds it: the kubeconfig (--kubeconfig, else KUBECONFIG, else
~/.kube/config) at its current context or --context; inside a pod with no kubeconfig, the pod's own service
account. When there is none, or it cannot be reached, a command says so in one line and exits 1."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from rlhf_api import v1alpha1 as api
from rlhf_operator.kube import Kube

DEFAULT_KUBECONFIG = Path("~/.kube/config").expanduser()
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
NO_CLUSTER = "set KUBECONFIG, pass --kubeconfig, or run inside a pod"


class NoCluster(Exception):
    """No kubeconfig, or one that names no usable cluster, and not in a pod."""


def add_flags(parser: argparse.ArgumentParser, after_command: bool = False) -> None:
    """--kubeconfig and --context on `rlhf` and again on each cluster command, so that they may come before or
    after it (kubectl passes a plugin's flags after its name: kubectl rlhf list --context prod). After the
    command they default to nothing, leaving what `rlhf` itself was given."""
    default = argparse.SUPPRESS if after_command else None
    parser.add_argument("--kubeconfig", default=default, metavar="FILE",
                        help="the kubeconfig file (default: KUBECONFIG, else ~/.kube/config)")
    parser.add_argument("--context", default=default, help="the kubeconfig context (default: its current context)")


def command(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A subcommand that talks to the cluster: the connection flags and -n."""
    add_flags(parser, after_command=True)
    parser.add_argument("-n", "--namespace", help="the namespace (default: the kubeconfig context's, else default)")
    return parser


def _kubeconfig(args: argparse.Namespace) -> str | None:
    """The kubeconfig file(s), KUBECONFIG's list included; None when there is none to read."""
    if args.kubeconfig or os.environ.get("KUBECONFIG"):
        return args.kubeconfig or os.environ["KUBECONFIG"]
    return str(DEFAULT_KUBECONFIG) if DEFAULT_KUBECONFIG.exists() else None


def _in_pod(args: argparse.Namespace) -> bool:
    return _kubeconfig(args) is None and not args.context and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def connect(args: argparse.Namespace) -> Kube:
    configuration, kubeconfig = k8s.Configuration(), _kubeconfig(args)
    try:
        if _in_pod(args):
            k8s_config.load_incluster_config(client_configuration=configuration)
        elif kubeconfig is None:
            raise NoCluster("no kubeconfig")
        else:
            k8s_config.load_kube_config(kubeconfig, args.context, client_configuration=configuration)
    except k8s_config.ConfigException as error:
        raise NoCluster(f"{kubeconfig or 'the pod'}: {error}") from error
    return Kube(k8s.ApiClient(configuration))


def namespace(args: argparse.Namespace) -> str:
    """-n, else the context's namespace, else in a pod the pod's, else default (as kubectl)."""
    if args.namespace:
        return args.namespace
    if _in_pod(args):
        return POD_NAMESPACE_FILE.read_text().strip() if POD_NAMESPACE_FILE.exists() else "default"
    try:
        contexts, current = k8s_config.list_kube_config_contexts(_kubeconfig(args))
    except (k8s_config.ConfigException, FileNotFoundError):
        return "default"  # connect says why there is no cluster
    chosen = next((c for c in contexts if c["name"] == args.context), None) if args.context else current
    return (chosen or {}).get("context", {}).get("namespace") or "default"


def job(kube: Kube, namespace: str, name: str) -> dict:
    found = kube.get(api.KIND, namespace, name)
    if found is None:
        raise SystemExit(f"rlhf: no RLHFJob {name} in namespace {namespace} (rlhf list -A lists them; "
                         "-n selects the namespace)")
    return found


def api_message(error: ApiException) -> str:
    try:
        return json.loads(error.body or "{}").get("message") or str(error.reason)
    except ValueError:
        return str(error.body or error.reason)


def _unreachable(reason: object) -> None:
    print(f"rlhf: cannot reach the cluster's API server: {reason}. Is it up, and is this the context you meant "
          "(--context)?", file=sys.stderr)


def reported(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A cluster command whose connection failures end in one line a person can act on, exit status 1."""
    @functools.wraps(run)
    def reporting(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except NoCluster as error:
            print(f"rlhf: no cluster configured ({error}): {NO_CLUSTER}", file=sys.stderr)
        except HTTPError as error:  # urllib3's: refused, unresolvable, timed out
            _unreachable(getattr(error, "reason", None) or error)
        except ApiException as error:
            if error.status == 0:  # the client's wrapping of a TLS failure
                _unreachable(error.reason)
            else:
                print(f"rlhf: the API server answered {error.status} {error.reason}: {api_message(error)}",
                      file=sys.stderr)
        return 1
    return reporting
