"""Tenant quotas over real sockets with the openai SDK: 429s in OpenAI's shape with Retry-After and
x-ratelimit headers, nothing sent upstream when refused, tokens settled with real usage (streams
included, the usage chunk stripped for a client that did not ask), leases released on every path,
cache hits counted as requests but not tokens, reloads, and a dead Redis degrading, never a 5xx."""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
import uuid
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from gateway.web.keys import LIVE
from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]
KEY = "sk-acme-" + secrets.token_hex(16)
ADMIN = "sk-admin-" + secrets.token_hex(16)


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _policy(up, quota: dict, **extra) -> dict:
    policy = simple_policy(up, cache={"enabled": False}, **extra)
    policy["tenants"] = {"acme": {"key_sha256": [_digest(KEY)], "quota": quota}}
    policy["admin"] = {"key_sha256": [_digest(ADMIN)]}
    return policy


async def left_after_first_delta(http: aiohttp.ClientSession, url: str, body: dict, headers: dict[str, str]) -> bytes:
    """A streamed /v1/responses whose client leaves at its first text delta (no usage comes back)."""
    async with http.post(url + "/v1/responses", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        buf = b""
        while b"output_text.delta" not in buf:
            buf += await r.content.readany()
        r.close()
        return buf


async def _admin_tenants(gw) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/admin/tenants", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            return (await r.json())["tenants"]


async def _metrics(gw) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            return await r.text()


async def test_rpm_refuses_with_openai_shape_headers_and_nothing_upstream(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(_policy(up, {"rpm": 3}))
    client = gw.client(key=KEY)
    for i in range(3):
        r = await client.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG)
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        assert r.headers["x-ratelimit-remaining-requests"] == str(2 - i)
    started = time.perf_counter()
    with pytest.raises(openai.RateLimitError) as exc:
        await client.chat.completions.create(model="gpt-test", messages=MSG)
    assert time.perf_counter() - started < 0.5
    err = exc.value
    assert err.status_code == 429 and err.code == "rate_limit_exceeded" and "rpm" in err.message
    assert 1 <= int(err.response.headers["retry-after"]) <= 61
    assert err.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert up.stats.requests == 3
    assert 'gateway_quota_rejections_total{limit="rpm",tenant="acme"} 1.0' in await _metrics(gw)


async def test_a_token_refusal_says_what_the_request_reserves(upstream, gateway):
    """A max_tokens past the tpm reserves the whole tpm: after one 25-token answer the next was
    refused with "reached its tpm limit (20000)" next to x-ratelimit-remaining-tokens 19,975,
    which read as a contradiction (review helper's repro). The 429 says what it reserves."""
    up = await upstream("a", tokens=5)
    gw = await gateway(_policy(up, {"tpm": 20_000}))
    client = gw.client(key=KEY)
    await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=32_000)
    with pytest.raises(openai.RateLimitError) as exc:
        await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=32_000)
    assert "reserves 20000 tokens" in exc.value.message and "max_tokens" in exc.value.message, exc.value.message
    await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=100)  # a smaller one fits


async def test_a_tenant_out_of_requests_is_refused_before_its_body_is_parsed(upstream, gateway):
    """Once a refusal said the tenant's rpm is spent, its next requests are 429s before their bodies
    are parsed and classified: a tenant refused every request still cost the event loop ~0.5 s
    with each 4 MiB body of 145,000 empty messages (review helper's repro: another tenant's p50
    went from 12 to 531 ms). A body that is not even JSON shows it: a 429, not the 400 that
    parsing it would give. /v1/route/explain takes one request of the limits (it is parsed and
    classified like one), and is refused the same way."""
    up = await upstream("a")
    gw = await gateway(_policy(up, {"rpm": 2}))
    client = gw.client(key=KEY)
    explain = await _post(gw, "/v1/route/explain", orjson.dumps({"model": "gpt-test", "messages": MSG}))
    assert explain[0] == 200
    await client.chat.completions.create(model="gpt-test", messages=MSG)
    with pytest.raises(openai.RateLimitError):  # the refusal that says so
        await client.chat.completions.create(model="gpt-test", messages=MSG)
    for path in ("/v1/chat/completions", "/v1/route/explain", "/v1/responses"):
        status, body, headers = await _post(gw, path, b"{not json at all")
        assert status == 429 and "rpm" in body["error"]["message"], (path, body)
        if path != "/v1/route/explain":
            assert 1 <= int(headers["retry-after"]) <= 61 and headers["x-ratelimit-remaining-requests"] == "0"
    assert up.stats.requests == 1
    assert 'gateway_quota_rejections_total{limit="rpm",tenant="acme"} 4.0' in await _metrics(gw)


