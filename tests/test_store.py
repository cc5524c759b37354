"""Store contract tests, run against MemoryStore and RedisStore alike, plus each one's specifics.

Redis tests use the shared server at 127.0.0.1:6379, DB 13, with a unique key prefix per test
(deleted afterwards); the outage tests start a redis-server of their own on a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aredis

from gateway.store.core import FairMemoryStore, MemoryStore, Store, StoreError
from gateway.store.holdings import Holdings
from gateway.tenants.quota_counters import Ask, Scope, Settle
from gateway.store.redis_store import RedisStore
from tests.procs import needs_redis_server

REDIS_URL = "redis://127.0.0.1:6379/13"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _delete_prefix(prefix: str) -> None:
    raw = aredis.Redis.from_url(REDIS_URL)
    try:
        keys = [k async for k in raw.scan_iter(match=prefix + "*", count=1000)]
        if keys:
            await raw.delete(*keys)
    finally:
        await raw.aclose()


@contextlib.asynccontextmanager
async def _redis_store() -> AsyncIterator[RedisStore]:
    prefix = f"test:store:{uuid.uuid4().hex}:"
    # A generous timeout: these tests check the contract, not the latency of a busy CI machine.
    store = RedisStore(REDIS_URL, timeout_ms=500, prefix=prefix)
    try:
        yield store
    finally:
        await store.close()
        await _delete_prefix(prefix)


@pytest.fixture
async def redis_store() -> AsyncIterator[RedisStore]:
    async with _redis_store() as store:
        yield store


def _first_byte(key: str, value: bytes) -> str:
    return value[:1].decode("latin-1")


@pytest.fixture(params=["memory", "fair", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
    elif request.param == "fair":
        yield FairMemoryStore(_first_byte)
    else:
        async with _redis_store() as s:
            yield s


# --- the contract ---


async def test_missing_key_reads_as_none(store: Store) -> None:
    assert await store.get("absent") is None


async def test_values_round_trip_byte_exact(store: Store) -> None:
    value = b'{"a":1}\x00\xff' + bytes(range(256))
    await store.set("k", value, 60)
    assert await store.get("k") == value


async def test_set_replaces_and_delete_removes(store: Store) -> None:
    await store.set("k", b"one", 60)
    await store.set("k", b"two", 60)
    assert await store.get("k") == b"two"
    await store.delete("k")
    await store.delete("k")  # deleting an absent key is fine
    assert await store.get("k") is None


async def test_non_positive_ttl_stores_nothing(store: Store) -> None:
    await store.set("k", b"old", 60)
    await store.set("k", b"new", 0)
    assert await store.get("k") is None


async def test_concurrent_calls_all_answer(store: Store) -> None:
    await asyncio.gather(*(store.set(f"k{i}", str(i).encode(), 60) for i in range(50)))
    got = await asyncio.gather(*(store.get(f"k{i}") for i in range(50)))
    assert got == [str(i).encode() for i in range(50)]


async def test_add_stores_only_when_absent(store: Store) -> None:
    assert await store.add("lock", b"1", 30)
    assert not await store.add("lock", b"2", 30)
    assert await store.get("lock") == b"1"
    await store.delete("lock")
    assert await store.add("lock", b"3", 30)


async def test_delete_if_removes_only_while_the_value_is_there(store: Store) -> None:
    await store.set("lock", b"theirs", 30)
    assert not await store.delete_if("lock", b"mine")  # a lock taken by another since
    assert await store.get("lock") == b"theirs"
    assert not await store.delete_if("absent", b"mine")
    assert await store.delete_if("lock", b"theirs")
    assert await store.get("lock") is None


async def test_settle_now_applies_at_once_only_on_the_processs_own_counters(store: Store) -> None:
    """A settle on this process's counters needs no round trip (Quota settles it without a task);
    on Redis, settle_now does nothing and says so (the settle goes through quota_settle)."""
    tenant = f"t-{uuid.uuid4().hex}"
    d = await store.quota_take(tenant, Ask((Scope("", tpm=1000),), 100, "lease-1", 30_000))
    settle = Settle(("",), d.bucket, d.day, -60, 0, "lease-1")
    done = store.settle_now(tenant, settle)
    assert done is (not store.shared)
    if not done:
        await store.quota_settle(tenant, settle)
    assert (await store.quota_usage(tenant, "")).window_tokens == 40


def test_both_stores_satisfy_the_protocol() -> None:
    assert isinstance(MemoryStore(), Store)
    assert isinstance(RedisStore(REDIS_URL), Store)


# --- MemoryStore ---


async def test_memory_ttl_expires_on_the_injected_clock() -> None:
    clock = FakeClock()
    s = MemoryStore(clock=clock)
    await s.set("k", b"v", 10)
    clock.now += 9.9
    assert await s.get("k") == b"v"
    clock.now += 0.2
    assert await s.get("k") is None
    assert len(s) == 0 and s.used_bytes == 0


async def test_memory_evicts_least_recently_used_by_count() -> None:
    s = MemoryStore(max_items=3)
    for k in "abc":
        await s.set(k, b"v", 60)
    await s.get("a")  # a is now the most recent: b goes first
    await s.set("d", b"v", 60)
    assert [await s.get(k) for k in "abcd"] == [b"v", None, b"v", b"v"]
    assert len(s) == 3


async def test_a_part_of_its_own_is_not_evicted_by_the_rest() -> None:
    s = MemoryStore(max_items=2)
    records = s.own("records")
    assert s.own("records") is records and records is not s  # made once, kept across reloads with s
    await records.set("r", b"A's record", 60)
    for i in range(10):  # another user's traffic fills the parent LRU many times over
        await s.set(f"k{i}", b"v", 60)
    assert await records.get("r") == b"A's record"
    assert records.max_items == 2 and await s.get("r") is None


async def test_a_fair_part_evicts_from_the_owner_holding_the_most() -> None:
    s = MemoryStore(max_items=6)
    records = s.own("records", _first_byte)
    assert isinstance(records, FairMemoryStore) and s.own("records", _first_byte) is records
    await records.set("a1", b"A", 60)
    await records.set("a2", b"A", 60)
    for i in range(20):  # B floods: past the bound, its own least recently used go
        await records.set(f"b{i}", b"B", 60)
    assert await records.get("a1") == b"A" and await records.get("a2") == b"A"
    assert records.owners() == {"A": 2, "B": 4} and len(records) == 6
    assert [await records.get(f"b{i}") for i in (14, 15)] == [None, None]
    await records.get("b16")  # touched: b17 is B's least recently used now
    await records.set("c1", b"C", 60)
    assert await records.get("b17") is None and await records.get("b16") == b"B"
    for i in range(5):  # C grows past B: then C pays for its own growth
        await records.set(f"c{i + 2}", b"C", 60)
    assert records.owners() == {"A": 2, "B": 2, "C": 2}
    await records.delete("a1")
    assert records.owners() == {"A": 1, "B": 2, "C": 2} and len(records) == 5


async def test_past_its_bytes_a_fair_part_evicts_from_the_owner_holding_the_most_bytes() -> None:
    # Counted in entries, an owner of few large entries (a tenant's long cached answers) evicted
    # the small ones of an owner holding more of them.
    s = FairMemoryStore(_first_byte, max_bytes=1000)
    for i in range(20):
        await s.set(f"a{i}", b"A" + b"x" * 8, 60)  # 20 small entries: 220 bytes
    for i in range(10):
        await s.set(f"b{i}", b"B" + b"x" * 197, 60)  # 10 of 200 bytes: the bound is passed
    assert s.owners()["A"] == 20 and s.used_bytes <= 1000  # B shed its own


async def test_a_fair_part_evicts_by_bytes_and_rewrites_move_an_entry_between_owners() -> None:
    clock = FakeClock()
    s = FairMemoryStore(_first_byte, max_bytes=100, clock=clock)
    await s.set("k", b"A" + b"x" * 19, 60)  # 21 bytes
    for i in range(8):
        await s.set(f"b{i}", b"B" + b"x" * 18, 60)  # 21 bytes each
    assert s.used_bytes <= 100 and await s.get("k") is not None and s.owners() == {"A": 1, "B": 3}
    await s.set("k", b"B", 60)  # the key now names B: it is B's, and A holds nothing
    assert s.owners() == {"B": 4} and s.used_bytes == 2 + 3 * 21
    await s.set("big", b"A" * 200, 60)  # larger than the whole: not stored, nothing evicted
    assert await s.get("big") is None and s.owners() == {"B": 4}
    clock.now += 61
    assert await s.get("k") is None and s.owners() == {"B": 3}  # expired on read
    assert await s.add("k", b"A", 60) and not await s.add("k", b"B", 60)
    assert await s.delete_if("k", b"A") and s.owners() == {"B": 3}
    await s.close()
    assert len(s) == 0 and s.used_bytes == 0 and s.owners() == {}


def test_holdings_keep_the_owners_holding_the_most_at_hand() -> None:
    h = Holdings()
    assert h.top() == (0, []) and h.heaviest() is None and h.below_top() == 0
    h.move("a", 3)
    h.move("b", 1)
    h.move("c", 3)
    assert h.top() == (3, ["a", "c"]) and h.heaviest() == "a" and h.below_top() == 1
    assert h.move("a", -1) == 2 and h.top() == (3, ["c"]) and h.below_top() == 2
    assert h.move("b", -1) == 0 and h.held("b") == 0 and len(h) == 2
    with pytest.raises(ValueError):
        h.move("b", -1)
    assert len(h) == 2 and h.top() == (3, ["c"])  # a refused move changes nothing


async def test_memory_evicts_by_bytes_and_skips_oversized_values() -> None:
    s = MemoryStore(max_bytes=100)
    await s.set("a", b"x" * 40, 60)  # 41 bytes with the key
    await s.set("b", b"x" * 40, 60)
    await s.set("c", b"x" * 40, 60)  # 123 > 100: a is evicted
    assert await s.get("a") is None and await s.get("b") and await s.get("c")
    assert s.used_bytes == 82
    await s.set("big", b"x" * 200, 60)
    assert await s.get("big") is None and s.used_bytes == 82
    await s.set("b", b"y", 60)  # replacing frees the old value's bytes
    assert s.used_bytes == 41 + 2


# --- RedisStore ---


async def test_redis_ttl_expires_for_real(redis_store: RedisStore) -> None:
    await redis_store.set("k", b"v", 0.05)  # PX 50
    assert await redis_store.get("k") == b"v"
    await asyncio.sleep(0.12)
    assert await redis_store.get("k") is None


async def test_redis_prefix_namespaces_keys(redis_store: RedisStore) -> None:
    await redis_store.set("k", b"v", 60)
    raw = aredis.Redis.from_url(REDIS_URL)
    try:
        assert await raw.get(redis_store.prefix + "k") == b"v"
        assert await raw.get("k") != b"v" or redis_store.prefix == ""
    finally:
        await raw.aclose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnRedis:
    """A redis-server of the test's own, started and killed by PID."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.1) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.01)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)


