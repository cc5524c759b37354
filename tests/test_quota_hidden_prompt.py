"""What a tenant is charged for what it sends, wherever the body carries it (review helper's
repros): a prompt in parts the classifier does not read is reserved whole and complex; every
read of a prompt is priced in spend; a background Response under daily limits is charged what it
may generate; a malformed body on POST /v1/conversations spends rpm. Real sockets: the gateway
and fake upstreams, the quota's figures from its x-ratelimit headers and its counters."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.web.keys import LIVE
from tests.conftest import simple_policy
from tests.test_quota_e2e import left_after_first_delta

KEY = "sk-acme-hidden-0123456789abcdef"
HDR = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
BIG = "word " * 40000  # 200,000 characters: ~50,000 tokens
IMAGE = "data:image/png;base64," + "iVBORw0KGgo" * 40000  # 440,000 characters of an image's bytes

# Responses input items whose text the classifier did not read (it was classed simple on "hi",
# sent to the small model and reserved 6-7 tokens).
ITEMS: dict[str, list[dict[str, Any]]] = {
    "function_call_output_list": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": BIG}]},
        {"role": "user", "content": "hi"},
    ],
    "custom_tool_call_output": [
        {"type": "custom_tool_call", "call_id": "c1", "name": "f", "input": "x"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": BIG},
        {"role": "user", "content": "hi"},
    ],
    "reasoning_summary": [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": BIG}]},
        {"role": "user", "content": "hi"},
    ],
    "input_file": [{"role": "user", "content": [
        {"type": "input_file", "filename": "a.txt", "file_data": "data:text/plain;base64," + "QUFB" * 50000},
        {"type": "input_text", "text": "hi"}]}],
    # a kind the classifier's view does not model at all: unread, so complex
    "mcp_call_output": [
        {"type": "mcp_call", "id": "mcp_1", "server_label": "docs", "name": "fetch", "arguments": "{}", "output": BIG},
        {"role": "user", "content": "hi"},
    ],
}

HIDDEN: dict[str, tuple[str, dict[str, Any]]] = {
    **{kind: ("/v1/responses", {"input": items, "max_output_tokens": 5, "store": False}) for kind, items in ITEMS.items()},
    "responses_prompt_variables": ("/v1/responses", {"input": "hi", "prompt": {"id": "pmpt_1", "variables": {"doc": BIG}},
                                                     "max_output_tokens": 5}),
    "chat_refusal_part": ("/v1/chat/completions", {"max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": BIG}]},
        {"role": "user", "content": "hi"}]}),
}


def _split(small, big, quota: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "version": 1, "cache": {"enabled": False},
        "backends": {"small": {"url": small.url, "models": ["tiny"]}, "big": {"url": big.url, "models": ["large"]}},
        "models": {"auto": {"simple": ["small"], "complex": ["big"]}},
        "tenants": {"acme": {"key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "quota": quota or {"tpm": 1_000_000}}},
    }


async def _post(gw, path: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + path, data=orjson.dumps(body), headers=HDR) as r:
            return r.status, dict(r.headers), await r.read()


def _reserved(headers: dict[str, str]) -> int:
    return 1_000_000 - int(headers["x-ratelimit-remaining-tokens"])


@pytest.mark.parametrize("kind", list(HIDDEN))
async def test_a_prompt_the_classifier_does_not_read_is_reserved_whole_and_complex(upstream, gateway, kind):
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway(_split(small, big))
    path, body = HIDDEN[kind]
    status, headers, raw = await _post(gw, path, {"model": "auto", **body})
    assert status == 200, raw
    assert (headers["x-gateway-class"], headers["x-gateway-backend"]) == ("complex", "big"), kind
    assert _reserved(headers) >= 45_000, (kind, _reserved(headers))
    assert small.stats.requests == 0


@pytest.mark.parametrize("kind", ["input_file", "mcp_call_output"])
async def test_a_prompt_mostly_in_parts_the_classifier_skips_is_unread(upstream, gateway, kind):
    """The classifier reads "hi"; the body carries ~50,000 tokens it does not read: the rule
    `unread_prompt` makes it complex, whatever the part it read would score."""
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway(_split(small, big))
    status, _, raw = await _post(gw, "/v1/route/explain", {"model": "auto", "input": ITEMS[kind], "max_output_tokens": 5})
    why = orjson.loads(raw)
    assert status == 200, why
    assert (why["class"], why["rule"], why["stage"]) == ("complex", "unread_prompt", "rule"), why
    assert why["prompt_tokens"] >= 45_000, why


@pytest.mark.parametrize("kind", ["function_call_output_list", "custom_tool_call_output", "mcp_call_output"])
async def test_a_stream_left_early_is_charged_the_prompt_the_backend_read(upstream, gateway, kind):
    """No usage comes back (the client leaves after the first delta): the prompt estimate is
    what is charged, and it is the whole body's, not the 2 tokens the classifier read."""
    small, big = await upstream("small", tokens=200, itl_ms=5), await upstream("big", tokens=200, itl_ms=5)
    gw = await gateway(_split(small, big))
    quota = gw.app[LIVE].runtime.quota
    body = {"model": "auto", "input": ITEMS[kind], "stream": True, "store": False}
    async with aiohttp.ClientSession() as http:
        await left_after_first_delta(http, gw.url, body, {"Authorization": f"Bearer {KEY}"})
    await asyncio.sleep(0.2)
    await quota.drain()
    charged = (await quota.usage("acme"))[""].window_tokens
    assert charged >= 45_000, (kind, charged)
    assert (small.stats.requests, big.stats.requests) == (0, 1)


