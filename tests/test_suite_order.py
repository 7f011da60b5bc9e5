"""The suite's own order: units of work (a module, or a group of e2e/parallel.py) longest first; on a fresh
machine the control plane and the images build while the tests that need neither run, so every unit with
a test that needs one (the control_plane fixture, build.sh's tools through binaries.built marked
needs_build, an image fixture) is passed over until they are built; a unit's tests stay together, for
their module's fixtures. One that ran build.sh unmarked waited on the build's lock inside its timeout
(tests/test_monitoring.py did, on a fresh machine)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from e2e import parallel, report
from e2e.controlplane import binaries
from e2e.fixtures import needs_build, needs_images


def test_while_a_build_is_pending_the_units_that_need_it_are_named_so_and_all_go_longest_first(
        request, monkeypatch, tmp_path):
    monkeypatch.setenv(parallel.BUILDS_PENDING_ENV, "1")
    monkeypatch.setenv(parallel.UNITS_ENV, str(tmp_path / "units.json"))
    items = list(request.session.items)
    parallel.pytest_collection_modifyitems(items)
    named = json.loads(Path(os.environ[parallel.UNITS_ENV]).read_text())
    units = [named[item.nodeid] for item in items]
    waiting = {unit for item, unit in zip(items, units, strict=True) if needs_build(item) or needs_images(item)}
    assert all(parallel.waits(unit) for unit in waiting)
    assert not any(parallel.waits(unit) for unit in set(units) - waiting)
    parallel.pytest_collection_modifyitems([Item("e2e/a.py::t", "control_plane"), Item("e2e/b.py::t", "pod_runtime", "trainer_image"),
                                            Item("tests/c.py::t", "local_ray"), Item("tests/d.py::t")])
    assert json.loads(Path(os.environ[parallel.UNITS_ENV]).read_text()) == {
        "e2e/a.py::t": f"{parallel.WAITS}e2e/a.py", "e2e/b.py::t": f"{parallel.TRAINS}{parallel.WAITS}pod-runtime",
        "tests/c.py::t": f"{parallel.TRAINS}tests/c.py", "tests/d.py::t": "tests/d.py"}
    times = parallel.last_times()
    seconds = [sum(times.get(m, 0) for m in {parallel.module_of(i.nodeid) for i, u in zip(items, units) if u == unit})
               for unit in dict.fromkeys(units)]
    assert seconds == sorted(seconds, reverse=True)
    assert all(units[i] == units[i - 1] or units[i] not in units[:i] for i in range(1, len(units))), "a unit split"
    unmarked = [item.nodeid for item in items
                if not needs_build(item) and getattr(item.module, "built", None) is binaries.built]
    assert unmarked == []


def test_units_that_wait_for_a_build_go_out_in_their_place_once_it_is_done(pytestconfig, monkeypatch):
    """While the control plane and the images build, the workers get the units that need neither; once
    both are built, the longest unit that waited goes out next. (Ordered after every unit that needs no
    build, the longest of all, the pod runtime's group, started 75 minutes into a fresh machine's run.)"""
    monkeypatch.setattr(parallel, "ML_SLOTS", 2)
    monkeypatch.setattr(parallel, "BUILD_CHECK_SECONDS", 0)
    monkeypatch.setenv(parallel.BUILDS_PENDING_ENV, "1")
    built = []
    monkeypatch.setattr(parallel, "builds_current", lambda: bool(built))
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"], raising=False)
    scheduler = parallel.ModuleOrGroupScheduling(pytestconfig)
    pods = "e2e/pods.py::test_0"
    scheduler.units = {pods: parallel.TRAINS + parallel.WAITS + "e2e/pods.py"}  # as the workers write them
    collection = [pods] + [f"t/test_{n}.py::test_0" for n in range(6)]  # the longest first
    workers = [Worker(name) for name in "xy"]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    sent = [index for worker in workers for index in worker.sent]
    assert 0 not in sent and len(sent) == 4  # each worker has two units, none of them the one that waits
    built.append(True)
    scheduler._assign_work_unit(workers[0])
    assert workers[0].sent[-1] == 0


class Worker:
    """What xdist's scheduler uses of a worker (its controller): its id and the indexes of the tests it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway, self.sent, self.shutting_down = SimpleNamespace(id=name), [], False

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent += indexes

    def shutdown(self) -> None:
        self.shutting_down = True