@pytest.fixture
def own_redis() -> Iterator[OwnRedis]:
    needs_redis_server()
    server = OwnRedis(_free_port())
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                server.signal(signal.SIGCONT)
        server.kill()


# 100 ms budgets (not the few ms of production) keep these tests steady on a loaded CI machine; the
# point is that a dead or stalled Redis costs about the budget, never a multi-second socket timeout.
async def _fails_fast(call: object, limit_s: float) -> float:
    started = time.perf_counter()
    with pytest.raises(StoreError):
        await call  # type: ignore[misc]
    took = time.perf_counter() - started
    assert took < limit_s, f"took {took * 1000:.0f} ms"
    return took


async def test_redis_down_fails_fast_and_reconnects_by_itself(own_redis: OwnRedis) -> None:
    store = RedisStore(f"redis://127.0.0.1:{own_redis.port}/0", timeout_ms=100, max_connections=4)
    try:
        await store.set("k", b"v", 60)
        await asyncio.gather(*(store.get("k") for _ in range(4)))  # several pooled connections
        own_redis.kill()
        await _fails_fast(store.get("k"), 0.5)
        await _fails_fast(store.set("k", b"v", 60), 0.5)
        for _ in range(5):  # every call while down is bounded, not only the first
            await _fails_fast(store.get("k"), 0.5)
        own_redis.start()  # same port, empty data
        assert await store.get("k") is None
        await store.set("k", b"back", 60)
        assert await asyncio.gather(*(store.get("k") for _ in range(4))) == [b"back"] * 4
    finally:
        await store.close()


async def test_redis_stalled_times_out_within_the_budget(own_redis: OwnRedis) -> None:
    store = RedisStore(f"redis://127.0.0.1:{own_redis.port}/0", timeout_ms=100)
    try:
        await store.set("k", b"v", 60)
        own_redis.signal(signal.SIGSTOP)  # alive but not answering: the slow-Redis case
        took = await _fails_fast(store.get("k"), 0.5)
        assert took >= 0.09
        await _fails_fast(store.set("k", b"v", 60), 0.5)
        own_redis.signal(signal.SIGCONT)
        assert await store.get("k") == b"v"
    finally:
        await store.close()
