"""reconcile.Kept: the per-job memories that kopf's handler threads and the resync share."""

from __future__ import annotations

import sys
import threading

from rlhf_operator.reconcile import Kept

THREADS = 32  # kopf's handler threads (kube.HANDLER_THREADS)


def test_the_entry_written_least_recently_goes_first():
    memory = Kept(size=2)
    memory.put("a", 1)
    memory.put("b", 1)
    memory.put("a", 2)  # a running job's status written again
    memory.put("c", 1)
    assert (memory.get("a"), memory.get("b"), memory.get("c")) == (2, None, 1)


def test_first_is_true_once_per_key_and_bounded():
    memory = Kept(size=2)
    assert memory.first("a") and not memory.first("a")
    memory.first("b")
    memory.first("c")
    assert memory.first("a")  # forgotten: at most size keys are kept


def test_threads_writing_at_once_never_raise_and_keep_the_bound():
    """Each thread writes its own keys, with a thread switch as often as the interpreter allows: a
    dict evicted without a lock raised KeyError or 'dictionary changed size during iteration'."""
    switch = sys.getswitchinterval()
    memory, errors = Kept(size=8), []

    def write(thread: int) -> None:
        try:
            for i in range(3000):
                memory.put((thread, i), i)
                memory.get((thread, i - 1))
        except Exception as error:  # noqa: BLE001 - the test counts them
            errors.append(error)

    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=write, args=(t,)) for t in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    assert sum(memory.get((t, i)) is not None for t in range(THREADS) for i in range(3000)) == 8