async def test_requests_refused_by_intake_count_in_rpm_and_a_flood_of_them_is_then_refused_early(upstream, gateway):
    """A body that fails validation is a request too: a tenant could send bodies that decode slowly
    (~50 ms of the event loop for 4 MiB of tiny objects) and fail validation, never reaching the
    quota stage, so never refused early (review helper's repro, once the early refusal was in).
    Each takes a request of its rpm (its own error stands); past it, the next is a 429 before
    parsing."""
    up = await upstream("a")
    gw = await gateway(_policy(up, {"rpm": 3}))
    statuses = [(await _post(gw, "/v1/chat/completions", body))[0]
                for body in (b"{not json", orjson.dumps({"model": "gpt-test"}), orjson.dumps({"model": "nope", "messages": MSG}),
                             b"{not json", b"{not json")]
    assert statuses == [400, 400, 404, 400, 429], statuses
    assert up.stats.requests == 0


async def _post(gw, path: str, data: bytes) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as http:
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        async with http.post(gw.url + path, data=data, headers=headers) as r:
            return r.status, await r.json(content_type=None), r.headers.copy()


async def test_tokens_are_settled_with_the_reported_usage_and_streams_are_charged(upstream, gateway):
    up = await upstream("a", tokens=4)
    gw = await gateway(_policy(up, {"tpm": 100_000, "tokens_per_day": 1_000_000}))
    client = gw.client(key=KEY)
    r = await client.chat.completions.create(model="gpt-test", messages=MSG, max_tokens=500)
    used = r.usage.total_tokens
    # A stream whose client did not ask for usage: the gateway asks the backend, and strips the chunk.
    chunks = [c async for c in await client.chat.completions.create(model="gpt-test", messages=MSG, stream=True)]
    assert all(c.choices for c in chunks)  # no usage-only chunk reached this client
    assert up.stats.last_body["stream_options"] == {"include_usage": True}
    use = (await _admin_tenants(gw))["acme"]["use"]["tenant"]
    assert use["requests_60s"] == 2 and use["inflight"] == 0
    # settled with each answer's usage, not the reservations (500, and 1,024 by default)
    assert use["tokens_60s"] == use["tokens_today"] and used < use["tokens_60s"] < used + 100


async def test_a_client_that_asked_for_usage_still_gets_it(upstream, gateway):
    up = await upstream("a", tokens=3)
    gw = await gateway(_policy(up, {"tpm": 100_000}))
    client = gw.client(key=KEY)
    chunks = [c async for c in await client.chat.completions.create(
        model="gpt-test", messages=MSG, stream=True, stream_options={"include_usage": True})]
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0


async def test_concurrency_leases_are_released_on_answers_errors_and_disconnects(upstream, gateway):
    up = await upstream("a", ttft_ms=300, tokens=20, itl_ms=20)
    gw = await gateway(_policy(up, {"concurrency": 2}))
    client = gw.client(key=KEY)
    results = await asyncio.gather(
        *[client.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG) for _ in range(5)],
        return_exceptions=True,
    )
    assert sum(1 for r in results if not isinstance(r, Exception)) == 2
    assert all(isinstance(r, openai.RateLimitError) for r in results if isinstance(r, Exception))
    # a client that leaves mid-stream gives its lease back, and is charged what it got
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": True})
    async with aiohttp.ClientSession() as http:
        r = await http.post(gw.url + "/v1/chat/completions", data=body, headers={"Authorization": f"Bearer {KEY}"})
        await r.content.readuntil(b"w2 ")
        r.close()
    deadline = time.monotonic() + 3
    while (await _admin_tenants(gw))["acme"]["use"]["tenant"]["inflight"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert (await _admin_tenants(gw))["acme"]["use"]["tenant"]["inflight"] == 0
    ok = await asyncio.gather(*[client.chat.completions.create(model="gpt-test", messages=MSG) for _ in range(2)])
    assert len(ok) == 2


async def test_a_disconnected_stream_is_charged_what_was_streamed(upstream, gateway):
    up = await upstream("a", tokens=200, itl_ms=20)
    gw = await gateway(_policy(up, {"tpm": 100_000}))
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": True, "max_tokens": 5000})
    async with aiohttp.ClientSession() as http:
        r = await http.post(gw.url + "/v1/chat/completions", data=body, headers={"Authorization": f"Bearer {KEY}"})
        await r.content.readuntil(b"w4 ")
        r.close()
    await asyncio.sleep(0.3)
    tokens = (await _admin_tenants(gw))["acme"]["use"]["tenant"]["tokens_60s"]
    assert 5 <= tokens < 200  # the prompt estimate and the ~5-10 tokens it got, not the 5,000 reserved


async def test_cache_hits_count_as_requests_not_tokens(upstream, gateway):
    up = await upstream("a")
    policy = _policy(up, {"rpm": 100, "tpm": 100_000})
    policy["cache"] = {"ttl_s": 60}
    gw = await gateway(policy)
    client = gw.client(key=KEY)
    first = await client.chat.completions.create(model="gpt-test", messages=MSG, temperature=0)
    hit = await client.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, temperature=0)
    assert hit.headers["x-gateway-cache"] == "hit"
    use = (await _admin_tenants(gw))["acme"]["use"]["tenant"]
    assert use["requests_60s"] == 2 and use["tokens_60s"] == first.usage.total_tokens


