"""Per-tenant quotas: reserve before dispatch, settle with the real usage after the answer.

One Store round trip per request (`quota_take`: every limit checked and taken at once, atomic on
Redis through a Lua script), one more after it (`quota_settle`). The reservation is the prompt
estimate plus `max_tokens` (or the tenant's `default_max_tokens`), capped at the smallest `tpm`
of its scopes and the same on each; the settle replaces it with the usage the backend reported
(asked for on streams: the client's stream does not carry it unless it asked), or with an
estimate when none came (see `_tokens_used`). A reservation whose replica died stays counted at
its estimate and leaves the window with it.

While the shared store fails, each replica limits on its own counters (the in-memory store),
logs once a minute and counts `gateway_quota_degraded_total`: never a 5xx. It applies there the
daily limits the shared store said are spent (`_DayOut`), uses the shared store again as soon as
it answers, and then adds to it what was used on its own counters meanwhile (`_replay_now`). A
script that fails on Redis is a bug, not an outage: the request is refused (503), not admitted
on this process's counters (`_script_failed`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from redis.exceptions import ResponseError

from ..config.policy import LimitsPolicy, Policy, QuotaPolicy
from ..errors import RateLimited, Unavailable
from ..pipeline.call import CacheResult, Call, Finish
from ..pipeline.ids import fresh_id
from ..store.core import MemoryStore, Store, StoreError
from ..web.sink import Sink
from .auth import Tenant
from .breaker import Breaker
from .quota_counters import DAY_S, Ask, Decision, Scope, Settle, Usage

__all__ = ["Quota", "Hold", "QuotaExceeded", "TOKEN_LIMITS", "reported"]

log = logging.getLogger("gateway.quota")

_WARN_EVERY_S = 60.0
_LEASE_MARGIN_MS = 10_000  # a lease outlives its request's deadline by this much, then expires
_EARLY_S = 1.0  # how long an rpm refusal refuses the tenant's next requests before their bodies are parsed
_UNDO_PAUSES_S = (0.25, 0.5, 1.0, 2.0, 4.0)  # a timed-out take is reversed after these pauses, until the store answers
_MAX_UNDOS = 1_000  # reversals waiting at once (a store that is down would otherwise pile them up)
# Limits that need the real token count of every answer (so streams ask for usage).
TOKEN_LIMITS = ("tpm", "tokens_per_day", "spend_per_day_usd")
# The most tokens a usage figure may say, and a reservation hold (a tenant without tpm reserves
# max_tokens whole): beyond, Lua formats a number as "1.8e+19", which HINCRBY refuses mid-script
# (a take admitted on the local counters, a settle that never released its lease). Lua prints
# integers whole below 1e17 and Redis's counters are int64: 2**40 leaves room for 2**23 at once.
_MAX_TOKENS = 1 << 40
_MAX_MICRO = 1 << 50  # the most micro-USD one request is charged (~$1.1e9), for the same reason


class QuotaExceeded(RateLimited):
    """A tenant limit refused the request: 429, nothing sent upstream."""

    def __init__(self, message: str, *, retry_after_s: float, limit: str) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.limit = limit


@dataclass(frozen=True, slots=True)
class _Limits:
    """What a request for one model takes: its scopes, their names, and the reservation's cap."""

    scopes: tuple[Scope, ...]
    names: tuple[str, ...]
    cap: int
    spend_cap: int  # the smallest spend limit among the scopes (micro-USD; 0: none)

    @classmethod
    def of(cls, scopes: tuple[Scope, ...]) -> _Limits:
        spends = [s.spend_per_day_micro for s in scopes if s.spend_per_day_micro]
        return cls(scopes, tuple(s.name for s in scopes), _cap(scopes), min(spends, default=0))


@dataclass(frozen=True, slots=True)
class _Plan:
    tenant: Scope
    models: dict[str, Scope]
    default_max_tokens: int
    counts_tokens: bool  # some limit needs the real token count
    any_model: _Limits  # a model without limits of its own: the tenant's
    per_model: dict[str, _Limits]  # built once: a request only looks its model up


@dataclass(frozen=True, slots=True)
class _Out:
    """A tenant out of requests (its own `rpm`), as a refusal at `set_at` said (this process's
    clock): counted requests only leave the window with time. Refused early until `until`."""

    until: float
    set_at: float
    decision: Decision
    scopes: tuple[Scope, ...]


@dataclass(frozen=True, slots=True)
class _DayOut:
    """A daily limit of one scope the shared store refused by, applied until the UTC day ends
    while that store fails (this process's own counters start the day at 0: a tenant refused for
    the day was admitted again during a stall of Redis, $4 spent under $2.5). `need`: the
    smallest reservation it refused (tokens for `tokens_per_day`, micro-USD for spend: a smaller
    one may still fit); 0: every request (spend spent)."""

    until: float  # this process's clock
    need: int
    decision: Decision


@dataclass(slots=True)
class Hold:
    """One request's reservation, settled exactly once."""

    tenant: str
    scopes: tuple[str, ...]
    store: Store
    decision: Decision
    reserved: int
    lease: str
    spend_reserved: int = 0  # micro-USD the take reserved against spend limits (a settle corrects it)
    settled: bool = False


