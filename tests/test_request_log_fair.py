"""The request log's fair eviction (gateway/admin/log_store.py): past `size`, the oldest entry of the
tenant holding the most goes, so one tenant's flood (cheap 404s, its own 429s: every one is logged)
evicts its own entries and another tenant's recent history stays. In memory, on a redis-server of
the test's own, across two stores sharing it (replicas), and on a log an older version wrote."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import orjson
import pytest
import redis.asyncio as aredis

from gateway.admin.log_store import Cursor, Filter, LogStore, MemoryLogStore, RedisLogStore, scan
from tests.procs import redis_server

T0 = 1_700_000_000_000_000  # microseconds


def _entry(n: int, tenant: str, pad: int = 0) -> tuple[int, str, bytes]:
    """The `n`th request (its score orders them), as the writer hands it to the store."""
    e = {"id": f"{tenant}-{n}", "time": (T0 + n) / 1e6, "tenant": tenant, "status": 404, "pad": "x" * pad}
    return T0 + n, tenant, orjson.dumps(e)


async def _ids(store: LogStore, tenant: str | None = None) -> list[str]:
    return [e["id"] async for e in scan(store, Filter(tenant=tenant), chunk=37)]


async def _held(store: LogStore) -> Counter[str]:
    return Counter(i.rsplit("-", 1)[0] for i in await _ids(store))


async def test_a_tenant_flooding_the_log_evicts_its_own_entries_and_the_others_keep_theirs(log_store):
    """The review's case: tenant b's few requests, then tenant a's thousands (batches of every
    size, some of b's requests among them). b keeps all of its entries, a its newest, the log
    `size`; a tenant's page reads what the whole log holds of it."""
    store = log_store(100)
    for n in range(1, 6):
        await store.append([_entry(n, "b")])
    written: dict[str, list[str]] = {"a": [], "b": [f"b-{n}" for n in range(1, 6)]}
    rng, n = random.Random(7), 5
    for _ in range(40):
        batch = []
        for _ in range(rng.choice((1, 7, 60, 300))):
            n += 1
            batch.append(_entry(n, "a" if rng.random() < 0.99 else "b"))
            written[batch[-1][1]].append(batch[-1][2].decode().split('"')[3])
        await store.append(batch)
    ids = await _ids(store)
    a_ids, b_ids = await _ids(store, "a"), await _ids(store, "b")
    assert len(ids) == 100 and len(written["a"]) > 3000
    assert b_ids == written["b"][::-1]  # every one of b's, the first ones included
    assert a_ids == written["a"][::-1][: 100 - len(b_ids)]  # a's newest, in the room b leaves
    assert sorted(ids) == sorted(a_ids + b_ids)


async def test_the_log_is_shared_out_evenly_among_the_tenants_that_fill_it(log_store):
    """z writes 10, y 50, then x floods: z (under size / 3) loses nothing, x and y share the rest
    evenly, each its newest; and a tenant's page and the whole log agree."""
    store = log_store(90)
    n = 0
    for tenant, count in (("z", 10), ("y", 50)):
        for _ in range(count):
            n += 1
            await store.append([_entry(n, tenant)])
    for _ in range(20):
        batch = []
        for _ in range(100):
            n += 1
            batch.append(_entry(n, "x"))
        await store.append(batch)
    assert await _held(store) == {"z": 10, "y": 40, "x": 40}
    assert await _ids(store, "y") == [f"y-{i}" for i in reversed(range(21, 61))]
    assert await _ids(store, "x") == [f"x-{i}" for i in reversed(range(n - 39, n + 1))]
    assert await _ids(store, "z") == [f"z-{i}" for i in reversed(range(1, 11))]
    page = await store.page(Filter(), 50, None)  # the cursor walks the kept entries, newest first
    rest = await store.page(Filter(), 50, Cursor.parse(page.next or "0"))
    assert [e["id"] for e in page.entries + rest.entries] == await _ids(store) and rest.next is None


async def test_two_replicas_on_one_redis_evict_fairly_and_keep_its_keys_consistent():
    """Two stores on one Redis (two replicas), writing at once: a's flood through one, b's and c's
    requests through the other. b and c keep theirs, the log is `size`, and the counts the
    eviction reads equal each tenant's index, whose entries are the log's."""
    async with redis_server() as url:
        one, two = RedisLogStore(url, 200, prefix="gw:"), RedisLogStore(url, 200, prefix="gw:")
        r = aredis.Redis.from_url(url)
        try:
            async def flood() -> None:
                for k in range(60):
                    await one.append([_entry(10_000 + 50 * k + j, "a") for j in range(50)])

            async def quiet() -> None:
                for k in range(60):
                    await two.append([_entry(10_000 + 50 * k + 25, "b" if k % 2 else "c")])

            await asyncio.gather(flood(), quiet())
            held = await _held(two)
            assert sum(held.values()) == 200 and held["b"] == 30 and held["c"] == 30 and held["a"] == 140
            assert await _ids(one) == await _ids(two)
            log = set(await r.zrange("gw:{log}", 0, -1))
            counts = {k.decode(): int(v) for k, v in await r.zrange("gw:{log}:held", 0, -1, withscores=True)}
            assert counts == {"a": 140, "b": 30, "c": 30}
            union: set[bytes] = set()
            for t in counts:
                index = set(await r.zrange(f"gw:{{log}}:t:{t}", 0, -1))
                assert len(index) == counts[t]
                union |= index
            assert union == log
        finally:
            await r.aclose()
            await one.close()
            await two.close()


