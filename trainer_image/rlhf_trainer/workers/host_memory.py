"""Host memory a phase freed, handed back to the OS when the phase ends.

The engine and the model groups take turns, each in its own process. glibc keeps what a process frees
(an update's activations, a rollout's logits, a scoring pass's micro-batches) in its heap for reuse, so
every process stays at its own high-water mark while the others work, and the node's memory peaks at
their sum. malloc_trim returns the free pages; the next phase allocates them again (a few ms). The CPU
analogue of torch.cuda.empty_cache, which the hybrid engine calls before vLLM wakes on a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache


@cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Free heap pages back to the OS (a no-op without glibc)."""
    if trim := _malloc_trim():
        trim(0)