def _scope(name: str, lp: LimitsPolicy) -> Scope:
    spend = lp.spend_per_day_usd
    return Scope(
        name,
        rpm=lp.rpm or 0,
        tpm=lp.tpm or 0,
        concurrency=lp.concurrency or 0,
        tokens_per_day=lp.tokens_per_day or 0,
        spend_per_day_micro=round(spend * 1e6) if spend else 0,
    )


def _counts_tokens(q: QuotaPolicy) -> bool:
    return any(getattr(lp, k) is not None for lp in (q, *q.models.values()) for k in TOKEN_LIMITS)


def _duration(seconds: float) -> str:
    """OpenAI's style for x-ratelimit-reset-*: `1s`, `6m0s`, `250ms`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s}s" if m else f"{s}s"


class Quota:
    """The quota stage of one Runtime: the tenants' limits from the policy, on a Store."""

    def __init__(
        self,
        policy: Policy,
        store: Store,
        fallback: Store,
        *,
        on_degraded: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.fallback = fallback  # this process's own counters while `store` fails
        self._on_degraded = on_degraded
        self._clock = clock
        self._last_warn: float | None = None
        self._settling: set[asyncio.Task[Any]] = set()  # settles (and takes whose caller left) in flight, owned here
        self._undoing: set[asyncio.Task[None]] = set()  # reversals of takes that timed out (_undo_later), owned here
        self._draining = False  # shutting down: a failed settle is not tried again (drain would wait ~9 s on a dead store)
        self._out: dict[str, _Out] = {}  # tenants of the policy refused by their rpm, until it frees up
        self._shared = store.shared and store is not fallback  # a store other processes count on too
        self._day_out: dict[tuple[str, str, str], _DayOut] = {}  # (tenant, scope, limit): the shared store's daily refusals
        # (tenant, scopes, day) -> [tokens, micro-USD] used on this process's counters while the
        # shared store failed: added to it once it answers again (_replay_now).
        self._replay: dict[tuple[str, tuple[str, ...], int], list[int]] = {}
        self._last_bug: float | None = None
        # Skips a shared store that keeps failing for a moment (a stalled Redis cost every request
        # quota_timeout_ms); this process's own counters never fail.
        self._breaker = Breaker(clock=clock)
        self.plans: dict[str, _Plan] = {}
        for name, tp in policy.tenants.items():
            q = tp.quota
            if q is None or not q.any():
                continue
            tenant, models = _scope("", q), {m: _scope(m, lp) for m, lp in q.models.items()}
            self.plans[name] = _Plan(
                tenant, models, q.default_max_tokens, _counts_tokens(q),
                _Limits.of((tenant,)), {m: _Limits.of((tenant, s)) for m, s in models.items()},
            )

    def __bool__(self) -> bool:
        return bool(self.plans)

    async def reserve(self, call: Call, tenant: Tenant, sink: Sink, ceiling: Callable[[], int | None],
                      cost: Callable[[int, int], float] | None = None) -> Hold | None:
        """Take the tenant's limits for this call (None: the tenant has none). Sets the
        x-ratelimit headers; raises QuotaExceeded when a limit refuses. `ceiling`: the largest
        answer limit every backend that may answer accepts (None: unknown), see `_fit`; `cost`:
        what an answer of (prompt, completion) tokens may cost in USD, which a spend limit reserves."""
        plan = self.plans.get(tenant.name)
        if plan is None:
            return None
        limits = plan.per_model.get(call.model, plan.any_model)
        ask, held = _ask(call, plan, limits, ceiling, cost)
        store, decision = self.store, self.store.take_now(tenant.name, ask)  # this process's counters: no await
        if decision is None:
            store, decision = await self._take(tenant.name, ask, limits.names, held)
            if store is self.store and (self._day_out or not decision.ok):
                self._note_day(tenant.name, decision, limits.scopes, ask, held)
        _headers(sink.set_header, decision)
        if not decision.ok:
            assert decision.limit is not None
            raise self._refused(tenant.name, decision, limits.scopes, held)
        if plan.counts_tokens:
            call.ask_usage()  # a stream settles with the backend's usage
        return Hold(tenant.name, limits.names, store, decision, held, ask.lease, ask.spend_micro)

    async def check(self, call: Call, tenant: Tenant, ceiling: Callable[[], int | None],
                    cost: Callable[[int, int], float] | None = None) -> Decision | None:
        """What `reserve` would answer for this call now, taking nothing (/v1/route/explain): the
        same answer limit written into the call's body (`_fit`, `_later`: the cache stage, next,
        looks up the key of the body as rewritten), and the same QuotaExceeded when a limit
        refuses. No counter, lease, early refusal (`_out`), daily refusal (`_DayOut`), breaker
        or degraded count changes. The shared store is read by a script that writes nothing;
        while it fails (or its breaker is open), this process's own counters, as `reserve`.
        None: the tenant has no limits, or no store can say without taking."""
        plan = self.plans.get(tenant.name)
        if plan is None:
            return None
        limits = plan.per_model.get(call.model, plan.any_model)
        ask, held = _ask(call, plan, limits, ceiling, cost)
        decision = await self._peek(tenant.name, ask, held)
        if decision is None:
            return None
        if not decision.ok:
            raise _exceeded(tenant.name, decision, limits.scopes, held)
        if plan.counts_tokens:
            call.ask_usage()
        return decision

    async def _peek(self, tenant: str, ask: Ask, held: int) -> Decision | None:
        """`_take`'s choice of counters and their answer, for `check`: nothing taken, nothing
        learnt (a failure of the shared store is not reported to its breaker)."""
        if not self._breaker.open:  # open: every request but its one probe decides on this process's counters
            try:
                return await _peek_on(self.store, tenant, ask)
            except StoreError as exc:
                if _script_failed(exc):  # the read-only script's bug, not what a request would meet
                    self._bug(f"quota peek for tenant {tenant!r} failed on the store: {exc}")
                    return None
        if self._day_out and (out := self._still_out(tenant, ask, held, forget=False)) is not None:
            return out
        return await _peek_on(self.fallback, tenant, ask)

    async def reserve_request(self, tenant: Tenant, timeout_s: float, set_header: Callable[[str, str], None]) -> Hold | None:
        """Take one request from the tenant's request limits (`rpm`, `concurrency`) for a call that
        spends no tokens: the Responses by-id endpoints and the conversations endpoints, once per
        upstream request they make (None: the tenant has none). Token limits are not checked (a
        tenant over its tokens may still poll or delete what it made). Sets the x-ratelimit
        headers through `set_header`; raises QuotaExceeded (at once, with no round trip, while an
        earlier refusal said the tenant's rpm is spent: refuse_early). Give the hold back with `release`."""
        plan = self.plans.get(tenant.name)
        if plan is None:
            return None
        self.refuse_early(tenant, set_header)  # out of requests: no round trip to say so again
        t = plan.tenant
        scopes = (Scope(t.name, rpm=t.rpm, concurrency=t.concurrency),)
        lease = fresh_id(64)
        ask = Ask(scopes, 0, lease, int(timeout_s * 1000) + _LEASE_MARGIN_MS)
        store, decision = await self._take(tenant.name, ask, (t.name,), 0)  # no daily limit: no _DayOut
        _headers(set_header, decision)
        if not decision.ok:
            raise self._refused(tenant.name, decision, scopes)
        return Hold(tenant.name, (t.name,), store, decision, 0, lease)

    def refuse_early(self, tenant: Tenant, set_header: Callable[[str, str], None]) -> None:
        """Raise QuotaExceeded while an earlier refusal said the tenant's own `rpm` is spent: before
        its body is parsed and classified, so its refused requests cost the event loop next to
        nothing (a tenant refused every request still took ~0.5 s of the loop with each 4 MiB body
        of empty messages, and other tenants' requests waited). For up to _EARLY_S after each such
        refusal: what a request counted stays counted until it leaves the window, and the
        store's own answer is asked again after that."""
        out = self._out.get(tenant.name)
        if out is None:
            return
        now = self._clock()
        if now >= out.until:
            del self._out[tenant.name]
            return
        free = out.decision.retry_after_s - (now - out.set_at)  # when the refusal said it frees up
        d = replace(out.decision, retry_after_s=free, remaining_requests=0, reset_requests_s=free, limit_tokens=-1)
        _headers(set_header, d)  # the requests' figures only: the tokens' may have moved since
        raise _exceeded(tenant.name, d, out.scopes)

    def _refused(self, tenant: str, d: Decision, scopes: tuple[Scope, ...], reserved: int = 0) -> QuotaExceeded:
        if d.limit == "rpm" and d.scope == "" and d.retry_after_s > 0:
            # For at most _EARLY_S at a time: then one request goes the whole way and asks the store
            # again (a reload, or a shared store gone down and this process's own counters in its
            # place, may admit it).
            now = self._clock()
            self._out[tenant] = _Out(now + min(d.retry_after_s, _EARLY_S), now, d, scopes)
        return _exceeded(tenant, d, scopes, reserved)

    def _note_day(self, tenant: str, d: Decision, scopes: tuple[Scope, ...], ask: Ask, held: int) -> None:
        """Keep the shared store's word on the daily limits for while it fails (`_DayOut`): a
        refusal by one is remembered until the day ends, with the reservation it refused (spend
        refused while requests in flight hold it may free up as they settle: while the store
        fails, its `need` still refuses, on the side of the limit); an admission forgets the
        refusals it proves wrong (those of at most what it reserved)."""
        if d.ok:
            for s in scopes:
                for limit, took in (("tokens_per_day", held), ("spend_per_day_usd", ask.spend_micro)):
                    out = self._day_out.get((tenant, s.name, limit))
                    if out is not None and took >= out.need:
                        del self._day_out[(tenant, s.name, limit)]
            return
        if d.limit == "tokens_per_day":
            need = held
        elif d.limit == "spend_per_day_usd":
            need = 0 if d.retry_after_s > 1.0 else ask.spend_micro  # spent for the day: every request
        else:
            return
        key = (tenant, d.scope, d.limit)
        if (old := self._day_out.get(key)) is not None:
            need = min(need, old.need)
        until = self._clock() + (d.day + 1) * DAY_S - time.time()  # the store's day end, on this process's clock
        self._day_out[key] = _DayOut(until, need, d)

    def _still_out(self, tenant: str, ask: Ask, held: int, *, forget: bool = True) -> Decision | None:
        """While the shared store fails: the refusal a daily limit it refused by still gives this
        ask (None: none applies), its figures left out of the headers (they may have moved).
        `forget`: drop the refusals whose day is over (False: `check`, which changes nothing)."""
        now = self._clock()
        for s in ask.scopes:
            for limit, has, took in (("tokens_per_day", s.tokens_per_day, held), ("spend_per_day_usd", s.spend_per_day_micro, ask.spend_micro)):
                out = self._day_out.get((tenant, s.name, limit))
                if out is None:
                    continue
                if now >= out.until:
                    if forget:
                        del self._day_out[(tenant, s.name, limit)]
                elif has and took >= out.need:
                    return replace(out.decision, retry_after_s=out.until - now, limit_requests=-1, limit_tokens=-1)
        return None

    async def _take(self, tenant: str, ask: Ask, scopes: tuple[str, ...], reserved: int) -> tuple[Store, Decision]:
        """The shared store's decision, or this process's own while the shared one fails.

        Shielded: a caller cancelled during the round trip (its client went away) cannot know
        whether the script ran; the take finishes in a task of its own and what it took is given
        back at once (`scopes` and `reserved` as the Hold would say), instead of holding a
        concurrency slot and the reservation until the lease's deadline + 10 s.

        While the shared store's breaker is open (a run of failures in a row: tenants/breaker.py),
        this process's own counters at once: no round trip to wait out, nothing to reverse there."""
        if not self._breaker.allows():
            self._degraded(None)
            return await self._local(tenant, ask, reserved)
        task = asyncio.get_running_loop().create_task(self._take_any(tenant, ask, reserved))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._settling.add(task)  # drain() waits for it, and for the settle it starts (added first)
            task.add_done_callback(lambda t: self._give_back(t, tenant, scopes, reserved, ask.lease, ask.spend_micro))
            task.add_done_callback(self._settling.discard)
            raise

    async def _take_any(self, tenant: str, ask: Ask, held: int) -> tuple[Store, Decision]:
        try:
            decision = await self.store.quota_take(tenant, ask)
        except StoreError as exc:
            if _script_failed(exc):
                self._breaker.succeeded()  # it answered
                # Redis answered: the script failed part-way (what it took before the error
                # stays taken), and this process's counters would admit the request with no
                # lease on Redis (3 at once under concurrency 1 across two replicas). A bug to
                # fix, not an outage: refused, loudly, rather than past the limits.
                self._bug(f"quota take for tenant {tenant!r} failed on the store, request refused: {exc}")
                raise Unavailable(f"the quota store could not check tenant {tenant!r}'s limits (a failed script); see the gateway's log") from exc
            self._breaker.failed()
            self._degraded(exc)
            self._undo_later(tenant, ask)
            return await self._local(tenant, ask, held)
        self._breaker.succeeded()
        if self._replay:
            self._replay_now()  # it answers again: what was used on this process's counters meanwhile goes to it
        return self.store, decision

    async def _local(self, tenant: str, ask: Ask, held: int) -> tuple[Store, Decision]:
        """This process's own decision while the shared store fails (its daily refusals kept)."""
        if self._day_out and (out := self._still_out(tenant, ask, held)) is not None:
            return self.fallback, out
        return self.fallback, await self.fallback.quota_take(tenant, ask)

    def _undo_later(self, tenant: str, ask: Ask) -> None:
        """A take that failed on the shared store may still have run there (a timeout on a
        stalled Redis): its request went on this process's counters, and nothing would have given
        its lease and tokens back on the shared store before its lease's TTL (the deadline + 10 s:
        ~10 minutes in which a tenant with `concurrency: 1` was refused everywhere; review
        helper's repro). Reversed there as soon as the store answers again (a few tries over ~8 s),
        at most _MAX_UNDOS at a time."""
        if len(self._undoing) >= _MAX_UNDOS:
            return
        task = asyncio.get_running_loop().create_task(self._undo(tenant, ask))
        self._undoing.add(task)
        task.add_done_callback(self._undoing.discard)

    async def _undo(self, tenant: str, ask: Ask) -> None:
        for pause in _UNDO_PAUSES_S:
            await asyncio.sleep(pause)
            try:
                await self.store.quota_undo(tenant, ask)
            except StoreError:
                continue
            if self._replay:
                self._replay_now()
            return

    def _give_back(self, task: asyncio.Task[tuple[Store, Decision]], tenant: str, scopes: tuple[str, ...], reserved: int,
                   lease: str, spend: int) -> None:
        """A take whose caller left: settle what it took as unused (the request stays counted)."""
        if task.cancelled() or task.exception() is not None:
            return
        store, decision = task.result()
        if decision.ok:
            self._finish(Hold(tenant, scopes, store, decision, reserved, lease, spend), 0, 0.0)

    def release(self, hold: Hold | None) -> None:
        """Settle a `reserve_request` hold: the request stays counted, its lease goes back."""
        self._finish(hold, 0, 0.0)

    def settle(self, hold: Hold, call: Call, spend_of: Callable[[Call, tuple[int, int] | None], float]) -> float:
        """Replace the reservation with what was used and release the lease (every path, once);
        returns the spend (USD). `spend_of(call, tokens)`: what the answer cost at its backend's price,
        from its usage, else from `tokens`, the (input, output) estimate charged in its place.

        On a shared store in a task of its own: the answer is not held up by the round trip, and
        a cancelled handler (the client went away) still gives its lease back. `drain()` awaits
        them. On this process's own counters at once. Settled even when the figures fail (the
        reservation then stands): a lease left behind held a `concurrency: 1` tenant for 10 minutes."""
        used, spend = hold.reserved, hold.spend_reserved / 1e6
        try:
            used, estimate = _tokens_used(call, hold.reserved)
            spend = spend_of(call, estimate)
        finally:
            self._finish(hold, used, spend)
        return spend

    def _finish(self, hold: Hold | None, used: int, spend_usd: float) -> None:
        if hold is None or hold.settled:
            return
        hold.settled = True
        d = hold.decision
        # Bounded as a usage figure is (_MAX_TOKENS, _MAX_MICRO): a delta the scripts cannot add
        # failed the settle after it had deleted the take's record, and its lease never went back.
        used, spend = min(max(used, 0), _MAX_TOKENS), _micro(spend_usd)
        settle = Settle(hold.scopes, d.bucket, d.day, used - hold.reserved, spend - hold.spend_reserved, hold.lease)
        if hold.store.settle_now(hold.tenant, settle):
            if hold.store is self.fallback and self._shared and (used or spend):
                self._replay_add(hold.tenant, hold.scopes, d.day, used, spend)
            return  # this process's counters: no round trip, so no task (a task costs µs per request)
        task = asyncio.get_running_loop().create_task(self._settle(hold, settle))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, hold: Hold, settle: Settle) -> None:
        """On the shared store, tried again while it fails (a few times over ~8 s): a settle lost
        leaves the reservation counted, and a spend reservation for the rest of the day."""
        for pause in (0.0, *_UNDO_PAUSES_S):
            await asyncio.sleep(pause)
            try:
                await hold.store.quota_settle(hold.tenant, settle)
                return
            except StoreError as exc:
                if _script_failed(exc):  # the same again would fail the same way
                    self._bug(f"quota settle for tenant {hold.tenant!r} failed on the store: {exc}")
                    return
                self._degraded(exc)  # the lease expires by itself; the estimate stays counted
            if self._draining:
                return

    def _replay_add(self, tenant: str, scopes: tuple[str, ...], day: int, used: int, spend: int) -> None:
        """Keep what a request used on this process's counters while the shared store failed, for
        `_replay_now` (at most _MAX_UNDOS tenants' scopes and days at once; beyond, it is lost)."""
        key = (tenant, scopes, day)
        acc = self._replay.get(key)
        if acc is None:
            if len(self._replay) >= _MAX_UNDOS:
                return
            acc = self._replay[key] = [0, 0]
        acc[0] = min(acc[0] + used, _MAX_TOKENS)
        acc[1] = min(acc[1] + spend, _MAX_MICRO)

    def _replay_now(self) -> None:
        """The shared store answers again: add to its daily counters (tokens, spend) what was used
        on this process's counters while it failed, so the day's totals there hold it (a tenant
        spent $2 on a replica's own counters during a stall, which Redis never heard of). As a
        settle without a lease, day counters only (bucket -1): the 60-second windows of the
        outage are not replayed. Kept for the next try while the store fails."""
        batch, self._replay = self._replay, {}
        task = asyncio.get_running_loop().create_task(self._send_replay(batch))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _send_replay(self, batch: dict[tuple[str, tuple[str, ...], int], list[int]]) -> None:
        for (tenant, scopes, day), (used, spend) in list(batch.items()):
            try:
                # A lease of its own: its record is what makes the settle count once if sent again.
                await self.store.quota_settle(tenant, Settle(scopes, -1, day, used, spend, fresh_id(64)))
            except StoreError as exc:
                if _script_failed(exc):
                    self._bug(f"quota replay for tenant {tenant!r} failed on the store: {exc}")
                    del batch[(tenant, scopes, day)]
                    continue
                for (t, sc, dy), (u, sp) in batch.items():  # the rest waits for the next answer
                    self._replay_add(t, sc, dy, u, sp)
                return
            del batch[(tenant, scopes, day)]

    async def drain(self) -> None:
        """Wait for the settles in flight (each bounded by the store's timeout); the reversals of
        timed-out takes still waiting for the store are given up (their leases expire by themselves),
        and a settle that fails is not tried again."""
        self._draining = True
        while self._settling:
            await asyncio.gather(*list(self._settling), return_exceptions=True)
        for task in list(self._undoing):
            task.cancel()
        await asyncio.gather(*list(self._undoing), return_exceptions=True)

    async def usage(self, tenant: str) -> dict[str, Usage]:
        """Current use of each scope of a tenant with limits (tenant scope under "")."""
        plan = self.plans.get(tenant)
        if plan is None:
            return {}
        out = {}
        for name in ("", *plan.models):
            try:
                out[name] = await self.store.quota_usage(tenant, name)
            except StoreError as exc:
                self._degraded(exc)
                out[name] = await self.fallback.quota_usage(tenant, name)
        return out

    @staticmethod
    def _completion_estimate(call: Call, plan: _Plan, unset: int | None = None) -> int:
        """What the answers may cost: each one's limit (or `unset`, else default_max_tokens),
        times how many the backend generates (n, best_of, a list of prompts: 10 requests of
        n=100 reserved for one answer each, and spent 10x the tpm)."""
        if not call.endpoint.generates:
            return 0
        limit = call.max_output_tokens()
        if limit is None:
            limit = plan.default_max_tokens if unset is None else unset
        return limit * call.answers()

    def _bug(self, message: str) -> None:
        """A script failed on the store: an error in the log (once a minute: every request may hit it)."""
        now = self._clock()
        if self._last_bug is None or now - self._last_bug >= _WARN_EVERY_S:
            self._last_bug = now
            log.error("%s (a bug: report it, with this line)", message)

    def _degraded(self, exc: StoreError | None) -> None:
        """One decision made on this process's counters: `exc`, the store's failure (None: the
        store was skipped, its breaker open)."""
        if self._on_degraded is not None:
            self._on_degraded()
        now = self._clock()
        if self._last_warn is None or now - self._last_warn >= _WARN_EVERY_S:
            self._last_warn = now
            why = exc if exc is not None else "it failed several times in a row; skipped for a moment, then tried again"
            log.warning("quota store failed, limiting on this replica's own counters: %s", why)


