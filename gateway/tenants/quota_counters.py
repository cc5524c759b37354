"""Quota counters: the check-and-take that a Store performs atomically for one tenant.

The same algorithm runs in Python here (MemoryQuota, for the in-memory store and as each
replica's fallback while Redis is down) and in Lua in store/redis_store.py (QUOTA_LUA), and both pass
the same contract tests (tests/test_quota_counters.py).

Windows are 61 one-second buckets: a request admitted at time t is checked against every bucket
from floor(t) - 60 to floor(t), a span that contains [t - 60, t]. Checking the last admission of
any 60-second window that way bounds every window: never more than `rpm` requests (or `tpm`
tokens) in any 60 seconds, bursts included, with nothing lost to rounding but the part of one
second. Concurrency is a set of leases with expiry (a crashed replica's leases come back by
themselves); daily tokens and spend are counters per UTC day.

`MemoryQuota.peek` (and the Redis store's `quota_peek`) answer as a take would, writing nothing:
/v1/route/explain's quota verdict.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Scope", "Ask", "Decision", "Settle", "Usage", "MemoryQuota", "WINDOW_S", "LIMIT_NAMES"]

WINDOW_S = 60
DAY_S = 86_400
LIMIT_NAMES = ("rpm", "tpm", "concurrency", "tokens_per_day", "spend_per_day_usd")


@dataclass(frozen=True, slots=True)
class Scope:
    """One set of counters of a tenant: the tenant's own (`name` ""), or a model's (`name` the model).
    A limit of 0 means none. Spend is in micro-USD, so counters stay integers."""

    name: str
    rpm: int = 0
    tpm: int = 0
    concurrency: int = 0
    tokens_per_day: int = 0
    spend_per_day_micro: int = 0


@dataclass(frozen=True, slots=True)
class Ask:
    """Check every limit of every scope and, when all pass, take one request, `tokens` tokens and
    a concurrency lease `lease` valid for `lease_ttl_ms`. The tokens are capped at the smallest
    `tpm` among the scopes (so a big request can ever run) and that same number is taken on every
    scope: one Settle's delta then corrects each of them to what was used."""

    scopes: tuple[Scope, ...]
    tokens: int
    lease: str
    lease_ttl_ms: int
    spend_micro: int = 0  # what the answer may cost (micro-USD), reserved on every scope with a spend limit


@dataclass(slots=True)
class Decision:
    """The answer to an Ask. Refused: `limit` names the first limit that refused (`scope` says
    whose) and `retry_after_s` when it frees up. Either way, the tenant scope's request and token
    window figures for the x-ratelimit headers (-1 when that limit is not set)."""

    ok: bool
    limit: str | None = None
    scope: str = ""
    retry_after_s: float = 0.0
    bucket: int = 0  # the second the tokens were reserved in: a settle gives back what was not used there
    day: int = 0
    limit_requests: int = -1
    remaining_requests: int = -1
    reset_requests_s: float = 0.0
    limit_tokens: int = -1
    remaining_tokens: int = -1
    reset_tokens_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Settle:
    """Correct a reservation: `token_delta` (actual - reserved) into its bucket (what it used beyond
    it: into the current second's) and day of every
    scope (a take reserved the same number on each), `spend_micro` (actual - reserved) into its
    day, and release the lease. `bucket` -1: into the day only (a replay of what a replica
    counted on its own while the shared store failed: its seconds have passed)."""

    scopes: tuple[str, ...]
    bucket: int
    day: int
    token_delta: int
    spend_micro: int
    lease: str


@dataclass(slots=True)
class Usage:
    """A scope's current use, for /admin/tenants."""

    window_requests: int = 0
    window_tokens: int = 0
    inflight: int = 0
    day_tokens: int = 0
    day_spend_micro: int = 0


