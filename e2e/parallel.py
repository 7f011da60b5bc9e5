"""How the suite's tests share the pytest-xdist workers (`pytest -n N`; tests/run.sh).

A worker runs whole units of work: a module, or a group of modules (below). A module's tests share
module-scoped fixtures (a Ray instance, a Ray cluster of several nodes, Kueue), which would otherwise
start once per worker that got one of its tests. Session-scoped fixtures (a control plane, the tiny
models) are made once per worker; what is expensive to make is cached on disk across workers (the etcd
seed, the converted real model).

Tests that use something of which this machine has only one (SHARED_FIXTURES: the pod runtime's
bridge, its fixed subnet and 10.96.0.1:443; the memory for one training run of the real model, smollm2)
form one group, run by one worker one module after another.

At most ML_SLOTS units that train (HEAVY_FIXTURES: Ray clusters, `rlhf run`, pods that run Ray; or
marked TRAINS_MARK) run at once, whatever the number of workers: two cores shared by four training runs only make each slower
and closer to its timeouts. Such a unit is named TRAINS + its module (or group); while ML_SLOTS of
them run, a worker that asks for work gets the first unit that does not train.

The scheduler runs in the controller, which sees only test ids: the workers write each test's unit
to the file UNITS_ENV names (the controller sets it before they start). xdist's own groups cannot
carry it: its --dist loadgroup appends the group to `item._nodeid`, which pytest 9 no longer reads
(a node's id is `_id`), so every unit silently became its module and nothing limited the units
that train.

Order: longest first by the last run's times (RECORD, written by e2e/report.py), so that no long unit
starts last and keeps one worker busy after the others are done. A fresh clone (CI) has no RECORD: it
reads SEED, a whole run's RECORD committed beside this file (copy it there after a change that moves a
unit's time by minutes). While a build is pending (a fresh machine: the control plane, the images), a
unit with a test that needs it is named WAITS + ...: the scheduler passes it over until the builds are
done, then hands it out in its place. (Ordered after every unit that needs no build, the longest of all,
the pod runtime's group, waited for the ML units to end and ran alone for the last 25 minutes.)
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import time
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling  # pytest-xdist: a dev dependency, as pytest is

from e2e.controlplane import cache_dir
from e2e.fixtures import builds_current, needs_build, needs_images
from rlhf_api.startup import collector_paused

# Fixture -> the xdist group of every test that uses it.
SHARED_FIXTURES = {"pod_runtime": "pod-runtime", "dev_cluster": "pod-runtime", "smollm2": "smollm2"}
HEAVY_FIXTURES = {"local_ray", "ray_nodes", "toy_job", "smollm2_job", "pod_runtime", "dev_cluster"}
TRAINS_MARK = "trains"  # a module that trains through none of them (its head pods run `rlhf run`: e2e/pods/head.py)
TRAINS = "trains:"  # the name of a unit that trains (a test uses a HEAVY_FIXTURE) starts with this
WAITS = "waits:"  # then this, for a unit that waits for a pending build
BUILD_CHECK_SECONDS = 10  # how often the scheduler looks whether the builds are done, while they are not
ML_SLOTS = int(os.environ.get("RLHF_ML_SLOTS", "2"))
RECORD = "suite-modules.json"  # under the cache dir: {unit of work: seconds it took last time}
SEED = Path(__file__).with_name("suite-times.json")  # a whole run's RECORD, for a fresh clone


UNITS_ENV = "RLHF_SUITE_UNITS"  # the file of {test id: its unit of work} the workers write
BUILDS_PENDING_ENV = "RLHF_SUITE_BUILDS_PENDING"  # "1" or "0": the controller's builds_pending()


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"{TRAINS_MARK}: the module trains (see e2e/parallel.py's ML_SLOTS)")
    if not hasattr(config, "workerinput") and getattr(config.option, "numprocesses", None):  # the controller
        os.environ[UNITS_ENV] = str(Path(tempfile.mkdtemp(prefix="rlhf-suite-")) / "units.json")
        # Decided once, here: the workers, which inherit it, must all collect in the same order.
        os.environ[BUILDS_PENDING_ENV] = "0" if builds_current() else "1"


def builds_pending() -> bool:
    """Some binary or image is still to build (a fresh machine, a changed Dockerfile): the units that need
    one wait, so those that need none go first."""
    decided = os.environ.get(BUILDS_PENDING_ENV)
    return decided == "1" if decided else not builds_current()


def last_times() -> dict[str, float]:
    """Seconds per unit of work: this machine's last runs (RECORD) over the committed SEED."""
    times = {}
    for path in (SEED, cache_dir() / RECORD):
        try:
            times.update(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return times


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session):
    """A worker's collection imports the stack (torch, transformers, vLLM ...) and builds every test item, all of
    which live as long as the worker: collected without the collector, then frozen (rlhf_api.startup), so that
    the worker's full collections during the tests skip them."""
    with collector_paused(freeze=True):
        return (yield)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def shared_group(item: pytest.Item) -> str | None:
        return next((group for fixture, group in SHARED_FIXTURES.items() if fixture in fixtures(item)), None)

    units = {item.nodeid: shared_group(item) or module_of(item.nodeid) for item in items}
    training = {units[item.nodeid] for item in items
                if HEAVY_FIXTURES & fixtures(item) or item.get_closest_marker(TRAINS_MARK)}
    waiting = builds_pending() and {units[item.nodeid] for item in items if needs_build(item) or needs_images(item)}
    units = {nodeid: (TRAINS if unit in training else "") + (WAITS if waiting and unit in waiting else "") + unit
             for nodeid, unit in units.items()}
    if path := os.environ.get(UNITS_ENV):  # for the controller's scheduler; every worker writes the same
        written = Path(f"{path}.{os.getpid()}")
        written.write_text(json.dumps(units))
        written.replace(path)
    # The record is by module (reports carry no group): a unit takes as long as its modules together.
    took, modules = last_times(), collections.defaultdict(set)
    for item in items:
        modules[units[item.nodeid]].add(module_of(item.nodeid))
    seconds = {unit: sum(took.get(module, 0) for module in unit_modules) for unit, unit_modules in modules.items()}
    items.sort(key=lambda item: (-seconds[u := units[item.nodeid]], u))