_NO_CAP = 1 << 62  # no scope has a tpm


@runtime_checkable
class _Peeks(Protocol):
    """A store that answers a quota take without taking it (the Redis store)."""

    async def quota_peek(self, tenant: str, ask: Ask) -> Decision: ...


async def _peek_on(store: Store, tenant: str, ask: Ask) -> Decision | None:
    """`store`'s answer to `ask`, taking nothing (None: it cannot tell without taking)."""
    if isinstance(store, MemoryStore):
        return store.quota.peek(tenant, ask)
    if isinstance(store, _Peeks):
        return await store.quota_peek(tenant, ask)
    return None


def _ask(call: Call, plan: _Plan, limits: _Limits, ceiling: Callable[[], int | None],
         cost: Callable[[int, int], float] | None) -> tuple[Ask, int]:
    """What a call takes and what its hold records (the tokens the counters take), its answer
    limit written into its body first where one applies (`_fit`, `_later`): `reserve`'s and
    `check`'s, one code, so that explain's verdict and cache key are the request's."""
    # Before _fit writes a limit. Bounded (_MAX_TOKENS): a tenant without tpm reserved
    # max_tokens 2**64-1 whole, which the take script could not add.
    reserved = min(call.prompt_tokens + Quota._completion_estimate(call, plan), _MAX_TOKENS)
    if plan.counts_tokens:
        _fit(call, limits, ceiling)
        if call.endpoint.answers_later(call.body):
            # Its usage never comes back (a background Response answers `queued`): charged
            # what it may generate, its limit as now bounded (without one, what a reservation
            # holds: the tpm), not an estimate (5 background requests were charged 5,190
            # tokens and generated 100,060). Without a tpm, a limit it sets (at most what
            # its backends accept), else default_max_tokens written into it (_later).
            room = _room(call, limits)
            answer = Quota._completion_estimate(call, plan, room) if room is not None else _later(call, plan, ceiling)
            reserved = min(call.prompt_tokens + answer, _MAX_TOKENS)
    held = min(reserved, limits.cap)  # what the counters take (they cap it there too)
    spend = _spend_reserve(limits.spend_cap, cost, call.prompt_tokens, held - call.prompt_tokens) if limits.spend_cap else 0
    return Ask(limits.scopes, reserved, fresh_id(64), int(call.remaining_s() * 1000) + _LEASE_MARGIN_MS, spend), held


