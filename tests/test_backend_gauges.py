"""A backend that a reload removes leaves /metrics' live gauges (healthy, in flight, TTFT P95), in
one process and across `gateway serve --workers 2` (whose values live in mmap files); added back,
it is there again. Real gateways on loopback, fake upstreams."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import aiohttp
import yaml

from gateway.tenants.auth import hash_key
from tests.procs import both_workers, serve

GAUGES = ("gateway_backend_healthy", "gateway_backend_inflight", "gateway_backend_ttft_p95_seconds")
KEY = "sk-" + secrets.token_urlsafe(16)
ADMIN = "sk-" + secrets.token_urlsafe(16)


def _policy(*ups: Any, **extra: Any) -> dict[str, Any]:
    """Each upstream a backend serving its own model `m-<name>`."""
    return {
        "version": 1,
        "backends": {up.name: {"url": up.url, "models": [f"m-{up.name}"]} for up in ups},
        "models": {f"m-{up.name}": {"backends": [up.name]} for up in ups},
        "reload": {"watch": False},
        **extra,
    }


def _gauged(text: str) -> dict[str, set[str]]:
    """Backends named by each live gauge on /metrics."""
    out: dict[str, set[str]] = {g: set() for g in GAUGES}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in out and rest.startswith('backend="'):
            out[name].add(rest[len('backend="'):].split('"', 1)[0])
    return out


async def _ask(url: str, model: str, headers: dict[str, str]) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status == 200, await r.text()
            await r.read()


async def _scrape(url: str, headers: dict[str, str]) -> dict[str, set[str]]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        async with http.get(url + "/metrics", headers=headers) as r:
            assert r.status == 200
            return _gauged(await r.text())


async def _scrape_until(url: str, headers: dict[str, str], want: dict[str, set[str]], timeout_s: float = 15.0) -> dict[str, set[str]]:
    """Scrape until /metrics names `want` (or `timeout_s` passed): the last scrape's gauges."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while (got := await _scrape(url, headers)) != want and loop.time() < end:
        await asyncio.sleep(0.1)
    return got


async def _reload(url: str, headers: dict[str, str]) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/admin/reload", headers=headers) as r:
            assert r.status == 200, await r.text()


async def test_a_reload_that_removes_a_backend_removes_its_gauges(upstream, gateway):
    a, b = await upstream("a", ttft_ms=5), await upstream("b", ttft_ms=5)
    gw = await gateway(_policy(a, b))
    for model in ("m-a", "m-b"):
        await _ask(gw.url, model, {})
    assert await _scrape(gw.url, {}) == {g: {"a", "b"} for g in GAUGES}

    gw.write_policy(_policy(a))
    await _reload(gw.url, {})
    assert await _scrape(gw.url, {}) == {g: {"a"} for g in GAUGES}

    gw.write_policy(_policy(a, b))  # added back: its series come back
    await _reload(gw.url, {})
    await _ask(gw.url, "m-b", {})
    assert await _scrape(gw.url, {}) == {g: {"a", "b"} for g in GAUGES}


async def test_two_workers_drop_a_removed_backends_gauges(upstream, tmp_path):
    a, b = await upstream("a", ttft_ms=5), await upstream("b", ttft_ms=5)
    auth = {"tenants": {"t": {"key_sha256": [hash_key(KEY)]}}, "admin": {"key_sha256": [hash_key(ADMIN)]}}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(_policy(a, b, **auth)))
    adm = {"Authorization": f"Bearer {ADMIN}"}
    async with serve(path, tmp_path, "--workers", "2") as gw:
        await both_workers(gw.url, adm)
        for i in range(8):  # fresh connections: SO_REUSEPORT spreads them over both workers
            await _ask(gw.url, ("m-a", "m-b")[i % 2], {"Authorization": f"Bearer {KEY}"})
        # A worker publishes its live gauges to the shared mmap files on a scrape it answers and
        # every second (refresh_gauges): until the one that served a backend's requests has, a
        # scrape answered by the other lacks that backend's TTFT P95. Wait for both workers' figures.
        both = {g: {"a", "b"} for g in GAUGES}
        assert await _scrape_until(gw.url, adm, both) == both

        path.write_text(yaml.safe_dump(_policy(a, **auth)))
        await _reload(gw.url, adm)  # reaches both workers
        for _ in range(6):  # whichever worker answers the scrape, with the others' mmap files
            assert await _scrape(gw.url, adm) == {g: {"a"} for g in GAUGES}
