"""A container as a process tree: the "image", its environment, its command, its namespaces.

The image is this machine's filesystem with the project's virtualenv in place of the trainer image's
/opt/venv. Inside the container's mount namespace:
- /root is an empty tmpfs with only the virtualenv, its base Python and the project's checkout bound
  back at their paths (scripts' shebangs name them): uid 1000 can read them, and nothing else of
  root's home is seen; those in /tmp are bound back into the pod's own /tmp;
- /etc/profile is the image's (Ubuntu's leaves PATH alone; this machine's Debian one resets it,
  and KubeRay runs every command in `bash -l`);
- /etc/hosts and /etc/resolv.conf are the pod network's (network.py), /tmp the pod's own, HOME the user's;
- then the pod's volumes (volumes.bind_script), and the command runs as the pod's user (setpriv).

Each container is the leader of its own session: stopped by process group, never by `ray stop`.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from kubernetes.utils import parse_quantity

from e2e.pods.users import Identity

VENV = Path(sys.prefix).resolve()
BASE_PYTHON = Path(sys.base_prefix).resolve()
REPO = Path(__file__).resolve().parents[2]  # the venv imports the project from its checkout (an editable install)
IMAGE_HOME = "/home/ray"
IMAGE_PATH = f"{VENV / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
IMAGE_PROFILE = 'for i in /etc/profile.d/*.sh; do [ -r "$i" ] && . "$i"; done\n'


def resolve_env(container: dict[str, Any], fields: dict[str, str], lookup, extra: dict[str, str]) -> dict[str, str]:
    """The container's environment: the image's, the kubelet's (extra), envFrom, then env in order.

    fields: fieldRef paths (metadata.name, status.podIP, metadata.labels['k'] ...) to values;
    lookup(kind, name) -> the ConfigMap's or Secret's keys. $(VAR) references are expanded.
    """
    env = {"PATH": IMAGE_PATH, "HOME": IMAGE_HOME, "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", **extra}
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


def image_script(root: Path, hosts: Path, resolv: Path, home: Path) -> str:
    """Shell lines (run as root in the new mount namespace) that lay out the image around the pod."""
    profile = root / "profile"
    profile.write_text(IMAGE_PROFILE)
    q = shlex.quote
    # /root is built aside, then moved over /root: its sources are in the /root it hides.
    stage = root / "image-root"
    stage.mkdir(exist_ok=True)
    lines = [f"mount -t tmpfs -o mode=755 tmpfs {q(str(stage))}"]
    # What the image holds stays at its path wherever this machine has it: in root's home (bound into
    # the new /root) or in /tmp (bound into the pod's own /tmp: tmp_target).
    for path in (BASE_PYTHON, VENV, REPO):
        if path.is_relative_to("/root"):
            inside = q(str(stage / path.relative_to("/root")))
        elif path.is_relative_to("/tmp"):
            inside = q(tmp_target(root, str(path)))
        else:
            continue
        lines += [f"mkdir -p {inside}", f"mount --bind {q(str(path))} {inside}"]
    lines += [f"mount --move {q(str(stage))} /root", f"mount --bind {q(str(profile))} /etc/profile",
              f"mount --bind {q(str(hosts))} /etc/hosts", f"mount --bind {q(str(resolv))} /etc/resolv.conf",
              "mountpoint -q /home || mount -t tmpfs -o mode=755 tmpfs /home", f"mkdir -p {IMAGE_HOME}",
              f"mount --bind {q(str(home))} {IMAGE_HOME}"]
    return "".join(line + "\n" for line in lines)


def pod_tmp(root: Path) -> Path:
    """The pod's own /tmp. It is mounted last (tmp_script), as sources of the other mounts may be in this
    machine's /tmp: a mount whose target is in /tmp goes into this directory instead (tmp_target)."""
    tmp = root / "tmp"
    tmp.mkdir(exist_ok=True)
    tmp.chmod(0o1777)
    return tmp


def tmp_target(root: Path, target: str) -> str:
    relative = Path(target).relative_to("/tmp") if Path(target).is_relative_to("/tmp") else None
    return target if relative is None else str(pod_tmp(root) / relative)


def tmp_script(root: Path) -> str:
    return f"mount --rbind {shlex.quote(str(pod_tmp(root)))} /tmp\n"


def launch(netns: str, hostname: str, script: str, who: Identity, argv: list[str], workdir: str,
           env: dict[str, str], log: Path) -> subprocess.Popen:
    """Run argv as `who` in the pod's network namespace, in a new mount and UTS namespace laid out by script.

    Every step execs the next, so the Popen's pid is the container's main process (in its namespaces).
    """
    setpriv = ["setpriv", f"--reuid={who.uid}", f"--regid={who.gid}", f"--groups={','.join(map(str, who.groups))}",
               "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    # The open-files limit stays this machine's (a container runtime gives 1048576; this sandbox refuses more than
    # its 20000 even to root), so KubeRay's `ulimit -n 65536` fails, without consequence, before `ray start`.
    body = (f"set -e\nhostname {shlex.quote(hostname)}\n{script}cd {shlex.quote(workdir)}\n"
            f'exec {shlex.join(setpriv)} -- "$@"\n')
    with open(log, "ab") as out:
        return subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--propagation", "private",
             "bash", "-c", body, "container", *argv],
            env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def exec_in(pid: int, who: Identity, argv: list[str], env: dict[str, str], timeout: float,
            log: Path | None = None) -> int:
    """An exec probe or hook: argv in the container's namespaces, as its user; the exit code (1 on timeout).
    Its output goes to `log` if given (a hook's to the container's log), else nowhere (a probe's)."""
    setpriv = ["setpriv", f"--reuid={who.uid}", f"--regid={who.gid}", f"--groups={','.join(map(str, who.groups))}"]
    with open(log or os.devnull, "ab") as out:
        try:
            return subprocess.run(["nsenter", "-t", str(pid), "-m", "-n", "-u", "--", *setpriv, "--", *argv], env=env,
                                  stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 1


def stop(process: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM to the container's process group, SIGKILL after the grace period."""
    if process.poll() is not None:
        kill_group(process.pid, signal.SIGKILL)  # what it left behind
        return
    kill_group(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    kill_group(process.pid, signal.SIGKILL)
    process.wait(10)


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
