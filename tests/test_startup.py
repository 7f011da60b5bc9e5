"""rlhf_api.startup: no collection while a process loads its stack, and the collector as it was afterwards; frozen,
only the survivors of the start (its garbage collected first). Each case in a fresh interpreter: a freeze is for
the life of the process."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASE = """
import gc, weakref
from rlhf_api.startup import collector_paused

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a

collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
gc.enable() if {enabled} else gc.disable()
with collector_paused(freeze={freeze}):
    assert not gc.isenabled()
    garbage = weakref.ref(cycle())  # unreachable at once: only the cyclic collector frees it
    for _ in range(100_000):  # allocations that would set off a collection (700 by default)
        cycle()
    assert garbage() is not None and collections == [], collections
assert gc.isenabled() == {enabled}
print(garbage() is None, gc.get_freeze_count() > 0)
"""


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
@pytest.mark.parametrize("freeze", [False, True], ids=["resumed", "frozen"])
def test_nothing_is_collected_inside_and_a_freeze_keeps_only_the_survivors(enabled, freeze):
    result = subprocess.run([sys.executable, "-c", CASE.format(enabled=enabled, freeze=freeze)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    collected, frozen = result.stdout.split()
    assert frozen == str(freeze)
    if freeze:  # the start's garbage went before the survivors were frozen
        assert collected == "True"
