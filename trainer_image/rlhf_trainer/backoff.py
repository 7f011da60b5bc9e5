"""How long to wait before retrying a remote call: exponential backoff with full jitter, or what
the server asked for in Retry-After.

Full jitter (a uniform draw from [0, min(cap, base * 2**k)] before retry k) spreads the retries of
clients that failed together, so they do not return in lock-step and knock the service over again
(Brooker, "Exponential Backoff And Jitter", AWS Architecture Blog, 2015).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Callable


@dataclass(frozen=True)
class Backoff:
    base: float = 1.0  # seconds: retry k waits up to base * 2**k
    cap: float = 30.0  # no wait is longer, a server's Retry-After included
    random: Callable[[], float] = field(default=random.random, repr=False)  # a draw from [0, 1); tests pass their own

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry `retry` (0 for the first): the server's Retry-After when it
        gave one (it knows when it will be back), else a jittered exponential step."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.cap)
        return self.random() * min(self.cap, self.base * 2 ** min(retry, 64))


def retry_after(value: str | None, now: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> float | None:
    """Seconds from a Retry-After header (delay-seconds or an HTTP date, RFC 9110 10.2.3); None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max((when - now()).total_seconds(), 0.0)
