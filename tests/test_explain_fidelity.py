"""/v1/route/explain says what the real request with the same body, headers and key would do at
that moment, and changes nothing doing so (review helper's repros):

- it ranked with the live selector, whose rank() moves state (round robin's position, the latency
  strategy's exploration budget, random draws): its `chosen` was not where the next request went,
  and every explain shifted real traffic;
- the quota stage writes the answer limit it bounds a request to (`_fit`) into the body before
  the cache stage takes its key: explain looked up the body as sent, `miss` where it hit;
- it checked only the tenant's rpm and concurrency, not per-model limits, tpm, tokens_per_day or
  spend: 200 where the request is a 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import random
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aredis

from gateway.routing.health import Health
from gateway.routing.latency import Tracker
from gateway.routing.selector import Candidate, Selector
from gateway.store.redis_store import RedisStore
from gateway.tenants import quota_lua
from gateway.tenants.quota_counters import Ask, MemoryQuota, Scope
from gateway.web.keys import LIVE
from tests.clock import Clock
from tests.procs import redis_server

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


# -- the selector: explain ranks with a peeking copy ---------------------------------------------


def _cand(clock: Clock, name: str, ttft: float | None = None, **kw: Any) -> Candidate:
    tr = Tracker(clock=clock)
    if ttft is not None:
        tr.observe_ttft(ttft)
        tr.observe_done(ttft, ok=True)
    return Candidate(name, tr, Health(clock=clock, rng=random.Random(0)), **kw)


def _state(sel: Selector) -> tuple[int, int, Any]:
    return sel._rr, sel._since_explore, sel.rng.getstate()


@pytest.mark.parametrize("strategy", ["latency", "round_robin", "least_inflight", "weighted", "ordered"])
def test_a_peek_changes_nothing_in_the_live_selector(strategy):
    clock = Clock()
    cands = [_cand(clock, n, t, weight=w) for n, t, w in (("a", 0.1, 3.0), ("b", 0.1, 1.0), ("c", None, 1.0))]
    sel = Selector(strategy, rng=random.Random(7))
    before = _state(sel)
    for _ in range(5):
        sel.peeking().rank(cands, 100)
    assert _state(sel) == before


def test_round_robin_peek_names_the_next_pick_every_time():
    clock = Clock()
    cands = [_cand(clock, n, 0.1) for n in "abc"]
    sel = Selector("round_robin")
    for _ in range(7):
        said = [r.name for r in sel.peeking().rank(cands)]
        assert said == [r.name for r in sel.rank(cands)]


def test_latency_peek_sees_the_exploration_the_next_request_gets_without_spending_it():
    clock = Clock()
    good, silent = _cand(clock, "good", 0.05), _cand(clock, "silent", 2.0)
    sel = Selector("latency", rng=random.Random(0), explore_after_s=3.0, explore_every=50)
    clock.t += 60  # silent for a minute: the next pick explores it
    for _ in range(3):  # explains: none spends the budget
        peek = sel.peeking().rank([good, silent])[0]
        assert peek.name == "silent" and peek.note and peek.note.startswith("explore")
    real = sel.rank([good, silent])[0]
    assert (real.name, real.note) == (peek.name, peek.note)
    assert sel.peeking().rank([good, silent])[0].name == "good" == sel.rank([good, silent])[0].name  # spent now


def test_a_tie_is_named_as_a_draw_among_the_tied():
    clock = Clock()
    cands = [_cand(clock, "a", 0.1), _cand(clock, "b", 0.1), _cand(clock, "slow", 0.9)]
    sel = Selector("latency", rng=random.Random(3))
    peek = sel.peeking()
    first = peek.rank(cands)[0]
    assert first.name == "a" and first.note == "tie among 2: drawn at random"
    assert peek.drawn == ("a", "b")
    assert {sel.rank(cands)[0].name for _ in range(50)} == set(peek.drawn)  # what the live one does


def test_best_of_two_is_named_as_a_draw_among_those_it_can_pick():
    clock = Clock()
    cands = [_cand(clock, f"g{i}", 0.1 + i * 0.005) for i in range(8)] + [_cand(clock, f"s{i}", 1.0) for i in range(8)]
    sel = Selector("latency", rng=random.Random(1), p2c_min=6, tie_pct=0.0)
    peek = sel.peeking()
    first = peek.rank(cands)[0]
    assert first.name == "g0" and first.note == "best of two drawn at random among 7"
    # The worst of the band never wins a pair (no near tie): the live picks are exactly those named.
    assert {sel.rank(cands)[0].name for _ in range(2000)} == set(peek.drawn) == {f"g{i}" for i in range(7)}


def test_least_inflight_and_weighted_name_what_they_draw_from():
    clock = Clock()
    cands = [_cand(clock, "a", 0.1, weight=3.0), _cand(clock, "b", 0.9, weight=1.0), _cand(clock, "c", 0.5, weight=0.0)]
    cands[0].tracker.inflight = 3
    peek = Selector("least_inflight").peeking()
    assert [r.name for r in peek.rank(cands)] == ["b", "c", "a"] and peek.drawn == ("b", "c")
    peek = Selector("weighted").peeking()
    assert peek.rank(cands)[0].name == "a" and peek.drawn == ("a", "b")
    cands[0].tracker.inflight = 0
    peek = Selector("least_inflight").peeking()
    peek.rank(cands[:1])
    assert peek.drawn == ()  # one candidate: a certain pick


async def test_round_robin_explain_then_request(upstream, gateway):
    a, b = await upstream("a"), await upstream("b")
    gw = await gateway({
        "version": 1, "reload": {"watch": False}, "cache": {"enabled": False},
        "backends": {u.name: {"url": u.url, "models": ["m"]} for u in (a, b)},
        "models": {"m": {"backends": ["a", "b"], "strategy": "round_robin"}},
    })
    pairs = []
    async with aiohttp.ClientSession() as http:
        for _ in range(4):
            for _ in range(2):  # two explains in a row say the same and move nothing
                async with http.post(gw.url + "/v1/route/explain", json=BODY) as r:
                    why = await r.json()
                    assert why["chosen_among"] is None, why
            async with http.post(gw.url + "/v1/chat/completions", json=BODY) as r:
                await r.read()
                pairs.append((why["chosen"], r.headers["x-gateway-backend"]))
    assert all(c == real for c, real in pairs), f"(explain chosen, real backend): {pairs}"
    assert [real for _, real in pairs] == ["a", "b", "a", "b"], pairs


async def test_explain_names_the_candidates_of_a_random_pick(upstream, gateway):
    a, b = await upstream("a"), await upstream("b")
    gw = await gateway({
        "version": 1, "reload": {"watch": False}, "cache": {"enabled": False},
        "backends": {u.name: {"url": u.url, "models": ["m"], "weight": 1} for u in (a, b)},
        "models": {"m": {"backends": ["a", "b"], "strategy": "weighted"}},
    })
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain", json=BODY) as r:
            why = await r.json()
    assert sorted(why["chosen_among"]) == ["a", "b"] and why["chosen"] in why["chosen_among"], why
    assert "drawn at random" in why["candidates"][0]["note"], why


# -- the quota: the same body rewrite, and the same verdict, read not taken ----------------------


KEY = "sk-acme-" + secrets.token_hex(16)
AUTH = {"Authorization": f"Bearer {KEY}"}


def _policy(up: Any, quota: dict[str, Any], *, tenant: str = "acme", **extra: Any) -> dict[str, Any]:
    return {
        "version": 1, "reload": {"watch": False}, "cache": {"enabled": False},
        "backends": {"a": {"url": up.url, "models": ["m"]}},
        "models": {"m": {"backends": ["a"]}},
        "tenants": {tenant: {"key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "quota": quota}},
        **extra,
    }


async def _post(http: aiohttp.ClientSession, gw: Any, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    async with http.post(gw.url + path, json=BODY if body is None else body, headers=AUTH) as r:
        return r.status, await r.json()


async def _explain_then_request(gw: Any, first: bool = True) -> tuple[tuple[int, Any], tuple[int, Any]]:
    async with aiohttp.ClientSession() as http:
        if first:
            status, body = await _post(http, gw, "/v1/chat/completions")
            assert status == 200, body
        explained = await _post(http, gw, "/v1/route/explain")
        real = await _post(http, gw, "/v1/chat/completions")
    return explained, real


async def _metrics(gw: Any) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            return await r.text()


def _rejections(text: str) -> float:
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith("gateway_quota_rejections_total{"))


def _same_refusal(explained: tuple[int, Any], real: tuple[int, Any], limit: str) -> None:
    (es, ebody), (rs, rbody) = explained, real
    assert rs == 429 and limit in rbody["error"]["message"], rbody
    assert es == rs, f"explain {es} ({ebody}) while the request is {rs}: {rbody['error']['message']}"
    assert ebody["error"]["type"] == rbody["error"]["type"] and ebody["error"]["code"] == rbody["error"]["code"]
    # The same words, but for when it frees up (a second may pass between the two).
    assert ebody["error"]["message"].rsplit(";", 1)[0] == rbody["error"]["message"].rsplit(";", 1)[0]


async def test_explain_says_hit_where_the_real_request_hits(upstream, gateway):
    up = await upstream("a", tokens=3)
    gw = await gateway({
        "version": 1, "reload": {"watch": False},
        "backends": {"a": {"url": up.url, "models": ["m"], "max_output_tokens": 4096}},
        "models": {"m": {"backends": ["a"]}},
        "tenants": {"acme": {"key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "quota": {"tpm": 2000}}},
    })
    body = {"model": "m", "messages": [{"role": "user", "content": "what is 2+2"}], "temperature": 0}  # the quota writes max_tokens 2000
    async with aiohttp.ClientSession() as http:
        status, why = await _post(http, gw, "/v1/route/explain", body)
        assert status == 200 and why["cache"] == "miss", why
        for expect in ("miss", "hit"):
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH) as r:
                assert r.headers.get("x-gateway-cache") == expect, (r.status, await r.text())
        status, why = await _post(http, gw, "/v1/route/explain", body)
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=AUTH) as r:
            await r.read()
            real = r.headers["x-gateway-cache"]
    assert real == "hit" and why["cache"] == real, (why["cache"], real)
    assert up.stats.requests == 1


async def test_per_model_rpm(upstream, gateway):
    gw = await gateway(_policy(await upstream("a"), {"models": {"m": {"rpm": 1}}}))
    explained, real = await _explain_then_request(gw)
    _same_refusal(explained, real, "rpm")


async def test_tokens_per_day_spent(upstream, gateway):
    gw = await gateway(_policy(await upstream("a"), {"tokens_per_day": 60}))
    explained, real = await _explain_then_request(gw, first=False)  # its 1,040-token reservation never fits
    _same_refusal(explained, real, "tokens_per_day")


async def test_tpm_spent(upstream, gateway):
    gw = await gateway(_policy(await upstream("a", tokens=45), {"tpm": 50}))  # the first answer used them up
    explained, real = await _explain_then_request(gw)
    _same_refusal(explained, real, "tpm")


async def test_spend_spent(upstream, gateway):
    up = await upstream("a", tokens=3)
    policy = _policy(up, {"spend_per_day_usd": 0.0001})
    policy["backends"]["a"]["price"] = {"input_per_mtok": 100.0, "output_per_mtok": 100.0}
    gw = await gateway(policy)
    explained, real = await _explain_then_request(gw)
    _same_refusal(explained, real, "spend_per_day_usd")


async def test_an_explain_takes_no_tokens_no_lease_and_counts_no_refusal(upstream, gateway):
    """Its own request of rpm and concurrency is given back before the verdict: under
    concurrency 1 it says 200 while nothing is in flight. Its verdict takes nothing: no tokens
    in the windows, no lease, nothing for the day, no gateway_quota_rejections_total."""
    up = await upstream("a", tokens=3)
    gw = await gateway(_policy(up, {"concurrency": 1, "tpm": 100_000, "models": {"m": {"rpm": 1}}}))
    quota = gw.app[LIVE].runtime.quota
    async with aiohttp.ClientSession() as http:
        status, why = await _post(http, gw, "/v1/route/explain")
        assert status == 200 and why["chosen"] == "a", why
        before = await quota.usage("acme")
        status, why = await _post(http, gw, "/v1/route/explain")
        assert status == 200, why
        after = await quota.usage("acme")
        assert after[""].window_requests == before[""].window_requests + 1  # its own request, as documented
        assert (after[""].window_tokens, after[""].inflight, after[""].day_tokens) == (before[""].window_tokens, 0, before[""].day_tokens)
        assert after["m"] == before["m"]
        assert (await _post(http, gw, "/v1/chat/completions"))[0] == 200
        used, rejected = await quota.usage("acme"), _rejections(await _metrics(gw))
        status, why = await _post(http, gw, "/v1/route/explain")  # the model's rpm is spent
        assert status == 429 and "rpm" in why["error"]["message"], why
        assert _rejections(await _metrics(gw)) == rejected
        assert (await quota.usage("acme"))["m"] == used["m"]


async def test_concurrency_in_flight_is_the_same_refusal(upstream, gateway):
    up = await upstream("a", ttft_ms=800)
    gw = await gateway(_policy(up, {"concurrency": 1}))
    async with aiohttp.ClientSession() as http:
        slow = asyncio.create_task(_post(http, gw, "/v1/chat/completions"))
        await asyncio.sleep(0.3)
        explained = await _post(http, gw, "/v1/route/explain")
        real = await _post(http, gw, "/v1/chat/completions")
        assert (await slow)[0] == 200
        _same_refusal(explained, real, "concurrency")
        assert (await _post(http, gw, "/v1/route/explain"))[0] == 200  # its lease is back


# -- the counters' read-only check: take's answer, nothing written -------------------------------


class FixedClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.25

    def __call__(self) -> float:
        return self.now


def _ask(*scopes: Scope, tokens: int = 0, spend: int = 0) -> Ask:
    return Ask(scopes, tokens, uuid.uuid4().hex, 60_000, spend)


def _counters(m: MemoryQuota) -> Any:
    return copy.deepcopy({k: (c.requests.buckets, c.requests.total, c.tokens.buckets, c.tokens.total, c.leases, c.day,
                              c.spend, c.trimmed) for k, c in m._c.items()})


SCENARIOS: list[tuple[str, tuple[Scope, ...], list[tuple[int, int]], tuple[int, int]]] = [
    # (name, scopes, takes before as (tokens, spend), the peeked ask's (tokens, spend))
    ("rpm free", (Scope("", rpm=3),), [(0, 0)], (0, 0)),
    ("rpm spent", (Scope("", rpm=2),), [(0, 0), (0, 0)], (0, 0)),
    ("tpm fits", (Scope("", tpm=100),), [(40, 0)], (50, 0)),
    ("tpm spent", (Scope("", tpm=100),), [(80, 0)], (30, 0)),
    ("tpm capped", (Scope("", tpm=100),), [], (500, 0)),
    ("concurrency", (Scope("", concurrency=1),), [(0, 0)], (0, 0)),
    ("day", (Scope("", tokens_per_day=100),), [(70, 0)], (40, 0)),
    ("spend held", (Scope("", spend_per_day_micro=100),), [(0, 60)], (0, 50)),
    ("spend spent", (Scope("", spend_per_day_micro=100),), [(0, 100)], (0, 1)),
    ("model rpm", (Scope("", rpm=10, tpm=1000), Scope("m", rpm=1)), [(10, 0)], (10, 0)),
    ("model tpm", (Scope("", rpm=10, tpm=1000), Scope("m", tpm=50)), [(40, 0)], (20, 0)),
]


def test_memory_peek_is_takes_answer_and_writes_nothing():
    for name, scopes, before, (tokens, spend) in SCENARIOS:
        clock = FixedClock()
        m = MemoryQuota(clock=clock)
        for t, sp in before:
            assert m.take("t", _ask(*scopes, tokens=t, spend=sp)).ok, name
        clock.now += 0.5
        state = _counters(m)
        ask = _ask(*scopes, tokens=tokens, spend=spend)
        peeked = m.peek("t", ask)
        assert _counters(m) == state, name
        assert m.peek("u", ask).ok and "u\x00" not in m._c, name  # a tenant never counted: no entry made
        assert peeked == m.take("t", ask), name


def test_memory_peek_leaves_out_what_left_the_window_without_dropping_it():
    clock = FixedClock()
    m = MemoryQuota(clock=clock)
    scope = Scope("", rpm=1, concurrency=1)
    lease = _ask(scope)
    assert m.take("t", lease).ok
    clock.now += 61.5  # the request left the window; its lease expired (60 s)
    state = _counters(m)
    peeked = m.peek("t", _ask(scope))
    assert peeked.ok and _counters(m) == state
    assert peeked == m.take("t", _ask(scope))


@contextlib.asynccontextmanager
async def _redis() -> AsyncIterator[tuple[RedisStore, aredis.Redis, str]]:
    async with redis_server() as url:
        prefix = f"test:peek:{uuid.uuid4().hex}:"
        store = RedisStore(url, timeout_ms=500, quota_timeout_ms=5000, prefix=prefix)
        raw = aredis.Redis.from_url(url)
        try:
            yield store, raw, prefix
        finally:
            await store.close()
            await raw.aclose()


async def _dump(raw: aredis.Redis, prefix: str) -> dict[bytes, Any]:
    out: dict[bytes, Any] = {}
    async for k in raw.scan_iter(match=prefix + "*"):
        kind = await raw.type(k)
        out[k] = (await raw.hgetall(k)) if kind == b"hash" else (await raw.zrange(k, 0, -1, withscores=True)) if kind == b"zset" else await raw.get(k)
    return out


async def test_redis_peek_is_takes_answer_and_writes_nothing():
    async with _redis() as (store, raw, prefix):
        for n, (name, scopes, before, (tokens, spend)) in enumerate(SCENARIOS):
            tenant = f"t{n}"
            for t, sp in before:
                assert (await store.quota_take(tenant, _ask(*scopes, tokens=t, spend=sp))).ok, name
            state = await _dump(raw, prefix)
            ask = _ask(*scopes, tokens=tokens, spend=spend)
            peeked = await store.quota_peek(tenant, ask)
            assert await _dump(raw, prefix) == state, name
            took = await store.quota_take(tenant, ask)
            # Redis runs on its own clock: the waits may move by the time between the two.
            assert abs(peeked.retry_after_s - took.retry_after_s) < 1.5, name
            assert (peeked.ok, peeked.limit, peeked.scope, peeked.day, peeked.remaining_requests, peeked.remaining_tokens) == (
                took.ok, took.limit, took.scope, took.day, took.remaining_requests, took.remaining_tokens), name


async def test_redis_peek_leaves_out_old_buckets_and_expired_leases_without_deleting_them():
    async with _redis() as (store, raw, prefix):
        scope = Scope("", rpm=1, concurrency=1)
        r, _t, c, _d, _m = quota_lua.scope_keys(prefix, "t", "")
        now_s, _ = await raw.time()
        await raw.hset(r, str(now_s - 120), 5)  # a bucket two minutes old: out of the window
        await raw.zadd(c, {"gone": (now_s - 5) * 1000})  # a lease that expired
        state = await _dump(raw, prefix)
        peeked = await store.quota_peek("t", _ask(scope))
        assert peeked.ok and peeked.remaining_requests == 0 and await _dump(raw, prefix) == state
        assert (await store.quota_take("t", _ask(scope))).ok
        refused = await store.quota_peek("t", _ask(scope))
        assert not refused.ok and refused.limit == "rpm"


async def test_explain_on_a_redis_store_gives_the_requests_verdict(upstream, gateway):
    async with redis_server() as url:
        up = await upstream("a", tokens=3)
        gw = await gateway(_policy(up, {"concurrency": 2, "models": {"m": {"rpm": 1}}}, store={"url": url}))
        async with aiohttp.ClientSession() as http:
            assert (await _post(http, gw, "/v1/route/explain"))[0] == 200
            assert (await _post(http, gw, "/v1/chat/completions"))[0] == 200
            quota = gw.app[LIVE].runtime.quota
            before = await quota.usage("acme")
            explained = await _post(http, gw, "/v1/route/explain")
            after = await quota.usage("acme")
            real = await _post(http, gw, "/v1/chat/completions")
        _same_refusal(explained, real, "rpm")
        assert after["m"] == before["m"] and after[""].window_tokens == before[""].window_tokens and after[""].inflight == 0