async def test_per_model_limits_apply_on_top_of_the_tenants(upstream, gateway):
    up = await upstream("a")
    policy = _policy(up, {"rpm": 100, "models": {"gpt-test": {"rpm": 1}}})
    policy["backends"]["a"]["models"] = ["gpt-test", "other"]
    gw = await gateway(policy)
    client = gw.client(key=KEY)
    await client.chat.completions.create(model="gpt-test", messages=MSG)
    with pytest.raises(openai.RateLimitError, match="gpt-test"):
        await client.chat.completions.create(model="gpt-test", messages=MSG)
    await client.chat.completions.create(model="other", messages=MSG)


@pytest.mark.parametrize("quota", [
    {"tpm": 1000, "models": {"gpt-test": {"tokens_per_day": 1_000_000}}},  # the model scope has no tpm
    {"tpm": 100_000, "models": {"gpt-test": {"tpm": 1000}}},  # the model's tpm is the smaller one
])
async def test_per_model_scopes_are_settled_to_the_usage_whatever_their_tpm(upstream, gateway, quota):
    """A reservation capped by one scope's tpm (50,000 max_tokens under a tpm of 1,000) leaves
    every scope, the tenant's and the model's, holding exactly the tokens used once settled."""
    up = await upstream("a", tokens=4)
    gw = await gateway(_policy(up, quota))
    r = await gw.client(key=KEY).chat.completions.create(model="gpt-test", messages=MSG, max_tokens=50_000)
    used = r.usage.total_tokens
    use = (await _admin_tenants(gw))["acme"]["use"]
    for scope in ("tenant", "gpt-test"):
        assert (use[scope]["tokens_60s"], use[scope]["tokens_today"]) == (used, used), (scope, use)


async def test_spend_per_day_uses_backend_prices(upstream, gateway):
    up = await upstream("a", tokens=10)
    policy = _policy(up, {"spend_per_day_usd": 0.000001})
    policy["backends"]["a"]["price"] = {"input_per_mtok": 1000, "output_per_mtok": 1000}
    gw = await gateway(policy)
    client = gw.client(key=KEY)
    await client.chat.completions.create(model="gpt-test", messages=MSG)
    with pytest.raises(openai.RateLimitError, match="spend_per_day_usd"):
        await client.chat.completions.create(model="gpt-test", messages=MSG)
    assert 'gateway_spend_usd_total{tenant="acme"}' in await _metrics(gw)


async def test_requests_at_once_cannot_spend_past_the_daily_limit_together(upstream, gateway):
    """20 streams at once under a $10 daily limit (one answer's worth) were all admitted, and
    spent $200 (review helper's repro): a take reserves what its answer may cost at the dearest
    price that may apply, capped at the limit."""
    up = await upstream("a", tokens=1000, itl_ms=1)
    policy = _policy(up, {"spend_per_day_usd": 10})
    policy["backends"]["a"]["price"] = {"input_per_mtok": 10, "output_per_mtok": 10_000}  # $10 for 1,000 output tokens
    gw = await gateway(policy)

    async def one(http: aiohttp.ClientSession) -> int:
        body = {"model": "gpt-test", "messages": MSG, "stream": True}
        async with http.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as http:
        statuses = await asyncio.gather(*(one(http) for _ in range(20)))
    await gw.app[LIVE].runtime.quota.drain()
    spent = (await gw.app[LIVE].runtime.quota.usage("acme"))[""].day_spend_micro / 1e6
    assert statuses.count(200) == 1 and set(statuses) == {200, 429}, statuses
    assert 10 <= spent <= 10.01, spent


async def test_a_reload_that_changes_a_limit_takes_effect_on_the_next_request(upstream, gateway):
    up = await upstream("a")
    policy = _policy(up, {"rpm": 1})
    gw = await gateway(policy)
    client = gw.client(key=KEY)
    await client.chat.completions.create(model="gpt-test", messages=MSG)
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model="gpt-test", messages=MSG)
    policy["tenants"]["acme"]["quota"] = {"rpm": 5}
    gw.write_policy(policy)
    gen = gw.app[LIVE].runtime.generation
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/admin/reload", headers={"Authorization": f"Bearer {ADMIN}"}) as r:
            assert r.status == 200
    assert gw.app[LIVE].runtime.generation > gen
    await client.chat.completions.create(model="gpt-test", messages=MSG)


async def test_redis_down_degrades_to_local_limits_never_a_5xx(upstream, gateway):
    up = await upstream("a")
    # A Redis that refuses connections: every quota call fails at once.
    policy = _policy(up, {"rpm": 2}, store={"url": "redis://127.0.0.1:1/0", "timeout_ms": 50})
    gw = await gateway(policy)
    client = gw.client(key=KEY)
    statuses = []
    for _ in range(4):
        try:
            await client.chat.completions.create(model="gpt-test", messages=MSG)
            statuses.append(200)
        except openai.APIStatusError as exc:
            statuses.append(exc.status_code)
    assert statuses == [200, 200, 429, 429]  # the local limiter still holds the limit
    assert "gateway_quota_degraded_total" in (text := await _metrics(gw)) and "gateway_quota_degraded_total 0.0" not in text