class _Window:
    """Per-second counts over the sliding window, oldest first, and their running total: a check
    costs O(1) instead of a sum and a sort over 61 buckets on every request. A count for a second
    older than the newest bucket (the wall clock stepped back) joins the newest one: it then
    stays counted a little longer, never shorter."""

    __slots__ = ("buckets", "total")

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}  # second -> count, in insertion (= time) order
        self.total = 0

    def second(self, sec: int) -> int:
        """The bucket a count taken at `sec` goes to."""
        if self.buckets:
            newest = next(reversed(self.buckets))
            if sec < newest:
                return newest
        return sec

    def add(self, sec: int, n: int) -> None:
        b = self.buckets
        b[sec] = b.get(sec, 0) + n
        self.total += n

    def correct(self, sec: int, delta: int) -> None:
        """Add `delta` (may be negative) to a bucket still in the window; never below 0."""
        b = self.buckets
        old = b.get(sec)
        if old is None:
            return
        new = max(0, old + delta)
        b[sec] = new
        self.total += new - old

    def trim(self, low: int) -> None:
        """Drop the buckets older than `low`."""
        b = self.buckets
        while b:
            first = next(iter(b))
            if first >= low:
                return
            self.total -= b.pop(first)

    def since(self, low: int) -> _Window:
        """A copy holding the buckets from `low` on: what trim(low) would leave, this one untouched."""
        w = _Window()
        w.buckets = {sec: n for sec, n in self.buckets.items() if sec >= low}
        w.total = sum(w.buckets.values())
        return w

    def free_after(self, need: int, limit: int, now: float) -> float:
        """Seconds until `need` more fits under `limit`, as old buckets leave the window."""
        used = self.total
        for sec, n in self.buckets.items():
            used -= n
            if used + need <= limit:
                return max(0.0, sec + WINDOW_S + 1 - now)
        return float(WINDOW_S + 1)