def test_a_worker_without_a_training_slot_takes_the_next_unit_that_does_not_train(pytestconfig, monkeypatch):
    """Three workers, two slots, the queue's first three units train: the third worker, asking while two
    others train, gets the units that do not train; a worker that trains already takes the next unit
    that trains behind its own (it runs them one after another)."""
    monkeypatch.setattr(parallel, "ML_SLOTS", 2)
    monkeypatch.setattr(pytestconfig.option, "tx", ["3*popen"], raising=False)
    scheduler = parallel.ModuleOrGroupScheduling(pytestconfig)
    scheduler.units = {}  # as the workers write them (UNITS_ENV)

    def unit(name: str, tests: int, trains: bool) -> list[str]:
        path = f"t/test_{name}.py"
        ids = [f"{path}::test_{n}" for n in range(tests)]
        scheduler.units |= {nodeid: (parallel.TRAINS if trains else "") + path for nodeid in ids}
        return ids

    collection = (unit("a", 3, True) + unit("b", 1, True) + unit("c", 1, True)  # 0-2, 3, 4
                  + unit("light", 1, False) + unit("long", 3, False))  # 5, 6-8
    x, y, z = workers = [Worker(name) for name in "xyz"]
    for worker in workers:
        scheduler.add_node(worker)
        scheduler.add_node_collection(worker, collection)
    scheduler.schedule()
    # Each worker is sent a second unit while it has fewer than 3 tests to run.
    assert (x.sent, y.sent, z.sent) == ([0, 1, 2], [3, 4], [5, 6, 7, 8])


def test_a_fresh_clone_orders_units_by_the_committed_times(monkeypatch, tmp_path):
    """CI starts without the cache's record of the last run: the committed seed gives the order, so that
    the longest units (the pod runtime's, test_learning) are not handed out last, alphabetically."""
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    seeded = parallel.last_times()
    assert seeded == parallel.json.loads(parallel.SEED.read_text())
    longest_first = sorted(seeded, key=seeded.get, reverse=True)
    # Which of the two is first changes with each re-seeding (1,428 and 1,035 s in the last).
    assert set(longest_first[:2]) == {"tests/trainer/test_learning.py", "e2e/operator/test_multipod.py"}
    root = Path(parallel.__file__).parents[1]
    assert [module for module in seeded if not (root / module).is_file()] == []  # none stale

    (tmp_path / parallel.RECORD).write_text('{"tests/test_api.py": 99999}')
    assert parallel.last_times() == {**seeded, "tests/test_api.py": 99999}  # this machine's record wins


class Item(SimpleNamespace):
    """What the ordering hook reads of a collected test."""

    def __init__(self, nodeid: str, *fixtures: str) -> None:
        super().__init__(nodeid=nodeid, fixturenames=list(fixtures), marks=[])

    def add_marker(self, mark) -> None:
        self.marks.append(mark)

    def get_closest_marker(self, name: str):
        return next((mark for mark in self.marks if mark.name == name), None)


def test_units_that_train_are_handed_out_longest_first_by_their_modules_times(monkeypatch, tmp_path):
    """The record holds modules; a unit that trains is named TRAINS + module, and the pod runtime's group
    holds several modules: each is ordered by the sum of its modules' times (it once read 0 for every
    unit that trains, which then ran in alphabetical order: the longest of them last)."""
    monkeypatch.setattr(parallel, "SEED", tmp_path / "none.json")
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    (tmp_path / parallel.RECORD).write_text(parallel.json.dumps(
        {"tests/a.py": 10, "tests/b.py": 300, "tests/c.py": 50, "e2e/p1.py": 100, "e2e/p2.py": 150}))
    items = [Item("tests/a.py::t", "local_ray"), Item("tests/b.py::t", "toy_job"), Item("tests/c.py::t"),
             Item("e2e/p1.py::t", "pod_runtime"), Item("e2e/p2.py::t", "pod_runtime")]
    parallel.pytest_collection_modifyitems(items)
    assert [item.nodeid for item in items] == [
        "tests/b.py::t", "e2e/p1.py::t", "e2e/p2.py::t", "tests/c.py::t", "tests/a.py::t"]


TRAINING_MODULE = """
import json, os, time, pytest

@pytest.fixture(scope="module")
def local_ray():  # the name makes the module a unit that trains (e2e/parallel.py's HEAVY_FIXTURES)
    with open(os.environ["SPANS"], "a") as spans:
        spans.write(json.dumps(["start", __name__]) + "\\n")
    yield
    with open(os.environ["SPANS"], "a") as spans:
        spans.write(json.dumps(["end", __name__]) + "\\n")

def test_trains(local_ray):
    time.sleep(1)  # long enough for the other workers to be handed units meanwhile
"""