def _script_failed(exc: StoreError) -> bool:
    """Whether the store ran a quota script and it failed at one of its lines (Redis names it
    `@user_script`): an argument or a counter the script cannot handle, not a store that is down,
    slow, or refusing for a reason of its own (BUSY, READONLY, OOM, MOVED: other types, or no
    line). A command a script calls during a failover, under memory pressure or while Redis
    is busy fails inside the script too, and Redis names the line then as well
    (`NOREPLICAS ... on @user_script:12`; redis-py leaves codes it does not know as a plain
    ResponseError): those are an outage to ride out on this process's counters, not a bug.
    The Redis store raises its StoreError inside the `except` (`from None` keeps
    `__context__`)."""
    ctx = exc.__context__
    if type(ctx) is not ResponseError or "@user_script" not in (text := str(ctx)):
        return False
    return text.split(" ", 1)[0] not in _TRANSIENT_CODES


# Error codes Redis answers with while it cannot serve a write for now (redis-py gives most of
# them types of their own; the rest arrive as a ResponseError that starts with the code).
_TRANSIENT_CODES = frozenset({
    "BUSY", "NOREPLICAS", "MISCONF", "READONLY", "OOM", "LOADING", "MASTERDOWN",
    "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK", "UNKILLABLE",
})


def _micro(usd: float) -> int:
    """A cost in whole micro-USD, a positive one rounded up (to at most _MAX_MICRO): rounded to
    the nearest, a request at $0.02/Mtok (0.4 micro-USD) cost 0, and 30 passed a 2 micro-USD
    limit. The relative slack keeps float noise (1.0000000000000002) from adding one."""
    if usd <= 0:
        return 0
    x = usd * 1e6
    return min(math.ceil(x - x * 1e-12), _MAX_MICRO)


