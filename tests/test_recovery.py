"""A primary that recovers is used again within seconds: request probes, the retry rule after an
ejection, and the fault suite's "primary down, then healthy" scenario over real sockets."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import aiohttp
import openai
import pytest

from gateway.routing.backends import Backend, BackendState
from gateway.config.policy import BackendPolicy, RetryPolicy
from gateway.routing.probes import probe_request, recovery_targets
from gateway.relay.timing import retry_wait
from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _backend(url: str, **policy: Any) -> Backend:
    return Backend("b", BackendPolicy(url=url, models=["m"], **policy), BackendState())


async def _probe(backend: Backend, timeout_s: float = 2.0) -> Any:
    async with aiohttp.ClientSession() as http:
        return await probe_request(http, backend, "m", timeout_s)


async def _metric_sum(gw: Any, prefix: str) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


async def _upstream_stats(up: Any) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{up.port}/_stats") as r:
            return dict(await r.json())


# -- the request probe ----------------------------------------------------------------------------


async def test_a_request_probe_sends_the_model_a_one_token_request_with_the_backends_key(upstream, monkeypatch):
    monkeypatch.setenv("PROBE_KEY", "sk-probe")
    up = await upstream("u", tokens=5)
    result = await _probe(_backend(up.url, api_key_env="PROBE_KEY"))
    assert result.ok is True and not result.whole_backend
    # Text completions first: the least a model can do, no chat template.
    assert up.stats.by_path == {"/v1/completions": 1} and result.endpoint == "completions"
    assert up.stats.last_body == {"model": "m", "prompt": "ping", "max_tokens": 1, "stream": False}
    assert up.stats.last_headers["Authorization"] == "Bearer sk-probe"
    assert up.stats.last_headers["x-gateway-probe"] == "recovery"


async def test_a_backend_without_text_completions_is_probed_on_chat_and_then_on_chat_first(upstream):
    up = await upstream("u", endpoints=("chat", "models"))  # others answer a plain 404, as OpenAI's chat models do
    backend = _backend(up.url)
    first = await _probe(backend)
    assert first.ok is True and first.endpoint == "chat"
    assert up.stats.by_path == {"/v1/completions": 1, "/v1/chat/completions": 1}
    assert up.stats.last_body["messages"] == [{"role": "user", "content": "ping"}] and up.stats.last_body["max_tokens"] == 1
    async with aiohttp.ClientSession() as http:
        again = await probe_request(http, backend, "m", 2.0, first=first.endpoint)
    assert again.ok is True and up.stats.by_path == {"/v1/completions": 1, "/v1/chat/completions": 2}


@pytest.mark.parametrize("mode", ["error_500", "error_502", "error_401", "garbage"])
async def test_a_request_probe_fails_on_what_counts_against_a_backend(upstream, mode):
    up = await upstream("u", mode=mode)
    result = await _probe(_backend(up.url))
    assert result.ok is False and not result.whole_backend, result


async def test_a_refused_connection_is_about_the_backend_not_the_model():
    result = await _probe(_backend(f"http://127.0.0.1:{_closed_port()}/v1"))
    assert result.ok is False and result.whole_backend


async def test_a_silent_backend_fails_the_probe_at_its_timeout(upstream):
    up = await upstream("u", mode="hang")
    t0 = time.perf_counter()
    result = await _probe(_backend(up.url), timeout_s=0.3)
    assert result.ok is False and result.why == "timeout" and time.perf_counter() - t0 < 1.5


@pytest.mark.parametrize("mode", ["error_429", "error_400"])
async def test_busy_or_a_request_shape_not_served_is_inconclusive(upstream, mode):
    up = await upstream("u", mode=mode)
    result = await _probe(_backend(up.url, endpoints=["chat", "completions"]))
    assert result.ok is None, result
    # 400 on completions: chat is tried next (both 400 here); 429: busy, nothing more is asked
    assert up.stats.requests == (2 if mode == "error_400" else 1)


async def test_an_embeddings_only_backend_is_probed_with_an_embedding(upstream):
    up = await upstream("u", endpoints=("embeddings",))
    result = await _probe(_backend(up.url, endpoints=["embeddings"]))
    assert result.ok is True and up.stats.embeddings == 1 and up.stats.requests == 0


def test_request_probes_go_to_ejected_models_and_to_one_model_of_an_ejected_backend():
    b = _backend("http://127.0.0.1:1/v1")
    assert recovery_targets(b) == []
    h = b.health_for("m")
    h.failures_to_eject = 1
    h.report_failure()
    assert recovery_targets(b) == [("m", h.ejected_at)] and h.ejected_at > 0
    h.report_probe(True, request=True)  # half-open: the next user request is the trial, no probe
    assert h.state() == "probing" and recovery_targets(b) == []
    b.health.failures_to_eject = 1
    b.health.report_failure()  # refused connections eject the backend as a whole
    assert recovery_targets(b) == [("m", b.health.ejected_at)]
    b.health.ready = False  # a launched backend still starting: its launcher watches it
    assert recovery_targets(b) == []


def test_no_retry_on_a_backend_that_health_has_ejected():
    rp = RetryPolicy(attempts=3, on=(500,), max_wait_ms=3000)
    args: dict[str, Any] = {"tries_here": 1, "tries_total": 1, "max_attempts": 3, "cooling_s": 0.0, "remaining_s": 30.0}
    assert retry_wait(rp, "http_500", **args) is not None
    assert retry_wait(rp, "http_500", **args, ejected=True) is None


# -- over real sockets -----------------------------------------------------------------------------


async def test_a_primary_down_then_healthy_is_used_again_within_5_s_with_one_attempt_per_trial(upstream, gateway):
    """The fault suite's flapping primary: down long enough for repeated ejections (each half-open
    trial failing), then healthy. Every request is answered meanwhile (by the fallback); requests are
    back on the primary within 5 s of its recovery, although its back-off had many seconds left;
    and each trial cost the primary one attempt, not one per `retry` attempt."""
    p = await upstream("p", tokens=2)
    s = await upstream("s", tokens=3)
    policy = simple_policy(
        p, s,
        cache={"enabled": False},
        # No model-list probes: every request the primary sees is a user attempt or a request probe.
        health={"failures_to_eject": 2, "eject_ms": 3000, "max_eject_ms": 30_000, "probe_interval_ms": 600_000},
    )  # fmt: skip
    policy["models"]["gpt-test"]["retry"] = {"attempts": 3, "on": [500, 502, 503, "reset"], "max_wait_ms": 2000, "backoff_ms": 50}
    gw = await gateway(policy)
    client = gw.client()
    sent = 0

    async def ask() -> str:
        nonlocal sent
        sent += 1
        raw = await client.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG)
        text = raw.parse().choices[0].message.content
        backend = raw.headers["x-gateway-backend"]
        assert text == ("w0 w1 " if backend == "p" else "w0 w1 w2 ")
        return str(backend)

    p.set(mode="error_500")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 10.0:  # ejections of ~3 s, then ~6 s, then ~12 s
        assert await ask() == "s"  # answered, by the fallback
        await asyncio.sleep(0.05)
    ejections = await _metric_sum(gw, 'gateway_backend_ejections_total{backend="p"}')
    assert ejections >= 2, "no half-open trial happened during the outage: the test proves nothing"
    p.set(mode="ok")
    recovered = time.monotonic()
    while await ask() != "p":  # its current ejection has seconds left: only a probe can end it early
        assert time.monotonic() - recovered < 5.0, "the primary was not used again within 5 s of its recovery"
        await asyncio.sleep(0.05)
    back_after = time.monotonic() - recovered
    assert [await ask() for _ in range(5)] == ["p"] * 5
    await asyncio.sleep(0.1)
    stats = await _upstream_stats(p)
    probes = await _metric_sum(gw, 'gateway_probes_total{backend="p"')
    user_attempts = stats["requests"] - probes
    ejections = await _metric_sum(gw, 'gateway_backend_ejections_total{backend="p"}')
    # The first request: 2 attempts (its second ejects the primary: no third, though `retry` allows
    # it); each later ejection is one failed trial of one attempt; then the successful trial and the
    # 5 requests after it.
    assert user_attempts == 2 + (ejections - 1) + 1 + 5, (stats["requests"], probes, ejections, back_after)
    assert await _metric_sum(gw, 'gateway_relay_events_total{event="retry"') == 1  # none once ejected
    assert probes >= 1 and probes <= 10 / 1.0 + 2  # about one a second while ejected, no more
    # Probes are not requests of any tenant's: only the client's own are counted.
    assert await _metric_sum(gw, "gateway_requests_total{") == sent


async def test_request_probes_are_one_per_interval_one_at_a_time_and_can_be_turned_off(upstream, gateway):
    hang = await upstream("hang", mode="error_500")
    down = await upstream("down", mode="error_500")
    off = await upstream("off", mode="error_500")
    health = {"failures_to_eject": 1, "eject_ms": 60_000, "probe_interval_ms": 600_000, "probe_timeout_ms": 5_000}
    gw = await gateway(simple_policy(hang, down, cache={"enabled": False}, health={**health, "recovery_probe_interval_ms": 200}))
    gw_off = await gateway(simple_policy(off, cache={"enabled": False}, health={**health, "recovery_probe_interval_ms": 0}), name="off.yaml")
    # gw last: its recovery probes start 200 ms after the ejection, so the counts below are read
    # at once after its answer (on a loaded machine another request in between took longer).
    for g in (gw_off, gw):
        with pytest.raises(openai.InternalServerError):
            await g.client().chat.completions.create(model="gpt-test", messages=MSG)  # every backend ejected
    assert (hang.stats.requests, down.stats.requests, off.stats.requests) == (1, 1, 1)
    hang.set(mode="hang")
    await asyncio.sleep(1.5)
    assert hang.stats.requests == 2  # one probe, still waiting for its answer: never a second on top
    assert 4 <= down.stats.requests - 1 <= 9  # one every 200 ms
    assert off.stats.requests == 1  # recovery_probe_interval_ms: 0
