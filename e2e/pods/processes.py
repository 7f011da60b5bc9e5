"""A container as a process tree: its root, its environment, its command, its namespaces.

The container's root is its image's filesystem (rootfs.py). Inside the container's mount namespace,
before the root changes to it (`root_script`): /proc, /sys and /dev of this machine (so a process
sees itself and the devices, as under a runtime), a /dev/shm of its own, the pod network's
/etc/hosts and /etc/resolv.conf (network.py), then the pod's volumes (volumes.bind_script). Then
the command runs in the root, in its working directory, as the container's user (setpriv, the
image's own), with no capabilities and no new privileges.

Each container is the leader of its own session: stopped as a runtime stops one (`stop`), never by `ray stop`.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from pathlib import Path
from typing import Any

from kubernetes.utils import parse_quantity

from e2e.pods.rootfs import inside
from e2e.pods.users import Identity

# Ray's memory monitor kills a node's tasks once the memory it reads is 95% used. Under a kubelet that is the
# container's memory cgroup; these pods have none of their own, so it would read the whole machine's, shared
# with the rest of the suite, and kill a pod's training for other tests' memory (seen once with the machine at
# 22.7 of 23.5 GiB). Off in every container and head here, as the node's own setting.
NODE_ENV = {"RAY_memory_monitor_refresh_ms": "0"}

def resolve_env(container: dict[str, Any], fields: dict[str, str], lookup, base: dict[str, str]) -> dict[str, str]:
    """The container's environment: base (the image's and the kubelet's), envFrom, then env in order.

    fields: fieldRef paths (metadata.name, status.podIP, metadata.labels['k'] ...) to values;
    lookup(kind, name) -> the ConfigMap's or Secret's keys. $(VAR) references are expanded.
    """
    env = dict(base)
    for source in container.get("envFrom", []):
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        ref = source.get("configMapRef") or source.get("secretRef")
        env.update({source.get("prefix", "") + k: v for k, v in lookup(kind, ref["name"]).items()})
    limits = (container.get("resources") or {}).get("limits") or {}
    for var in container.get("env", []):
        value_from = var.get("valueFrom", {})
        if "value" in var or not value_from:
            env[var["name"]] = expand(var.get("value", ""), env)
        elif "fieldRef" in value_from:
            env[var["name"]] = fields[value_from["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in value_from:
            ref = value_from["resourceFieldRef"]
            quantity = parse_quantity(limits[ref["resource"].split(".", 1)[1]])
            env[var["name"]] = str(int(-(-quantity // parse_quantity(ref.get("divisor", "1")))))
        else:
            kind = "ConfigMap" if "configMapKeyRef" in value_from else "Secret"
            ref = value_from.get("configMapKeyRef") or value_from.get("secretKeyRef")
            env[var["name"]] = lookup(kind, ref["name"])[ref["key"]]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion ($$ escapes; an unknown name stays as written)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def pod_fields(pod: dict[str, Any], pod_ip: str, host_ip: str) -> dict[str, str]:
    meta = pod["metadata"]
    fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
              "spec.nodeName": pod["spec"].get("nodeName", ""),
              "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "default"),
              "status.podIP": pod_ip, "status.podIPs": pod_ip, "status.hostIP": host_ip}
    for key in ("labels", "annotations"):
        fields.update({f"metadata.{key}['{k}']": v for k, v in (meta.get(key) or {}).items()})
    return fields


def root_script(root: Path, hosts: Path, resolv: Path) -> str:
    """Shell lines (run as root in the container's new mount namespace) that lay out its root around it."""
    q = shlex.quote
    lines = []
    for path in ("/proc", "/sys", "/dev"):
        lines += [f"mkdir -p {q(str(root) + path)}", f"mount --rbind {path} {q(str(root) + path)}"]
    lines += [f"mkdir -p {q(str(root / 'dev/shm'))}", f"mount -t tmpfs -o mode=1777 shm {q(str(root / 'dev/shm'))}"]
    for source, target in ((hosts, "/etc/hosts"), (resolv, "/etc/resolv.conf")):
        at = q(str(inside(root, target)))
        lines += [f"touch {at}", f"mount --bind {q(str(source))} {at}"]
    return "".join(line + "\n" for line in lines)


def read_only_root(root: Path) -> str:
    """readOnlyRootFilesystem: the root made read-only once its mount points exist (the mounts on it stay as they are)."""
    return f"mount -o remount,bind,ro {shlex.quote(str(root))}\n"


def launch(netns: str, hostname: str, script: str, who: Identity, argv: list[str], root: Path, workdir: str,
           env: dict[str, str], log: Path) -> subprocess.Popen:
    """Run argv as `who` in the pod's network namespace, in a new mount and UTS namespace laid out by script,
    with `root` as its root directory and `workdir` (created if the image lacks it) as its working directory.

    Every step execs the next, so the Popen's pid is the container's main process (in its namespaces).
    """
    setpriv = ["setpriv", f"--reuid={who.uid}", f"--regid={who.gid}", f"--groups={','.join(map(str, who.groups))}",
               "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    # The open-files limit stays this machine's (a container runtime gives 1048576; this sandbox refuses more than
    # its 20000 even to root), so KubeRay's `ulimit -n 65536` fails, without consequence, before `ray start`.
    q = shlex.quote
    body = (f"set -e\nhostname {q(hostname)}\nmkdir -p {q(str(inside(root, workdir)))}\n{script}"
            f'exec unshare --root={q(str(root))} --wd={q(workdir)} {shlex.join(setpriv)} -- "$@"\n')
    with open(log, "ab") as out:
        return subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--propagation", "private",
             "bash", "-c", body, "container", *argv],
            env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def exec_in(pid: int, who: Identity, argv: list[str], env: dict[str, str], timeout: float,
            log: Path | None = None) -> int:
    """An exec probe or hook: argv in the container's namespaces, as its user; the exit code (1 on timeout).
    Its output goes to `log` if given (a hook's to the container's log), else nowhere (a probe's).
    It runs in the container's root and working directory, so the command is the image's."""
    setpriv = ["setpriv", f"--reuid={who.uid}", f"--regid={who.gid}", f"--groups={','.join(map(str, who.groups))}"]
    with open(log or os.devnull, "ab") as out:
        try:
            return subprocess.run(["nsenter", "-t", str(pid), "-m", "-n", "-u", "-r", "-w", "--", *setpriv, "--", *argv], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 1


def stop(process: subprocess.Popen, grace: float = 10) -> None:
    """As a container runtime stops a container: SIGTERM to its main process alone, then SIGKILL to every
    process left once the main process has exited or the grace period has passed.

    The main process is the container's PID 1, which the kernel spares a signal it has no handler for
    (a shell that did not exec its last command ignores SIGTERM; `ray start`, which KubeRay's `bash -c`
    execs, handles it by draining its node through the GCS). Signalling the whole group instead would
    stop the GCS under a draining `ray start`, which then waits a minute for it to come back."""
    if process.poll() is None:
        if handles(process.pid, signal.SIGTERM):
            try:
                os.kill(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    kill_group(process.pid, signal.SIGKILL)  # what is left: PID 1's exit ends its whole namespace
    process.wait(10)


def handles(pid: int, sig: int) -> bool:
    """The process has a handler for the signal (SigCgt of /proc/PID/status); False once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) >> (sig - 1) & 1)


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def rss_by_session() -> dict[int, int]:
    """Resident bytes of every session on this machine (a container is one: its process tree), in one pass."""
    totals: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        session = int(stat[3])  # field 6; rss in pages is field 24
        totals[session] = totals.get(session, 0) + int(stat[21]) * os.sysconf("SC_PAGE_SIZE")
    return totals
