"""Failover before the first byte, and honest endings after it."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import openai
import orjson
import pytest

from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _stream_text(client, **kw) -> str:
    s = await client.chat.completions.create(model="gpt-test", messages=MSG, stream=True, **kw)
    return "".join([c.choices[0].delta.content or "" async for c in s if c.choices])


async def _metric(gw, name: str) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            return "\n".join(line for line in (await r.text()).splitlines() if line.startswith(name))


async def test_connection_refused_fails_over_to_the_next_backend(upstream, gateway):
    good = await upstream("good", tokens=3)
    policy = simple_policy(good)
    policy["backends"]["dead"] = {"url": f"http://127.0.0.1:{_free_port()}/v1", "models": ["gpt-test"]}
    policy["models"]["gpt-test"]["backends"] = ["dead", "good"]
    gw = await gateway(policy)
    raw = await gw.client().chat.completions.with_raw_response.create(model="gpt-test", messages=MSG)
    assert raw.parse().choices[0].message.content == "w0 w1 w2 "
    assert raw.headers["x-gateway-backend"] == "good"
    assert await _stream_text(gw.client()) == "w0 w1 w2 "
    assert 'kind="connect"' in await _metric(gw, "gateway_upstream_errors_total")
    assert 'backend="good"' in await _metric(gw, "gateway_failovers_total")


@pytest.mark.parametrize("mode", ["error_500", "error_401", "garbage"])
async def test_5xx_and_broken_answers_fail_over(upstream, gateway, mode):
    bad = await upstream("bad", mode=mode)
    good = await upstream("good", tokens=2)
    gw = await gateway(simple_policy(bad, good))
    r = await gw.client().chat.completions.create(model="gpt-test", messages=MSG)
    assert r.choices[0].message.content == "w0 w1 "
    assert bad.stats.requests == 1 and good.stats.requests == 1


async def test_429_with_retry_after_cools_the_backend_and_is_not_hammered(upstream, gateway):
    busy = await upstream("busy", mode="error_429", retry_after_s=30)
    good = await upstream("good", tokens=2)
    gw = await gateway(simple_policy(busy, good))
    for _ in range(5):
        r = await gw.client().chat.completions.create(model="gpt-test", messages=MSG)
        assert r.choices[0].message.content == "w0 w1 "
    assert busy.stats.requests == 1  # asked once, then left alone for its 30 s
    assert good.stats.requests == 5


async def test_when_every_backend_asks_to_back_off_the_client_gets_429_with_retry_after(upstream, gateway):
    busy = await upstream("busy", mode="error_429", retry_after_s=7)
    gw = await gateway(simple_policy(busy))
    for _ in range(2):
        with pytest.raises(openai.RateLimitError) as exc:
            await gw.client().chat.completions.create(model="gpt-test", messages=MSG)
        assert 1 <= int(exc.value.response.headers["retry-after"]) <= 7
    assert busy.stats.requests == 1


async def test_a_400_from_the_backend_is_passed_back_and_not_retried(upstream, gateway):
    picky = await upstream("picky", mode="error_400")
    other = await upstream("other")
    gw = await gateway(simple_policy(picky, other))
    with pytest.raises(openai.BadRequestError) as exc:
        await gw.client().chat.completions.create(model="gpt-test", messages=MSG)
    assert "fake upstream picky says 400" in exc.value.message
    assert picky.stats.requests == 1 and other.stats.requests == 0


async def test_every_failure_is_listed_when_all_backends_fail(upstream, gateway):
    a = await upstream("a", mode="error_500")
    b = await upstream("b", mode="error_502")
    gw = await gateway(simple_policy(a, b))
    with pytest.raises(openai.InternalServerError) as exc:
        await gw.client().chat.completions.create(model="gpt-test", messages=MSG)
    assert exc.value.status_code == 502
    assert "a: HTTP 500" in exc.value.message and "b: HTTP 502" in exc.value.message


async def test_attempts_are_bounded(upstream, gateway):
    ups = [await upstream(f"u{i}", mode="error_500") for i in range(4)]
    gw = await gateway(simple_policy(*ups, server={"max_attempts": 2}))
    with pytest.raises(openai.InternalServerError):
        await gw.client().chat.completions.create(model="gpt-test", messages=MSG)
    assert [u.stats.requests for u in ups] == [1, 1, 0, 0]


async def test_a_stream_stalled_before_its_first_token_is_abandoned_at_the_deadline(upstream, gateway):
    stuck = await upstream("stuck", mode="stall")
    good = await upstream("good", tokens=3)
    policy = simple_policy(stuck, good)
    policy["backends"]["stuck"]["timeouts"] = {"first_token_ms": 300}
    gw = await gateway(policy)
    t0 = time.perf_counter()
    assert await _stream_text(gw.client()) == "w0 w1 w2 "
    assert 0.3 <= time.perf_counter() - t0 < 2.0
    await asyncio.sleep(0.05)
    assert stuck.stats.cancelled == 1  # the abandoned upstream request was closed
    assert 'kind="first_token_timeout"' in await _metric(gw, "gateway_upstream_errors_total")


async def test_a_hung_backend_is_abandoned_without_streaming_too(upstream, gateway):
    stuck = await upstream("stuck", mode="hang")
    good = await upstream("good", tokens=1)
    policy = simple_policy(stuck, good)
    policy["backends"]["stuck"]["timeouts"] = {"first_token_ms": 200, "total_ms": 200}
    gw = await gateway(policy)
    r = await gw.client().chat.completions.create(model="gpt-test", messages=MSG)
    assert r.choices[0].message.content == "w0 "


async def test_the_request_deadline_header_bounds_the_whole_request(upstream, gateway):
    stuck = await upstream("stuck", mode="hang")
    gw = await gateway(simple_policy(stuck))
    t0 = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as exc:
        await gw.client().chat.completions.create(model="gpt-test", messages=MSG, extra_headers={"x-request-timeout-ms": "250"})
    assert exc.value.status_code == 504
    assert time.perf_counter() - t0 < 1.5


async def test_a_backend_dying_mid_stream_gives_an_error_event_and_no_done_without_continuation(upstream, gateway):
    flaky = await upstream("flaky", mode="disconnect", fail_after=3, tokens=10)
    spare = await upstream("spare")
    gw = await gateway(simple_policy(flaky, spare, routing={"continuation": False}))
    parts = []
    with pytest.raises(openai.APIError) as exc:
        s = await gw.client().chat.completions.create(model="gpt-test", messages=MSG, stream=True)
        async for c in s:
            parts.append(c.choices[0].delta.content or "")
    assert "".join(parts) == "w0 w1 w2 "  # what was sent stays sent; nothing replayed elsewhere
    assert "mid-stream" in str(exc.value.message)
    assert spare.stats.requests == 0
    assert 'kind="cut_mid_stream"' in await _metric(gw, "gateway_upstream_errors_total")


async def test_a_backend_dying_mid_stream_is_continued_on_the_next_backend(upstream, gateway):
    flaky = await upstream("flaky", mode="disconnect", fail_after=3, tokens=10)
    spare = await upstream("spare", tokens=10)
    gw = await gateway(simple_policy(flaky, spare))
    chunks = []
    s = await gw.client().chat.completions.create(model="gpt-test", messages=MSG, stream=True)
    async for c in s:
        chunks.append(c)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(f"w{i} " for i in range(10))  # one seamless answer, nothing twice
    assert len({c.id for c in chunks}) == 1 and len({c.model for c in chunks}) == 1
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish and finish[-1].model_extra["x_gateway"]["backends"] == ["flaky", "spare"]
    assert spare.stats.requests == 1
    assert 'event="continuation",reason="restart"' in await _metric(gw, "gateway_relay_events_total")


@pytest.mark.parametrize("mode", ["cut", "error_event"])
async def test_a_stream_cut_before_its_finish_reason_is_never_a_success(upstream, gateway, mode):
    up = await upstream("a", mode=mode, fail_after=2, tokens=5)  # one backend: nothing to continue on
    gw = await gateway(simple_policy(up))
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": True})
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", data=body) as r:
            raw = await r.read()
    assert b"[DONE]" not in raw
    assert raw.rstrip().split(b"\n\n")[-1].startswith(b'data: {"error"')


async def test_a_stream_with_its_finish_reason_but_no_done_is_completed_at_once(upstream, gateway):
    up = await upstream("a", mode="no_done", tokens=3)
    gw = await gateway(simple_policy(up))
    t0 = time.perf_counter()
    assert await _stream_text(gw.client()) == "w0 w1 w2 "
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize("mode", ["no_done", "ok"])
async def test_a_stream_without_the_usage_its_client_asked_for_ends_with_the_gateways_estimate(upstream, gateway, mode):
    """Cut after its finish reason (no_done), or from a backend that ignores stream_options: the
    client that asked for usage still gets its usage chunk (the figures the quota charges), the
    last before [DONE]; a client that did not ask gets none."""
    up = await upstream("a", mode=mode, tokens=3, ignore_usage=True)
    gw = await gateway(simple_policy(up))
    client = gw.client()
    s = await client.chat.completions.create(model="gpt-test", messages=MSG, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in s]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "w0 w1 w2 "
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None, last
    assert last.usage.completion_tokens == 3 and last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + 3
    assert {c.id for c in chunks} == {chunks[0].id} and last.model == chunks[0].model
    assert [c for c in chunks[:-1] if c.usage is not None] == []
    plain = await client.chat.completions.create(model="gpt-test", messages=MSG, stream=True)
    assert [c async for c in plain if c.usage is not None or not c.choices] == []


async def test_malformed_chunks_are_dropped_and_counted(upstream, gateway):
    up = await upstream("a", mode="malformed", fail_after=1, tokens=4)
    gw = await gateway(simple_policy(up))
    assert await _stream_text(gw.client()) == "w0 w1 w2 w3 "
    assert 'gateway_stream_malformed_chunks_total{backend="a"} 1.0' in await _metric(gw, "gateway_stream_malformed")


async def test_an_error_before_the_first_token_fails_over(upstream, gateway):
    bad = await upstream("bad", mode="error_event", fail_after=0, tokens=3)
    good = await upstream("good", tokens=2)
    gw = await gateway(simple_policy(bad, good))
    assert await _stream_text(gw.client()) == "w0 w1 "


async def test_a_stream_that_goes_idle_mid_way_is_ended_with_an_error(upstream, gateway):
    up = await upstream("a", tokens=3, itl_ms=1500)
    policy = simple_policy(up)
    policy["backends"]["a"]["timeouts"] = {"idle_ms": 200}
    gw = await gateway(policy)
    with pytest.raises(openai.APIError) as exc:
        await _stream_text(gw.client())
    assert "stalled" in str(exc.value.message)


async def test_heartbeats_keep_a_slow_stream_open_and_failover_still_works(upstream, gateway):
    stuck = await upstream("stuck", mode="stall")
    good = await upstream("good", tokens=2, ttft_ms=300)
    policy = simple_policy(stuck, good, server={"heartbeat_after_ms": 100, "heartbeat_interval_ms": 100})
    policy["backends"]["stuck"]["timeouts"] = {"first_token_ms": 400}
    gw = await gateway(policy)
    body = orjson.dumps({"model": "gpt-test", "messages": MSG, "stream": True})
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", data=body) as r:
            assert r.status == 200
            raw = await r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[0] == b": keep-alive"  # heartbeats came first, while nothing was known
    data = [orjson.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    assert "".join(d["choices"][0]["delta"].get("content") or "" for d in data if d["choices"]) == "w0 w1 "
    assert events[-1] == b"data: [DONE]"


async def test_fast_failures_still_get_a_real_status_before_heartbeats_start(upstream, gateway):
    bad = await upstream("bad", mode="error_500")
    gw = await gateway(simple_policy(bad, server={"heartbeat_after_ms": 2000}))
    with pytest.raises(openai.InternalServerError):
        await _stream_text(gw.client())


async def test_when_every_backend_is_full_requests_wait_for_a_slot_and_say_how_long(upstream, gateway):
    up = await upstream("a", tokens=2, ttft_ms=200)
    policy = simple_policy(up)
    policy["backends"]["a"]["max_concurrency"] = 1
    gw = await gateway(policy)
    c = gw.client()
    first, second = await asyncio.gather(
        c.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG),
        c.chat.completions.with_raw_response.create(model="gpt-test", messages=MSG),
    )
    waits = sorted(float(r.headers["x-gateway-queue-ms"]) for r in (first, second))
    assert waits[0] == 0 and waits[1] >= 100
    assert up.stats.requests == 2


async def test_a_full_backend_that_stays_full_past_the_deadline_gives_503(upstream, gateway):
    up = await upstream("a", tokens=2, ttft_ms=1500)
    policy = simple_policy(up)
    policy["backends"]["a"]["max_concurrency"] = 1
    gw = await gateway(policy)
    c = gw.client()
    slow = asyncio.create_task(c.chat.completions.create(model="gpt-test", messages=MSG))
    await asyncio.sleep(0.2)
    with pytest.raises(openai.APIStatusError) as exc:
        await c.chat.completions.create(model="gpt-test", messages=MSG, extra_headers={"x-request-timeout-ms": "300"})
    assert exc.value.status_code in (503, 504)
    await slow
