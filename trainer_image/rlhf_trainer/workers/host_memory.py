"""Host memory a phase freed, handed back to the OS when the phase ends.

The engine and the model groups take turns, each in its own process. glibc keeps what a process frees
(an update's activations, a rollout's logits, a scoring pass's micro-batches) in its heap for reuse, so
every process stays at its own high-water mark while the others work, and the node's memory peaks at
their sum. malloc_trim returns the free pages; the next phase faults them in again, which costs more
than it saves when little was freed (the tiny example's steps: 5% slower), hence the threshold.

On a GPU the same holds for torch's caching allocator: the processes of colocated groups take turns on it and
the memory plan charges only the largest pass, so each hands its cached blocks back when its pass ends
(`release_after_pass`), not only before vLLM wakes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import cache

TRIM_ABOVE = 256 * 2**20  # free heap bytes worth handing back


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@cache
def _glibc():
    """The C library if it is glibc 2.33 or later (malloc_trim and mallinfo2), else None (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim  # noqa: B018 (looked up: missing, the library is not glibc)
    except (OSError, AttributeError):
        return None
    return libc


def free_heap_bytes() -> int:
    """The bytes free in this process's heap (every arena), 0 without glibc."""
    libc = _glibc()
    return libc.mallinfo2().fordblks if libc else 0


def release_free_memory() -> None:
    """Free heap pages back to the OS when more than TRIM_ABOVE bytes are free."""
    if free_heap_bytes() > TRIM_ABOVE:
        _glibc().malloc_trim(0)


def release_after_pass() -> None:
    """What a pass (scoring, an update) freed, handed back before the next process's turn: the caching
    allocator's blocks on a GPU, and the heap's free pages."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    release_free_memory()