async def test_quotas_are_shared_across_gateways_on_one_redis(upstream, gateway):
    up = await upstream("a")
    prefix_db = "redis://127.0.0.1:6379/12"  # its own DB: the cache tests flush 14
    policy = _policy(up, {"rpm": 5}, store={"url": prefix_db, "timeout_ms": 500, "quota_timeout_ms": 5000})
    policy["tenants"]["acme"]["key_sha256"] = [_digest(KEY)]
    tenant = "acme-" + uuid.uuid4().hex[:8]  # a fresh tenant name: fresh counters on the shared Redis
    policy["tenants"] = {tenant: policy["tenants"]["acme"]}
    gws = [await gateway(policy, name=f"p{i}.yaml") for i in range(3)]
    try:
        results = await asyncio.gather(
            *[gws[i % 3].client(key=KEY).chat.completions.with_raw_response.create(model="gpt-test", messages=MSG)
              for i in range(15)],
            return_exceptions=True,
        )
        assert sum(1 for r in results if not isinstance(r, Exception)) == 5
        assert up.stats.requests == 5
    finally:
        import redis.asyncio as aredis

        raw = aredis.Redis.from_url(prefix_db)
        keys = [k async for k in raw.scan_iter(match=f"{{gwq:{tenant}}}*")]
        if keys:
            await raw.delete(*keys)
        await raw.aclose()


async def test_cancelling_at_every_point_gives_every_lease_back(upstream, gateway):
    up = await upstream("a", ttft_ms=40, itl_ms=5, tokens=6)
    gw = await gateway(_policy(up, {"concurrency": 3, "tpm": 1_000_000}))
    auth = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        for stream in (False, True):
            body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": stream})

            async def one() -> None:
                async with http.post(gw.url + "/v1/chat/completions", data=body, headers=auth) as r:
                    await r.read()

            for delay_ms in range(0, 90, 3):  # before the quota stage, while upstream, mid-stream, after
                task = asyncio.create_task(one())
                await asyncio.sleep(delay_ms / 1000)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    deadline = time.monotonic() + 3
    while (await _admin_tenants(gw))["acme"]["use"]["tenant"]["inflight"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert (await _admin_tenants(gw))["acme"]["use"]["tenant"]["inflight"] == 0
    client = gw.client(key=KEY)
    await asyncio.gather(*[client.chat.completions.create(model="gpt-test", messages=MSG) for _ in range(3)])


async def _remaining_after(gw, path: str, body: dict) -> int:
    """x-ratelimit-remaining-tokens of one request: the tpm less what it reserved (nothing used before)."""
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + path, json={"model": "gpt-test", **body}, headers={"Authorization": f"Bearer {KEY}"}) as r:
            await r.read()
            assert r.status == 200, await r.text()
            return int(r.headers["x-ratelimit-remaining-tokens"])


@pytest.mark.parametrize(("path", "body", "answers"), [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 20, "n": 7}, 7),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 20}, 5),
    ("/v1/completions", {"prompt": [[1, 2], [3, 4], [5, 6]], "max_tokens": 20, "n": 2, "best_of": 4}, 12),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 20}, 1),  # one prompt of token ids
], ids=["chat n", "a list of prompts", "best_of per prompt", "token ids"])
async def test_a_request_reserves_for_every_answer_the_backend_generates(upstream, gateway, path, body, answers):
    # 10 concurrent requests of n=100 reserved for one answer each, and spent 10x the tpm.
    up = await upstream("a")
    gw = await gateway(_policy(up, {"tpm": 100_000}))
    reserved = 100_000 - await _remaining_after(gw, path, body)
    assert 20 * answers <= reserved < 20 * answers + 50, reserved  # and the prompt estimate


CJK = "请详细解释量子纠缠的原理" * 200  # 2,400 characters: ~1 token each, 600 by characters / 4


@pytest.mark.parametrize("kind", ["chat", "completions", "tools"])
async def test_text_in_other_scripts_is_reserved_by_its_width(upstream, gateway, kind):
    """A Chinese prompt was reserved characters / 4 (600 tokens for 2,400 characters a tokenizer
    makes ~2,400 tokens of): a tenant writing Chinese ran 4x past its tpm before settling caught up.
    The SDK sends UTF-8 (a body of \\u escapes is reserved more, never less)."""
    up = await upstream("a")
    gw = await gateway(_policy(up, {"tpm": 100_000}))
    client = gw.client(key=KEY)
    if kind == "completions":
        r: Any = await client.completions.with_raw_response.create(model="gpt-test", prompt=CJK, max_tokens=20)
    else:
        tools = [{"type": "function", "function": {"name": "f", "description": CJK}}] if kind == "tools" else openai.NOT_GIVEN
        r = await client.chat.completions.with_raw_response.create(
            model="gpt-test", messages=[{"role": "user", "content": "hi" if kind == "tools" else CJK}], max_tokens=20, tools=tools)
    reserved = 100_000 - int(r.headers["x-ratelimit-remaining-tokens"])
    assert 2_400 + 20 <= reserved < 2_400 + 20 + 100, reserved


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": MSG, "max_output_tokens": 0.5}),  # a Responses field: chat ignores it
    ("/v1/completions", {"prompt": "hi", "max_completion_tokens": 1}),  # a chat field: completions ignores it
], ids=["chat", "completions"])
async def test_a_limit_field_the_endpoint_ignores_reserves_nothing_less(upstream, gateway, path, body):
    up = await upstream("a")
    gw = await gateway(_policy(up, {"tpm": 100_000, "default_max_tokens": 700}))
    reserved = 100_000 - await _remaining_after(gw, path, body)
    assert 700 <= reserved < 750, reserved  # default_max_tokens: the backend generates up to its own limit


