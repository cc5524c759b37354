"""A Redis that evicts: the cache may live on one of its own (`cache.store`), and a main store that
evicts (its quota counters and Responses records have TTLs, and went with the cache's least
recently used entries) is named in the start-up log. Real redis-servers of the test's own."""

from __future__ import annotations

import logging
import secrets

import redis.asyncio as aredis

from gateway.config.policy import StorePolicy
from gateway.store.connect import store_warnings
from gateway.tenants.auth import hash_key
from tests.conftest import simple_policy
from tests.procs import redis_server

KEY = "sk-acme-" + secrets.token_hex(8)


async def _configure(url: str, **config: str) -> None:
    client = aredis.Redis.from_url(url)
    try:
        for name, value in config.items():
            await client.config_set(name, value)
    finally:
        await client.aclose()


async def _keys(url: str) -> list[bytes]:
    client = aredis.Redis.from_url(url)
    try:
        return sorted(await client.keys("*"))
    finally:
        await client.aclose()


async def test_a_redis_that_evicts_is_named_unless_it_holds_only_the_cache():
    async with redis_server() as url:
        sp = StorePolicy(url=url)
        assert (await store_warnings(sp, 1))[1] is None  # no maxmemory: nothing is evicted
        await _configure(url, maxmemory="64mb", **{"maxmemory-policy": "volatile-lru"})
        problem = (await store_warnings(sp, 1))[1]
        assert problem is not None and "volatile-lru" in problem and "cache.store.url" in problem
        assert (await store_warnings(sp, 1, evicts=True))[1] is None  # a cache's own store may
        await _configure(url, **{"maxmemory-policy": "allkeys-lru"})
        assert "virtual keys" in str((await store_warnings(sp, 1))[1])
        await _configure(url, **{"maxmemory-policy": "noeviction"})
        assert (await store_warnings(sp, 1))[1] is None


async def test_the_cache_on_a_store_of_its_own_leaves_the_quotas_where_nothing_is_evicted(upstream, gateway, caplog):
    """One cacheable request: its answer on the cache's Redis (which may evict), the tenant's
    counters on the main one; the start-up log names neither (the cache's may evict)."""
    up = await upstream("a")
    async with redis_server() as main, redis_server() as cache:
        await _configure(cache, maxmemory="64mb", **{"maxmemory-policy": "allkeys-lru"})
        policy = simple_policy(up, store={"url": main}, cache={"store": {"url": cache}},
                               reload={"watch": False, "channel": "t-" + secrets.token_hex(4)})
        policy["tenants"] = {"acme": {"key_sha256": [hash_key(KEY)], "quota": {"tokens_per_day": 100_000}}}
        with caplog.at_level(logging.WARNING):
            gw = await gateway(policy)
            client = gw.client(key=KEY)
            for _ in range(2):
                r = await client.chat.completions.with_raw_response.create(
                    model="gpt-test", messages=[{"role": "user", "content": "hi"}], temperature=0)
            assert r.headers["x-gateway-cache"] == "hit"
        cached, counted = await _keys(cache), await _keys(main)
        assert cached and all(b"gwq" not in k for k in cached), cached
        assert any(b"gwq" in k for k in counted) and not any(k in counted for k in cached), counted
        assert not [r for r in caplog.records if "evicts keys" in r.getMessage()]
