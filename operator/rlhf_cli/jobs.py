"""RLHFJobs of a namespace, or of all: `rlhf list`, `rlhf suspend|resume|delete JOB...`.

`list` prints the API server's own table of them (the CRD's printer columns, as `kubectl get rlhfjobs`);
suspend and resume set spec.suspend, which the operator carries to the RayJob (its Ray cluster goes, and a
new one resumes from the newest checkpoint; a queued job's Kueue Workload is deactivated instead); delete
takes the job's children with it.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kubernetes import client as k8s

from rlhf_api import v1alpha1 as api

from . import cluster

# The API server's table of a list (server-side printing): kubectl get's columns, Age already a duration.
TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"


def cmd_list(args: argparse.Namespace) -> int:
    kube = cluster.connect(args)
    custom = k8s.CustomObjectsApi(kube.api_client)
    options = {"_headers": {"Accept": TABLE}, "_preload_content": False, "_request_timeout": kube.timeout}
    if args.all_namespaces:
        response = custom.list_cluster_custom_object(api.GROUP, api.VERSION, api.PLURAL, **options)
    else:
        response = custom.list_namespaced_custom_object(api.GROUP, api.VERSION, cluster.namespace(args), api.PLURAL,
                                                        **options)
    table = json.loads(response.data)
    if not table["rows"]:
        where = "any namespace" if args.all_namespaces else f"namespace {cluster.namespace(args)}"
        print(f"No RLHFJobs in {where}.")
        return 0
    print("\n".join(table_lines(table, args.all_namespaces, args.output == "wide")))
    return 0


def table_lines(table: dict[str, Any], namespaces: bool, wide: bool) -> list[str]:
    """A meta.k8s.io Table as kubectl prints it: upper-case headers, columns of priority 0 (all of them when
    wide), a NAMESPACE column first when listing every namespace."""
    shown = [i for i, column in enumerate(table["columnDefinitions"]) if wide or column.get("priority", 0) == 0]
    header = [table["columnDefinitions"][i]["name"].upper() for i in shown]
    rows = [[_cell(row["cells"][i]) for i in shown] for row in table["rows"]]
    if namespaces:
        header = ["NAMESPACE", *header]
        rows = [[row["object"]["metadata"]["namespace"], *cells] for row, cells in zip(table["rows"], rows)]
    widths = [max(map(len, column)) for column in zip(header, *rows)]
    return ["   ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [header, *rows]]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    return f"{value:g}" if isinstance(value, float) else str(value)


def _patch_suspend(args: argparse.Namespace, suspend: bool) -> int:
    namespace, kube = cluster.namespace(args), cluster.connect(args)
    for name in args.jobs:
        cluster.job(kube, namespace, name)
        kube.patch(api.KIND, namespace, name, {"spec": {"suspend": suspend}})
        print(f"RLHFJob {namespace}/{name} {'suspended' if suspend else 'resumed'}")
    return 0


def cmd_suspend(args: argparse.Namespace) -> int:
    return _patch_suspend(args, True)


def cmd_resume(args: argparse.Namespace) -> int:
    return _patch_suspend(args, False)


def cmd_delete(args: argparse.Namespace) -> int:
    namespace, kube = cluster.namespace(args), cluster.connect(args)
    for name in args.jobs:
        job = cluster.job(kube, namespace, name)
        kube.delete(api.KIND, namespace, name, job["metadata"]["uid"])
        print(f"RLHFJob {namespace}/{name} deleted")
    return 0


def register(commands: Any) -> None:
    """The subcommands on `rlhf`'s parser."""
    listing = cluster.command(commands.add_parser(
        "list", help="the RLHFJobs of a namespace (or all): phase, progress, reward, GPU-hours, age"))
    listing.add_argument("-A", "--all-namespaces", action="store_true", help="of every namespace")
    listing.add_argument("-o", "--output", choices=["wide"], help="wide: every printer column (KL, Ray job)")
    listing.set_defaults(func=cluster.reported(cmd_list))
    for name, run, help in (
            ("suspend", cmd_suspend, "suspend RLHFJobs (spec.suspend): their Ray clusters go, their checkpoints stay"),
            ("resume", cmd_resume, "resume suspended RLHFJobs: a new Ray cluster continues from the newest checkpoint"),
            ("delete", cmd_delete, "delete RLHFJobs and everything the operator made for them")):
        command = cluster.command(commands.add_parser(name, help=help))
        command.add_argument("jobs", nargs="+", metavar="JOB", help="the RLHFJobs' names")
        command.set_defaults(func=cluster.reported(run))
