"""Health of one backend: passive ejection with growing back-off, half-open trials, cool-downs.

The relay reports outcomes (and the prober reports probe results); this object decides. States:

- ``starting``: a launched backend is not ready yet (`ready` is False);
- ``ejected``: `failures_to_eject` consecutive failures (errors or timeouts) took it out for a
  back-off of ``eject_s * 2**(n-1)`` (n: ejections in a row without a success), capped at
  `max_eject_s`, shortened by up to `jitter` at random so replicas do not all retry at once;
- ``probing`` (half-open): the back-off ran out, or a probe succeeded, but no request has succeeded
  since; the next outcome decides: a success makes it ``healthy``, one failure ejects it again for
  a longer back-off. The selector gives a probing backend one request at a time;
- ``cooling``: an upstream 429/503 asked for a pause (Retry-After); it is busy, not broken;
- ``healthy``.

"Never eject the last healthy backend" needs a view of all candidates: see `routing.usable()`.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Health"]


@dataclass
class Health:
    """Health state of one backend. Every method is O(1) and does no I/O."""

    failures_to_eject: int = 3
    eject_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    max_eject_s: float = 60.0
    jitter: float = 0.2  # an ejection lasts between (1 - jitter) and 1 times its back-off
    rng: random.Random = field(default_factory=random.Random)
    consecutive_failures: int = 0
    ejections: int = 0  # ejections in a row without a success: drives the back-off
    ejected_until: float = 0.0
    cooldown_until: float = 0.0  # from an upstream Retry-After
    ready: bool = True  # False while a launched backend starts

    def report_success(self) -> None:
        """A request (not a probe) was answered: the backend is fully healthy again."""
        self.consecutive_failures = 0
        self.ejections = 0
        self.ejected_until = 0.0

    def report_failure(self) -> None:
        """A request failed or timed out in a way that is the backend's fault."""
        now = self.clock()
        if now < self.ejected_until:
            return  # started before the ejection: it tells us nothing new
        self.consecutive_failures += 1
        if self.ejections > 0 or self.consecutive_failures >= self.failures_to_eject:
            self._eject(now)  # a failed half-open trial re-ejects at once, for longer

    def report_probe(self, ok: bool) -> None:
        """An active probe's result. A good probe ends a first ejection early (half-open: the next
        real request decides); a failed one counts as a failure unless the backend is already out."""
        if not ok:
            self.report_failure()
        elif self.clock() < self.ejected_until:
            # Only a first ejection ends early: a backend whose cheap probe works while its real
            # requests keep failing would otherwise get a trial request every probe interval,
            # whatever its back-off says.
            if self.ejections <= 1:
                self.ejected_until = 0.0
        elif self.ejections == 0:
            self.consecutive_failures = 0

    def _eject(self, now: float) -> None:
        self.ejections += 1
        backoff = min(self.max_eject_s, self.eject_s * 2.0 ** min(self.ejections - 1, 30))
        self.ejected_until = now + backoff * (1.0 - self.jitter * self.rng.random())

    def cool_down(self, seconds: float) -> None:
        """The backend asked for a pause (429/503 Retry-After): send it nothing for that long."""
        self.cooldown_until = max(self.cooldown_until, self.clock() + seconds)

    def cooling_for(self) -> float:
        """Seconds left of an upstream-requested pause (0 when none)."""
        return max(0.0, self.cooldown_until - self.clock())

    def available_in(self) -> float:
        """Seconds until it may take traffic again (0 when it may now; inf while starting)."""
        if not self.ready:
            return math.inf
        now = self.clock()
        return max(0.0, self.ejected_until - now, self.cooldown_until - now)

    @property
    def healthy(self) -> bool:
        """Ready and not ejected (a cooling backend is healthy, only paused)."""
        return self.ready and self.clock() >= self.ejected_until

    @property
    def probing(self) -> bool:
        """Half-open: back from an ejection, no request has succeeded since."""
        return self.ejections > 0 and self.clock() >= self.ejected_until

    def state(self) -> str:
        """One of starting, ejected, cooling, probing, healthy."""
        if not self.ready:
            return "starting"
        now = self.clock()
        if now < self.ejected_until:
            return "ejected"
        if now < self.cooldown_until:
            return "cooling"
        if self.ejections > 0:
            return "probing"
        return "healthy"