async def test_a_smaller_size_from_a_reload_evicts_fairly():
    store = MemoryLogStore(100)
    await store.append([_entry(i, "a") for i in range(80)] + [_entry(100 + i, "b") for i in range(20)])
    store.size = 30  # RequestLog.configure; the memory log applies it at once
    assert len(store) == 30 and await _held(store) == {"a": 15, "b": 15}
    assert await _ids(store, "b") == [f"b-{100 + i}" for i in reversed(range(5, 20))]


async def test_the_memory_log_keeps_its_byte_bound_and_a_flood_of_large_entries_evicts_its_own():
    """A tenant whose entries are large (log_payloads) fills the byte bound: its own entries go,
    the small ones of the others stay; the bytes kept (blobs of partly evicted batches included)
    stay under the bound."""
    store = MemoryLogStore(100_000, max_bytes=200_000)
    await store.append([_entry(i, "small") for i in range(50)])
    for k in range(100):
        await store.append([_entry(1000 + 20 * k + j, "big", pad=2000) for j in range(20)])
        held = sum(len(p.blob) for heap in store._parts.values() for p in heap)  # what the process holds
        assert held == store._bytes <= 200_000
    assert (await _held(store))["small"] == 50 and 60 < (await _held(store))["big"] < 100
    assert (await _ids(store, "big"))[0] == f"big-{1000 + 20 * 99 + 19}"


async def test_the_byte_bound_evicts_from_the_tenant_holding_the_most_bytes_not_the_most_entries():
    """A busy tenant's many small entries and a payload tenant's few large ones: past the byte
    bound, the latter sheds its own (it was the busy one's, holding the most entries: 1,000 small
    entries came down to 180 under 300 large ones). Random batches keep the accounting exact."""
    store = MemoryLogStore(100_000, max_bytes=400_000)
    await store.append([_entry(i, "busy") for i in range(1000)])  # about a quarter of the bound
    for k in range(30):  # 300 entries of ~2 KB
        await store.append([_entry(10_000 + 10 * k + j, "payload", pad=2000) for j in range(10)])
    held = await _held(store)
    assert held["busy"] == 1000 and 100 < held["payload"] < 300, held
    assert (await _ids(store, "payload"))[0] == "payload-10299"  # its newest stay
    rng = random.Random(7)
    n = 20_000
    for _ in range(200):
        batch = [_entry((n := n + 1), rng.choice("abc"), pad=rng.choice((0, 50, 3000, 20_000))) for _ in range(rng.randint(1, 30))]
        await store.append(batch)
        kept = {t: sum(len(p.blob) for p in parts) for t, parts in store._parts.items()}
        assert kept == store._tenant_bytes and sum(kept.values()) == store._bytes <= 400_000
        assert len(store) == sum(len(p) for parts in store._parts.values() for p in parts)
    store.max_bytes = 50_000  # a reload: applied at once, fairly
    sizes = sorted(store._tenant_bytes.values())
    assert store._bytes <= 50_000 and sizes[-1] - sizes[0] < 25_000, store._tenant_bytes


async def test_a_log_written_by_the_previous_version_is_counted_once_and_then_evicted_fairly():
    """The key layout is the one before, plus `{log}:held`: a log an older gateway wrote (no
    counts; objects, and rows as entry.py writes them) is read as it was, and its first append
    counts its tenants, so a tenant that held most of the log before is not spared while another
    floods."""
    old_append = r"""
    local size = tonumber(ARGV[1])
    local touched = {}
    for score, tenant, entry in string.gmatch(ARGV[2], "(%d+)\t([^\t\n]*)\t([^\n]*)\n") do
      redis.call('ZADD', KEYS[1], score, entry)
      redis.call('ZADD', KEYS[2] .. tenant, score, entry)
      touched[tenant] = true
    end
    redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -size - 1)
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')[2]
    if oldest then
      for t, _ in pairs(touched) do
        redis.call('ZREMRANGEBYSCORE', KEYS[2] .. t, '-inf', '(' .. oldest)
      end
    end
    return 1
    """  # the append script before fair eviction, verbatim
    async with redis_server() as url:
        r = aredis.Redis.from_url(url)
        store = RedisLogStore(url, 100, prefix="gw:")
        try:
            old = r.register_script(old_append)
            rows = [(T0 + 100 + i, "f", orjson.dumps([1, f"f-{100 + i}", (T0 + 100 + i) / 1e6, "f"])) for i in range(10)]
            lines = b"".join(b"%d\t%s\t%s\n" % (s, t.encode(), e) for s, t, e in [_entry(i, "q") for i in range(90)] + rows)
            await old(keys=["gw:{log}", "gw:{log}:t:"], args=[100, lines])
            assert await _held(store) == {"q": 90, "f": 10}  # read as it was
            await store.append([_entry(200 + i, "f") for i in range(100)])
            assert await _held(store) == {"q": 50, "f": 50}
            assert await _ids(store, "q") == [f"q-{i}" for i in reversed(range(40, 90))]
            counts = {k.decode(): int(v) for k, v in await r.zrange("gw:{log}:held", 0, -1, withscores=True)}
            assert counts == {"q": 50, "f": 50}
        finally:
            await r.aclose()
            await store.close()
