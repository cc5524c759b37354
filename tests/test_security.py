"""Secure by default: open mode only on loopback, admin and /metrics keys, request ids and odd
headers that never escape the error contract, and readiness that means the routes can answer."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.web.app import create_app
from gateway.tenants.auth import hash_key, is_loopback
from gateway.web.keys import LIVE
from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": "gpt-test", "messages": MSG}
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def public_app(tmp_path: Path) -> AsyncIterator[Any]:
    """Factory: an app built as `gateway serve --host 0.0.0.0` builds it, listening on loopback
    for the test; returns its base URL."""
    runners: list[web.AppRunner] = []

    async def make(policy: dict[str, Any]) -> tuple[str, web.Application, Path]:
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(policy))
        app = create_app(path, host="0.0.0.0")
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}", app, path

    yield make
    for runner in runners:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [(None, True), ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("gateway.internal", False), ("", False)],
)
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


async def test_an_open_policy_is_refused_off_loopback_unless_stated(upstream, tmp_path):
    up = await upstream("a")
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(simple_policy(up)))
    with pytest.raises(ValueError, match="open_access: true"):
        create_app(path, host="0.0.0.0")
    create_app(path)  # no host: loopback, as the test fixtures build it
    create_app(path, host="127.0.0.1")
    path.write_text(yaml.safe_dump(simple_policy(up, server={"open_access": True})))
    create_app(path, host="0.0.0.0")
    tenants = {"t": {"key_sha256": [hash_key("sk-t")]}}
    path.write_text(yaml.safe_dump(simple_policy(up, tenants=tenants)))
    create_app(path, host="0.0.0.0")


async def test_admin_needs_an_admin_key_except_in_loopback_open_mode(upstream, gateway, public_app):
    up = await upstream("a")
    # Stated open on a public address: calls are open, /admin is not.
    url, _, _ = await public_app(simple_policy(up, server={"open_access": True}))
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 200
        async with http.get(url + "/admin/backends") as r:
            assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
        async with http.post(url + "/admin/reload") as r:
            assert r.status == 401
    # Tenants but no admin key, even on loopback: a tenant key is not an admin key.
    gw = await gateway(simple_policy(up, tenants={"t": {"key_sha256": [hash_key("sk-t")]}}), name="t.yaml")
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/admin/backends", headers=_auth("sk-t")) as r:
            assert r.status == 401
    # Loopback open mode: local development, /admin is open.
    gw = await gateway(simple_policy(up), name="open.yaml")
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/admin/backends") as r:
            assert r.status == 200


async def test_a_reload_that_drops_every_tenant_is_refused_off_loopback(upstream, public_app):
    up = await upstream("a")
    policy = simple_policy(
        up,
        tenants={"t": {"key_sha256": [hash_key("sk-t")]}},
        admin={"key_sha256": [hash_key("sk-admin")]},
        reload={"watch": False},
    )
    url, app, path = await public_app(policy)
    del policy["tenants"]
    path.write_text(yaml.safe_dump(policy))
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/admin/reload", headers=_auth("sk-admin")) as r:
            assert r.status == 400 and "open_access" in (await r.json())["error"]["message"]
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 401  # the previous policy, with its tenants, stays in force
    assert app[LIVE].runtime.generation == 1


async def test_metrics_can_require_a_key(upstream, gateway):
    up = await upstream("a")
    policy = simple_policy(
        up,
        tenants={"t": {"key_sha256": [hash_key("sk-t")]}},
        admin={"key_sha256": [hash_key("sk-admin")]},
        metrics={"key_sha256": [hash_key("sk-prom")], "tenant_label": False},
    )
    gw = await gateway(policy)
    async with aiohttp.ClientSession() as http:
        for headers, status in (({}, 401), (_auth("sk-t"), 401), (_auth("sk-prom"), 200), (_auth("sk-admin"), 200)):
            async with http.get(gw.url + "/metrics", headers=headers) as r:
                assert r.status == status, headers
                if status == 200:
                    assert "gateway_requests_total" in await r.text()
                else:
                    assert (await r.json())["error"]["type"] == "authentication_error"
    tenants = gw.app[LIVE].runtime.tenants
    assert tenants.tenant_label is False and tenants.metric_label("t") == "tenant"


async def test_metrics_are_open_and_label_tenants_by_default(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            assert r.status == 200
    tenants = gw.app[LIVE].runtime.tenants
    assert tenants.tenant_label is True and tenants.metric_label("t") == "t"


@pytest.mark.parametrize("bad_id", ["has spaces", "x" * 200, "<script>", "a;b=c", "ümlaut"])
async def test_an_invalid_request_id_is_never_echoed(upstream, gateway, bad_id):
    up = await upstream("a", tokens=2)
    policy = simple_policy(up, server={"max_body_bytes": 2000})
    policy["tenants"] = {"t": {"key_sha256": [hash_key("sk-t")]}}
    gw = await gateway(policy)
    rid = {"x-request-id": bad_id}
    big = {"model": "gpt-test", "messages": [{"role": "user", "content": "x" * 5000}]}
    cases = [
        ("/v1/chat/completions", {"json": big, "headers": {**rid, **_auth("sk-t")}}, 413),
        ("/v1/chat/completions", {"json": CHAT, "headers": rid}, 401),
        ("/v1/chat/completions", {"data": b"{nope", "headers": {**rid, **_auth("sk-t")}}, 400),
        ("/v1/chat/completions", {"json": CHAT, "headers": {**rid, **_auth("sk-t"), "x-request-timeout-ms": "inf"}}, 400),
        ("/v1/chat/completions", {"json": CHAT, "headers": {**rid, **_auth("sk-t")}}, 200),
        ("/v1/chat/completions", {"json": {**CHAT, "stream": True}, "headers": {**rid, **_auth("sk-t")}}, 200),
        ("/v1/route/explain", {"json": CHAT, "headers": {**rid, **_auth("sk-t")}}, 200),
        ("/v1/route/explain", {"json": CHAT, "headers": {**rid, **_auth("sk-t"), "x-request-timeout-ms": "-5"}}, 400),
    ]
    async with aiohttp.ClientSession() as http:
        for path, kw, status in cases:
            async with http.post(gw.url + path, **kw) as r:
                await r.read()
                assert r.status == status, (path, kw.get("headers"))
                echoed = r.headers.get("x-request-id", "")
                assert echoed != bad_id and _SAFE_ID.match(echoed), (path, status, echoed)
    assert up.stats.last_headers.get("x-request-id") != bad_id


async def test_a_valid_request_id_is_echoed_on_early_errors_too(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", data=b"{nope", headers={"x-request-id": "req-7"}) as r:
            assert r.status == 400 and r.headers["x-request-id"] == "req-7"


@pytest.mark.parametrize("value", ["inf", "-inf", "Infinity", "nan", "-5", "0", "-0.0", "soon", "1e", "1_0x"])
async def test_odd_timeout_headers_are_400_naming_the_header(upstream, gateway, value):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"x-request-timeout-ms": value}) as r:
            assert r.status == 400, await r.text()
            assert r.content_type == "application/json"
            assert (await r.json())["error"]["param"] == "x-request-timeout-ms"
    assert up.stats.requests == 0


@pytest.mark.parametrize("value", ["1e400", "99999999999999999999999", "1e999999999", "2500.7", "0.5"])
async def test_huge_or_fractional_timeouts_are_clamped_not_errors(upstream, gateway, value):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"x-request-timeout-ms": value}) as r:
            # 0.5 ms rounds up to the shortest deadline (1 ms): a 504 in the contract, not a 500
            assert r.status in ((200,) if value != "0.5" else (200, 504)), await r.text()
            assert r.content_type == "application/json"


async def test_readyz_needs_a_usable_backend_for_every_model(upstream, gateway):
    a, b = await upstream("a"), await upstream("b")
    policy = simple_policy(a)
    policy["backends"]["local"] = {"url": b.url, "models": ["small"]}
    gw = await gateway(policy)
    backends = gw.app[LIVE].runtime.backends
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/readyz") as r:
            assert r.status == 200 and (await r.json())["models_without_backend"] == []
        backends["local"].health.ready = False  # what the launcher sets while a local model loads
        async with http.get(gw.url + "/readyz") as r:
            body = await r.json()
        assert r.status == 503 and body["models_without_backend"] == ["small"] and "small" in body["detail"]
        backends["local"].health.ready = True
        # Ejected, but the route's last resort: the router still sends it requests, so still ready.
        backends["local"].health.ejected_until = float("inf")
        async with http.get(gw.url + "/readyz") as r:
            assert r.status == 200


async def test_readyz_checks_each_class_of_a_split_route(upstream, gateway):
    a, b = await upstream("a"), await upstream("b")
    policy = simple_policy(a, b)
    policy["models"]["auto"] = {"simple": ["b"], "complex": ["a"]}
    gw = await gateway(policy)
    gw.app[LIVE].runtime.backends["b"].health.ready = False
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/readyz") as r:
            assert r.status == 503 and (await r.json())["models_without_backend"] == ["auto"]


async def test_sampled_answers_are_not_cached_by_default(upstream, gateway):
    up = await upstream("a", tokens=2)
    gw = await gateway(simple_policy(up))
    c = gw.client()

    async def cache_header(**kw: Any) -> str:
        raw = await c.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG, **kw)
        return raw.headers["x-gateway-cache"]

    assert [await cache_header(temperature=1.0) for _ in range(2)] == ["bypass", "bypass"]
    assert [await cache_header(temperature=0) for _ in range(2)] == ["miss", "hit"]


def test_the_default_policy_does_not_cache_sampled_answers():
    from gateway.config.policy import load_policy

    policy = load_policy(Path(__file__).resolve().parents[1] / "policies" / "default.yaml")
    assert policy.cache.include_sampled is False
    assert all(r.cache is None or r.cache.include_sampled in (None, False) for r in policy.models.values())