def _ceiling(policy: dict, **tops: int | None) -> dict:
    """The policy with backends' max_output_tokens set."""
    for name, top in tops.items():
        policy["backends"][name]["max_output_tokens"] = top
    return policy


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens", None])
async def test_an_answer_never_outgrows_what_one_reservation_holds(upstream, gateway, field):
    # A reservation is capped at the tpm so that a big request can ever run; the answer was not:
    # max_tokens 50,000 under a tpm of 1,000 and 3,000 a day spent 50,020 tokens at once.
    up = await upstream("a", tokens=50_000)
    gw = await gateway(_ceiling(_policy(up, {"tpm": 1000, "tokens_per_day": 3000}), a=16_384))
    limit = {} if field is None else {field: 50_000}
    r = await gw.client(key=KEY).chat.completions.create(model="gpt-test", messages=MSG, **limit)
    sent = up.stats.last_body
    room = sent.get(field or "max_completion_tokens")
    assert room == 1000, sent  # the tpm (one answer)
    assert r.usage.completion_tokens == room  # the backend stopped there
    use = (await _admin_tenants(gw))["acme"]["use"]["tenant"]
    assert use["tokens_60s"] <= 1000 + 30 and use["tokens_today"] == use["tokens_60s"]  # and the prompt


async def test_a_request_without_a_limit_gets_one_only_below_what_every_backend_accepts(upstream, gateway):
    # A limit above a model's maximum is a 400 at the provider (OpenAI: "max_tokens is too large:
    # 100000. This model supports at most 16384 completion tokens"): under a tpm of 100,000,
    # every request without a limit got one of 100,000 written.
    a, b = await upstream("a", tokens=5), await upstream("b", tokens=5)
    cases = [
        ({"a": None, "b": None}, None),  # unknown: nothing written, the backend's maximum bounds it
        ({"a": 16_384, "b": 16_384}, None),  # the tpm is above what they accept: their maximum is tighter
        ({"a": 16_384, "b": None}, None),  # one of the backends that may answer does not say
        ({"a": 200_000, "b": 150_000}, 100_000),  # below every backend's maximum: the tpm bounds it
    ]
    for tops, written in cases:
        policy = _policy(a, {"tpm": 100_000})
        policy["backends"]["b"] = {"url": b.url, "models": ["gpt-test"]}
        policy["models"]["gpt-test"]["backends"] = ["a", "b"]
        gw = await gateway(_ceiling(policy, **tops))
        # A limit the request set is lowered to the tpm whatever the backends say: a lower limit is always accepted.
        await gw.client(key=KEY).chat.completions.create(model="gpt-test", messages=MSG, max_tokens=500_000)
        assert a.stats.last_body["max_tokens"] == 100_000
        r = await gw.client(key=KEY).chat.completions.create(model="gpt-test", messages=MSG)
        sent = a.stats.last_body  # `ordered`: b is a candidate that never answers here
        assert r.choices and sent.get("max_completion_tokens") == written, (tops, sent)
        assert "max_tokens" not in sent


async def test_a_long_prompt_still_runs_and_many_answers_share_the_bound(upstream, gateway):
    # The prompt estimate reads an image's bytes as text: a request whose estimate alone passes
    # the tpm is not refused (its reservation is the tpm; what it used is charged once settled).
    up = await upstream("a")
    gw = await gateway(_ceiling(_policy(up, {"tpm": 1000}), a=4096))
    long = [{"role": "user", "content": "word " * 6000}]  # ~7,500 tokens by the estimate
    r = await gw.client(key=KEY).chat.completions.create(model="gpt-test", messages=long)
    assert r.choices and up.stats.last_body["max_completion_tokens"] == 1000
    gw = await gateway(_policy(up, {"tpm": 1000}))  # a fresh window
    r = await gw.client(key=KEY).chat.completions.create(model="gpt-test", messages=MSG, n=128, max_tokens=50)
    assert up.stats.last_body["max_tokens"] == 1000 // 128  # each of the 128 answers' share of the tpm
    assert r.choices


class SlowRedis:
    """A TCP hop to the machine's Redis that holds back Redis's replies by `delay_s` (0: none):
    the network between a replica and a slow or distant Redis, without touching Redis itself."""

    def __init__(self, port: int = 6379) -> None:
        self.target = port
        self.delay_s = 0.0
        self.server: asyncio.Server | None = None
        self.port = 0
        self.writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> "SlowRedis":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self.writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, slow: bool) -> None:
            try:
                while data := await src.read(65536):
                    if slow and self.delay_s:
                        await asyncio.sleep(self.delay_s)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))


