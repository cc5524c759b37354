"""The response cache through the gateway, on the in-memory store and on a real Redis."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import time

import aiohttp
import openai
import pytest
import redis

from gateway.tenants.auth import hash_key
from gateway.cache.core import cache_key
from gateway.web.keys import LIVE
from tests.conftest import simple_policy
from tests.procs import needs_redis_server, shared_redis

MSG = [{"role": "user", "content": "What is the capital of France?"}]
REDIS_DB = 14


@pytest.fixture(params=["memory", "redis"])
def store_policy(request):
    if request.param == "memory":
        yield {}
        return
    client = shared_redis(REDIS_DB)
    yield {"url": f"redis://127.0.0.1:6379/{REDIS_DB}", "timeout_ms": 200}
    client.flushdb()  # this DB is the tests' own
    client.close()


def _policy(up, store, **extra):
    p = simple_policy(up, store=store)
    p.update(extra)
    return p


async def _metric(gw, needle: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith(needle):
                    return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_repeated_deterministic_request_is_answered_from_the_cache(upstream, gateway, store_policy):
    up = await upstream("a", tokens=4)
    gw = await gateway(_policy(up, store_policy))
    c = gw.client()
    first = await c.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, temperature=0)
    second = await c.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, temperature=0)
    assert first.headers["x-gateway-cache"] == "miss" and second.headers["x-gateway-cache"] == "hit"
    assert second.headers["x-gateway-backend"] == "cache"
    assert first.parse().choices[0].message.content == second.parse().choices[0].message.content == "w0 w1 w2 w3 "
    assert up.stats.requests == 1
    assert await _metric(gw, 'gateway_cache_lookups_total{result="hit"}') == 1


async def test_a_streamed_miss_is_stored_and_replayed_as_a_valid_stream(upstream, gateway, store_policy):
    up = await upstream("a", tokens=30)
    gw = await gateway(_policy(up, store_policy))
    c = gw.client()

    async def streamed():
        raw = await c.chat.completions.with_raw_response.create(
            model="gpt-test", messages=MSG, seed=7, stream=True, stream_options={"include_usage": True}
        )
        text, usage, finish = "", None, None
        async for ch in raw.parse():
            usage = ch.usage or usage
            for choice in ch.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return raw.headers["x-gateway-cache"], text, usage, finish

    miss = await streamed()
    hit = await streamed()
    expected = "".join(f"w{i} " for i in range(30))
    assert miss[0] == "miss" and hit[0] == "hit"
    assert miss[1] == hit[1] == expected and hit[3] == "stop"
    assert hit[2] is not None and hit[2].completion_tokens == 30
    # the same answer serves a non-streamed request too
    r = await c.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, seed=7)
    assert r.headers["x-gateway-cache"] == "hit" and r.parse().choices[0].message.content == expected
    assert up.stats.requests == 1


async def test_a_streamed_miss_without_usage_asked_stores_the_usage_later_hits_ask_for(upstream, gateway, store_policy):
    # The backend is asked for the usage chunk whatever the client asked (dropped for it): the
    # stored answer then serves a stream that asks for usage and a whole answer, which has it.
    up = await upstream("a", tokens=5)
    gw = await gateway(_policy(up, store_policy))
    c = gw.client()

    async def streamed(**kw):
        raw = await c.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, seed=3, stream=True, **kw)
        chunks = [ch async for ch in raw.parse()]
        return raw.headers["x-gateway-cache"], [ch.usage for ch in chunks if ch.usage], [ch for ch in chunks if not ch.choices]

    cache, usages, empty = await streamed()
    assert cache == "miss" and usages == [] and empty == []  # the client did not ask: no usage chunk
    cache, usages, _ = await streamed(stream_options={"include_usage": True})
    assert cache == "hit" and len(usages) == 1 and usages[0].completion_tokens == 5
    whole = await c.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, seed=3)
    assert whole.headers["x-gateway-cache"] == "hit" and whole.parse().usage.completion_tokens == 5
    assert up.stats.requests == 1


async def test_what_is_not_cached(upstream, gateway):
    up = await upstream("a", tokens=2)
    gw = await gateway(_policy(up, {}))
    c = gw.client()

    async def cache_header(**kw) -> str:
        raw = await c.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, **kw)
        return raw.headers["x-gateway-cache"]

    assert await cache_header(temperature=0.7) == "bypass"  # not deterministic
    assert await cache_header(temperature=0, n=1, extra_headers={"cache-control": "no-store"}) == "miss"
    assert await cache_header(temperature=0, n=1) == "miss"  # the no-store answer was not kept
    assert await cache_header(temperature=0, n=1) == "hit"
    assert await cache_header(temperature=0, n=1, extra_headers={"cache-control": "no-cache"}) == "bypass"
    assert await cache_header(temperature=0, max_tokens=1) == "miss"  # another parameter, another key
    up.set(mode="cut", fail_after=1, tokens=3)  # an incomplete answer is never stored
    with pytest.raises(openai.APIError):
        s = await c.chat.completions.create(model="gpt-test", messages=MSG, temperature=0, seed=1, stream=True)
        async for _ in s:
            pass
    up.set(mode="ok", tokens=2)
    assert await cache_header(temperature=0, seed=1) == "miss"


async def test_tenants_never_see_each_others_answers_unless_they_share_a_namespace(upstream, gateway):
    up = await upstream("a", tokens=2)
    tenants = {
        "acme": {"key_sha256": [hash_key("sk-acme")]},
        "globex": {"key_sha256": [hash_key("sk-globex")]},
        "faq1": {"key_sha256": [hash_key("sk-faq1")], "cache_namespace": "faq"},
        "faq2": {"key_sha256": [hash_key("sk-faq2")], "cache_namespace": "faq"},
    }
    gw = await gateway(_policy(up, {}, tenants=tenants))

    async def cache_header(key: str) -> str:
        raw = await gw.client(key).chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, temperature=0)
        return raw.headers["x-gateway-cache"]

    assert await cache_header("sk-acme") == "miss"
    assert await cache_header("sk-globex") == "miss"  # isolated
    assert await cache_header("sk-acme") == "hit"
    assert await cache_header("sk-faq1") == "miss"
    assert await cache_header("sk-faq2") == "hit"  # shared on purpose


async def test_per_model_and_per_tenant_settings_widen_or_narrow_the_cache(upstream, gateway):
    up = await upstream("a", tokens=2)
    policy = _policy(up, {}, tenants={"t": {"key_sha256": [hash_key("sk-t")], "cache": {"enabled": False}},
                                      "u": {"key_sha256": [hash_key("sk-u")]}})
    policy["models"]["gpt-test"]["cache"] = {"include_sampled": True}  # widen: cache sampled answers too
    gw = await gateway(policy)
    for key, expected in (("sk-u", "miss"), ("sk-u", "hit"), ("sk-t", "bypass")):
        raw = await gw.client(key).chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, temperature=0.9)
        assert raw.headers["x-gateway-cache"] == expected


async def test_concurrent_identical_misses_make_one_upstream_call(upstream, gateway, store_policy):
    up = await upstream("a", tokens=3, ttft_ms=200)
    gw = await gateway(_policy(up, store_policy))
    c = gw.client()
    results = await asyncio.gather(
        *(c.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, temperature=0) for _ in range(10))
    )
    assert up.stats.requests == 1
    assert sorted(r.headers["x-gateway-cache"] for r in results) == ["hit"] * 9 + ["miss"]
    assert {r.parse().choices[0].message.content for r in results} == {"w0 w1 w2 "}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(
    "raw",
    [b"{not json", b'{"id":"chatcmpl-1","choices":[{"index":0,"message":{"role":"assis', b"[1,2]", b'{"id":"x"}'],
    ids=["bad-json", "truncated", "a-list", "no-choices"],
)
async def test_a_corrupt_entry_is_a_miss_that_is_deleted_and_counted(upstream, gateway, store_policy, stream, raw):
    up = await upstream("a", tokens=3)
    gw = await gateway(_policy(up, store_policy))
    c = gw.client()
    body = {"model": "gpt-test", "messages": MSG, "temperature": 0}
    k = cache_key("default", "chat", "gpt-test", body)  # the open-mode tenant's namespace
    store = gw.app[LIVE].runtime.cache.store
    await store.set(k, raw, 60)  # what a damaged store, or another writer, left there

    async def ask() -> tuple[str, str]:
        if not stream:
            r = await c.chat.completions.with_raw_response.create(**body)
            return r.headers["x-gateway-cache"], r.parse().choices[0].message.content
        r = await c.chat.completions.with_raw_response.create(**body, stream=True)
        text = ""
        async for ch in r.parse():
            text += "".join(choice.delta.content or "" for choice in ch.choices)
        return r.headers["x-gateway-cache"], text

    assert await ask() == ("miss", "w0 w1 w2 ")  # not a 500, not the garbage
    assert up.stats.requests == 1
    assert await _metric(gw, 'gateway_cache_errors_total{op="corrupt"}') == 1
    assert await ask() == ("hit", "w0 w1 w2 ")  # replaced by the good answer
    assert up.stats.requests == 1


async def test_explain_reports_hits(upstream, gateway):
    up = await upstream("a", tokens=2)
    gw = await gateway(_policy(up, {}))
    body = {"model": "gpt-test", "messages": MSG, "temperature": 0}
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain", json=body) as r:
            assert (await r.json())["cache"] == "miss"
        await gw.client().chat.completions.create(**body)
        async with http.post(gw.url + "/v1/route/explain", json=body) as r:
            assert (await r.json())["cache"] == "hit"
        async with http.post(gw.url + "/v1/route/explain", json={**body, "temperature": 1}) as r:
            out = await r.json()
            assert out["cache"] == "bypass" and "temperature" in out["cache_reason"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_redis(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [needs_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    client.close()
    return proc


async def test_redis_stopped_mid_test_fails_open_and_recovers(upstream, gateway, caplog):
    port = _free_port()
    proc = _start_redis(port)
    try:
        up = await upstream("a", tokens=2)
        gw = await gateway(_policy(up, {"url": f"redis://127.0.0.1:{port}/0", "timeout_ms": 50}))
        c = gw.client()

        async def ask() -> str:
            raw = await c.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, temperature=0)
            assert raw.parse().choices[0].message.content == "w0 w1 "
            return raw.headers["x-gateway-cache"]

        assert await ask() == "miss" and await ask() == "hit"
        proc.send_signal(signal.SIGKILL)  # our own redis-server, by PID
        proc.wait()
        t0 = time.perf_counter()
        for _ in range(5):
            assert await ask() == "miss"  # answered upstream, without waiting on the dead store
        assert time.perf_counter() - t0 < 3
        assert await _metric(gw, 'gateway_cache_errors_total{op="get"}') >= 5
        assert caplog.text.count("cache store failed") == 1  # warned once, not per request
        proc = _start_redis(port)
        assert await ask() == "miss"  # the empty new Redis: stored again
        assert await ask() == "hit"  # reconnected by itself
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait()


def _defaults_policy(greedy, sampler) -> dict:
    """`greedy` says it decodes greedily without a temperature; `sampler` is OpenAI-like (1.0)."""
    return {
        "backends": {
            "greedy": {"url": greedy.url, "models": ["solo", "mixed", "fallback"], "default_temperature": 0},
            "sampler": {"url": sampler.url, "models": ["mixed", "fallback", "openai-like"]},
        },
        "models": {
            "solo": {"backends": ["greedy"]},
            "mixed": {"backends": ["greedy", "sampler"], "strategy": "ordered"},
            "fallback": {"backends": ["greedy"], "context_fallbacks": ["sampler"]},
            "openai-like": {"backends": ["sampler"]},
        },
    }


async def test_a_request_without_temperature_is_cached_when_every_candidate_defaults_to_greedy(upstream, gateway):
    greedy, sampler = await upstream("greedy", tokens=3), await upstream("sampler", tokens=3)
    gw = await gateway(_defaults_policy(greedy, sampler))
    c = gw.client()

    async def ask(model: str) -> tuple[str, dict]:
        raw = await c.chat.completions.with_raw_response.create(model=model, messages=MSG)  # no temperature, no seed
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/v1/route/explain", json={"model": model, "messages": MSG}) as r:
                explained = await r.json()
        return raw.headers["x-gateway-cache"], explained

    cache, explained = await ask("solo")
    assert cache == "miss"
    assert explained["cache"] == "hit" and explained["cache_reason"] is None  # what the next request gets
    cache, _ = await ask("solo")
    assert cache == "hit"
    for model, blocker in (("mixed", "'sampler' (1)"), ("fallback", "'sampler' (1)"), ("openai-like", "'sampler' (1)")):
        for _ in range(2):
            cache, explained = await ask(model)
            assert cache == "bypass", model
            assert explained["cache"] == "bypass"
            assert explained["cache_reason"] == f"no temperature 0 or seed, and backend {blocker} samples by default (default_temperature)"


async def test_one_tenants_cacheable_traffic_does_not_evict_anothers_answers(upstream, gateway):
    # The in-memory cache was one LRU: 100 of one tenant's 13 KB answers under a 1 MiB store made
    # another tenant's cached answer a miss again (review helper's repro).
    from tests.conftest import simple_policy

    up = await upstream("a", tokens=2000)
    tenants = {"acme": {"key_sha256": [hash_key("sk-acme")]}, "evil": {"key_sha256": [hash_key("sk-evil")]}}
    gw = await gateway(simple_policy(up, tenants=tenants, store={"memory_max_bytes": 1 << 20}))

    async def cache(key: str, text: str) -> str:
        raw = await gw.client(key).chat.completions.with_raw_response.create(
            model="gpt-test", messages=[{"role": "user", "content": text}], temperature=0)
        return raw.headers["x-gateway-cache"]

    assert [await cache("sk-acme", "capital of France?") for _ in range(2)] == ["miss", "hit"]
    for i in range(100):  # 100 x 13 KB: past the store's 1 MiB
        assert await cache("sk-evil", f"junk {i}") == "miss"
    assert await cache("sk-acme", "capital of France?") == "hit"
