"""What a tenant may learn about the inside (issue 23, item 8): an upstream failure names the
backend (its policy name) and the kind of failure, never its address, the OS's socket error or the
backend's own error body, which stay in the log with the request id; and `/metrics` (tenant
names, tokens, spend) is closed when the gateway listens beyond loopback unless the policy opens it."""

from __future__ import annotations

import logging
import secrets
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from gateway.web.app import create_app
from gateway.tenants.auth import Tenants, hash_key
from gateway.config.policy import PolicyError, parse_policy
from tests.conftest import simple_policy

TENANT, ADMIN, SCRAPE = (f"sk-{n}-" + secrets.token_hex(12) for n in ("t", "admin", "prom"))
MSG = [{"role": "user", "content": "hi"}]
# What must never reach a tenant: addresses and the OS's words for a failed socket.
LEAKS = ("127.0.0.1", "localhost", "http://", "refused", "errno", "connect call failed", "reset by peer", "10.9.8.7")


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _leaks(text: str, *extra: str) -> list[str]:
    return [s for s in (*LEAKS, *extra) if s.lower() in text.lower()]


async def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)


def _policy(*ups: Any, **extra: Any) -> dict[str, Any]:
    return simple_policy(*ups, tenants={"t": {"key_sha256": [hash_key(TENANT)]}}, cache={"enabled": False},
                         health={"probe_interval_ms": 600_000}, **extra)


# -- upstream failures -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_dead_backend_is_named_with_the_kind_of_failure_and_its_address_stays_in_the_log(gateway, caplog, stream):
    port = _dead_port()
    policy = _policy(model="gpt-test")
    policy["backends"] = {"dead": {"url": f"http://127.0.0.1:{port}/v1", "models": ["gpt-test"]}}
    policy["models"] = {"gpt-test": {"backends": ["dead"]}}
    gw = await gateway(policy)
    rid = "disclosure-" + secrets.token_hex(4)
    with caplog.at_level(logging.INFO, logger="gateway"):
        status, body = await _post(gw.url + "/v1/chat/completions", {"model": "gpt-test", "messages": MSG, "stream": stream},
                                   {**_auth(TENANT), "x-request-id": rid})
    message = body["error"]["message"]
    assert status == 502 and body["error"]["code"] == "upstream_error", body
    assert "dead: connect failed" in message, message
    assert not _leaks(str(body), str(port)), message
    logged = [r.getMessage() for r in caplog.records if rid in r.getMessage()]
    assert any(f"127.0.0.1:{port}" in line for line in logged), logged  # the operator still finds it