async def test_a_client_that_leaves_while_its_quota_take_is_on_the_wire_gives_its_lease_back_at_once(upstream, gateway):
    # Its handler is cancelled mid round trip; the script ran on Redis all the same. Before, its
    # concurrency lease (and its reserved tokens) stayed taken until its deadline + 10 s.
    up = await upstream("a")
    db = 12  # its own DB: the cache tests flush 14
    tenant = "acme-" + uuid.uuid4().hex[:8]  # fresh counters on the shared Redis
    async with SlowRedis() as hop:
        policy = _policy(up, {"concurrency": 1, "tpm": 100_000},
                         store={"url": f"redis://127.0.0.1:{hop.port}/{db}", "timeout_ms": 2000, "quota_timeout_ms": 2000})
        policy["tenants"] = {tenant: policy["tenants"]["acme"]}
        gw = await gateway(policy)
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"model": "gpt-test", "messages": MSG}
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth) as r:
                    assert r.status == 200  # the connections to Redis are up
                    used = (await r.json())["usage"]["total_tokens"]
                await asyncio.sleep(0.1)  # its settle is back too (one connection carries the quota's calls)
                hop.delay_s = 0.4
                with pytest.raises(TimeoutError):
                    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth,
                                         timeout=aiohttp.ClientTimeout(total=0.15)) as r:
                        await r.read()
                await asyncio.sleep(0.5)  # the take's reply came; the lease went straight back
                hop.delay_s = 0.0
                async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth) as r:
                    assert r.status == 200, await r.text()  # before: 429, concurrency held by the one that left
                    used += (await r.json())["usage"]["total_tokens"]
                use = (await _admin_tenants(gw))[tenant]["use"]["tenant"]
            assert up.stats.requests == 2
            assert use["inflight"] == 0 and use["tokens_60s"] == used  # the one that left took nothing for long
        finally:
            import redis.asyncio as aredis

            raw = aredis.Redis.from_url(f"redis://127.0.0.1:6379/{db}")
            keys = [k async for k in raw.scan_iter(match=f"{{gwq:{tenant}}}*")]
            if keys:
                await raw.delete(*keys)
            await raw.aclose()


async def test_a_take_that_times_out_on_a_stalled_redis_is_reversed_there(upstream, gateway):
    """Redis stalls for ~0.5 s (a slow script, a big key's DEL, a fork): the gateway's take times
    out and the request goes on this process's counters, but the take still ran on Redis, and its
    lease stayed until the request's deadline + 10 s: a tenant with `concurrency: 1` was refused
    for ~10 minutes (review helper's repro). The take is reversed there once Redis answers."""
    import redis.asyncio as aredis

    from tests.procs import redis_server

    up = await upstream("a", tokens=4)
    async with redis_server() as url:
        policy = _policy(up, {"concurrency": 1, "tpm": 100_000})
        policy["store"] = {"url": url, "quota_timeout_ms": 250}
        gw = await gateway(policy)
        q = gw.app[LIVE].runtime.quota
        r = aredis.from_url(url)
        client = gw.client(key=KEY)
        await client.chat.completions.create(model="gpt-test", messages=MSG)  # Redis answers
        t0 = time.perf_counter()
        await r.eval("local i=0 while i<3000000 do i=i+1 end return i", 0)
        loops = int(3_000_000 * 0.6 / max(1e-3, time.perf_counter() - t0))  # ~0.6 s of Redis busy
        busy = asyncio.ensure_future(r.eval(f"local i=0 while i<{loops} do i=i+1 end return i", 0))
        await asyncio.sleep(0.05)
        await client.chat.completions.create(model="gpt-test", messages=MSG)  # served on this process's counters
        await busy
        for _ in range(40):  # the reversal runs once Redis answers again (within a few tries)
            if (await q.usage("acme"))[""].inflight == 0:
                break
            await asyncio.sleep(0.25)
        assert (await q.usage("acme"))[""].inflight == 0
        for _ in range(3):
            await client.chat.completions.create(model="gpt-test", messages=MSG)  # not refused: concurrency 1 is free
        await r.aclose()


@pytest.mark.parametrize("stream", [False, True])
async def test_every_attempt_that_read_the_prompt_is_charged_its_prompt(upstream, gateway, stream):
    """A prompt whose prefill outlasts the cold first-token deadline on the first candidates was
    read by every backend and charged once: 10,053 tokens for three readings (review helper's
    repro). Each attempt after which a backend had read the prompt costs its prompt."""
    ups = [await upstream(f"u{i}", tokens=20, prompt_ms_per_kchar=40) for i in range(3)]  # ~1.6 s to prefill 40,000 chars
    policy = simple_policy(*ups, cache={"enabled": False})
    policy["models"]["gpt-test"]["strategy"] = "ordered"
    policy["routing"] = {"cold_first_token_ms": 1000}
    policy["tenants"] = {"acme": {"key_sha256": [_digest(KEY)], "quota": {"tpm": 1_000_000}}}
    gw = await gateway(policy)
    q = gw.app[LIVE].runtime.quota
    big = "word " * 8000  # ~10,000 tokens
    async with aiohttp.ClientSession() as http:
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": big}], "stream": stream, "max_tokens": 20}
        async with http.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
    await q.drain()
    charged = (await q.usage("acme"))[""].window_tokens
    reads = sum(u.stats.requests for u in ups)
    assert charged >= reads * 10_000, (reads, charged)
    assert reads >= 2 or not stream  # a stream's first token is due within 1 s: it failed over (a whole answer had longer)


