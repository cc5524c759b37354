"""The cache's breaker (cache/core.py, tenants/breaker.py): a store that keeps timing out is skipped
for a moment (a miss, nothing stored, no cross-process lock), one probe at a time tries it again;
the Responses API's records on the same store keep their retries. Then through a gateway, on a
real redis-server of the test's own that it stops (SIGSTOP) and resumes."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import pytest

from gateway.cache import shared_flight
from gateway.cache.core import Cache, Skipped
from gateway.cache.entry import Entry
from gateway.config.policy import parse_policy
from gateway.config.runtime import build_runtime
from gateway.responses.affinity import Affinity, MapUnavailable
from gateway.store.core import MemoryStore, StoreError
from gateway.tenants.breaker import Breaker
from tests.conftest import simple_policy

TIMEOUT_S = 0.01  # the fake store's "timeout": what each stalled call costs on the fake clock
ENTRY = Entry(b'{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,'
              b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}')


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _StallingStore(MemoryStore):
    """A shared store whose calls, while `stalled`, fail after the timeout (on the fake clock);
    `refused`: they fail at once. `calls` counts every call that reached it."""

    shared = True

    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self.clock = clock
        self.stalled = False
        self.refused = False
        self.calls = 0
        self.gate: asyncio.Event | None = None  # set: get waits on it (a probe in flight)

    async def _reach(self) -> None:
        self.calls += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.refused:
            raise StoreError("redis get: ConnectionError: refused")
        if self.stalled:
            self.clock.t += TIMEOUT_S
            raise StoreError("redis get: timed out")

    async def get(self, key: str) -> bytes | None:
        await self._reach()
        return await super().get(key)

    async def set(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> None:
        await self._reach()
        await super().set(key, value, ttl_s)

    async def add(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> bool:
        await self._reach()
        return await super().add(key, value, ttl_s)

    async def delete_if(self, key: str, value: bytes) -> bool:
        await self._reach()
        return await super().delete_if(key, value)

    def own(self, name: str, owner_of=None) -> _StallingStore:
        return self  # as a RedisStore's: one object for every use


def _cache(clock: _Clock, store: _StallingStore, errors: list[str]) -> Cache:
    breaker = Breaker(threshold=3, first_pause_s=0.5, max_pause_s=2.0, clock=clock)
    return Cache(store, ttl_s=60, max_entry_bytes=1 << 20, on_error=errors.append, clock=clock, breaker=breaker,
                 slow_s=0.9 * TIMEOUT_S)


async def _opened(clock: _Clock, store: _StallingStore, errors: list[str]) -> Cache:
    cache = _cache(clock, store, errors)
    store.stalled = True
    for _ in range(3):
        assert await cache.lookup("k") is None
    assert store.calls == 3 and errors == ["get"] * 3
    return cache


async def test_timeouts_in_a_row_open_it_and_the_store_is_skipped(caplog):
    clock, errors = _Clock(), []
    store = _StallingStore(clock)
    with caplog.at_level(logging.INFO, logger="gateway.cache"):
        cache = await _opened(clock, store, errors)
        assert await cache.lookup("k") is None and await cache.save("k", ENTRY) is False
        await cache.forget("k")
        with pytest.raises(Skipped):
            await cache.call(store.get, "other")
    assert store.calls == 3  # none of them reached it
    assert errors == ["get"] * 3 + ["skipped"] * 3
    assert caplog.text.count("cache store keeps timing out") == 1  # when it opened, not per skipped call
    assert caplog.text.count("cache store failed") == 1  # the first failure's warning, once a minute


async def test_one_probe_at_a_time_after_the_pause_and_its_answer_closes_it(caplog):
    clock, errors = _Clock(), []
    store = _StallingStore(clock)
    cache = await _opened(clock, store, errors)
    clock.t += 0.5
    assert await cache.lookup("k") is None and store.calls == 4  # the probe: it timed out too
    clock.t += 0.5
    assert await cache.lookup("k") is None and store.calls == 4  # a longer pause now (1 s)
    clock.t += 0.6
    store.stalled, store.gate = False, asyncio.Event()
    probe = asyncio.ensure_future(cache.lookup("k"))
    await asyncio.sleep(0)
    assert store.calls == 5
    assert await cache.lookup("k") is None and store.calls == 5  # skipped while the probe is out
    with caplog.at_level(logging.INFO, logger="gateway.cache"):
        store.gate.set()
        assert await probe is None
    assert "cache store answers again" in caplog.text
    store.gate = None
    assert await cache.save("k", ENTRY) and await cache.lookup("k") == ENTRY  # closed: every call reaches it
    assert store.calls == 7


async def test_refused_connections_do_not_open_it():
    """A down Redis refuses at once: trying it costs nothing, and the first call after a restart finds it."""
    clock, errors = _Clock(), []
    store = _StallingStore(clock)
    cache = _cache(clock, store, errors)
    store.refused = True
    for _ in range(10):
        assert await cache.lookup("k") is None
    assert store.calls == 10 and errors == ["get"] * 10
    store.refused = False
    assert await cache.save("k", ENTRY) and await cache.lookup("k") == ENTRY


async def test_a_probe_cancelled_while_it_waits_frees_the_probe():
    clock, errors = _Clock(), []
    store = _StallingStore(clock)
    cache = await _opened(clock, store, errors)
    clock.t += 0.5
    store.stalled, store.gate = False, asyncio.Event()
    probe = asyncio.ensure_future(cache.lookup("k"))
    await asyncio.sleep(0)
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    store.gate = None
    clock.t += 1.0  # the longer pause a failed probe gets, not the breaker's 5 s for a lost probe
    assert await cache.save("k", ENTRY) and store.calls == 5


async def test_no_cross_process_lock_is_taken_or_waited_on_while_it_is_open():
    clock, errors = _Clock(), []
    store = _StallingStore(clock)
    cache = await _opened(clock, store, errors)
    assert await shared_flight.claim(cache, "k", wait_s=5, lock_s=5) == (None, None)
    assert await shared_flight.claim(cache, "k", wait_s=5, lock_s=5, take=False) == (None, None)
    assert store.calls == 3
    assert await shared_flight.release(cache, "k", "token") is False and store.calls == 3


async def test_a_lock_held_when_it_opened_is_still_given_back_in_the_background():
    clock, errors = _Clock(), []
    store = _StallingStore(clock)
    cache = _cache(clock, store, errors)
    token, entry = await shared_flight.claim(cache, "k", wait_s=5, lock_s=30)
    assert token is not None and entry is None
    store.stalled = True
    for _ in range(3):
        await cache.lookup("other")  # the store stalls; the breaker opens
    assert await shared_flight.release(cache, "k", token) is False  # skipped: no request waits on it
    store.stalled = False  # the stall ends before the breaker's pause does
    await shared_flight.release_later(cache, "k", token)
    assert await store.get("gwlock:k") is None


async def test_the_responses_records_on_the_same_store_keep_their_retries():
    """Records may share the cache's store object (one RedisStore: its `own` is itself): the
    breaker is the cache's, not the store's."""
    clock, errors = _Clock(), []
    store = _StallingStore(clock)
    cache = await _opened(clock, store, errors)
    records = Affinity(store.own("records"), 60, attempts=3)
    assert records.store is store
    with pytest.raises(MapUnavailable):
        await records.lookup("resp_1")
    assert store.calls == 3 + 3  # each of its tries reached the store
    store.stalled = False
    await records.record(["resp_1"], "a", "tenant")
    assert (await records.lookup("resp_1")) is not None
    assert await cache.lookup("k") is None and errors[-1] == "skipped"  # the cache's breaker is still open


def _wired(store: str, extra: str = ""):
    policy = parse_policy(f"backends:\n  a: {{url: 'http://127.0.0.1:1/v1', models: [m]}}\n{store}{extra}")
    return build_runtime(policy, {}, 1, {})


async def _stalled() -> None:
    await asyncio.sleep(0.02)  # the wired store's whole timeout
    raise StoreError("redis get: timed out")


async def _refused() -> None:
    raise StoreError("redis get: ConnectionError: refused")


async def _raised(aw) -> BaseException | None:
    try:
        await aw
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


async def test_the_runtime_gives_a_cache_on_redis_a_breaker_that_counts_timeouts_only():
    """No socket: nothing connects until used, and no call here reaches the Redis."""
    rt = _wired("store: {url: 'redis://127.0.0.1:1/0', timeout_ms: 20}\n", "responses: {record_timeout_ms: 20}\n")
    cache = rt.cache
    assert cache is not None and rt.affinity.store is cache.store  # the records' store object is the cache's
    try:
        for _ in range(10):  # failures at once (a refused connection) do not open it
            assert type(await _raised(cache.call(_refused))) is StoreError
        for _ in range(5):  # five that took the timeout do
            assert type(await _raised(cache.call(_stalled))) is StoreError
        assert isinstance(await _raised(cache.call(_stalled)), Skipped)
        t0 = time.perf_counter()
        assert await cache.lookup("k") is None and await cache.save("k", ENTRY) is False
        assert time.perf_counter() - t0 < 0.015  # skipped, not tried
    finally:
        await cache.store.close()
    memory = _wired("").cache  # this process's memory never stalls: no breaker
    assert memory is not None
    for _ in range(6):
        assert type(await _raised(memory.call(_stalled))) is StoreError


# Through the gateway, on a redis-server of the test's own.

MSG = [{"role": "user", "content": "What is the capital of France?"}]
OTHER = [{"role": "user", "content": "And of Italy?"}]
STORE_TIMEOUT_S = 0.2  # generous, so that a request that waited it stands out on a busy machine


async def test_a_stalled_redis_is_skipped_after_a_few_timeouts_and_used_again_when_it_resumes(upstream, gateway, caplog):
    from tests.procs import redis_process

    caplog.set_level(logging.INFO, logger="gateway.cache")
    async with redis_process() as (url, proc):
        up = await upstream("a", tokens=2)
        gw = await gateway(simple_policy(up, store={"url": url, "timeout_ms": STORE_TIMEOUT_S * 1000}))
        c = gw.client()

        async def ask(messages) -> tuple[str, float]:
            t0 = time.perf_counter()
            raw = await c.chat.completions.with_raw_response.create(model="gpt-test", messages=messages, temperature=0)
            assert raw.parse().choices[0].message.content == "w0 w1 "
            return raw.headers["x-gateway-cache"], time.perf_counter() - t0

        assert [(await ask(MSG))[0] for _ in range(2)] == ["miss", "hit"]
        proc.send_signal(signal.SIGSTOP)  # our own redis-server, by PID
        try:
            during = [await ask(MSG) for _ in range(20)]
            assert {result for result, _ in during} == {"miss"}  # answered upstream
            # The first request waits out a timeout on each of its calls (lookup, lock, save,
            # release); the second's lookup is the fifth failure in a row: the breaker opens.
            # After it, a request waits at most one probe's timeout (after each pause).
            waited = [i for i, (_, s) in enumerate(during) if s >= 0.9 * STORE_TIMEOUT_S]
            assert waited[:2] == [0, 1] and len(waited) <= 4, during
            assert sum(s for _, s in during[2:]) < 18 * STORE_TIMEOUT_S, during
        finally:
            proc.send_signal(signal.SIGCONT)
        assert caplog.text.count("cache store keeps timing out") == 1
        # Answering again: within the longest pause (2 s) a probe finds it and closes the breaker.
        # (Another prompt: a lock the stalled requests' commands may take once Redis reads them,
        # its token's owner gone, is the lock's TTL's to end, breaker or not.)
        deadline = time.perf_counter() + 6
        results = []
        while time.perf_counter() < deadline:
            results.append((await ask(OTHER))[0])
            if results[-1] == "hit":
                break
            await asyncio.sleep(0.05)
        assert results[-1] == "hit", results
        assert "cache store answers again" in caplog.text
        assert up.stats.requests == 1 + 20 + results.count("miss")
