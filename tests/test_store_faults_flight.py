"""The cross-process single-flight lock (cache/shared_flight.py) through a store stall longer than
the release's first retries: a leader that finished while Redis was stalled (a fork, a slow
command, a Cluster failover of `cluster-node-timeout`, 15 s by default) could neither store its
answer nor give its lock back, and its retries stopped after ~4 s; the lock then held the same
request on every other replica for the rest of `cache.lock_ms`, waiting on an answer nobody
stores. A redis-server of the test's own, stalled with SIGSTOP."""

from __future__ import annotations

import asyncio
import signal
import time

from gateway.cache import shared_flight as flight
from gateway.cache.core import Cache
from gateway.store.core import MemoryStore, StoreError
from gateway.store.redis_store import RedisStore
from gateway.tenants.breaker import Breaker
from tests.procs import redis_process

LOCK_S = 20.0


def _cache(url: str) -> Cache:
    store = RedisStore(url, timeout_ms=50, max_connections=8)
    return Cache(store, ttl_s=60, max_entry_bytes=1 << 20, breaker=Breaker(), slow_s=0.045)


async def test_a_lock_whose_leader_finished_during_a_long_stall_is_given_back_when_it_ends():
    async with redis_process() as (url, proc):
        leader, other = _cache(url), _cache(url)
        try:
            token, _ = await flight.claim(leader, "k", wait_s=LOCK_S, lock_s=LOCK_S)
            assert token is not None
            proc.send_signal(signal.SIGSTOP)  # stalled, alive
            # The leader is done: its answer could not be stored, nor its lock given back now
            # (cache/stage.py _land then gives it back later, in a task of its own).
            assert not await flight.release(leader, "k", token)
            later = asyncio.create_task(flight.release_later(leader, "k", token))
            await asyncio.sleep(6.0)
            proc.send_signal(signal.SIGCONT)
            resumed = time.monotonic()
            await asyncio.wait_for(later, 5.0)
            assert time.monotonic() - resumed < 3.0, "given back within a retry's pause of the store answering"
            # The same request on another replica leads at once instead of waiting on the lock.
            started = time.monotonic()
            token2, entry2 = await flight.claim(other, "k", wait_s=LOCK_S, lock_s=LOCK_S)
            assert token2 is not None and entry2 is None
            assert time.monotonic() - started < 1.0
        finally:
            proc.send_signal(signal.SIGCONT)
            await leader.store.close()
            await other.store.close()


async def test_the_retries_end_when_the_lock_would_have_ended_by_itself():
    """A store that never answers again: the retries stop at the lock's TTL (after it the lock is
    gone anyway), not at once and not never; each one is a single cheap call."""

    class Down(MemoryStore):
        shared = True
        tries = 0

        async def delete_if(self, key: str, value: bytes) -> bool:
            Down.tries += 1
            raise StoreError("redis delete_if: timed out")

    cache = Cache(Down(), ttl_s=60, max_entry_bytes=1 << 20)
    token, _ = await flight.claim(cache, "k", wait_s=3.0, lock_s=3.0)
    assert token is not None
    started = time.monotonic()
    await asyncio.wait_for(flight.release_later(cache, "k", token), 6.0)
    took = time.monotonic() - started
    assert 2.5 < took < 3.5, took
    assert 3 <= Down.tries <= 6, Down.tries


async def test_a_token_that_does_not_say_when_its_lock_ends_still_gets_its_retries():
    """A token without the lock's end (an earlier version's form) is given back like any."""

    class FailsOnce(MemoryStore):
        shared = True
        failed = False

        async def delete_if(self, key: str, value: bytes) -> bool:
            if not self.failed:
                self.failed = True
                raise StoreError("redis delete_if: timed out")
            return await super().delete_if(key, value)

    store = FailsOnce()
    cache = Cache(store, ttl_s=60, max_entry_bytes=1 << 20)
    assert await store.add("gwlock:k", b"abc 1000 0", 30)
    await asyncio.wait_for(flight.release_later(cache, "k", "abc 1000 0"), 2.0)
    assert await store.get("gwlock:k") is None
