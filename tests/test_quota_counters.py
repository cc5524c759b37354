"""Quota counter contract: the in-memory algorithm and the Redis Lua script decide alike.

Redis: the shared server at 127.0.0.1:6379, DB 13, a unique key prefix per test (deleted after).
Timing-sensitive windows use the memory store's injectable clock; Redis runs on its own clock, so
its tests only check what holds within one second.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest

from gateway.tenants.quota_counters import Ask, MemoryQuota, Scope, Settle
from gateway.store.core import MemoryStore
from gateway.store.redis_store import RedisStore
from tests.test_store import REDIS_URL, _delete_prefix


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.25

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def _store(kind: str) -> AsyncIterator[MemoryStore | RedisStore]:
    if kind == "memory":
        yield MemoryStore()
        return
    prefix = f"test:quota:{uuid.uuid4().hex}:"
    # Generous bounds: these tests check the contract, not the latency of a busy CI machine.
    store = RedisStore(REDIS_URL, timeout_ms=500, quota_timeout_ms=5000, prefix=prefix)
    try:
        yield store
    finally:
        await store.close()
        await _delete_prefix(prefix)


KINDS = ["memory", "redis"]


def _ask(*scopes: Scope, tokens: int = 0, lease: str | None = None) -> Ask:
    return Ask(scopes, tokens, lease or uuid.uuid4().hex, 60_000)


@pytest.mark.parametrize("kind", KINDS)
async def test_rpm_admits_exactly_the_limit_then_refuses_with_a_retry_after(kind):
    async with _store(kind) as s:
        scope = Scope("", rpm=5)
        got = [await s.quota_take("t", _ask(scope)) for _ in range(7)]
        assert [d.ok for d in got] == [True] * 5 + [False] * 2
        assert got[0].limit_requests == 5 and got[0].remaining_requests == 4 and got[4].remaining_requests == 0
        refused = got[5]
        assert refused.limit == "rpm" and 59 <= refused.retry_after_s <= 61.5
        assert refused.remaining_requests == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_tokens_are_reserved_then_settled_to_what_was_used(kind):
    async with _store(kind) as s:
        scope = Scope("", tpm=100)
        a = await s.quota_take("t", _ask(scope, tokens=80))
        assert a.ok and a.remaining_tokens == 20
        refused = await s.quota_take("t", _ask(scope, tokens=30))
        assert not refused.ok and refused.limit == "tpm"
        await s.quota_settle("t", Settle(("",), a.bucket, a.day, 10 - 80, 0, "x"))  # it used 10
        b = await s.quota_take("t", _ask(scope, tokens=30))
        assert b.ok and b.remaining_tokens == 100 - 10 - 30
        u = await s.quota_usage("t", "")
        assert (u.window_requests, u.window_tokens, u.day_tokens) == (2, 40, 40)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_reservation_larger_than_the_limit_is_capped_so_it_can_ever_run(kind):
    async with _store(kind) as s:
        d = await s.quota_take("t", _ask(Scope("", tpm=100), tokens=10_000))
        assert d.ok and d.remaining_tokens == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tenant_tpm, model_tpm", [(1000, 0), (100_000, 1000)])
async def test_scopes_with_different_tpm_reserve_alike_and_each_settles_to_what_was_used(kind, tenant_tpm, model_tpm):
    """One Settle delta corrects every scope, so a take reserves the same on each: the smallest
    tpm's cap, not each scope's own (which left the larger scope overcharged by the difference)."""
    async with _store(kind) as s:
        tenant = Scope("", tpm=tenant_tpm)
        model = Scope("gpt-x", tpm=model_tpm, tokens_per_day=1_000_000)
        d = await s.quota_take("t", _ask(tenant, model, tokens=50_024))
        assert d.ok
        for name in ("", "gpt-x"):
            u = await s.quota_usage("t", name)
            assert (u.window_tokens, u.day_tokens) == (1000, 1000), name
        await s.quota_settle("t", Settle(("", "gpt-x"), d.bucket, d.day, 24 - 1000, 0, "x"))  # it used 24
        for name in ("", "gpt-x"):
            u = await s.quota_usage("t", name)
            assert (u.window_tokens, u.day_tokens) == (24, 24), name


def test_what_a_request_used_past_its_reservation_stays_in_the_window_a_whole_window():
    """Into the take's bucket, a 59 s stream's overage left the window a second after it settled
    (review of the change): it counts from the settle, for a whole window."""
    clock = Clock()
    q = MemoryQuota(clock=clock)
    d = q.take("t", _ask(Scope("", tpm=100_000), tokens=100))
    clock.now += 59.5
    q.settle("t", Settle(("",), d.bucket, d.day, 50_000, 0, "x"))
    clock.now += 2.0  # the take's bucket has left the window
    assert q.usage("t", "").window_tokens == 50_000
    clock.now += 57.0
    assert q.usage("t", "").window_tokens == 50_000
    clock.now += 3.0
    assert q.usage("t", "").window_tokens == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_request_longer_than_the_window_settles_what_it_used_past_its_reservation_now(kind):
    """Its reservation's bucket has left the window: a positive correction went to that bucket and
    was dropped with it (a 2-minute stream's tokens past its reservation never reached the tpm).
    It counts in the current second now; a negative one has nothing left to give back."""
    async with _store(kind) as s:
        scope = Scope("", tpm=10_000)
        d = await s.quota_take("t", _ask(scope, tokens=100))
        long_ago = d.bucket - 120
        await s.quota_settle("t", Settle(("",), long_ago, d.day, 700, 0, "x"))
        await s.quota_settle("t", Settle(("",), long_ago, d.day, -300, 0, "y"))
        u = await s.quota_usage("t", "")
        assert (u.window_tokens, u.day_tokens) == (100 + 700, 100 + 700 - 300)
        after = await s.quota_take("t", _ask(scope, tokens=1))
        assert after.remaining_tokens == 10_000 - 801


@pytest.mark.parametrize("kind", KINDS)
async def test_concurrency_leases_are_released_by_settle(kind):
    async with _store(kind) as s:
        scope = Scope("", concurrency=2)
        a = await s.quota_take("t", _ask(scope, lease="l1"))
        b = await s.quota_take("t", _ask(scope, lease="l2"))
        c = await s.quota_take("t", _ask(scope, lease="l3"))
        assert a.ok and b.ok and not c.ok and c.limit == "concurrency"
        assert (await s.quota_usage("t", "")).inflight == 2
        await s.quota_settle("t", Settle(("",), a.bucket, a.day, 0, 0, "l1"))
        assert (await s.quota_take("t", _ask(scope, lease="l3"))).ok


async def test_a_take_whose_answer_never_came_is_reversed_on_redis_and_one_still_on_its_way_takes_nothing():
    """A take that timed out on the gateway's side may have run on Redis: its request, tokens and
    lease stayed there until the lease's TTL (~10 minutes of `concurrency` refusals; review
    helper's repro). UNDO reverses it; run first, it makes the late take take nothing."""
    async with _store("redis") as s:
        assert isinstance(s, RedisStore)
        scope, model = Scope("", rpm=100, tpm=10_000, concurrency=1), Scope("gpt-x", tpm=10_000, concurrency=1)
        ran = _ask(scope, model, tokens=700, lease="ran")
        assert (await s.quota_take("t", ran)).ok
        assert not (await s.quota_take("t", _ask(scope, model, lease="other"))).ok  # concurrency 1: held
        assert await s.quota_undo("t", ran) is True
        for name in ("", "gpt-x"):
            u = await s.quota_usage("t", name)
            assert (u.window_tokens, u.day_tokens, u.inflight) == (0, 0, 0), name
        assert (await s.quota_usage("t", "")).window_requests == 0
        assert await s.quota_undo("t", ran) is False  # once
        late = _ask(scope, model, tokens=700, lease="late")
        assert await s.quota_undo("t", late) is False  # it has not run (yet)
        assert (await s.quota_take("t", late)).limit == "undone"  # now it comes: it takes nothing
        assert (await s.quota_usage("t", "")).inflight == 0
        settled = _ask(scope, model, tokens=700, lease="settled")
        d = await s.quota_take("t", settled)
        await s.quota_settle("t", Settle(("", "gpt-x"), d.bucket, d.day, -700, 0, "settled"))
        assert await s.quota_undo("t", settled) is False  # a settled take's record is gone: nothing to reverse


@pytest.mark.parametrize("kind", KINDS)
async def test_a_short_lease_does_not_take_the_long_ones_with_it(kind):
    # On Redis the leases are one sorted set with a TTL: a request with a short deadline set that
    # TTL to its own, and the set expired with every long request's lease in it (their
    # concurrency came back while they still ran upstream).
    async with _store(kind) as s:
        scope = Scope("", concurrency=3)
        assert (await s.quota_take("t", Ask((scope,), 0, "long", 60_000))).ok
        assert (await s.quota_take("t", Ask((scope,), 0, "short", 100))).ok
        assert (await s.quota_usage("t", "")).inflight == 2
        await asyncio.sleep(1.3)  # past the short lease and the second the set's TTL adds to it
        assert (await s.quota_usage("t", "")).inflight == 1  # the long one still counts


@pytest.mark.parametrize("kind", KINDS)
async def test_a_model_scope_is_checked_on_top_of_the_tenant_and_nothing_is_taken_on_refusal(kind):
    async with _store(kind) as s:
        tenant, model = Scope("", rpm=10), Scope("gpt-x", rpm=1)
        assert (await s.quota_take("t", _ask(tenant, model))).ok
        refused = await s.quota_take("t", _ask(tenant, model))
        assert not refused.ok and refused.limit == "rpm" and refused.scope == "gpt-x"
        assert (await s.quota_usage("t", "")).window_requests == 1  # the refused one took nothing
        assert (await s.quota_take("t", _ask(tenant))).ok  # other models still go


@pytest.mark.parametrize("kind", KINDS)
async def test_daily_tokens_and_spend(kind):
    async with _store(kind) as s:
        scope = Scope("", tokens_per_day=100, spend_per_day_micro=5_000)
        a = await s.quota_take("t", _ask(scope, tokens=60))
        assert a.ok
        assert not (await s.quota_take("t", _ask(scope, tokens=60))).ok
        await s.quota_settle("t", Settle(("",), a.bucket, a.day, 0, 5_000, "x"))
        refused = await s.quota_take("t", _ask(scope, tokens=1))
        assert refused.limit == "spend_per_day_usd" and refused.retry_after_s <= 86_400
        assert (await s.quota_usage("t", "")).day_spend_micro == 5_000


@pytest.mark.parametrize("kind", KINDS)
async def test_a_spend_limit_reserves_what_an_answer_may_cost(kind):
    """A spend limit was checked against what was spent, and nothing reserved: 20 requests at once
    were all admitted under a limit one of them spent (review helper's repro). A take reserves the
    answer's estimated cost; a settle corrects it to what was spent."""
    async with _store(kind) as s:
        scope = Scope("", spend_per_day_micro=10_000)
        asks = [Ask((scope,), 0, f"l{i}", 60_000, spend_micro=4_000) for i in range(3)]
        got = [await s.quota_take("t", a) for a in asks]
        assert [d.ok for d in got] == [True, True, False] and got[2].limit == "spend_per_day_usd"
        assert got[2].retry_after_s <= 1  # held by requests in flight: free as they settle, not at midnight
        assert (await s.quota_usage("t", "")).day_spend_micro == 8_000
        await s.quota_settle("t", Settle(("",), got[0].bucket, got[0].day, 0, 1_000 - 4_000, "l0"))  # it cost 1,000
        assert (await s.quota_usage("t", "")).day_spend_micro == 5_000
        assert (await s.quota_take("t", Ask((scope,), 0, "l3", 60_000, spend_micro=4_000))).ok  # 9,000 of 10,000
        assert not (await s.quota_take("t", Ask((scope,), 0, "l4", 60_000, spend_micro=2_000))).ok
        await s.quota_settle("t", Settle(("",), got[0].bucket, got[0].day, 0, 2_000, "l5x"))  # spent to the limit
        assert (await s.quota_take("t", Ask((scope,), 0, "l6", 60_000))).retry_after_s > 60  # spent: until the day ends
        # A settle of its own (the same lease's settle again is a resend, counted once on Redis).
        await s.quota_settle("t", Settle(("",), got[0].bucket, got[0].day, 0, -2_000, "l5y"))
        assert (await s.quota_take("t", Ask((scope,), 0, "l5", 60_000))).ok  # no estimate (no price): under the limit, in
        for lease in ("l1", "l3"):  # what they reserved, none of it spent
            await s.quota_settle("t", Settle(("",), got[0].bucket, got[0].day, 0, -4_000, lease))
        assert (await s.quota_usage("t", "")).day_spend_micro == 1_000


@pytest.mark.parametrize("kind", KINDS)
async def test_tenants_are_independent(kind):
    async with _store(kind) as s:
        scope = Scope("", rpm=1)
        assert (await s.quota_take("a", _ask(scope))).ok
        assert (await s.quota_take("b", _ask(scope))).ok
        assert not (await s.quota_take("a", _ask(scope))).ok


async def test_concurrent_takes_on_redis_never_overshoot():
    async with _store("redis") as s:
        scope = Scope("", rpm=50, concurrency=1000)
        got = await asyncio.gather(*[s.quota_take("t", _ask(scope)) for _ in range(200)])
        assert sum(d.ok for d in got) == 50


def test_the_window_slides_second_by_second_and_bounds_any_60_seconds():
    clock = Clock()
    q = MemoryQuota(clock=clock)
    scope = Scope("", rpm=10)
    admitted: list[float] = []
    for _ in range(600):  # 3 minutes, a try every 0.3 s
        if q.take("t", _ask(scope)).ok:
            admitted.append(clock.now)
        clock.now += 0.3
    for t in admitted:
        assert sum(1 for x in admitted if t <= x < t + 60) <= 10
    assert len(admitted) >= 28  # ~10 per minute over 3 minutes (a second of each window is lost to rounding)


def test_expired_leases_come_back_by_themselves():
    clock = Clock()
    q = MemoryQuota(clock=clock)
    scope = Scope("", concurrency=1)
    assert q.take("t", Ask((scope,), 0, "l1", 1_000)).ok
    assert not q.take("t", Ask((scope,), 0, "l2", 1_000)).ok
    clock.now += 1.01  # the replica holding l1 died: its lease expires
    assert q.take("t", Ask((scope,), 0, "l2", 1_000)).ok


def test_window_totals_follow_a_sliding_window_and_a_clock_that_steps_back():
    """The memory counters keep running totals: they match the buckets as seconds leave the
    window, after settles, and when the wall clock steps back (the count joins the newest
    bucket, so it stays counted at least as long as it should)."""
    clock = Clock()
    q = MemoryQuota(clock=clock)
    scope = Scope("", rpm=1000, tpm=10_000)
    first = q.take("t", _ask(scope, tokens=100))
    clock.now += 30
    second = q.take("t", _ask(scope, tokens=200))
    assert q.usage("t", "").window_requests == 2 and q.usage("t", "").window_tokens == 300
    q.settle("t", Settle(("",), first.bucket, first.day, -60, 0, "x"))  # used 40 of 100
    assert q.usage("t", "").window_tokens == 240
    clock.now -= 10  # the wall clock steps back: counted in the newest second, not an older one
    back = q.take("t", _ask(scope, tokens=50))
    assert back.ok and back.bucket == second.bucket
    assert back.reset_requests_s == pytest.approx(first.bucket + 61 - clock.now)
    clock.now += 10 + 31.5  # the first second left the window, the others not
    u = q.usage("t", "")
    assert (u.window_requests, u.window_tokens) == (2, 250)
    q.settle("t", Settle(("",), first.bucket, first.day, -40, 0, "x"))  # a bucket that left: nothing to correct
    assert q.usage("t", "").window_tokens == 250
    clock.now += 61
    assert (q.usage("t", "").window_requests, q.usage("t", "").window_tokens) == (0, 0)


async def test_only_the_memory_store_takes_without_a_round_trip():
    memory = MemoryStore()
    d = memory.take_now("t", _ask(Scope("", rpm=1)))
    assert d is not None and d.ok and memory.take_now("t", _ask(Scope("", rpm=1))).ok is False  # type: ignore[union-attr]
    redis = RedisStore(REDIS_URL, prefix=f"test:quota:{uuid.uuid4().hex}:")
    try:
        assert redis.take_now("t", _ask(Scope("", rpm=1))) is None
    finally:
        await redis.close()
