"""Wall-clock time of a step's phases, reported as time/<phase> in seconds (as OpenRLHF reports its
generation and training times): generation, rewards, experience, update, weight_sync (and evaluation)
inside a step, and step, the whole of it (the phases add up to at most the step)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class PhaseTimer:
    """Sums the seconds spent in each named phase until `take` hands them over."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.muted = False

    @contextmanager
    def phase(self, name: str, *, split: bool = True) -> Iterator[None]:
        """Time the block as `name`. split=False: the phases inside it count toward it alone (an
        evaluation samples and scores too, but that is not the step's generation)."""
        if self.muted:
            yield
            return
        started, self.muted = time.perf_counter(), not split
        try:
            yield
        finally:
            self.muted = False
            key = f"time/{name}"
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - started

    def take(self) -> dict[str, float]:
        """The phases timed since the last call, as metrics; starts over."""
        seconds, self.seconds = self.seconds, {}
        return seconds