async def test_a_base64_image_counts_a_bounded_estimate_not_its_characters(upstream, gateway):
    """An image's data URL is 440,000 characters (110,000 tokens as text); a model reads its
    pixels: it counts at most 2,048 tokens, and it does not make the prompt unread."""
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway(_split(small, big))
    chat = {"model": "auto", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What colour is the sky in this photo?"}, {"type": "image_url", "image_url": {"url": IMAGE}}]}]}
    responses = {"model": "auto", "max_output_tokens": 5, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What colour is the sky in this photo?"}, {"type": "input_image", "image_url": IMAGE}]}]}
    for body in (chat, responses):
        status, _, raw = await _post(gw, "/v1/route/explain", body)
        why = orjson.loads(raw)
        assert status == 200, why
        assert 2_048 <= why["prompt_tokens"] < 2_300 and why["rule"] != "unread_prompt", why


async def test_a_base64_image_on_a_route_that_does_not_split_counts_the_same(upstream, gateway):
    up = await upstream("a")
    policy = simple_policy(up, cache={"enabled": False})
    policy["tenants"] = {"acme": {"key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "quota": {"tpm": 1_000_000}}}
    gw = await gateway(policy)
    body = {"model": "gpt-test", "max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": IMAGE}}]}]}
    status, headers, raw = await _post(gw, "/v1/chat/completions", body)
    assert status == 200, raw
    assert 2_048 <= _reserved(headers) - 5 < 2_300, _reserved(headers)


B64 = "iVBORw0KGgo" * 40000  # 440,000 characters: 110,000 tokens as text
MEDIA = {
    "chat_audio": ("/v1/chat/completions", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Transcribe this."}, {"type": "input_audio", "input_audio": {"data": B64, "format": "wav"}}]}]}),
    "messages_image": ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": B64}},
        {"type": "text", "text": "What is in this picture?"}]}]}),
    "responses_image_in_a_function_output": ("/v1/responses", {"max_output_tokens": 5, "store": False, "input": [
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": "data:image/png;base64," + B64}]},
        {"role": "user", "content": "What is on the screen?"}]}),
}


