"""Python's cyclic garbage collector held off while a process loads its stack.

Importing torch, transformers, DeepSpeed and vLLM makes millions of objects that live as long as the process, and
CPython 3.11's collector scans every one of them again each time the survivors have grown by a quarter: a sixth of
those imports' CPU time (8.2 against 6.8 CPU-seconds for the four, medians of three, 2026-11-29), paid by every
model rank, vLLM engine and `rlhf run`/`rlhf operator` process as it starts. Inside `collector_paused` nothing is
collected; collection resumes at its end. Where what the start made lives as long as the process (a Ray actor's
model, a test runner's collected tests) the start's garbage is then collected once and the survivors frozen
(gc.freeze): the later full collections of the process's life skip them, as vLLM's engine does after its start.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused(freeze: bool = False) -> Iterator[None]:
    """No garbage collection inside. freeze: at the end one full collection, and the survivors set aside for
    good; only where they live as long as the process (a Ray actor's model, not a run a test makes in-process)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.collect()
            gc.freeze()
        if enabled:
            gc.enable()
