"""The suite's time by phase, its slowest modules, the machine's peak memory and least free disk, printed at
its end, so that a change that costs minutes is seen at once (measured, never asserted).

Phases: what tests/run-suite.sh timed before and beside pytest (the install, each build; lines
"<phase> <seconds>" in the file RLHF_SUITE_TIMES names) and the tests by kind: unit (tests/), ML
(tests/trainer/: Ray, DeepSpeed, vLLM and models) and e2e (e2e/: control planes, controllers, pods).
Under pytest-xdist the kinds overlap, so each has its summed test time and its span of wall time.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.controlplane import cache_dir
from e2e.parallel import RECORD, last_times, module_of

SLOWEST_MODULES = 15
REASON_CHARS = 400  # of each failure's reason, repeated at the very end of the output


def phase_of(nodeid: str) -> str:
    if nodeid.startswith("tests/trainer/"):
        return "ML"
    return "e2e" if nodeid.startswith("e2e/") else "unit"


class MachineUse:
    """The most memory in use on the machine (MemTotal - MemAvailable) and the least disk free where the caches
    are (a run that fills the disk fails everywhere at once), sampled every second."""

    def __init__(self) -> None:
        self.peak = 0
        self.total = self._meminfo()["MemTotal"]
        self.least_free_disk = self._free_disk()
        self.stopped = threading.Event()
        threading.Thread(target=self._sample, daemon=True, name="machine-use").start()

    @staticmethod
    def _meminfo() -> dict[str, int]:
        fields = (line.split() for line in Path("/proc/meminfo").read_text().splitlines())
        return {f[0].rstrip(":"): int(f[1]) * 1024 for f in fields}

    @staticmethod
    def _free_disk() -> int:
        folder = cache_dir()
        while not folder.exists():
            folder = folder.parent
        stat = os.statvfs(folder)
        return stat.f_bavail * stat.f_frsize

    def _sample(self) -> None:
        while not self.stopped.wait(1):
            info = self._meminfo()
            self.peak = max(self.peak, info["MemTotal"] - info["MemAvailable"])
            self.least_free_disk = min(self.least_free_disk, self._free_disk())


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat); idle is idle plus iowait."""
    fields = [int(field) for field in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def _widen(spans: dict[str, list[float]], key: str, start: float, end: float) -> None:
    """spans[key] = [first start, last end], widened to include this interval."""
    span = spans.setdefault(key, [start, end])
    span[0], span[1] = min(span[0], start), max(span[1], end)


class SuiteReport:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.machine = MachineUse()
        self.spans: dict[str, list[float]] = {}  # phase -> [first start, last end], seconds since started
        self.summed: collections.Counter[str] = collections.Counter()
        self.tests: collections.Counter[str] = collections.Counter()
        self.modules: collections.Counter[str] = collections.Counter()  # seconds per test module
        self.module_spans: dict[str, list[float]] = {}  # module -> [first start, last end]: where it sat in the run
        self.module_workers: dict[str, str] = {}
        self.cpu = cpu_times()
        self.not_passed: list[str] = []  # "<nodeid> (<phase>): <reason>" of each failed or errored test phase

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # Reports reach the controller as each phase of a test ends (under xdist too): its end is now.
        end = time.monotonic() - self.started
        phase = phase_of(report.nodeid)
        _widen(self.spans, phase, end - report.duration, end)
        self.summed[phase] += report.duration
        module = module_of(report.nodeid)
        self.modules[module] += report.duration
        _widen(self.module_spans, module, end - report.duration, end)
        if node := getattr(report, "node", None):  # under xdist: the worker that ran it
            self.module_workers[module] = node.gateway.id
        if report.when == "call":
            self.tests[phase] += 1
        if report.failed:
            self.not_passed.append(f"{report.nodeid} ({report.when}): {_reason(report)}")

    # The outermost wrapper, printing after pytest's own summary (failures, durations, short summary):
    # the last lines of a long run's output are often all that a CI log shows.
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter) -> Iterator[None]:
        yield
        self.machine.stopped.set()
        write = terminalreporter.write_line
        terminalreporter.section("suite time by phase")
        times = os.environ.get("RLHF_SUITE_TIMES")
        if times and Path(times).exists():
            for line in Path(times).read_text().splitlines():
                name, seconds = line.rsplit(" ", 1)
                write(f"{name:<28} {float(seconds):8.0f} s")
        workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT") or getattr(terminalreporter.config.option, "numprocesses", None)
        for phase in ("unit", "ML", "e2e"):
            if phase in self.spans:
                first, last = self.spans[phase]
                write(f"{phase + ' tests':<28} {last - first:8.0f} s wall ({first:.0f}-{last:.0f} s into pytest), "
                      f"{self.summed[phase]:.0f} s summed over {self.tests[phase]} tests")
        write(f"{'pytest':<28} {time.monotonic() - self.started:8.0f} s wall, {workers or 1} worker(s)")
        write(f"peak memory in use: {self.machine.peak / 2**30:.1f} GiB of {self.machine.total / 2**30:.1f} GiB")
        write(f"least free disk: {self.machine.least_free_disk / 2**30:.1f} GiB (where {cache_dir()} is)")
        busy, total = (end - start for start, end in zip(self.cpu, cpu_times()))
        write(f"CPU busy: {busy / max(total, 1) * os.cpu_count():.1f} of {os.cpu_count()} cores on average")
        terminalreporter.section(f"slowest {SLOWEST_MODULES} modules (setup and teardown included)")
        for module, seconds in self.modules.most_common(SLOWEST_MODULES):
            first, last = self.module_spans[module]
            write(f"{seconds:8.0f} s  {module}  ({self.module_workers.get(module, 'main')}, {first:.0f}-{last:.0f} s)")
        if self.not_passed:  # again, last: pytest's short summary is far above in a long run's log
            terminalreporter.section(f"{len(self.not_passed)} failed or errored (a failure's phase: setup, call or teardown)")
            for line in self.not_passed:
                write(line)
        # The next run hands out the longest units first (e2e/parallel.py). Only a whole run's times are kept: a
        # module of which `-k` picked one test took seconds, and recorded so it went out last in the next run.
        if whole_suite(terminalreporter.config):
            cache_dir().mkdir(parents=True, exist_ok=True)
            (cache_dir() / RECORD).write_text(json.dumps({**last_times(), **self.modules}, indent=0, sort_keys=True))


def _reason(report: pytest.TestReport) -> str:
    """The failure's one-line cause: the crash message pytest shows in its short summary, else the report's end."""
    crash = getattr(report.longrepr, "reprcrash", None)
    reason = crash.message if crash else str(report.longrepr).strip().rsplit("\n", 1)[-1]
    return " ".join(reason.split())[:REASON_CHARS]


def whole_suite(config: pytest.Config) -> bool:
    """The run collected every test of its testpaths: no paths given, nothing selected or deselected."""
    option = config.option
    return (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not option.keyword and not option.markexpr
            and not getattr(option, "lf", False) and not getattr(option, "deselect", None))


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist), not a worker
        config.pluginmanager.register(SuiteReport(), "rlhf-suite-report")
