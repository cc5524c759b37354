"""Recall first, whatever text the classifier reads: a prompt far over the long-prompt rule is
complex (and reserves its tokens) when it hides behind what the classifier would read instead.
Real sockets: the gateway, two fake upstreams (small, big), the prompt estimate in the quota's
x-ratelimit headers."""

from __future__ import annotations

import hashlib

import aiohttp
import orjson

KEY = "sk-acme-hidden-0123456789abcdef"
HUGE = "The quick brown fox jumps over the lazy dog. " * 4000  # ~180,000 characters, ~45,000 tokens


def _policy(small, big):
    return {
        "version": 1, "cache": {"enabled": False},
        "backends": {"small": {"url": small.url, "models": ["tiny"]}, "big": {"url": big.url, "models": ["large"]}},
        "models": {"auto": {"simple": ["small"], "complex": ["big"]}},
        "tenants": {"acme": {"key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], "quota": {"tpm": 1_000_000}}},
    }


async def _post(gw, path, body):
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + path, data=orjson.dumps(body),
                             headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}) as r:
            return r.status, dict(r.headers), await r.read()


async def test_a_completions_prompt_behind_a_messages_field_is_read(upstream, gateway):
    """The classifier read `messages` whatever the endpoint: a 180,000-character completions
    prompt beside `"messages": [{"content": "hi"}]` was simple, went to the small model and
    reserved 6 tokens (review helper's repro)."""
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway(_policy(small, big))
    body = {"model": "auto", "max_tokens": 5, "prompt": HUGE, "messages": [{"role": "user", "content": "hi"}]}
    status, headers, raw = await _post(gw, "/v1/completions", body)
    assert status == 200, raw
    assert (headers["x-gateway-class"], headers["x-gateway-backend"]) == ("complex", "big")
    assert 1_000_000 - int(headers["x-ratelimit-remaining-tokens"]) >= len(HUGE) // 4 * 0.9


async def test_a_prompt_long_in_its_tool_calls_is_complex(upstream, gateway):
    """The long-prompt rule read the classifier's count of the messages' text: 45,000 tokens of an
    earlier turn's tool-call arguments went simple to the small model (review helper's repro).
    The rule reads the whole prompt estimate."""
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway(_policy(small, big))
    body = {"model": "auto", "max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "note", "arguments": orjson.dumps({"t": HUGE}).decode()}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "user", "content": "thanks"},
    ]}
    status, _, raw = await _post(gw, "/v1/route/explain", body)
    why = orjson.loads(raw)
    assert status == 200 and why["prompt_tokens"] > 40_000, why
    assert (why["class"], why["rule"], why["stage"]) == ("complex", "prompt_tokens", "rule"), why
    status, headers, _ = await _post(gw, "/v1/chat/completions", body)
    assert status == 200 and (headers["x-gateway-class"], headers["x-gateway-backend"]) == ("complex", "big")


async def test_a_long_prompt_in_another_script_is_long(upstream, gateway):
    """Characters / 4 read 2,000 Chinese characters (~2,000 tokens) as 500: past the long-prompt
    rule's 1,500, it went simple to the small model and reserved a quarter of what it used."""
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway(_policy(small, big))
    body = {"model": "auto", "max_tokens": 5, "messages": [{"role": "user", "content": "你好，请问今天天气怎么样？" * 160}]}
    status, _, raw = await _post(gw, "/v1/route/explain", body)
    why = orjson.loads(raw)
    assert status == 200 and why["prompt_tokens"] >= 1_900, why
    assert (why["class"], why["rule"]) == ("complex", "prompt_tokens"), why
    status, headers, _ = await _post(gw, "/v1/chat/completions", body)
    assert status == 200 and (headers["x-gateway-class"], headers["x-gateway-backend"]) == ("complex", "big")
    assert 1_000_000 - int(headers["x-ratelimit-remaining-tokens"]) >= 1_900