@pytest.mark.parametrize("how", ["base_left_mid_stream", "conversation_items", "background_base", "items_added_later",
                                 "item_reference"])
async def test_a_follow_up_is_charged_the_context_even_when_no_usage_measured_it(upstream, gateway, how):
    """Context was recorded from an answer's usage only: follow-ups of a base whose stream was left
    before its usage, of a conversation made with items, or of a background response (answered
    `queued`) were charged their ~25 new tokens of a 10,000-token context (review helper's
    repros); so were those of a conversation whose items were added after it was made, and
    requests naming a stored item (`item_reference`). Without usage the context is what the base
    was charged; a conversation's items count, and a stored item's size."""
    import re

    up = await upstream("c", tokens=200, itl_ms=5)
    policy = _policy(up, {"tpm": 1_000_000})
    policy["server"] = {"heartbeat_after_ms": 60_000}
    gw = await gateway(policy)
    q = gw.app[LIVE].runtime.quota
    big = "word " * 8000  # ~10,000 tokens
    hdr = {"Authorization": f"Bearer {KEY}"}

    async def leave_after_first_delta(http: aiohttp.ClientSession, body: dict) -> bytes:
        return await left_after_first_delta(http, gw.url, body, hdr)

    async def charged(work: Any) -> tuple[int, Any]:
        await q.drain()
        before = (await q.usage("acme"))[""].window_tokens
        out = await work
        for _ in range(20):  # the context's record is written as the request ends
            await asyncio.sleep(0.05)
        await q.drain()
        return (await q.usage("acme"))[""].window_tokens - before, out

    async with aiohttp.ClientSession() as http:
        if how == "items_added_later":
            async def make() -> str:
                async with http.post(gw.url + "/v1/conversations", headers=hdr, json={}) as r:
                    assert r.status == 200, await r.text()
                    cid = (await r.json())["id"]
                async with http.post(gw.url + f"/v1/conversations/{cid}/items", headers=hdr,
                                     json={"items": [{"type": "message", "role": "user", "content": big}]}) as r:
                    assert r.status == 200, await r.text()
                return cid
            _, cid = await charged(make())
            ref: dict[str, Any] = {"conversation": cid}
        elif how == "item_reference":
            async def make() -> str:
                async with http.post(gw.url + "/v1/responses", headers=hdr, json={"model": "gpt-test", "input": big}) as r:
                    assert r.status == 200, await r.text()
                    rid = (await r.json())["id"]
                async with http.get(gw.url + f"/v1/responses/{rid}/input_items", headers=hdr) as r:  # the caller sees its items
                    assert r.status == 200, await r.text()
                    return (await r.json())["data"][0]["id"]
            _, iid = await charged(make())
            ref = {"input": [{"type": "item_reference", "id": iid}, {"role": "user", "content": "and then?"}]}
        elif how == "conversation_items":
            async def make() -> str:
                async with http.post(gw.url + "/v1/conversations", headers=hdr,
                                     json={"items": [{"type": "message", "role": "user", "content": big}]}) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["id"]
            _, cid = await charged(make())
            ref = {"conversation": cid}
        elif how == "background_base":
            async def make() -> str:
                body = {"model": "gpt-test", "input": big, "background": True, "max_output_tokens": 16}
                async with http.post(gw.url + "/v1/responses", headers=hdr, json=body) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["id"]
            _, rid = await charged(make())
            await asyncio.sleep(1.5)  # the backend completes it
            ref = {"previous_response_id": rid}
        else:
            buf = (await charged(leave_after_first_delta(http, {"model": "gpt-test", "input": big, "stream": True})))[1]
            ref = {"previous_response_id": re.search(rb'"id":"(resp_[^"]+)"', buf).group(1).decode()}
        for _ in range(2):  # and each follow-up's own follow-ups: the chain keeps its context
            cost, buf = await charged(leave_after_first_delta(http, {"model": "gpt-test", "input": "and then?", "stream": True, **ref}))
            assert cost >= 10_000, cost
            if "previous_response_id" in ref:
                ref = {"previous_response_id": re.search(rb'"id":"(resp_[^"]+)"', buf).group(1).decode()}


