"""How long the relay waits: a cold backend's first-token deadline, and the pause before trying
the same backend again (a route's `retry`). Pure functions of live data and policy."""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..config.policy import RetryPolicy, RoutingPolicy
from ..routing.backends import Backend

__all__ = ["cold_first_token_s", "retry_wait"]

# retry.on names -> the outcome kinds (health.OUTCOMES) they stand for
_RETRY_NAMES = {
    "reset": ("reset_before_headers", "disconnect", "cut"),
    "connect": ("connect",),
    "timeout": ("timeout", "first_token_timeout"),
}
_MIN_RETRY_WAIT_S = 0.05  # never a tight loop, whatever Retry-After says


def cold_first_token_s(backends: Sequence[Backend], prompt_tokens: int, rp: RoutingPolicy, model: str | None = None) -> float | None:
    """The first-token deadline for a candidate with too few samples while another could take
    over: the live deadline of the best-known alternative (for `model`: each backend's figures for
    it), else routing.cold_first_token_ms (None for a route of one backend: it gets its own timeouts)."""
    if len(backends) < 2:
        return None
    best = None
    for b in backends:
        p95 = b.tracker_for(model).ttft_p95_s(prompt_tokens, min_samples=20)
        if p95 is not None:
            d = max(rp.deadline_floor_ms / 1000, rp.deadline_p95_multiplier * p95)
            best = d if best is None else min(best, d)
    return best if best is not None else rp.cold_first_token_ms / 1000


def retry_wait(
    rp: RetryPolicy | None,
    kind: str | None,
    *,
    tries_here: int,
    tries_total: int,
    max_attempts: int,
    cooling_s: float,
    remaining_s: float,
    rng: random.Random | None = None,
    ejected: bool = False,
) -> float | None:
    """Seconds to wait before trying the same backend again, or None to fail over.

    `kind`: how its last attempt failed; `tries_here`: attempts on it so far; `cooling_s`: what
    is left of the pause it asked for (its Retry-After); `ejected`: health has taken it out (that
    failure ejected it, or a half-open trial failed). The pause is that Retry-After for 429/503,
    else `backoff_ms` doubled per retry with +-25 % jitter; never under 50 ms; None when it is
    ejected, past `max_wait_ms` or the request's deadline, or the tries are used up."""
    if rp is None or kind is None or ejected or tries_here >= rp.attempts or tries_total >= max_attempts:
        # Ejected: health decided the backend is broken; a retry would only add an attempt that
        # health has already written off (and a failed half-open trial would cost three).
        return None
    status = int(kind[5:]) if kind.startswith("http_") and kind[5:].isdigit() else None
    if not any(o == status if isinstance(o, int) else kind in _RETRY_NAMES[o] for o in rp.on):
        return None
    jitter = (rng or random).uniform(0.75, 1.25)
    wait = rp.backoff_ms / 1000 * 2.0 ** (max(1, tries_here) - 1) * jitter
    if kind in ("http_429", "http_503") and cooling_s > 0:
        wait = cooling_s
    wait = max(_MIN_RETRY_WAIT_S, wait)
    if wait > rp.max_wait_ms / 1000 or wait >= remaining_s:
        return None
    return wait