@pytest.mark.parametrize("kind", list(MEDIA))
async def test_base64_media_count_by_what_they_are_in_every_api(upstream, gateway, kind):
    """An image counts at most 2,048 tokens, audio a token per 1,024 characters of its base64
    (~40 a second of WAV), not 110,000 tokens of characters."""
    up = await upstream("a")
    policy = simple_policy(up, cache={"enabled": False})
    policy["tenants"] = {"acme": {"key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "quota": {"tpm": 1_000_000}}}
    gw = await gateway(policy)
    path, body = MEDIA[kind]
    status, headers, raw = await _post(gw, path, {"model": "gpt-test", **body})
    assert status == 200, raw
    assert 400 <= _reserved(headers) < 2_300, (kind, _reserved(headers))


async def test_every_read_of_the_prompt_is_priced_in_spend(upstream, gateway):
    """Three backends read a ~10,000-token prompt (the first two too slow to their first token):
    tokens counted the three reads, spend only the answer's usage. Each read costs ~$1."""
    ups = [await upstream(f"u{i}", tokens=20, prompt_ms_per_kchar=40) for i in range(3)]  # ~1.6 s prefill of 40,000 chars
    policy = simple_policy(*ups, cache={"enabled": False})
    policy["routing"] = {"cold_first_token_ms": 1000}
    for u in ups:
        policy["backends"][u.name]["price"] = {"input_per_mtok": 100, "output_per_mtok": 100}
    policy["tenants"] = {"acme": {"key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()],
                                  "quota": {"tpm": 1_000_000, "spend_per_day_usd": 1000}}}
    gw = await gateway(policy)
    q = gw.app[LIVE].runtime.quota
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": "word " * 8000}], "stream": True, "max_tokens": 20}
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", headers=HDR, json=body) as r:
            assert r.status == 200, await r.text()
            await r.read()
    await q.drain()
    use = (await q.usage("acme"))[""]
    reads = sum(u.stats.requests for u in ups)
    assert reads >= 2
    assert use.day_spend_micro >= reads * 900_000, (reads, use.window_tokens, use.day_spend_micro)


def _responses(up, quota: dict[str, Any]) -> dict[str, Any]:
    policy = simple_policy(up, cache={"enabled": False})
    policy["tenants"] = {"acme": {"key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "quota": quota}}
    return policy


async def _background(gw, body: dict[str, Any]) -> dict[str, Any]:
    status, _, raw = await _post(gw, "/v1/responses", {"model": "gpt-test", "input": "hi", "background": True, **body})
    answer = orjson.loads(raw)
    assert status == 200 and answer["status"] in ("queued", "in_progress"), answer
    return answer


@pytest.mark.parametrize("limit", [{"tokens_per_day": 1_000_000}, {"rpm": 1000, "tokens_per_day": 1_000_000},
                                   {"spend_per_day_usd": 1000}])
async def test_a_background_response_without_a_limit_is_bounded_to_what_it_is_charged(upstream, gateway, limit):
    """No tpm: nothing bounded what a background response generates, its usage never comes back,
    and it was charged default_max_tokens (1,024) however much it generated. Now the request
    gets that limit (at most what its backends accept), and is charged it."""
    a = await upstream("a", tokens=20_000)
    policy = _responses(a, limit)
    policy["backends"][a.name]["max_output_tokens"] = 32_000
    policy["backends"][a.name]["price"] = {"input_per_mtok": 1, "output_per_mtok": 1}
    gw = await gateway(policy)
    await _background(gw, {})
    assert a.stats.last_body.get("max_output_tokens") == 1024
    use = (await gw.app[LIVE].runtime.quota.usage("acme"))[""]
    assert use.day_tokens >= 1024 or use.day_spend_micro >= 1024, use


async def test_a_background_response_is_bounded_by_its_backends_ceiling(upstream, gateway):
    a = await upstream("a", tokens=20_000)
    policy = _responses(a, {"tokens_per_day": 1_000_000})
    policy["backends"][a.name]["max_output_tokens"] = 500  # below default_max_tokens
    gw = await gateway(policy)
    await _background(gw, {})
    assert a.stats.last_body.get("max_output_tokens") == 500
    assert (await gw.app[LIVE].runtime.quota.usage("acme"))[""].day_tokens >= 500


async def test_a_background_response_with_its_own_limit_is_charged_it(upstream, gateway):
    """Its own limit is what the backend may generate: charged whole (at most the backends' ceiling)."""
    a = await upstream("a", tokens=20_000)
    policy = _responses(a, {"tokens_per_day": 1_000_000})
    policy["backends"][a.name]["max_output_tokens"] = 32_000
    gw = await gateway(policy)
    quota = gw.app[LIVE].runtime.quota
    await _background(gw, {"max_output_tokens": 20_000})
    assert a.stats.last_body.get("max_output_tokens") == 20_000
    assert (await quota.usage("acme"))[""].day_tokens >= 20_000
    await _background(gw, {"max_output_tokens": 100_000})  # above what the backend accepts: its ceiling
    day = (await quota.usage("acme"))[""].day_tokens
    assert 52_000 <= day < 60_000, day


async def test_a_background_response_without_a_known_ceiling_gets_the_default_limit(upstream, gateway):
    a = await upstream("a", tokens=20_000)
    policy = _responses(a, {"tokens_per_day": 1_000_000, "default_max_tokens": 700})
    gw = await gateway(policy)
    await _background(gw, {})
    assert a.stats.last_body.get("max_output_tokens") == 700
    assert (await gw.app[LIVE].runtime.quota.usage("acme"))[""].day_tokens >= 700


async def test_malformed_conversation_bodies_spend_rpm(upstream, gateway):
    """A 400 for its body takes one request of rpm (tenants.md), so a flood of bad bodies is
    refused early: POST /v1/conversations parsed first and cost nothing."""
    a = await upstream("a")
    gw = await gateway(_responses(a, {"rpm": 3}))
    statuses = []
    async with aiohttp.ClientSession() as http:
        for _ in range(6):
            async with http.post(gw.url + "/v1/conversations", data=b"[" * 1000 + b"x", headers=HDR) as r:
                statuses.append(r.status)
    use = (await gw.app[LIVE].runtime.quota.usage("acme"))[""]
    assert statuses == [400, 400, 400, 429, 429, 429] and use.window_requests == 3, (statuses, use.window_requests)
