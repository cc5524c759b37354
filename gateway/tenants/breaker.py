"""When to stop asking a shared store that keeps failing, for a moment.

A Redis that is stalled (not down: a refused connection fails at once) costs each request the
store's whole timeout before the quota falls back to this process's own counters: 250 ms a
request, for as long as the stall lasts, and a fresh connection for each (a call cut short by
its timeout loses its connection). After `threshold` failures in a row the breaker opens: calls
skip the store for a pause, then one call (the probe) tries it while the others still skip; it
closes on the first success, and opens again for a longer pause (doubled, up to `max_pause_s`)
when the probe fails.

The response cache has one of its own (cache/core.py), fed only the calls that took the store's
timeout (a stall), for the cache's calls alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Breaker"]


class Breaker:
    """Failures in a row of one store's calls (see the module's note). Every call the breaker
    allows must report `succeeded()` or `failed()` (a probe that reports nothing is given up
    after `probe_s`, and another is let through)."""

    __slots__ = ("_clock", "_threshold", "_first_s", "_max_s", "_probe_s", "_failures", "_pause_s", "_open_until",
                 "_probe_at")

    def __init__(self, *, threshold: int = 5, first_pause_s: float = 0.5, max_pause_s: float = 2.0, probe_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._threshold, self._first_s, self._max_s, self._probe_s = threshold, first_pause_s, max_pause_s, probe_s
        self._failures = 0
        self._pause_s = first_pause_s
        self._open_until: float | None = None  # None: closed
        self._probe_at: float | None = None  # when the probe out now was let through

    @property
    def open(self) -> bool:
        return self._open_until is not None

    def allows(self) -> bool:
        """Whether this call may try the store: always while closed; while open, one call once
        the pause is over (the probe), none while a probe is out."""
        if self._open_until is None:
            return True
        now = self._clock()
        if now < self._open_until or (self._probe_at is not None and now - self._probe_at < self._probe_s):
            return False
        self._probe_at = now
        return True

    def succeeded(self) -> None:
        self._failures, self._pause_s, self._open_until, self._probe_at = 0, self._first_s, None, None

    def failed(self) -> None:
        now = self._clock()
        if self._probe_at is not None:  # the probe (or a call from before the pause) failed: a longer pause
            self._pause_s = min(self._pause_s * 2, self._max_s)
            self._open_until, self._probe_at = now + self._pause_s, None
            return
        self._failures += 1
        if self._open_until is None and self._failures >= self._threshold:
            self._open_until = now + self._pause_s
