"""The operator at scale: N RLHFJobs applied in a burst, against KubeRay's own controller in the same run.

For each N, a fresh private control plane (kube-apiserver, etcd, controller-manager, scheduler,
kwok fake nodes, the real KubeRay operator) and `rlhf operator --all-namespaces` as a subprocess
running as a ServiceAccount of the audited namespace with the install manifest's ClusterRole.
N copies of the tiny example job (job-0000, ...) are POSTed in a burst by a few threads; watches
started before the burst stamp time.monotonic() on the first ADDED event of each RLHFJob, RayJob
and RayCluster (creationTimestamp has 1 s resolution). Reported per N:

- apply->RayJob: the operator's latency (RLHFJob ADDED -> its RayJob ADDED), p50/p99/max;
  throughput (jobs / (last RayJob - first RLHFJob));
- RayJob->RayCluster: KubeRay's latency for the analogous step, same run, p50/p99/max;
- the operator's RSS (before the burst, peak VmHWM, end) and CPU seconds during the burst, from /proc;
- its API requests per job by verb and resource, from the API server's audit log.

    python benchmarks/operator_scale.py [--jobs 100 300 500] [--out benchmarks/results/operator_scale.json]

--profile samples where the operator spends its CPU (py-spy is not installed; cProfile sees one
thread, and kopf's work is spread over its event loop and the handler threads): a sitecustomize.py
put on the operator's PYTHONPATH starts a thread that, every 10 ms, takes the stack of each thread
whose CPU time (/proc/self/task/*/stat) moved during the burst, and writes the functions with the
most samples.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import datetime
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.measure import EXAMPLES, REPO, TOY, cpu_model, git_commit, total_memory  # noqa: E402
from e2e.controlplane import ControlPlane, apiserver  # noqa: E402
from e2e.fixtures import wait_for  # noqa: E402
from e2e.operator.conftest import OperatorProcess  # noqa: E402
from e2e.operator.test_operator_rbac import audited, request_key, token_kubeconfig  # noqa: E402
from rlhf_api import v1alpha1 as api  # noqa: E402
from rlhf_operator.kube import Kube  # noqa: E402

NAMESPACE = "bench"
SERVICE_ACCOUNT = "rlhf-operator"
APPLY_THREADS = 4
WAIT_SECONDS = 900  # for the last RayCluster of a burst
# (group, version, plural) of what is clocked; the key of a record is (namespace, name)
WATCHED = {"RLHFJob": (api.GROUP, api.VERSION, api.PLURAL), "RayJob": ("ray.io", "v1", "rayjobs"),
           "RayCluster": ("ray.io", "v1", "rayclusters")}


class Clock(threading.Thread):
    """time.monotonic() of the first ADDED event of each object of one kind, in every namespace."""

    def __init__(self, api_client, kind: str):
        super().__init__(daemon=True, name=f"clock-{kind}")
        self.api_client, self.kind = api_client, kind
        self.added: dict[str, float] = {}
        self.owner: dict[str, str] = {}  # name -> the name of its owner (a RayCluster's RayJob)
        self.ready, self.stop = threading.Event(), threading.Event()

    def run(self) -> None:
        from kubernetes import client, watch

        group, version, plural = WATCHED[self.kind]
        custom = client.CustomObjectsApi(self.api_client)
        version_seen = custom.list_cluster_custom_object(group, version, plural)["metadata"]["resourceVersion"]
        self.ready.set()
        while not self.stop.is_set():
            stream = watch.Watch().stream(custom.list_cluster_custom_object, group, version, plural,
                                          resource_version=version_seen, timeout_seconds=60)
            for event in _until_closed(stream):
                now = time.monotonic()
                meta = event["object"]["metadata"]
                version_seen = meta["resourceVersion"]
                if event["type"] == "ADDED" and meta["name"] not in self.added:
                    self.added[meta["name"]] = now
                    owners = meta.get("ownerReferences") or [{}]
                    self.owner[meta["name"]] = owners[0].get("name", "")


def _until_closed(stream):
    """The events of a watch; it ends quietly when the control plane stops under it."""
    from urllib3.exceptions import HTTPError

    try:
        yield from stream
    except HTTPError:
        return


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50, p99 (nearest rank) and max, in seconds."""
    ordered = sorted(values)
    if not ordered:
        return {"p50": None, "p99": None, "max": None, "count": 0}

    def rank(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.999999) - 1))], 3)

    return {"p50": rank(0.50), "p99": rank(0.99), "max": round(ordered[-1], 3), "count": len(ordered)}