def _cap(scopes: tuple[Scope, ...]) -> int:
    """The counters cap a reservation at the smallest tpm of its scopes, on every scope (so a big
    request can ever run, and one settle delta fits them all): what `Hold.reserved` records."""
    caps = [s.tpm for s in scopes if s.tpm]
    return min(caps) if caps else _NO_CAP


def _fit(call: Call, limits: _Limits, ceiling: Callable[[], int | None]) -> None:
    """Bound what the backend may generate to what one reservation holds (the smallest tpm of the
    scopes, shared by the answers): a limit per answer the request set above it is lowered to
    it. A reservation is capped there so that a big request can ever run; the answer was not,
    and one request with max_tokens 50,000 spent 16x its tenant's tokens_per_day. Not cap less
    the prompt: the estimate differs with fields such as stream_options (identical prompts must
    keep one cache key), and it reads an image's bytes as text (a request whose estimate alone
    passes the tpm still runs, as before; what it used is charged once settled).

    A request that sets no limit gets one only below `ceiling()`, the largest every backend
    that may answer it accepts (their `max_output_tokens`): a limit above a model's maximum is a
    400 (OpenAI's "max_tokens is too large", vLLM's context check), and at or above it the
    backend's own maximum is the tighter bound. Unknown, none is written: the backend's maximum
    bounds the answer, and what it used is charged once settled."""
    if not call.endpoint.generates or (room := _room(call, limits)) is None:
        return
    limit = call.max_output_tokens()
    if limit is None:
        top = ceiling()
        if top is not None and room < top:
            call.limit_answer(room)
    elif limit > room:
        call.limit_answer(room)