def trains(unit: str) -> bool:
    return unit.startswith(TRAINS)


def waits(unit: str) -> bool:
    return unit.removeprefix(TRAINS).startswith(WAITS)


def fixtures(item: pytest.Item) -> set[str]:
    return set(getattr(item, "fixturenames", ()))


class ModuleOrGroupScheduling(LoadScopeScheduling):
    """A test's unit of work is the one the workers wrote to UNITS_ENV's file (its module when there is
    none); units are handed out in the collection's order."""

    def __init__(self, config: pytest.Config, log: object = None) -> None:
        config.option.loadscopereorder = False  # xdist's default orders units by their number of tests
        super().__init__(config, log)
        self.units: dict[str, str] | None = None  # read once every worker has collected
        self.builds_done, self.next_build_check = not builds_pending(), 0.0

    def _split_scope(self, nodeid: str) -> str:
        if self.units is None:
            path = os.environ.get(UNITS_ENV)
            self.units = json.loads(Path(path).read_text()) if path and Path(path).exists() else {}
        return self.units.get(nodeid) or module_of(nodeid)

    def _trains(self, node: object) -> bool:
        """The worker has a unit that trains with tests left (running, or queued behind others)."""
        return any(trains(unit) and not all(tests.values())
                   for unit, tests in self.assigned_work.get(node, {}).items())

    def _builds_are_done(self) -> bool:
        if not self.builds_done and time.monotonic() >= self.next_build_check:
            self.builds_done, self.next_build_check = builds_current(), time.monotonic() + BUILD_CHECK_SECONDS
        return self.builds_done

    def _assign_work_unit(self, node: object) -> None:
        """The first unit in the queue, passing over those that train while ML_SLOTS other workers train:
        a worker without a slot runs the units that need none instead of waiting. A worker that trains
        already may take another such unit: it runs its units one after another. (It must: an xdist
        worker runs its last test only once it is sent the next, so a worker left holding the last test
        of its unit that trains would keep that slot, and the suite would stop.) Units that wait for a
        build are passed over until it is done, unless nothing else is left."""
        may_train = self._trains(node) or sum(self._trains(other) for other in self.nodes if other is not node) < ML_SLOTS
        allowed = [unit for unit in self.workqueue if not trains(unit) or may_train]
        if not self._builds_are_done():
            allowed = [unit for unit in allowed if not waits(unit)] or allowed
        if allowed:
            self.workqueue.move_to_end(allowed[0], last=False)
            super()._assign_work_unit(node)

    def mark_test_complete(self, node: object, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        for other in self.nodes:  # a unit that trained may have ended: a worker with no test to run
            if other is not node and self._pending_of(self.assigned_work[other]) <= 1:  # (or one it holds)
                self._reschedule(other)  # may now take one


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    return ModuleOrGroupScheduling(config, log)