@dataclass
class _Counters:
    requests: _Window = field(default_factory=_Window)
    tokens: _Window = field(default_factory=_Window)
    leases: dict[str, float] = field(default_factory=dict)  # lease -> expiry (s)
    day: dict[int, int] = field(default_factory=dict)
    spend: dict[int, int] = field(default_factory=dict)
    trimmed: int = -1  # the second of the last sweep of the windows and days

    def trim(self, now: float) -> None:
        sec = math.floor(now)
        if sec != self.trimmed:  # buckets and days only leave as the second changes
            self.trimmed = sec
            self.requests.trim(sec - WINDOW_S)
            self.tokens.trim(sec - WINDOW_S)
            today = int(now // DAY_S)
            for d in (self.day, self.spend):
                if len(d) > 1 and min(d) < today - 1:
                    for k in [k for k in d if k < today - 1]:
                        del d[k]
        # Checked before the sweep (min over the values, in C): on most calls there is nothing to drop.
        if self.leases and min(self.leases.values()) <= now:
            for lease in [k for k, exp in self.leases.items() if exp <= now]:
                del self.leases[lease]


def _view(c: _Counters | None, now: float) -> _Counters:
    """A copy of `c` as trim(now) would leave it (empty for a scope never counted), for a check
    that must write nothing: not a bucket dropped, nor a tenant's entry made or evicted."""
    if c is None:
        return _Counters()
    sec = math.floor(now)
    return _Counters(c.requests.since(sec - WINDOW_S), c.tokens.since(sec - WINDOW_S),
                     {k: exp for k, exp in c.leases.items() if exp > now}, c.day, c.spend)


def _over_spend(spent: int, reserve: int, limit: int) -> bool:
    """Whether a request that may cost `reserve` goes past a spend `limit` of which `spent` is
    taken (reserved or spent): with no estimate (no price known), once the limit is reached. The
    caller caps `reserve` at the smallest limit, so an expensive request can ever run."""
    return spent >= limit or (reserve > 0 and spent + reserve > limit)


def _reservation(ask: Ask) -> int:
    """The tokens an Ask takes on each of its scopes: capped at the smallest tpm among them, the
    same on all (a cap per scope would leave each holding a different reservation, which the one
    delta of a Settle cannot correct)."""
    caps = [s.tpm for s in ask.scopes if s.tpm]
    return min(ask.tokens, *caps) if caps else ask.tokens


def _decide(ask: Ask, counters: list[_Counters], now: float) -> tuple[Decision, int]:
    """Whether every limit of every scope lets `ask` in, with the tenant scope's figures for the
    headers (as they are before it takes anything), and the tokens it takes on each scope."""
    day = int(now // DAY_S)
    b = math.floor(now)
    for c in counters:  # one bucket for every scope (a settle corrects that one)
        b = c.tokens.second(c.requests.second(b))
    d = Decision(ok=True, bucket=b, day=day)
    tokens = _reservation(ask)
    for scope, c in zip(ask.scopes, counters, strict=True):
        reqs, toks = c.requests.total, c.tokens.total
        if scope.name == "":
            if scope.rpm:
                d.limit_requests, d.remaining_requests = scope.rpm, max(0, scope.rpm - reqs)
                d.reset_requests_s = c.requests.free_after(1, scope.rpm, now) if reqs else 0.0
            if scope.tpm:
                d.limit_tokens, d.remaining_tokens = scope.tpm, max(0, scope.tpm - toks)
                d.reset_tokens_s = c.tokens.free_after(tokens, scope.tpm, now) if toks else 0.0
        if not d.ok:
            continue
        refused: tuple[str, float] | None = None
        if scope.rpm and reqs + 1 > scope.rpm:
            refused = ("rpm", c.requests.free_after(1, scope.rpm, now))
        elif scope.tpm and toks + tokens > scope.tpm:
            refused = ("tpm", c.tokens.free_after(tokens, scope.tpm, now))
        elif scope.concurrency and len(c.leases) >= scope.concurrency:
            refused = ("concurrency", 1.0)
        elif scope.tokens_per_day and c.day.get(day, 0) + tokens > scope.tokens_per_day:
            refused = ("tokens_per_day", (day + 1) * DAY_S - now)
        elif scope.spend_per_day_micro and _over_spend(c.spend.get(day, 0), ask.spend_micro, scope.spend_per_day_micro):
            # Spent: until the day ends. Held by requests in flight: as soon as they settle.
            spent_out = c.spend.get(day, 0) >= scope.spend_per_day_micro
            refused = ("spend_per_day_usd", (day + 1) * DAY_S - now if spent_out else 1.0)
        if refused is not None:
            d.ok, d.limit, d.scope, d.retry_after_s = False, refused[0], scope.name, refused[1]
    return d, tokens


def _took(d: Decision, ask: Ask, tokens: int) -> None:
    """The tenant scope's figures once an admitted `ask` took its request and tokens."""
    for scope in ask.scopes:
        if scope.name == "":
            if d.remaining_requests > 0:
                d.remaining_requests -= 1
            if d.remaining_tokens >= 0:
                d.remaining_tokens = max(0, d.remaining_tokens - tokens)
            return


class MemoryQuota:
    """The quota counters of one process (a dict per tenant scope). Every operation is one
    synchronous step on the event loop, so check-and-take is atomic."""

    def __init__(self, clock: Callable[[], float] = time.time, max_keys: int = 100_000) -> None:
        self._clock = clock
        self._max_keys = max_keys
        self._c: dict[str, _Counters] = {}

    def _get(self, key: str) -> _Counters:
        c = self._c.get(key)
        if c is None:
            if len(self._c) >= self._max_keys:  # bounded: drop the oldest tenant scope
                self._c.pop(next(iter(self._c)))
            c = self._c[key] = _Counters()
        return c

    def take(self, tenant: str, ask: Ask) -> Decision:
        now = self._clock()
        counters = []
        for scope in ask.scopes:
            c = self._get(f"{tenant}\x00{scope.name}")
            c.trim(now)
            counters.append(c)
        d, tokens = _decide(ask, counters, now)
        if not d.ok:
            return d
        b, day = d.bucket, d.day
        for scope, c in zip(ask.scopes, counters, strict=True):
            c.requests.add(b, 1)
            c.tokens.add(b, tokens)
            c.day[day] = c.day.get(day, 0) + tokens
            if ask.spend_micro:
                c.spend[day] = c.spend.get(day, 0) + ask.spend_micro
            if scope.concurrency:
                c.leases[ask.lease] = now + ask.lease_ttl_ms / 1000
        _took(d, ask, tokens)
        return d

    def peek(self, tenant: str, ask: Ask) -> Decision:
        """What take(tenant, ask) would answer now, taking nothing (/v1/route/explain: the quota's
        verdict on a request it does not send): take's decision on a trimmed copy of the counters."""
        now = self._clock()
        d, tokens = _decide(ask, [_view(self._c.get(f"{tenant}\x00{scope.name}"), now) for scope in ask.scopes], now)
        if d.ok:
            _took(d, ask, tokens)
        return d

    def settle(self, tenant: str, s: Settle) -> None:
        now = self._clock()
        sec = math.floor(now)
        for name in s.scopes:
            c = self._get(f"{tenant}\x00{name}")
            if s.token_delta:
                if s.bucket < 0:
                    pass  # a replay: the day's only
                elif s.token_delta > 0:
                    # What it used beyond its reservation counts now: in the take's bucket it left
                    # the window with that bucket (a 2-minute stream's tokens past its reservation
                    # never reached the tpm, nor a 59 s one's after a second).
                    c.tokens.add(c.tokens.second(sec), s.token_delta)
                else:
                    c.tokens.correct(s.bucket, s.token_delta)
                c.day[s.day] = max(0, c.day.get(s.day, 0) + s.token_delta)
            if s.spend_micro:
                c.spend[s.day] = max(0, c.spend.get(s.day, 0) + s.spend_micro)
            c.leases.pop(s.lease, None)
            c.trim(now)

    def usage(self, tenant: str, scope: str) -> Usage:
        now = self._clock()
        c = self._c.get(f"{tenant}\x00{scope}")
        if c is None:
            return Usage()
        c.trim(now)
        day = int(now // DAY_S)
        return Usage(c.requests.total, c.tokens.total, len(c.leases), c.day.get(day, 0), c.spend.get(day, 0))