def _later(call: Call, plan: _Plan, ceiling: Callable[[], int | None]) -> int:
    """What a request answered later (a background Response: its usage never comes back through
    the gateway) may generate under limits without a tpm, all its answers together, and so what it
    is charged: its own limit, at most `ceiling()` (the largest its backends accept; a backend
    generates no more); without one, the tenant's `default_max_tokens` (at most the ceiling),
    written into the body, so the backend generates no more than it is charged. Such a request
    was charged default_max_tokens (1,024) whatever it generated: nothing bounded it (review
    helper's repro)."""
    if not call.endpoint.generates:
        return 0
    top = ceiling()
    limit = call.max_output_tokens()
    if limit is None:
        limit = plan.default_max_tokens if top is None else min(plan.default_max_tokens, top)
        call.limit_answer(limit)
    elif top is not None:
        limit = min(limit, top)
    return limit * call.answers()


def _room(call: Call, limits: _Limits) -> int | None:
    """One answer's share of what a reservation holds (the smallest tpm, shared by the answers);
    None without a tpm."""
    return None if limits.cap >= _NO_CAP else max(1, limits.cap // call.answers())


def _figures(usage: dict[str, Any] | None) -> tuple[int | None, int | None, int | None] | None:
    """A backend's usage as (prompt, completion, total) tokens, each None when absent; None when
    it has none, or when a figure it gives is not a whole number from 0 to _MAX_TOKENS (a bool,
    a float, a negative or a huge number: total_tokens -1e9 wiped a tenant's day, 2**64-1 failed
    the Redis settle): the estimate applies then, as without usage (the other figures of a usage
    that lies about one are not believed either)."""
    if not usage:
        return None
    p, c, t = usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")
    for v in (p, c, t):
        if v is not None and not (type(v) is int and 0 <= v <= _MAX_TOKENS):
            return None
    return p, c, t


def reported(usage: dict[str, Any] | None) -> tuple[int, int] | None:
    """The (prompt, completion) tokens a backend's usage reports (one absent: 0); None when it
    reports neither, or is not believed (`_figures`)."""
    f = _figures(usage)
    if f is None or (f[0] is None and f[1] is None):
        return None
    return f[0] or 0, f[1] or 0


def _tokens_used(call: Call, reserved: int) -> tuple[int, tuple[int, int] | None]:
    """What the request consumed, `reserved` being what its hold took: the tokens the counters
    settle with and, when the backend's usage does not say (`reported` is None), the answer's
    (input, output) split of them that its spend is priced at (without it a backend that
    reports no usage was charged $0 under a spend limit). The other reads of the prompt (below)
    are not in the split: Runtime.spend_usd prices them at the input price of the backends
    attempted, with a usage report or without.

    The tokens: the backend's usage (`total_tokens`, else prompt + completion); else an
    estimate, since a backend that reports none (or was left mid-way) still did the work:

    - a stream: the prompt estimate plus one token per content event delivered (a client that
      left is charged what it got);
    - a whole answer: its reservation stands (the prompt estimate plus `max_tokens` or
      `default_max_tokens`, never below the prompt estimate): its text is not kept for the
      settle, and `max_tokens` bounds it;
    - a request the backend goes on with whoever leaves (a background Response, streamed or
      not: Endpoint.answers_later): its reservation, the bounded limit it may generate;
    - sent to a backend but ended without an answer (the client left, the backends failed, a
      stream stopped before its first token): the prompt estimate, the backend may have read it;
    - never sent to a backend (a cache hit, a flight's follower, refused or shed before): 0.

    Plus the prompt estimate for every other attempt after which a backend had read the prompt
    (failed over after a timeout or a cut, a hedge's loser, a continuation's earlier legs:
    `call.out.read_prompts`): the answer's usage counts only its own backend's reading.
    """
    if call.cache.result is CacheResult.HIT:
        return 0, None
    prompt = call.prompt_tokens
    reads = call.out.read_prompts
    others = (reads - 1) * prompt if reads > 1 else 0
    f = _figures(call.out.usage)
    if f is not None:
        p, c, total = f
        if total is not None:
            if p is not None or c is not None:
                return total + others, None
            inp = min(total, prompt)  # priced as the estimate splits it
            return total + others, (inp, total - inp)
        if p is not None or c is not None:
            return (p or 0) + (c or 0) + others, None
    if not call.timing.sent_at:  # set as an attempt starts sending: no backend was asked
        return 0, (0, 0)
    if call.endpoint.answers_later(call.body):  # the backend runs on, whoever left: what it may generate
        out = max(reserved, prompt) - prompt
    elif call.out.streamed_tokens:
        out = call.out.streamed_tokens
    elif call.out.finish is Finish.OK and not call.stream:
        out = max(reserved, prompt) - prompt
    else:
        out = 0
    return prompt + out + others, (prompt, out)


def _headers(set_header: Callable[[str, str], None], d: Decision) -> None:
    if d.limit_requests >= 0:
        set_header("x-ratelimit-limit-requests", str(d.limit_requests))
        set_header("x-ratelimit-remaining-requests", str(d.remaining_requests))
        set_header("x-ratelimit-reset-requests", _duration(d.reset_requests_s))
    if d.limit_tokens >= 0:
        set_header("x-ratelimit-limit-tokens", str(d.limit_tokens))
        set_header("x-ratelimit-remaining-tokens", str(d.remaining_tokens))
        set_header("x-ratelimit-reset-tokens", _duration(d.reset_tokens_s))


def _spend_reserve(cap: int, cost: Callable[[int, int], float] | None, prompt: int, completion: int) -> int:
    """What a take reserves against spend limits (micro-USD): the answer's cost at the dearest
    price that may apply, capped at the smallest spend limit `cap` (so an expensive request can
    ever run); 0 without a price. Checked only against spend so far, 20 requests at once were all
    admitted under a limit one of them spent, and spent 20x it (review helper's repro)."""
    if cost is None:
        return 0
    return min(_micro(cost(prompt, max(0, completion))), cap)


def _exceeded(tenant: str, d: Decision, scopes: tuple[Scope, ...], reserved: int = 0) -> QuotaExceeded:
    """The 429 for a refusal. For a token limit it says what this request reserves: a large
    max_tokens reserves up to the whole tpm, and a refusal that came with 19,975 tokens
    "remaining" in its headers read as a contradiction (review helper's repro)."""
    scope = next(s for s in scopes if s.name == d.scope)
    value: float = getattr(scope, d.limit or "", 0) if d.limit != "spend_per_day_usd" else scope.spend_per_day_micro / 1e6
    where = f" for model {d.scope!r}" if d.scope else ""
    need = ""
    if reserved and d.limit in ("tpm", "tokens_per_day"):
        need = (f" (this request reserves {reserved} tokens: its prompt and its answer limit, max_tokens or the default,"
                f" at most the limit; a smaller max_tokens fits sooner)")
    return QuotaExceeded(
        f"tenant {tenant!r} reached its {d.limit} limit ({value:g}){where}{need}; it frees up in {_duration(d.retry_after_s)}",
        retry_after_s=max(d.retry_after_s, 0.001),
        limit=d.limit or "",
    )
