"""A tenant's `priority` is a ceiling (issue 23, item 5): `x-priority` and the body's
`service_tier` may ask for a band up to it, never above; an ask above is clamped (not refused), and
a `service_tier` above it never reaches a backend (providers bill priority processing to the
gateway's account). Checked as plain functions, then over real sockets with the body the fake
upstream received, for chat, completions and the Responses API, in explain, and in the queue."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.tenants.auth import OPEN_TENANT, Tenant, hash_key
from gateway.web.keys import LIVE
from gateway.config.policy import PolicyError, parse_policy
from gateway.tenants.priority import asked_band, band_for, without_tier
from tests.conftest import simple_policy

KEYS = {name: f"sk-{name}-" + secrets.token_hex(12) for name in ("flex", "std", "vip", "mixed")}
CEILINGS: dict[str, dict[str, str]] = {
    "flex": {"priority": "flex"},
    "std": {},  # the default ceiling: default
    "vip": {"priority": "priority"},
    "mixed": {"priority": "priority", "default_priority": "default"},
}
MSG = [{"role": "user", "content": "which band am I in?"}]


def _tenants() -> dict[str, dict[str, Any]]:
    return {name: {"key_sha256": [hash_key(KEYS[name])], **CEILINGS[name]} for name in KEYS}


def _auth(name: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}", **extra}


# -- the rule, as plain functions ------------------------------------------------------------------


FLEX = Tenant("f", "flex", None)
STD = Tenant("s", "default", None)
VIP = Tenant("v", "priority", None)
MIXED = Tenant("m", "priority", None, default_priority="default")


@pytest.mark.parametrize(
    ("tenant", "asked", "band"),
    [
        (FLEX, None, "flex"), (FLEX, "priority", "flex"), (FLEX, "default", "flex"), (FLEX, "flex", "flex"),
        (STD, None, "default"), (STD, "priority", "default"), (STD, "flex", "flex"),
        (VIP, None, "priority"), (VIP, "priority", "priority"), (VIP, "flex", "flex"),
        (MIXED, None, "default"), (MIXED, "priority", "priority"), (MIXED, "flex", "flex"),
        (OPEN_TENANT, None, "default"), (OPEN_TENANT, "priority", "priority"),  # open mode: no one to hold back
    ],
)
def test_the_band_is_what_was_asked_for_at_most_the_ceiling(tenant, asked, band):
    assert band_for(asked, tenant) == band


def test_the_header_wins_over_the_body_and_every_openai_tier_maps_to_a_band():
    assert asked_band("flex", {"service_tier": "priority"}) == "flex"
    assert asked_band(None, {"service_tier": "priority"}) == "priority"
    assert [asked_band(None, {"service_tier": t}) for t in ("auto", "default", "scale", "flex")] == ["default"] * 3 + ["flex"]
    assert asked_band(None, {}) is None and asked_band(None, {"service_tier": None}) is None


@pytest.mark.parametrize(
    ("tenant", "tier", "forwarded"),
    [
        (FLEX, "priority", False), (FLEX, "default", False), (FLEX, "auto", False), (FLEX, "scale", False), (FLEX, "flex", True),
        (STD, "priority", False), (STD, "default", True), (STD, "auto", True), (STD, "scale", True), (STD, "flex", True),
        (VIP, "priority", True), (MIXED, "priority", True), (MIXED, "flex", True),
        (STD, None, True),  # null: nothing asked, nothing to remove
        (VIP, {"not": "a tier"}, False), (VIP, "ultra", False),  # unvalidated (embeddings): never passed on
    ],
)
def test_a_service_tier_goes_upstream_only_within_the_ceiling(tenant, tier, forwarded):
    body = {"model": "m", "service_tier": tier, "messages": MSG}
    out = without_tier(body, tenant)
    if forwarded:
        assert out is None
    else:
        assert out == {"model": "m", "messages": MSG}
    assert without_tier({"model": "m"}, FLEX) is None  # no tier: the body goes as it is


def test_a_default_priority_above_the_ceiling_is_a_policy_error():
    policy = {
        "version": 1,
        "backends": {"b": {"url": "http://127.0.0.1:9/v1", "models": ["m"]}},
        "tenants": {"t": {"key_sha256": ["a" * 64], "priority": "default", "default_priority": "priority"}},
    }
    with pytest.raises(PolicyError) as info:
        parse_policy(yaml.safe_dump(policy))
    assert any(p.startswith("tenants.t.default_priority:") and "above" in p for p in map(str, info.value.problems)), info.value
    policy["tenants"]["t"]["default_priority"] = "flex"
    assert parse_policy(yaml.safe_dump(policy)).tenants["t"].default_priority == "flex"


# -- over real sockets -----------------------------------------------------------------------------


async def _post(gw: Any, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + path, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)


async def test_a_flex_tenant_asking_for_priority_is_served_flex_and_no_backend_sees_priority(upstream, gateway):
    up = await upstream("a", tokens=2)
    gw = await gateway(simple_policy(up, tenants=_tenants(), cache={"enabled": False}))
    chat = {"model": "gpt-test", "messages": MSG}
    for headers, body in (
        (_auth("flex"), chat),
        (_auth("flex", **{"x-priority": "priority"}), chat),
        (_auth("flex"), {**chat, "service_tier": "priority"}),
        (_auth("flex", **{"x-priority": "priority"}), {**chat, "service_tier": "priority"}),
    ):
        status, explained = await _post(gw, "/v1/route/explain", body, headers)
        assert status == 200 and explained["band"] == "flex" and explained["priority"] == "flex", explained
        assert explained["priority_ceiling"] == "flex" and explained["service_tier_upstream"] is None, explained
        status, answer = await _post(gw, "/v1/chat/completions", body, headers)
        assert status == 200, answer
        assert "service_tier" not in up.stats.last_body, up.stats.last_body  # removed, not passed on
        assert up.stats.last_body["messages"] == MSG  # the rest of the body untouched
    # Within the ceiling the tier goes as sent, for the completions endpoint too.
    status, _ = await _post(gw, "/v1/completions", {"model": "gpt-test", "prompt": "hi", "service_tier": "flex"}, _auth("flex"))
    assert status == 200 and up.stats.last_body["service_tier"] == "flex"
    status, _ = await _post(gw, "/v1/completions", {"model": "gpt-test", "prompt": "hi", "service_tier": "priority"}, _auth("flex"))
    assert status == 200 and "service_tier" not in up.stats.last_body


async def test_each_ceiling_forwards_the_tiers_it_allows_and_streams_too(upstream, gateway):
    up = await upstream("a", tokens=2)
    gw = await gateway(simple_policy(up, tenants=_tenants(), cache={"enabled": False}))
    cases = [  # (tenant, tier asked, tier the backend gets, band)
        ("std", "priority", None, "default"), ("std", "auto", "auto", "default"), ("std", "flex", "flex", "flex"),
        ("vip", "priority", "priority", "priority"), ("mixed", "priority", "priority", "priority"),
        ("mixed", None, None, "default"), ("vip", None, None, "priority"),
    ]
    for tenant, tier, sent, band in cases:
        body: dict[str, Any] = {"model": "gpt-test", "messages": MSG, **({"service_tier": tier} if tier else {})}
        status, explained = await _post(gw, "/v1/route/explain", body, _auth(tenant))
        assert status == 200 and explained["band"] == band, (tenant, tier, explained)
        assert explained["service_tier_upstream"] == sent, (tenant, tier, explained)
        for stream in (False, True):
            async with aiohttp.ClientSession() as http:
                async with http.post(gw.url + "/v1/chat/completions", json={**body, "stream": stream}, headers=_auth(tenant)) as r:
                    assert r.status == 200
                    await r.read()
            assert up.stats.last_body.get("service_tier") == sent, (tenant, tier, stream, up.stats.last_body)


async def test_the_responses_api_holds_a_flex_tenant_to_flex(upstream, gateway):
    up = await upstream("a", tokens=3)
    gw = await gateway(simple_policy(up, tenants=_tenants(), cache={"enabled": False}))
    ask = {"model": "gpt-test", "input": "tier probe", "service_tier": "priority"}
    status, explained = await _post(gw, "/v1/route/explain", ask, _auth("flex"))
    assert status == 200 and explained["endpoint"] == "responses" and explained["band"] == "flex", explained
    for stream in (False, True):
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/v1/responses", json={**ask, "stream": stream}, headers=_auth("flex")) as r:
                assert r.status == 200, await r.text()
                await r.read()
        assert up.stats.last_body["input"] == "tier probe" and "service_tier" not in up.stats.last_body, up.stats.last_body
    status, _ = await _post(gw, "/v1/responses", ask, _auth("vip"))
    assert status == 200 and up.stats.last_body["service_tier"] == "priority"  # allowed: sent as asked


async def test_a_clamped_priority_ask_waits_behind_the_default_band(upstream, gateway):
    """One slot, held; two `default` requests queue; then a flex tenant asks for `priority` and a
    vip tenant really has it. The vip overtakes both; the flex one waits behind them all."""
    up = await upstream("a", ttft_ms=600, tokens=1)
    policy = simple_policy(up, tenants=_tenants(), cache={"enabled": False}, health={"probe_interval_ms": 600_000})
    policy["backends"]["a"]["max_concurrency"] = 1
    gw = await gateway(policy)
    slots = gw.app[LIVE].runtime.backends["a"].slots
    done: list[str] = []

    async def one(name: str, tenant: str, **headers: str) -> None:
        body = {"model": "gpt-test", "messages": [{"role": "user", "content": name}]}
        status, answer = await _post(gw, "/v1/chat/completions", body, _auth(tenant, **headers))
        assert status == 200, answer
        done.append(name)

    async def until_queued(n: int) -> None:
        end = time.monotonic() + 5
        while sum(slots.queue.sizes.values()) < n:
            assert time.monotonic() < end, f"{n} never queued: {slots.queue.sizes}"
            await asyncio.sleep(0.005)

    tasks = [asyncio.create_task(one("holder", "std"))]
    end = time.monotonic() + 5
    while up.stats.active < 1:
        assert time.monotonic() < end
        await asyncio.sleep(0.005)
    for i in range(2):
        tasks.append(asyncio.create_task(one(f"default{i}", "std")))
        await until_queued(i + 1)
    tasks.append(asyncio.create_task(one("flex-asks-priority", "flex", **{"x-priority": "priority"})))
    await until_queued(3)
    assert slots.queue.sizes["flex"] == 1 and slots.queue.sizes["priority"] == 0, slots.queue.sizes
    tasks.append(asyncio.create_task(one("vip", "vip")))
    await until_queued(4)
    await asyncio.gather(*tasks)
    assert done[0] == "holder" and done[1] == "vip" and done[-1] == "flex-asks-priority", done