def operator_rbac() -> list[dict]:
    """The install manifest's ServiceAccount and cluster RBAC, moved to the audited namespace."""
    docs = [d for d in yaml.safe_load_all((REPO / "manifests" / "install.yaml").read_text())
            if d and d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")]
    for doc in docs:
        if doc["kind"] == "ServiceAccount":
            doc["metadata"].update(namespace=apiserver.AUDITED_NAMESPACE, name=SERVICE_ACCOUNT)
        for subject in doc.get("subjects") or []:
            subject.update(namespace=apiserver.AUDITED_NAMESPACE, name=SERVICE_ACCOUNT)
    return docs


def proc_stats(pid: int) -> dict[str, float]:
    """RSS now and its peak (MiB), and CPU seconds so far (user + system), of one process."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "peak_rss_mib": int(status["VmHWM"].split()[0]) / 1024,
            "cpu_seconds": (int(fields[11]) + int(fields[12])) / ticks}


SAMPLER = '''
import collections, json, os, sys, threading, time, traceback
def _sample(out, interval=0.01):
    me, ticks, inclusive, own, total = threading.get_native_id(), {}, collections.Counter(), collections.Counter(), 0
    last_dump = time.monotonic()
    while True:
        time.sleep(interval)
        if not os.path.exists(out + ".go"):  # the benchmark's burst starts
            continue
        native = {t.ident: t.native_id for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            tid = native.get(ident)
            if tid is None or tid == me:
                continue
            try:
                fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            used = int(fields[11]) + int(fields[12])
            if used == ticks.get(tid, used):
                ticks[tid] = used
                continue
            ticks[tid] = used
            stack = [f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.name}" for f in traceback.extract_stack(frame)]
            total += 1
            own[stack[-1]] += 1
            inclusive.update(set(stack))
        if time.monotonic() - last_dump > 5:
            last_dump = time.monotonic()
            with open(out, "w") as f:
                json.dump({"samples": total, "inclusive": inclusive.most_common(60), "own": own.most_common(40)}, f, indent=0)
if os.environ.get("OPERATOR_SCALE_PROFILE"):
    threading.Thread(target=_sample, args=(os.environ["OPERATOR_SCALE_PROFILE"],), daemon=True).start()
'''


def operator_counts(metrics: str) -> dict[str, float]:
    """Handler runs by handler, and handler errors by kind, from the operator's /metrics."""
    counts = {}
    for line in metrics.splitlines():
        for family, label, what in (("rlhf_operator_reconcile_duration_seconds_count", "handler", "runs"),
                                    ("rlhf_operator_errors_total", "kind", "errors")):
            if line.startswith(family + "{"):
                name = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                counts[f"{what} {name}"] = float(line.rsplit(" ", 1)[1])
    return counts


def burst_job(index: int) -> dict:
    job = yaml.safe_load((EXAMPLES / TOY.job).read_text())
    job["metadata"] = {"name": f"job-{index:04d}", "namespace": NAMESPACE}
    return job


def run(n: int, work: Path, operator_source: Path | None, verbose: bool, profile: Path | None) -> dict:
    """One burst of n jobs on a fresh control plane; operator_source: another copy of operator/ to run;
    profile: where the operator's CPU profile goes (see SAMPLER)."""
    env = {"PYTHONPATH": os.pathsep.join(str(p) for p in (operator_source, profile and work) if p)}
    if profile:
        (work / "sitecustomize.py").write_text(SAMPLER)
        env["OPERATOR_SCALE_PROFILE"] = str(profile)
    with ControlPlane(kwok=True, kuberay=True, kueue=False) as cp:
        cp.kubectl("create", "namespace", apiserver.AUDITED_NAMESPACE)
        cp.kubectl("create", "namespace", NAMESPACE)
        cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(operator_rbac()))
        kube = Kube(cp.api_client())
        wait_for(lambda: kube.get("ServiceAccount", NAMESPACE, "default"), 30, "the default ServiceAccount")
        operator = OperatorProcess(cp, None, work, kubeconfig=token_kubeconfig(cp, SERVICE_ACCOUNT, work / "kubeconfig"),
                                   verbose=verbose)
        clocks = {kind: Clock(cp.api_client(), kind) for kind in WATCHED}
        try:
            operator.start(**env)
            for clock in clocks.values():
                clock.start()
                clock.ready.wait(30)
            time.sleep(2)  # the operator's own watches settle
            pid = operator.proc.pid
            before, load_start = proc_stats(pid), os.getloadavg()
            if profile:
                Path(f"{profile}.go").touch()
            wall_start, start = time.time(), time.monotonic()
            jobs = [burst_job(i) for i in range(n)]
            with concurrent.futures.ThreadPoolExecutor(APPLY_THREADS) as pool:
                list(pool.map(kube.create, jobs))
            applied = time.monotonic()
            wait_for(lambda: len(clocks["RayJob"].added) >= n and len(clocks["RayCluster"].added) >= n,
                     WAIT_SECONDS, f"{n} RayJobs and RayClusters")
            after, load_end = proc_stats(pid), os.getloadavg()
            wall_end = time.time()
            handler_runs = operator_counts(operator.metrics())
        finally:
            for clock in clocks.values():
                clock.stop.set()
            operator.stop()
        requests = [e for e in audited(cp, SERVICE_ACCOUNT) if wall_start <= _timestamp(e) <= wall_end]
        kube.api_client.close()

    jobs_added, ray_jobs, clusters = (clocks[kind].added for kind in WATCHED)
    rayjob_of = {name: clocks["RayJob"].owner[name] for name in ray_jobs}  # RayJob -> its RLHFJob
    operator_latency = [ray_jobs[name] - jobs_added[rayjob_of[name]] for name in ray_jobs if rayjob_of[name] in jobs_added]
    kuberay_latency = [clusters[name] - ray_jobs[clocks["RayCluster"].owner[name]] for name in clusters
                       if clocks["RayCluster"].owner[name] in ray_jobs]
    by_request = collections.Counter(" ".join((verb, (group + "/" if group else "") + resource))
                                     for group, resource, verb in map(request_key, requests))
    first_apply = min(jobs_added.values())
    last_ray_job = max(ray_jobs.values()) - first_apply
    return {
        "jobs": n,
        "apply_seconds": round(applied - start, 3),
        "operator_apply_to_rayjob_seconds": percentiles(operator_latency),
        "kuberay_rayjob_to_raycluster_seconds": percentiles(kuberay_latency),
        "p99_ratio_operator_to_kuberay": round(percentiles(operator_latency)["p99"]
                                               / percentiles(kuberay_latency)["p99"], 3),
        "last_rayjob_after_first_apply_seconds": round(last_ray_job, 3),
        "throughput_jobs_per_second": round(n / last_ray_job, 2),
        "operator_rss_mib": {"before": round(before["rss_mib"], 1), "peak": round(after["peak_rss_mib"], 1),
                             "end": round(after["rss_mib"], 1)},
        "operator_cpu_seconds": round(after["cpu_seconds"] - before["cpu_seconds"], 2),
        "handler_runs_and_errors": handler_runs,
        "api_requests_per_job": round(len(requests) / n, 2),
        "api_requests_per_job_by_verb": {key: round(count / n, 2) for key, count in sorted(by_request.items())},
        "load_average_start": load_start,
        "load_average_end": load_end,
    }