def test_real_xdist_workers_run_at_most_ml_slots_units_that_train_at_once(tmp_path):
    """Five modules that train and five that do not, over four pytest-xdist workers: the starts and ends of
    the training modules, in the order they happened, never have more than ML_SLOTS open at once. (With
    xdist's groups, which pytest 9 drops, all four workers trained at once.)"""
    for n in range(5):
        (tmp_path / f"test_train_{n}.py").write_text(TRAINING_MODULE)
        (tmp_path / f"test_light_{n}.py").write_text("import time\ndef test_light():\n    time.sleep(1)\n")
    spans = tmp_path / "spans.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "4", "--dist", "loadscope", "-p", "e2e.parallel", "-p", "no:cacheprovider",
         "-q", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=Path(parallel.__file__).parents[1], env={**os.environ, "SPANS": str(spans), "RLHF_ML_SLOTS": "2",
                                                      "RLHF_CACHE": str(tmp_path / "cache")},
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    events = [json.loads(line) for line in spans.read_text().splitlines()]
    assert sorted(module for kind, module in events if kind == "start") == [f"test_train_{n}" for n in range(5)]
    open_at_once = list(itertools.accumulate(1 if kind == "start" else -1 for kind, _ in events))
    assert max(open_at_once) <= 2, events


def test_a_module_marked_trains_is_a_unit_that_trains(monkeypatch, tmp_path):
    """The e2e modules whose head pods run the trainer (e2e/pods/head.py) use none of the fixtures that
    make a unit one that trains; their mark does (they ran beside two training units, four at once)."""
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    monkeypatch.setenv(parallel.UNITS_ENV, str(tmp_path / "units.json"))
    monkeypatch.setenv(parallel.BUILDS_PENDING_ENV, "0")
    marked = Item("e2e/head.py::t", "control_plane")
    marked.add_marker(parallel.pytest.mark.trains)
    parallel.pytest_collection_modifyitems([marked, Item("e2e/plain.py::t", "control_plane")])
    assert json.loads((tmp_path / "units.json").read_text()) == {
        "e2e/head.py::t": f"{parallel.TRAINS}e2e/head.py", "e2e/plain.py::t": "e2e/plain.py"}


@pytest.mark.parametrize("args, whole", [([], True), (["-k", "chart"], False), (["-m", "trains"], False),
                                         (["tests/test_api.py"], False), (["-n", "4", "--dist", "loadscope"], True)])
def test_only_a_whole_run_records_its_module_times(args, whole):
    """A module of which `-k` ran one test took seconds: recorded, the next whole run handed it out last
    (test_multipod, recorded at 273 s of its 1,400, started 64 minutes into a run)."""
    from _pytest.config import _prepareconfig

    config = _prepareconfig([*args, "-p", "no:cacheprovider"])
    try:
        assert report.whole_suite(config) is whole
    finally:
        config._ensure_unconfigure()


def test_the_reports_last_lines_name_what_failed_and_why(tmp_path):
    """A CI log keeps only the output's tail: the run of 974d7f3 ended '1 error' with the test's name cut
    off above. The report names each failed or errored phase, with its cause, after everything else."""
    (tmp_path / "test_mixed.py").write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    raise RuntimeError('the fixture broke')\n"
        "def test_passes():\n    pass\n"
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n"
        "def test_errors(broken):\n    pass\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "e2e.report", "-p", "no:cacheprovider", "-q", "--rootdir", str(tmp_path),
         str(tmp_path)],
        cwd=Path(report.__file__).parents[1], env={**os.environ, "RLHF_CACHE": str(tmp_path / "cache")},
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout[-3000:]
    tail = result.stdout.strip().splitlines()[-4:-1]  # the last line is pytest's count
    assert "2 failed or errored" in tail[0], result.stdout[-3000:]
    assert tail[1].startswith("test_mixed.py::test_fails (call): AssertionError: one is not two"), tail
    assert tail[2] == "test_mixed.py::test_errors (setup): RuntimeError: the fixture broke", tail
    # The disk where the caches are (not made yet: its nearest existing folder's), with the memory's peak.
    assert re.search(r"^least free disk: \d+\.\d GiB \(where .*/cache is\)$", result.stdout, re.MULTILINE), result.stdout
