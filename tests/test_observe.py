"""Where the time went: the Server-Timing header, the per-stage histograms, the JSON access log
(no prompt text unless asked) and the OpenTelemetry export (to a fake OTLP/HTTP collector)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.web.drain import Drain
from gateway.web.keys import OBSERVER
from gateway.observe.observer import parse_traceparent
from gateway.process.workers import WorkerInfo, share
from tests.conftest import simple_policy


def _durations(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name = part.strip().split(";")[0]
        m = re.search(r"dur=([0-9.]+)", part)
        if m:
            out[name] = float(m.group(1))
    return out


async def test_server_timing_splits_gateway_queue_upstream_and_first_token(gateway, upstream):
    up = await upstream("a", ttft_ms=80, tokens=3)
    gw = await gateway(simple_policy(up))
    c = gw.client()
    raw = await c.chat.completions.with_raw_response.create(
        model="gpt-test", messages=[{"role": "user", "content": "hi"}], stream=True, temperature=1
    )
    async for _ in raw.parse():
        pass
    st = _durations(raw.headers["server-timing"])
    assert {"gateway", "queue", "upstream", "ttft", "total"} <= set(st), raw.headers["server-timing"]
    assert st["ttft"] >= 70 and st["gateway"] < st["ttft"] and st["upstream"] < st["ttft"]
    # A non-streamed answer and a cache hit say so too.
    body = {"model": "gpt-test", "messages": [{"role": "user", "content": "cached"}], "temperature": 0}
    async with aiohttp.ClientSession() as http:
        for expect_hit in (False, True):
            async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                await r.read()
                header = r.headers["server-timing"]
            assert ('cache;desc="hit"' in header) is expect_hit, header
            assert "total" in _durations(header)
        async with http.get(gw.url + "/metrics") as r:
            text = await r.text()
    for stage in ("gateway", "queue", "upstream_headers", "first_token", "decode"):
        assert f'gateway_stage_seconds_count{{stage="{stage}"}}' in text, stage


@pytest.fixture
def captured_access_log(capsys):
    """The access log's stdout (its writer thread writes to the sys.stdout of its start)."""
    yield capsys
    logging.getLogger("gateway.access").handlers[:] = []


async def test_the_access_log_is_one_json_line_per_request_without_the_prompt(gateway, upstream, captured_access_log):
    up = await upstream("a", tokens=2)
    gw = await gateway(simple_policy(up, log={"access": True}))
    c = gw.client()
    await c.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "secret prompt"}])
    s = await c.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "streamed"}], stream=True)
    async for _ in s:
        pass
    gw.app[OBSERVER].close()  # flushes the writer thread
    out = captured_access_log.readouterr().out
    lines = [orjson.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 2
    first = lines[0]
    for field in ("request_id", "tenant", "model", "class", "backend", "cache", "status", "ttft_ms", "duration_ms",
                  "prompt_tokens", "completion_tokens", "gateway_ms", "queue_ms", "upstream_headers_ms"):
        assert field in first, field
    assert first["status"] == 200 and first["backend"] == "a" and first["model"] == "gpt-test"
    assert lines[1]["stream"] is True and lines[1]["ttft_ms"] is not None and "first_token_ms" in lines[1]
    assert "secret prompt" not in out


async def test_the_access_log_carries_the_prompt_only_when_the_policy_asks(gateway, upstream, captured_access_log):
    up = await upstream("a", tokens=1)
    gw = await gateway(simple_policy(up, log={"access": True, "prompts": True}))
    await gw.client().chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "visible prompt"}])
    gw.app[OBSERVER].close()
    assert "visible prompt" in captured_access_log.readouterr().out


@contextlib.asynccontextmanager
async def _otlp_collector() -> AsyncIterator[tuple[str, list[Any]]]:
    """A fake OTLP/HTTP collector on loopback: its URL, and the spans it got (after the exporter flushed)."""
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans: list[Any] = []

    async def traces(request: web.Request) -> web.Response:
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        spans.extend(s for rs in msg.resource_spans for ss in rs.scope_spans for s in ss.spans)
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1/traces", spans
    finally:
        await runner.cleanup()


async def _flush(gw) -> None:
    # The exporter posts from its own thread, and blocks it until our loop answers.
    await asyncio.get_running_loop().run_in_executor(None, gw.app[OBSERVER].close)


async def test_spans_go_to_an_otlp_collector(gateway, upstream):
    async with _otlp_collector() as (url, spans):
        up = await upstream("a", tokens=1)
        gw = await gateway(simple_policy(up, tracing={"otlp_endpoint": url, "service_name": "gw-test"}))
        await gw.client().chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "traced"}])
        await _flush(gw)
        assert len(spans) == 1
        attrs = {a.key: a.value for a in spans[0].attributes}
        assert attrs["gen_ai.request.model"].string_value == "gpt-test"
        assert attrs["gateway.backend"].string_value == "a"
        assert "gateway.stage.upstream_headers_ms" in attrs
        assert spans[0].end_time_unix_nano > spans[0].start_time_unix_nano
        assert not spans[0].parent_span_id  # no traceparent: a trace of its own


async def test_a_callers_traceparent_makes_the_span_its_child_and_decides_sampling(gateway, upstream):
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    async with _otlp_collector() as (url, spans):
        up = await upstream("a", tokens=1)
        # sample_ratio 0: only a caller's sampled flag gets a span exported.
        gw = await gateway(simple_policy(up, tracing={"otlp_endpoint": url, "sample_ratio": 0.0}))
        client = gw.client()
        msgs = [{"role": "user", "content": "traced"}]
        await client.chat.completions.create(model="gpt-test", messages=msgs, extra_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
        await client.chat.completions.create(model="gpt-test", messages=msgs, extra_headers={"traceparent": f"00-{'1' * 32}-{parent}-00"})
        await client.chat.completions.create(model="gpt-test", messages=msgs)  # ratio 0, no parent: not sampled
        # Invalid: a new trace, sampled by the ratio (0), and still answered.
        r = await client.chat.completions.create(model="gpt-test", messages=msgs, extra_headers={"traceparent": "00-zz-00-01"})
        assert r.choices[0].message.content
        await _flush(gw)
        assert len(spans) == 1
        assert spans[0].trace_id.hex() == trace_id and spans[0].parent_span_id.hex() == parent


@pytest.mark.parametrize(
    ("header", "parsed"),
    [
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)),
        (" 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00 ", (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 0)),
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future", (0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7, 1)),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra", None),  # version 00 has exactly four fields
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None),
        ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", None),  # upper case is invalid
        ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", None),
        ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None),
        ("", None),
        (None, None),
        ("00-" + "a" * 600, None),
    ],
)
def test_traceparent_parsing_follows_the_w3c_rules(header: str | None, parsed: tuple[int, int, int] | None) -> None:
    assert parse_traceparent(header) == parsed


def test_max_concurrency_shares_add_up_across_workers():
    for limit in (1, 2, 4, 5, 64):
        for n in (1, 2, 3, 4):
            parts = [share(limit, WorkerInfo(i, n, None)) for i in range(n)]  # type: ignore[arg-type]
            assert sum(parts) == max(limit, n) and max(parts) - min(parts) <= 1


async def test_drain_waits_for_requests_in_flight_within_its_bound():
    d = Drain()
    assert await d.wait_idle(0.01)
    d.enter()
    asyncio.get_running_loop().call_later(0.05, d.leave)
    assert await d.wait_idle(5)
    d.enter()
    assert not await d.wait_idle(0.05)
