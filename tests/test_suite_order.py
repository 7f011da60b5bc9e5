"""The suite's own order: on a fresh machine the control plane builds while the tests that need no
build run, so every test that needs it (the control_plane fixture, or build.sh's tools through
binaries.built, marked needs_build) comes after all that do not. One that ran build.sh unmarked
waited on the build's lock inside its timeout (tests/test_monitoring.py did, on a fresh machine)."""

from __future__ import annotations

from e2e.controlplane import binaries
from e2e.fixtures import needs_build


def test_tests_that_need_the_build_run_after_all_that_do_not(request):
    items = request.session.items
    order = [needs_build(item) for item in items]
    assert order == sorted(order), [item.nodeid for item in items if needs_build(item)][:5]
    unmarked = [item.nodeid for item in items
                if not needs_build(item) and getattr(item.module, "built", None) is binaries.built]
    assert unmarked == []