def _timestamp(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["requestReceivedTimestamp"].replace("Z", "+00:00")).timestamp()


def markdown(runs: list[dict]) -> str:
    lines = ["| N | apply→RayJob p50 / p99 / max (s) | KubeRay RayJob→RayCluster p50 / p99 / max (s) | p99 ratio "
             "| last RayJob (s) | jobs/s | RSS before / peak / end (MiB) | CPU (s) | requests/job |",
             "|---:|---|---|---:|---:|---:|---|---:|---:|"]
    for r in runs:
        ours, theirs, rss = (r["operator_apply_to_rayjob_seconds"], r["kuberay_rayjob_to_raycluster_seconds"],
                             r["operator_rss_mib"])
        lines.append(f"| {r['jobs']} | {ours['p50']} / {ours['p99']} / {ours['max']} | {theirs['p50']} / "
                     f"{theirs['p99']} / {theirs['max']} | {r['p99_ratio_operator_to_kuberay']} | "
                     f"{r['last_rayjob_after_first_apply_seconds']} | {r['throughput_jobs_per_second']} | "
                     f"{rss['before']} / {rss['peak']} / {rss['end']} | {r['operator_cpu_seconds']} | "
                     f"{r['api_requests_per_job']} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[100, 300, 500], help="burst sizes (%(default)s)")
    parser.add_argument("--operator-source", type=Path, help="run the operator from this copy of operator/ "
                        "(e.g. the code before a change), not the installed one")
    parser.add_argument("--keep-logs", action="store_true", help="keep the operator's logs (--verbose)")
    parser.add_argument("--profile", type=Path, help="write the operator's CPU profile of each N here "
                        "(<file>-<N>.json)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "operator_scale.json")
    args = parser.parse_args()
    started, load_start = time.strftime("%Y-%m-%dT%H:%M:%S%z"), os.getloadavg()
    runs = []
    for n in args.jobs:
        work = Path(tempfile.mkdtemp(prefix=f"operator-scale-{n}-"))
        runs.append(run(n, work, args.operator_source, args.keep_logs,
                        args.profile and args.profile.with_name(f"{args.profile.stem}-{n}.json")))
        if args.keep_logs:
            print(f"# operator logs of {n} jobs: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work)
        print(json.dumps(runs[-1], indent=1), file=sys.stderr, flush=True)
    results = {
        "command": "python benchmarks/operator_scale.py " + " ".join(sys.argv[1:]),
        "date": started,
        "git_commit": git_commit(),
        "machine": {"cpus": os.cpu_count(), "processor": cpu_model(), "memory_gib": round(total_memory() / 2**30, 1)},
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "job": str((EXAMPLES / TOY.job).relative_to(REPO)),
        "operator_source": str(args.operator_source or REPO / "operator"),
        "summary_markdown": markdown(runs),
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(results["summary_markdown"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