async def test_a_follow_ups_context_is_reserved_before_it_reaches_a_backend(upstream, gateway):
    """The stored context joined a follow-up's prompt only after its reservation: a tenant with
    5,000 tokens of its tpm left had a follow-up of a 10,000-token response admitted, read by the
    backend and settled past the limit. It is refused at admission now, and no backend reads it."""
    up = await upstream("c", tokens=4)
    gw = await gateway(_policy(up, {"tpm": 15_000}))
    q = gw.app[LIVE].runtime.quota
    hdr = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/responses", headers=hdr,
                             json={"model": "gpt-test", "input": "word " * 8000, "max_output_tokens": 16}) as r:
            assert r.status == 200, await r.text()
            base = await r.json()
        await q.drain()
        used = (await q.usage("acme"))[""].window_tokens
        assert 9_000 < used < 11_000, used
        body = {"model": "gpt-test", "input": "and then?", "previous_response_id": base["id"], "max_output_tokens": 16}
        async with http.post(gw.url + "/v1/responses", headers=hdr, json=body) as r:
            assert r.status == 429, await r.text()
            err = (await r.json())["error"]
    assert "tpm" in err["message"], err
    assert up.stats.requests == 1  # the follow-up reached no backend


async def test_a_hedges_loser_is_charged_the_prompt_it_read(upstream, gateway):
    """The loser of a hedge is cancelled by its rival's claim: it read the 10,000-token prompt
    and was not charged it (review of the change)."""
    a = await upstream("a", mode="stall")
    b = await upstream("b", ttft_ms=5, tokens=3)
    policy = simple_policy(a, b, cache={"enabled": False})
    policy["models"]["gpt-test"]["strategy"] = "ordered"
    policy["models"]["gpt-test"]["hedge"] = {"max_extra_pct": 50, "min_delay_ms": 50, "default_delay_ms": 100}
    policy["backends"]["a"]["timeouts"] = {"first_token_ms": 20000}
    policy["tenants"] = {"acme": {"key_sha256": [_digest(KEY)], "quota": {"tpm": 1_000_000}}}
    gw = await gateway(policy)
    q = gw.app[LIVE].runtime.quota
    async with aiohttp.ClientSession() as http:
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": "word " * 8000}], "stream": True, "max_tokens": 20}
        async with http.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, json=body) as r:
            assert r.status == 200 and r.headers["x-gateway-backend"] == "b", await r.text()
            await r.read()
    await q.drain()
    assert a.stats.requests == 1 and b.stats.requests == 1
    assert (await q.usage("acme"))[""].window_tokens >= 2 * 9_000


async def test_shutdown_settles_a_request_that_began_before_a_reload(upstream, gateway):
    """Shutdown drained the settles of the newest runtime's quota only: a stream begun before a
    reload settled through the old one, the store closed under it and its concurrency lease stayed
    held in Redis until it expired (review helper's repro). Every quota put in force is drained."""
    import redis.asyncio as aredis

    from gateway.web.keys import RELOADER
    from tests.procs import redis_server

    async with redis_server() as url:
        up = await upstream("a", tokens=10, itl_ms=100)  # a ~1 s stream

        def policy(rpm: int) -> dict[str, Any]:
            p = _policy(up, {"concurrency": 5, "rpm": rpm})
            p["store"], p["reload"] = {"url": url, "quota_timeout_ms": 3000}, {"watch": False}
            return p

        gw = await gateway(policy(1000))
        r = aredis.from_url(url)
        async with aiohttp.ClientSession() as http:
            body = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 200
                gw.write_policy(policy(2000))
                ok, why = await gw.app[RELOADER].reload("test")
                assert ok, why
                # Redis stalls for writes as the stream ends (a blip, a failover): its settle waits.
                await r.execute_command("CLIENT", "PAUSE", "1000", "WRITE")
                await resp.read()
        await asyncio.sleep(0.1)
        await gw.runner.cleanup()  # the app's shutdown, after the drain of requests
        held = sum([await r.zcard(k) for k in await r.keys("*{gwq:acme}*:c")])
        await r.aclose()
    assert held == 0, f"{held} concurrency lease(s) left held in Redis after shutdown"


async def test_a_streamed_answers_stored_item_is_charged_its_whole_size_when_named(upstream, gateway):
    """A stream's output items were recorded at `response.output_item.added`, still empty (~22
    tokens), and never again: naming one later was charged that, not its size (review of the
    change). The size is recorded again as the item grows."""
    up = await upstream("c", tokens=3000, itl_ms=0)
    gw = await gateway(_policy(up, {"tpm": 1_000_000}))
    q = gw.app[LIVE].runtime.quota
    hdr = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as http:
        iid = None
        async with http.post(gw.url + "/v1/responses", headers=hdr, json={"model": "gpt-test", "input": "tell me", "stream": True}) as r:
            async for line in r.content:
                if line.startswith(b"data: ") and b'"response.completed"' in line:
                    iid = orjson.loads(line[6:])["response"]["output"][0]["id"]
        assert iid is not None
        size = await gw.app[LIVE].runtime.affinity.context(iid)
        assert size > 3000, size  # 3,000 words: its size, not the empty item's
        await q.drain()
        before = (await q.usage("acme"))[""].window_tokens
        up.set(itl_ms=5)  # the follow-up's client leaves long before its usage would come
        body = {"model": "gpt-test", "stream": True, "input": [{"type": "item_reference", "id": iid}, {"role": "user", "content": "and?"}]}
        await left_after_first_delta(http, gw.url, body, hdr)
    await asyncio.sleep(0.2)
    await q.drain()
    assert (await q.usage("acme"))[""].window_tokens - before >= size