async def test_a_backends_500_body_is_logged_not_shown(upstream, gateway, caplog):
    inside = "worker pod 10.9.8.7:8000 crashed: Traceback (most recent call last)"
    up = await upstream("a", mode="error_500", error_body=inside)
    gw = await gateway(_policy(up))
    with caplog.at_level(logging.INFO, logger="gateway"):
        status, body = await _post(gw.url + "/v1/chat/completions", {"model": "gpt-test", "messages": MSG}, _auth(TENANT))
    assert status == 502 and body["error"]["message"] == "all backends failed (a: HTTP 500)", body
    assert any(inside in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("mode", ["reset", "close"])
async def test_a_connection_lost_before_the_answer_says_so_without_the_os_error(upstream, gateway, mode):
    up = await upstream("a", mode=mode)
    gw = await gateway(_policy(up))
    status, body = await _post(gw.url + "/v1/chat/completions", {"model": "gpt-test", "messages": MSG}, _auth(TENANT))
    message = body["error"]["message"]
    assert status == 502 and "a: connection lost" in message, message
    assert not _leaks(message, str(up.port)), message


async def test_the_responses_api_and_its_by_id_calls_hide_the_address_too(upstream, gateway, caplog):
    up = await upstream("a", tokens=3)
    gw = await gateway(_policy(up))
    status, made = await _post(gw.url + "/v1/responses", {"model": "gpt-test", "input": "hi"}, _auth(TENANT))
    assert status == 200, made
    port = up.port
    await up.stop()  # the backend that holds the response goes away
    rid = "disclosure-" + secrets.token_hex(4)
    with caplog.at_level(logging.INFO, logger="gateway"):
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{gw.url}/v1/responses/{made['id']}", headers={**_auth(TENANT), "x-request-id": rid}) as r:
                got_status, got = r.status, await r.json(content_type=None)
        for stream in (False, True):
            status, body = await _post(gw.url + "/v1/responses", {"model": "gpt-test", "input": "again", "stream": stream},
                                       _auth(TENANT))
            assert status >= 500 and not _leaks(str(body), str(port)), body
    assert got_status >= 500 and "error" in got, got
    assert not _leaks(str(got), str(port)), got
    assert any(rid in r.getMessage() and f"127.0.0.1:{port}" in r.getMessage() for r in caplog.records)


# -- /metrics --------------------------------------------------------------------------------------


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Any]:
    """Factory: the app `gateway serve --host HOST` builds, bound to HOST on a free port (0.0.0.0
    listens beyond loopback for real); returns the URL to reach it on loopback."""
    runners: list[web.AppRunner] = []

    async def make(policy: dict[str, Any], host: str) -> str:
        path = tmp_path / f"policy-{len(runners)}.yaml"
        path.write_text(yaml.safe_dump(policy))
        runner = web.AppRunner(create_app(path, host=host), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    yield make
    for runner in runners:
        await runner.cleanup()


async def _scrape(url: str, key: str | None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics", headers=_auth(key) if key else {}) as r:
            return r.status, await r.text()


def _metrics_policy(up: Any, *, admin: bool = True, **metrics: Any) -> dict[str, Any]:
    extra: dict[str, Any] = {"admin": {"key_sha256": [hash_key(ADMIN)]}} if admin else {}
    return _policy(up, metrics=metrics, **extra) if metrics else _policy(up, **extra)


async def test_metrics_beyond_loopback_need_an_admin_key_unless_the_policy_opens_them(upstream, served):
    up = await upstream("a")
    url = await served(_metrics_policy(up), "0.0.0.0")
    status, text = await _scrape(url, None)
    assert status == 401 and "metrics.open" in text and "gateway_" not in text, text
    assert (await _scrape(url, TENANT))[0] == 401  # a tenant key is no admin key
    status, text = await _scrape(url, ADMIN)
    assert status == 200 and "gateway_requests_total" in text
    # Opened on purpose: anyone who reaches it.
    url = await served(_metrics_policy(up, open=True), "0.0.0.0")
    assert (await _scrape(url, None))[0] == 200
    # A scrape key: that key or an admin key, beyond loopback as on it.
    for host in ("0.0.0.0", "127.0.0.1"):
        url = await served(_metrics_policy(up, key_sha256=[hash_key(SCRAPE)]), host)
        assert [(await _scrape(url, k))[0] for k in (None, TENANT, SCRAPE, ADMIN)] == [401, 401, 200, 200]
    # No admin key, no scrape key, not open: nobody, and the answer says how to change that.
    url = await served(_metrics_policy(up, admin=False), "0.0.0.0")
    status, text = await _scrape(url, None)
    assert status == 401 and "metrics.key_sha256" in text
    # On loopback it stays open, as before.
    url = await served(_metrics_policy(up), "127.0.0.1")
    assert (await _scrape(url, None))[0] == 200


@pytest.mark.parametrize(
    ("metrics", "loopback", "key", "allowed"),
    [
        ({}, True, None, True), ({}, False, None, False), ({}, False, ADMIN, True), ({}, False, TENANT, False),
        ({"open": True}, False, None, True),
        ({"key_sha256": [hash_key(SCRAPE)]}, True, None, False), ({"key_sha256": [hash_key(SCRAPE)]}, False, SCRAPE, True),
        ({"key_sha256_env": "DISCLOSURE_SCRAPE_SHA256"}, False, SCRAPE, True),
        ({"key_sha256_env": "DISCLOSURE_SCRAPE_SHA256"}, True, None, False),
    ],
    # Named ids: the keys are random per run, and pytest-xdist's workers must collect the same names.
    ids=["loopback", "remote", "remote-admin", "remote-tenant", "open", "scrape-key-loopback-none",
         "scrape-key", "scrape-key-env", "scrape-key-env-loopback-none"],
)
def test_who_may_scrape(monkeypatch, metrics, loopback, key, allowed):
    monkeypatch.setenv("DISCLOSURE_SCRAPE_SHA256", hash_key(SCRAPE))
    policy = {
        "version": 1,
        "backends": {"b": {"url": "http://127.0.0.1:9/v1", "models": ["m"]}},
        "tenants": {"t": {"key_sha256": [hash_key(TENANT)]}},
        "admin": {"key_sha256": [hash_key(ADMIN)]},
        "metrics": metrics,
    }
    tenants = Tenants(parse_policy(yaml.safe_dump(policy)))
    assert tenants.may_scrape(key, loopback=loopback) is allowed


def test_metrics_open_with_scrape_keys_is_a_policy_error():
    policy = {"version": 1, "backends": {"b": {"url": "http://127.0.0.1:9/v1", "models": ["m"]}},
              "metrics": {"open": True, "key_sha256": [hash_key(SCRAPE)]}}
    with pytest.raises(PolicyError) as info:
        parse_policy(yaml.safe_dump(policy))
    assert any(str(p).startswith("metrics.open:") for p in info.value.problems), info.value


def test_the_deploy_files_give_prometheus_the_scrape_key_they_require():
    """compose and Kubernetes listen on 0.0.0.0: their policies close /metrics with a scrape key
    from the environment, and what scrapes it is handed the key."""
    from tests.conftest import ROOT

    deploy = ROOT / "deploy"
    compose_policy = yaml.safe_load((deploy / "policies" / "compose.yaml").read_text())
    assert compose_policy["metrics"] == {"key_sha256_env": "METRICS_KEY_SHA256"}
    compose = yaml.safe_load((deploy / "docker-compose.yaml").read_text())
    gateways = [s for s in compose["services"].values() if s.get("environment", {}).get("GATEWAY_POLICY")]
    assert gateways and all("METRICS_KEY_SHA256" in s["environment"] for s in gateways)
    assert compose["secrets"]["gateway_metrics_key"] == {"environment": "METRICS_KEY"}
    assert "gateway_metrics_key" in compose["services"]["prometheus"]["secrets"]
    scrape = yaml.safe_load((deploy / "prometheus" / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["authorization"]["credentials_file"] == "/run/secrets/gateway_metrics_key"
    docs = {d["kind"]: d for d in yaml.safe_load_all((deploy / "kubernetes" / "gateway.yaml").read_text()) if d}
    k8s_policy = yaml.safe_load(docs["ConfigMap"]["data"]["policy.yaml"])
    env = {e["name"]: e for e in docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    ref = env[k8s_policy["metrics"]["key_sha256_env"]]["valueFrom"]["secretKeyRef"]
    assert ref["key"] in docs["Secret"]["stringData"]
