"""Process supervision by PID: every process is started in its own session with its output in
a log file, recorded (PID + start time) in state.json, and stopped by PID, also from another
Python process (`python -m e2e.controlplane down`)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ControlPlaneError


# Listening ports are drawn from below Linux's ephemeral range (32768-60999), where the kernel takes
# the source port of every outgoing connection: a port found free there was, under load, taken by one
# of Ray's connections before the process it was chosen for could bind it. Ray's workers listen on
# 10002-19999 (its min/max_worker_port), so the range starts above them.
PORT_RANGE = range(20000, 32768)


def free_ports(count: int) -> list[int]:
    """Distinct loopback ports that were free a moment ago, outside the ephemeral range. Each pytest-xdist
    worker draws from its own slice of PORT_RANGE, so two workers never choose the same port."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    width = len(PORT_RANGE) // workers
    start = PORT_RANGE.start + int(worker) * width
    candidates = random.sample(range(start, start + width), width)
    ports: list[int] = []
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise ControlPlaneError(f"fewer than {count} free ports in {start}-{start + width - 1}")


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: tells a process apart from a later one with its PID."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# Runs argv with SIGKILL as its parent-death signal (PR_SET_PDEATHSIG, kept across exec): the
# control plane dies with the test process. setpriv (util-linux, in every Debian) sets it after the
# fork, where a preexec_fn would run Python in a child of a many-threaded process (the trainer tests'
# Ray and torch threads): that child once aborted with "double free or corruption" before exec.
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL", "--"]


def tail(path: Path, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            data = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])


@dataclass
class Process:
    name: str
    pid: int
    start_time: int | None
    argv: list[str]
    log: Path
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        return pid_alive(self.pid) and proc_start_time(self.pid) == self.start_time

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds; only if the PID is still ours."""
        if not self.alive():
            if self.popen is not None:
                self.popen.wait()
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and self.alive():
                time.sleep(0.05)
            if not self.alive():
                break
        if self.popen is not None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.pid, "start_time": self.start_time,
                "argv": self.argv, "log": str(self.log)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Process:
        return cls(d["name"], d["pid"], d["start_time"], d["argv"], Path(d["log"]))


def spawn(name: str, argv: list[str], log: Path, *, cwd: Path, env: dict[str, str],
          with_parent: bool) -> Process:
    """Start argv in its own session, appending its output to log; with_parent: it gets
    SIGKILL when this process dies."""
    with open(log, "ab") as out:
        popen = subprocess.Popen(
            DIE_WITH_PARENT + argv if with_parent else argv, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True,
        )
    return Process(name, popen.pid, proc_start_time(popen.pid), argv, log, popen)


@dataclass
class Launcher:
    """Starts a control plane's processes and waits on them: each logs to logs_dir/<name>.log,
    runs in cwd with env, and is recorded in processes (then on_spawn is called)."""
    logs_dir: Path
    cwd: Path
    env: dict[str, str]
    with_parent: bool
    processes: dict[str, Process]
    on_spawn: Callable[[], None] = lambda: None

    def spawn(self, name: str, argv: list[str]) -> Process:
        proc = spawn(name, argv, self.logs_dir / f"{name}.log", cwd=self.cwd, env=self.env,
                     with_parent=self.with_parent)
        self.processes[name] = proc
        self.on_spawn()
        return proc

    def wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        """Poll cond until true; fail fast when one of the processes has died."""
        wait_until(cond, timeout, what, self.processes.values(), self.logs_dir)


def wait_until(cond: Callable[[], bool], timeout: float, what: str,
               processes: Iterable[Process], logs_dir: Path) -> None:
    """Poll cond until true; fail fast when one of the processes (a live view, e.g. a dict's
    values(), so that processes started meanwhile count) has died."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        if cond():
            return
        dead = [p for p in processes if not p.alive()]
        if dead:
            raise ControlPlaneError(
                f"waiting for {what}: {', '.join(p.name for p in dead)} exited "
                f"(logs in {logs_dir})")
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"timed out after {timeout:.0f}s waiting for {what} "
                                    f"(logs in {logs_dir})")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def in_use(path: Path) -> bool:
    """Whether a state dir (or a seed's temporary one) has a live process of ours."""
    for state in [path / "state.json", path / "run" / "state.json"]:
        try:
            procs = json.loads(state.read_text()).get("processes", [])
        except (OSError, ValueError):
            continue
        if any(Process.from_json(p).alive() for p in procs):
            return True
    return False


def prune(parent: Path, keep: int, stale_after_s: float = 3600.0) -> None:
    """Keep the `keep` newest entries of parent (run dirs kept after failures, seeds); drop
    leftovers of interrupted runs (names starting with '.') after an hour. Never touches a
    directory with a live process."""
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:  # removed meanwhile by another session
            return 0.0

    now = time.time()
    try:
        entries = sorted(parent.iterdir(), key=mtime, reverse=True)
    except OSError:
        return
    visible = [p for p in entries if not p.name.startswith(".")]
    doomed = visible[keep:] + [p for p in entries if p.name.startswith(".tmp-")
                               and now - mtime(p) > stale_after_s]
    for p in doomed:
        if p.is_dir() and not in_use(p):
            shutil.rmtree(p, ignore_errors=True)
