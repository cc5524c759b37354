"""A write whose reply is lost: redis-py sends a command once more after its connection fails
(the store's `retries`), and a SET NX that had run the first time is then answered "taken" by
its own value. During a Cluster failover the client's reconnects lose such replies; a request
whose cross-process cache lock came back "taken" that way waited for itself (shared_flight.claim)
until `cache.lock_ms` (30 s): a client timeout in the chaos test (test_store_failover.py).

Here a proxy between the store and a redis-server of the test's own drops the connection right
after Redis answered one chosen command, so the loss is certain, not a matter of timing."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator

from gateway.cache import shared_flight as cache_flight
from gateway.cache.core import Cache
from gateway.store.core import MemoryStore, StoreError
from gateway.store.redis_store import RedisStore
from tests.procs import redis_server

LOCK_S = 3.0  # the wait the bug cost; a claim that leads answers in a poll or two (50 ms each)


class _LosingProxy:
    """TCP between clients and Redis; `lose(marker)` arms it: the next command whose bytes hold
    `marker` reaches Redis and runs, and its client's connection is closed instead of answered."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._marker: bytes | None = None
        self.lost = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    def lose(self, marker: bytes) -> None:
        self._marker = marker

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.port)
        losing = asyncio.Event()  # this connection's next reply is to be lost

        async def to_redis() -> None:
            while data := await reader.read(65536):
                if self._marker is not None and self._marker in data:
                    self._marker = None
                    losing.set()  # before Redis can answer: the next reply is this command's
                up_w.write(data)
                await up_w.drain()

        async def to_client() -> None:
            while data := await up_r.read(65536):
                if losing.is_set():  # Redis ran it; its client never hears so
                    self.lost += 1
                    return
                writer.write(data)
                await writer.drain()

        try:
            pumps = [asyncio.ensure_future(to_redis()), asyncio.ensure_future(to_client())]
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            self._conns.discard(task)
            for w in (writer, up_w):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()


@contextlib.asynccontextmanager
async def _losing_store() -> AsyncIterator[tuple[RedisStore, _LosingProxy]]:
    async with redis_server() as url:
        proxy = _LosingProxy(int(url.rsplit(":", 1)[1].split("/")[0]))
        # A generous budget: the point is the lost reply, not the latency of a busy machine.
        store = RedisStore(await proxy.start(), timeout_ms=1000, max_connections=4, quota_timeout_ms=1000)
        try:
            yield store, proxy
        finally:
            await store.close()
            await proxy.close()


async def _claims_at_once(cache: Cache, key: str) -> str:
    """claim()'s token: this process leads, within a poll or two, not after LOCK_S."""
    started = time.monotonic()
    token, entry = await cache_flight.claim(cache, key, wait_s=LOCK_S, lock_s=LOCK_S)
    took = time.monotonic() - started
    assert token is not None and entry is None, "the lock is ours: this process must lead"
    assert took < LOCK_S / 2, f"it waited {took:.1f} s for its own lock"
    return token


async def test_a_lock_taken_by_our_own_lost_write_is_ours_and_led_at_once() -> None:
    """The lock's SET NX runs, its reply is lost, redis-py sends it again and hears "taken"."""
    async with _losing_store() as (store, proxy):
        cache = Cache(store, ttl_s=60, max_entry_bytes=1 << 20)
        key = "answer-" + secrets.token_hex(4)
        proxy.lose(b"gwlock:" + key.encode())
        token = await _claims_at_once(cache, key)
        assert proxy.lost == 1
        assert await store.get("gwlock:" + key) == token.encode()
        # Given back at the end like any lock of ours.
        await cache_flight.release(cache, key, token)
        assert await store.get("gwlock:" + key) is None


async def test_on_any_store_a_lock_answered_taken_but_holding_our_token_is_ours() -> None:
    """The same, without Redis: an add() that stored our value and said it did not."""

    class LostReply(MemoryStore):
        async def add(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> bool:
            await super().add(key, value, ttl_s)
            return False

    store = LostReply()
    token = await _claims_at_once(Cache(store, ttl_s=60, max_entry_bytes=1 << 20), "k")
    assert await store.get("gwlock:k") == token.encode()


async def test_a_lock_whose_release_failed_is_given_back_once_the_store_answers_again() -> None:
    """The leader stored nothing and its release failed (the store failing over): the lock is
    tried again in a task of its own, so a request for the same answer on another replica goes
    upstream within a second, instead of waiting on an answer nobody stores until the lock's TTL."""
    from gateway.cache.core import SingleFlight
    from gateway.cache.stage import _land

    class FailingOver(MemoryStore):
        shared = True  # a store the other replicas see (it takes the cross-process lock path)
        failures = 2

        async def delete_if(self, key: str, value: bytes) -> bool:
            if self.failures:
                self.failures -= 1
                raise StoreError("redis delete_if: timed out")
            return await super().delete_if(key, value)

    store = FailingOver()
    cache = Cache(store, ttl_s=60, max_entry_bytes=1 << 20)
    token, _ = await cache_flight.claim(cache, "k", wait_s=LOCK_S, lock_s=LOCK_S)
    assert token is not None
    carried: set[asyncio.Task[None]] = set()
    async with SingleFlight().hold("k", wait_s=LOCK_S) as flight:
        await _land(cache, "k", None, 60, flight, token, carried)  # nothing to store; the release fails
    assert carried and await store.get("gwlock:k") == token.encode()
    started = time.monotonic()
    other, entry = await cache_flight.claim(cache, "k", wait_s=LOCK_S, lock_s=LOCK_S)  # another replica's request
    assert (other, entry) == (None, None), "the lock was gone without an answer: upstream, unlocked"
    assert time.monotonic() - started < 1.5 and store.failures == 0
    await asyncio.gather(*carried)
    assert not carried and await store.get("gwlock:k") is None


async def test_a_quota_take_and_settle_sent_again_after_their_replies_were_lost_count_once() -> None:
    """The take script ran, its reply was lost, redis-py sent it again: one request counted, one
    lease, one reservation (it counted twice: a tenant at rpm 10 was refused after 5 such); and
    the same for its settle."""
    from gateway.tenants.quota_counters import Ask, Scope, Settle

    async with _losing_store() as (store, proxy):
        scopes = (Scope("", rpm=10, tpm=1000, concurrency=2),)
        # The scripts loaded: an EVALSHA runs at once, not after a NOSCRIPT and a load.
        w = await store.quota_take("warm", Ask(scopes, 1, "warm", 30_000))
        await store.quota_settle("warm", Settle(("",), w.bucket, w.day, 0, 0, "warm"))
        lease = secrets.token_hex(8)
        ask = Ask(scopes, 100, lease, 30_000)
        proxy.lose(lease.encode())
        d = await store.quota_take("acme", ask)
        assert proxy.lost == 1 and d.ok
        used = await store.quota_usage("acme", "")
        assert (used.window_requests, used.window_tokens, used.inflight, used.day_tokens) == (1, 100, 1, 100), used
        # Settled with the bucket and day it was taken in, once though its reply is lost too: the
        # reservation comes off exactly (a second -60 came off a resent settle).
        proxy.lose(lease.encode())
        await store.quota_settle("acme", Settle(("",), d.bucket, d.day, -60, 0, lease))
        assert proxy.lost == 2
        used = await store.quota_usage("acme", "")
        assert (used.window_requests, used.window_tokens, used.inflight, used.day_tokens) == (1, 40, 0, 40), used
