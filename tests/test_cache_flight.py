"""Single flight across processes (cache/shared_flight.py): the lock, the stored answer, and the leader
that stores it, with a Store wrapper that delays chosen calls to force each interleaving.

The units drive two claims in a chosen order on the in-memory store and on Redis (DB 13, keys of
their own, deleted afterwards); the last test runs two gateways on one Redis in this process.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aredis
from redis.exceptions import RedisError

from gateway.cache import shared_flight as cache_flight
from gateway.cache.core import Cache, cache_key
from gateway.cache.entry import Entry
from gateway.web.keys import LIVE
from gateway.tenants.quota_counters import Ask, Decision, Settle, Usage
from gateway.store.core import MemoryStore, Store, StoreError
from gateway.store.redis_store import RedisStore
from tests.conftest import simple_policy
from tests.test_store import REDIS_URL, _delete_prefix
from tests.procs import redis_missing

LOCK = "gwlock:"
ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}],
}


class Delayed:
    """A Store over `inner` whose chosen calls take longer: `delay(op, prefix, s, times)` makes the
    next `times` (None: all) calls of `op` on keys starting with `prefix` wait `s` seconds first.
    Like RedisStore, a call that takes more than `timeout_s` raises StoreError."""

    shared = True  # stands in for a store other processes see

    def __init__(self, inner: Store, *, timeout_s: float = 1.0) -> None:
        self.inner = inner
        self.timeout_s = timeout_s
        self.rules: list[list[Any]] = []  # [op, prefix, seconds, times left or None]

    def delay(self, op: str, prefix: str, s: float, times: int | None = None) -> None:
        self.rules.append([op, prefix, s, times])

    def pending(self) -> int:
        """Delays still to come (counted rules only)."""
        return sum(r[3] for r in self.rules if r[3] is not None)

    async def _wait(self, op: str, key: str) -> None:
        for rule in self.rules:
            if rule[0] == op and key.startswith(rule[1]) and rule[3] != 0:
                if rule[3] is not None:
                    rule[3] -= 1
                try:
                    async with asyncio.timeout(self.timeout_s):
                        await asyncio.sleep(rule[2])
                except TimeoutError:
                    raise StoreError(f"delayed {op} of {key!r}: timed out after {self.timeout_s} s") from None
                return

    async def get(self, key: str) -> bytes | None:
        await self._wait("get", key)
        return await self.inner.get(key)

    async def set(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> None:
        await self._wait("set", key)
        await self.inner.set(key, value, ttl_s)

    async def delete(self, key: str) -> None:
        await self._wait("delete", key)
        await self.inner.delete(key)

    async def add(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> bool:
        await self._wait("add", key)
        return await self.inner.add(key, value, ttl_s)

    async def delete_if(self, key: str, value: bytes) -> bool:
        await self._wait("delete_if", key)
        return await self.inner.delete_if(key, value)

    async def close(self) -> None:
        await self.inner.close()

    async def quota_take(self, tenant: str, ask: Ask) -> Decision:
        return await self.inner.quota_take(tenant, ask)

    async def quota_settle(self, tenant: str, settle: Settle) -> None:
        await self.inner.quota_settle(tenant, settle)

    def take_now(self, tenant: str, ask: Ask) -> Decision | None:
        return None  # as RedisStore: every call goes through the (delayed) async path

    def settle_now(self, tenant: str, settle: Settle) -> bool:
        return False  # as RedisStore: every call goes through the (delayed) async path

    async def quota_usage(self, tenant: str, scope: str) -> Usage:
        return await self.inner.quota_usage(tenant, scope)


@pytest.fixture(params=["memory", "redis"])
async def inner(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    prefix = f"test-flight-{secrets.token_hex(6)}:"
    store = RedisStore(REDIS_URL, timeout_ms=500, prefix=prefix)  # no Redis: these fail, never skip (as test_store's)
    yield store
    await store.close()
    await _delete_prefix(prefix)


def _cache(store: Store) -> Cache:
    return Cache(store, ttl_s=60, max_entry_bytes=1 << 20)


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


async def test_a_lock_won_after_another_leader_stored_and_let_go_gives_its_answer(inner: Store) -> None:
    """Our lookup misses; then another process claims, stores its answer and releases the lock;
    then our claim wins the free lock. It must answer from the store, not lead a second call."""
    cache = _cache(inner)
    assert await cache.lookup("k") is None  # ours (pipeline.run), before the claim
    token, entry = await cache_flight.claim(cache, "k", wait_s=5, lock_s=5)  # the other process
    assert token is not None and entry is None
    await cache.save("k", Entry(orjson.dumps(ANSWER)))
    await cache_flight.release(cache, "k", token)
    token, entry = await cache_flight.claim(cache, "k", wait_s=5, lock_s=5)  # ours
    assert token is None and entry is not None and entry.answer()["id"] == "chatcmpl-1"
    assert await inner.get(LOCK + "k") is None  # the lock it took is given back at once


async def test_a_follower_keeps_waiting_through_slow_lock_reads(inner: Store) -> None:
    """Two lock reads that time out (a busy store) while the leader works: the follower still
    gets the stored answer, instead of calling upstream a second time."""
    store = Delayed(inner, timeout_s=0.02)
    cache = _cache(store)
    token, _ = await cache_flight.claim(cache, "k", wait_s=5, lock_s=5)  # the other process
    assert token is not None
    store.delay("get", LOCK, 1.0, times=2)
    follower = asyncio.create_task(cache_flight.claim(cache, "k", wait_s=5, lock_s=5))
    await _until(lambda: store.pending() == 0)
    await cache.save("k", Entry(orjson.dumps(ANSWER)))
    await cache_flight.release(cache, "k", token)
    theirs, entry = await asyncio.wait_for(follower, 5)
    assert theirs is None and entry is not None and entry.answer()["id"] == "chatcmpl-1"


async def test_a_lock_whose_set_timed_out_here_but_ran_there_is_given_back(inner: Store) -> None:
    """The SET of the lock timed out on the client after Redis ran it: the lock was left for the
    other replicas to wait on until its TTL (30 s) when the answer was not stored (review
    helper's finding). It is ours, and given back like any."""

    class LateAdd(Delayed):
        async def add(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> bool:
            await self.inner.add(key, value, ttl_s)
            raise StoreError(f"add of {key!r}: timed out after {self.timeout_s} s")

    cache = _cache(LateAdd(inner))
    token, entry = await cache_flight.claim(cache, "k", wait_s=5, lock_s=30)
    assert token is not None and entry is None
    assert await inner.get(LOCK + "k") == token.encode()
    await cache_flight.release(cache, "k", token)  # nothing stored: the others go upstream now
    assert await inner.get(LOCK + "k") is None


async def test_a_follower_stops_waiting_when_the_store_keeps_failing() -> None:
    store = Delayed(MemoryStore(), timeout_s=0.01)
    cache = _cache(store)
    token, _ = await cache_flight.claim(cache, "k", wait_s=30, lock_s=30)  # the other process
    assert token is not None
    store.delay("get", "", 1.0)  # every read times out: the lock's holder cannot be seen, nor its answer
    t0 = time.monotonic()
    assert await cache_flight.claim(cache, "k", wait_s=30, lock_s=30) == (None, None)  # upstream, at once
    assert time.monotonic() - t0 < 1.0


async def test_a_claim_cancelled_after_winning_the_lock_gives_it_back() -> None:
    mem = MemoryStore()
    store = Delayed(mem)
    cache = _cache(store)
    store.delay("get", "gwc:", 0.5)  # the lookup after the lock was won is slow
    task = asyncio.create_task(cache_flight.claim(cache, "gwc:k", wait_s=5, lock_s=30))
    await _until(lambda: len(mem) == 1)  # the lock is taken
    await asyncio.sleep(0.01)
    task.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await mem.get(LOCK + "gwc:k") is None  # not held for 30 s by nobody


async def test_a_lock_held_past_its_ttl_and_taken_by_another_leader_is_not_released_by_the_first(inner: Store) -> None:
    """Leader A is slower than its lock's TTL; the lock expires and leader B takes it. A's release
    must leave B's lock alone, or a third process would see no lock and call upstream a second
    time while B is still answering. B's own release then gives it back."""
    cache = _cache(inner)
    first, _ = await cache_flight.claim(cache, "k", wait_s=5, lock_s=0.2)  # A
    assert first is not None
    await asyncio.sleep(0.3)  # A's lock expires
    second, entry = await cache_flight.claim(cache, "k", wait_s=5, lock_s=30)  # B
    assert second is not None and second != first and entry is None
    await cache_flight.release(cache, "k", first)  # A, done at last
    assert await inner.get(LOCK + "k") == second.encode()  # still B's
    token, entry = await cache_flight.claim(cache, "k", wait_s=0.2, lock_s=30)  # C: waits on B's lock
    assert token is None and entry is None  # (its wait ran out: B stored nothing yet)
    await cache_flight.release(cache, "k", second)  # B
    assert await inner.get(LOCK + "k") is None


async def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes, str]:
    """One request on a connection of its own, closed as soon as the whole answer is read (as
    `Connection: close` clients do)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            return r.status, await r.read(), r.headers["x-gateway-cache"]


async def test_a_streamed_leader_whose_client_closes_at_the_end_still_stores_for_other_replicas(upstream, gateway):
    """Replica A leads a streamed miss; replica B waits on A's Redis lock. A's client closes its
    connection once it has [DONE], which cancels A's handler (handler_cancellation) while A's store
    call is still on its way (delayed here). A must store the answer before it lets go of the lock,
    or B sees the lock gone with nothing stored and calls upstream a second time."""
    probe = aredis.Redis.from_url(REDIS_URL)
    try:
        await probe.ping()
    except (OSError, RedisError):
        redis_missing("no Redis at 127.0.0.1:6379")
    up = await upstream("a", tokens=3, ttft_ms=300)
    policy = simple_policy(
        up,
        store={"url": REDIS_URL, "timeout_ms": 500},
        reload={"watch": False, "channel": "test-reload-" + secrets.token_hex(4)},
    )
    a = await gateway(policy, "a.yaml")
    b = await gateway(policy, "b.yaml")
    cache = a.app[LIVE].runtime.cache
    assert cache is not None
    slow = Delayed(cache.store)
    slow.delay("set", "gwc:", 0.3)  # A's answer takes a while to reach Redis
    cache.store = slow
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": "q " + secrets.token_hex(8)}], "temperature": 0}
    key = cache_key("default", "chat", "gpt-test", body)  # the open-mode tenant's namespace
    try:
        leader = asyncio.create_task(_post(a.url, {**body, "stream": True}))
        await _until(lambda: up.stats.requests == 1)  # A holds the lock and calls upstream
        follower = await _post(b.url, body)
        led = await leader
        assert led[0] == 200 and led[1].rstrip().endswith(b"data: [DONE]") and led[2] == "miss"
        assert follower[0] == 200 and follower[2] == "hit", follower
        assert orjson.loads(follower[1])["choices"][0]["message"]["content"] == "w0 w1 w2 "
        assert up.stats.requests == 1
    finally:
        await probe.delete(key, LOCK + key)
        await probe.aclose()


async def test_followers_of_a_whole_answer_whose_client_left_form_one_new_flight(upstream, gateway):
    """A non-streamed leader's client left just before its answer came: its handler was cancelled
    with the upstream call, and the three followers that had waited each went upstream alone
    (four upstream calls in all; review helper's repro). They form one new flight: two calls."""
    up = await upstream("a", tokens=3, ttft_ms=1000)
    gw = await gateway(simple_policy(up))
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": "slow question"}], "temperature": 0}
    async with aiohttp.ClientSession() as s:
        async def post() -> tuple[int, str | None]:
            async with s.post(f"{gw.url}/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status, r.headers.get("x-gateway-cache")

        leader = asyncio.ensure_future(post())
        await asyncio.sleep(0.1)
        followers = [asyncio.ensure_future(post()) for _ in range(3)]
        await asyncio.sleep(0.6)
        leader.cancel()  # its client goes away before the answer
        got = await asyncio.gather(*followers)
    assert sorted(got) == [(200, "hit"), (200, "hit"), (200, "miss")], got
    assert up.stats.requests == 2
