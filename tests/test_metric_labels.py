"""Metric label values come from the policy, never from what a client sends: bounded series."""

from __future__ import annotations

import hashlib

import aiohttp
import openai
import pytest

from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]


async def _metrics(gw) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            return await r.text()


def _series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


async def test_junk_model_names_share_one_other_series(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    client = gw.client()
    await client.chat.completions.create(model="gpt-test", messages=MSG)
    for i in range(50):
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model=f"junk-{i}", messages=MSG)
    text = await _metrics(gw)
    series = _series(text, "gateway_requests_total")
    assert len(series) == 2, series
    assert any('model="other"' in s and 'code="404"' in s and s.endswith(" 50.0") for s in series)
    assert not any("junk" in line for line in text.splitlines())


async def test_unclassified_requests_count_as_class_none_and_classified_ones_by_class(upstream, gateway):
    up = await upstream("a")
    policy = simple_policy(up)
    policy["models"]["auto"] = {"simple": ["a"], "complex": ["a"]}
    gw = await gateway(policy)
    client = gw.client()
    await client.chat.completions.create(model="gpt-test", messages=MSG)
    r = await client.chat.completions.with_raw_response.create(model="auto", messages=MSG)
    text = await _metrics(gw)
    series = _series(text, "gateway_requests_total")
    assert any('model="gpt-test"' in s and 'class="none"' in s for s in series)
    assert any('model="auto"' in s and f'class="{r.headers["x-gateway-class"]}"' in s for s in series)
    assert 'gateway_classified_total{class="none"}' not in text


async def test_pseudo_backends_never_appear_in_per_backend_failure_series(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up, cache={"ttl_s": 60}))
    client = gw.client()
    for _ in range(2):  # a miss, then a hit (backend "cache")
        await client.chat.completions.create(model="gpt-test", messages=MSG, temperature=0)
    with pytest.raises(openai.NotFoundError):  # backend "none"
        await client.chat.completions.create(model="nope", messages=MSG)
    text = await _metrics(gw)
    assert any('backend="cache"' in s for s in _series(text, "gateway_requests_total"))
    for name in ("gateway_failovers_total", "gateway_backend_ejections_total", "gateway_upstream_errors_total",
                 "gateway_stream_malformed_chunks_total", "gateway_ttft_seconds_bucket"):
        for line in _series(text, name):
            assert 'backend="cache"' not in line and 'backend="none"' not in line, line


async def test_tenant_names_in_labels_are_a_policy_choice(upstream, gateway):
    up = await upstream("a")
    key = "sk-" + "k" * 40
    digest = hashlib.sha256(key.encode()).hexdigest()
    policy = simple_policy(up, tenants={"acme": {"key_sha256": [digest]}}, metrics={"tenant_label": False})
    gw = await gateway(policy)
    await gw.client(key=key).chat.completions.create(model="gpt-test", messages=MSG)
    text = await _metrics(gw)
    tokens = _series(text, "gateway_tokens_total")
    assert tokens and not any("acme" in s for s in tokens)
