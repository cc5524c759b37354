"""What a caller asks for, or how it reads, is never the backend's failure: long whole answers,
clients that stop reading, reasoning models' thinking, answers past a size cap. And what a backend
sends stays bounded in the gateway (the continuation transcript, the model-list probe).

Each of these once ejected a healthy backend for every tenant, or cost a second full generation.
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from gateway.relay import continuation
from gateway.relay.refusal import request_too_large
from gateway.relay.continuation import Transcript
from gateway.routing import probes
from gateway.routing.backends import Backend, BackendState
from gateway.config.policy import BackendPolicy
from gateway.web import sink as web_sink
from gateway.relay import pump as relay_pump
from tests.conftest import simple_policy
from tests.servers import serve_app

MSG = [{"role": "user", "content": "hi"}]


async def _post(gw: Any, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "gpt-test", "messages": MSG, **body}) as r:
            return r.status, dict(r.headers), await r.read()


async def _backends(gw: Any) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/admin/backends") as r:
            return (await r.json())["backends"]


def _model_health(backends: dict[str, Any], name: str) -> tuple[str, int]:
    m = backends[name]["models"]["gpt-test"]
    return m["health"], m["consecutive_failures"]


async def test_a_long_whole_answer_within_its_max_tokens_is_not_a_backend_failure(upstream, gateway):
    """A live first-token deadline of ~2 s (the floor) is no bound for a non-streamed answer of
    400 tokens at 6 ms each: its headers come with its last token."""
    a = await upstream("a", ttft_ms=20, itl_ms=6, tokens=5000)
    b = await upstream("b", ttft_ms=20, itl_ms=6, tokens=5000)
    gw = await gateway(simple_policy(a, b))
    for _ in range(22):  # streamed traffic: live TTFT and inter-token samples for `a`
        assert (await _post(gw, {"stream": True, "max_tokens": 2}))[0] == 200
    started = time.monotonic()
    for _ in range(3):
        status, headers, _ = await _post(gw, {"max_tokens": 400})
        assert status == 200 and headers["x-gateway-backend"] == "a"
    assert time.monotonic() - started < 3 * 2.4 + 2  # each answered once (~2.4 s), never twice
    assert a.stats.cancelled == 0 and b.stats.requests == 0
    assert _model_health(await _backends(gw), "a") == ("healthy", 0)


async def test_a_whole_answer_on_the_last_candidate_may_take_until_total_ms(upstream, gateway):
    """With no backend to fail over to, a whole answer slower than `first_token_ms` (the
    headers' deadline of a stream) still arrives: `total_ms` bounds it."""
    a = await upstream("a", ttft_ms=900, tokens=4)
    gw = await gateway(simple_policy(a, backends={"a": {"url": a.url, "models": ["gpt-test"], "timeouts": {"first_token_ms": 300}}}))
    status, headers, _ = await _post(gw, {})
    assert status == 200 and headers["x-gateway-backend"] == "a"


async def _stalled_reader(port: int, body: dict[str, Any]) -> socket.socket:
    """A client that sends a streamed request, reads the head, then stops reading."""
    loop = asyncio.get_running_loop()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setblocking(False)
    await loop.sock_connect(s, ("127.0.0.1", port))
    raw = orjson.dumps(body)
    await loop.sock_sendall(s, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    # Waits for the head (a non-blocking recv after a fixed 0.3 s found nothing yet on a loaded CI machine).
    head = await asyncio.wait_for(loop.sock_recv(s, 1024), 10)
    assert head.startswith(b"HTTP/1.1 200"), head
    return s


async def test_a_client_that_stops_reading_is_not_a_stalled_backend_and_is_let_go(upstream, gateway, monkeypatch):
    monkeypatch.setattr(web_sink, "CLIENT_READ_S", 2.0)
    monkeypatch.setattr(relay_pump, "CLIENT_READ_S", 2.0)
    a = await upstream("a", tokens=100_000)
    b = await upstream("b", tokens=100_000)
    gw = await gateway(simple_policy(a, b, routing={"cold_idle_ms": 300}))  # a stalled backend: noticed in 0.3 s
    body = {"model": "gpt-test", "messages": MSG, "stream": True}
    readers = [await _stalled_reader(gw.port, body) for _ in range(3)]
    try:
        await asyncio.sleep(1.2)  # 4x the stall deadline, while the gateway waits on its clients
        assert _model_health(await _backends(gw), "a") == ("healthy", 0)
        assert a.stats.requests == 3 and b.stats.requests == 0  # no continuation elsewhere either
        deadline = time.monotonic() + 6
        while a.stats.cancelled < 3 and time.monotonic() < deadline:  # CLIENT_READ_S later: gone
            await asyncio.sleep(0.1)
        assert a.stats.cancelled == 3 and b.stats.requests == 0
        bk = await _backends(gw)
        assert _model_health(bk, "a") == ("healthy", 0) and bk["a"]["inflight"] == 0
    finally:
        for s in readers:
            s.close()
    assert (await _post(gw, {"stream": True}))[0] == 200


def _reasoner(think_chunks: int, stats: dict[str, int]) -> web.Application:
    """A reasoning model's chat stream: `reasoning_content` deltas, then the answer."""

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        stats["requests"] += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            return b"data: " + orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + b"\n\n"

        await resp.write(chunk({"role": "assistant", "content": ""}))
        for i in range(0, think_chunks, 200):
            await resp.write(b"".join(chunk({"reasoning_content": f"step {j}: weighing the options with care. "})
                                      for j in range(i, min(i + 200, think_chunks))))
        await resp.write(chunk({"content": "42"}) + chunk({}, "stop") + b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_a_reasoning_models_thinking_is_output_not_bytes_held_before_it(gateway):
    """12,000 thinking deltas (~2 MiB, past the 1 MiB held before a first token) reach the client
    as they come, and the backend stays healthy."""
    stats = {"requests": 0}
    runner, port = await serve_app(_reasoner(12_000, stats))
    try:
        policy = {"version": 1, "models": {"gpt-test": {"backends": ["r", "r2"], "strategy": "ordered"}},
                  "backends": {"r": {"url": f"http://127.0.0.1:{port}/v1", "models": ["gpt-test"]},
                               "r2": {"url": f"http://127.0.0.1:{port}/v1", "models": ["gpt-test"]}}}
        gw = await gateway(policy)
        status, headers, raw = await _post(gw, {"stream": True})
        assert status == 200 and headers["x-gateway-backend"] == "r" and stats["requests"] == 1
        assert raw.count(b"reasoning_content") == 12_000 and raw.endswith(b"data: [DONE]\n\n")
        assert _model_health(await _backends(gw), "r") == ("healthy", 0)
    finally:
        await runner.cleanup()


def test_a_continuation_does_not_repeat_the_thinking_the_client_already_has():
    t = Transcript()
    t.note({"id": "c", "choices": [{"index": 0, "delta": {"reasoning_content": "hmm"}}]}, "a")
    t.note({"id": "c", "choices": [{"index": 0, "delta": {"content": "The answer"}}]}, "a")
    assert t.continuable and t.text == "The answer"
    resume = continuation.Resume(t, "prefill", "b", "cut")
    assert resume.rewrite({"choices": [{"index": 0, "delta": {"reasoning_content": "let me think again"}}]}) is None
    out = resume.rewrite({"choices": [{"index": 0, "delta": {"reasoning_content": "again", "content": " is 42"}}]})
    assert out is not None and out["choices"][0]["delta"] == {"content": " is 42"}


def test_the_transcript_keeps_at_most_max_chars_then_gives_up_continuing(monkeypatch):
    monkeypatch.setattr(continuation, "MAX_CHARS", 100)
    t = Transcript()
    for _ in range(10):
        t.note({"id": "c", "choices": [{"index": 0, "delta": {"content": "x" * 30}}]}, "a")
    assert not t.continuable and t.parts == [] and t.tokens == 10


async def test_the_model_list_probe_reads_a_bounded_body():
    """A /models answer without end (or a gzip bomb) is cut at the probe's cap: the status decides."""

    async def models(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        await resp.prepare(request)
        bomb = gzip.compress(b" " * (8 << 20))  # 8 MiB of spaces in ~8 KiB
        try:
            while True:
                await resp.write(bomb)
        except ConnectionError:
            pass
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner, port = await serve_app(app)
    try:
        backend = Backend("x", BackendPolicy(url=f"http://127.0.0.1:{port}/v1", models=["m"]), BackendState())
        async with aiohttp.ClientSession() as http:
            started = time.monotonic()
            assert await probes.probe(http, backend, timeout_s=10) is True
            assert time.monotonic() - started < 5
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("completion", [None, 300])
def test_a_whole_answer_of_unknown_decode_time_is_no_ttft_spike_once_streams_taught_real_ones(completion):
    from gateway.routing.latency import Tracker

    tr = Tracker()
    tr.observe_ttft(0.07)
    tr.observe_done(3.0, ok=True, completion_tokens=completion, streamed=False)
    assert tr.predict_ttft() == pytest.approx(0.07)  # no inter-token time yet (or no usage came): no sample
    tr.observe_done(0.05, ok=True, completion_tokens=0, streamed=False)  # nothing decoded (embeddings): all of it
    assert tr.predict_ttft() < 0.07
    whole_only = Tracker()  # a backend that only ever answered whole: durations rank it
    whole_only.observe_done(3.0, ok=True, completion_tokens=completion, streamed=False)
    assert whole_only.predict_ttft() == pytest.approx(3.0)


async def test_a_whole_answer_is_hedged_past_the_p95_of_whole_answers_not_of_first_tokens(upstream, gateway):
    """Streams show a first token in ~5 ms; a whole answer of 12 tokens takes ~0.37 s. Hedging
    whole answers at the first token's P95 would start a second generation for every one."""
    a = await upstream("a", ttft_ms=5, itl_ms=30, tokens=12)
    b = await upstream("b", ttft_ms=5, itl_ms=30, tokens=12)
    policy = simple_policy(a, b)
    policy["models"]["gpt-test"]["hedge"] = {"max_extra_pct": 100, "min_delay_ms": 10, "default_delay_ms": 2000}
    gw = await gateway(policy)
    for _ in range(12):
        assert (await _post(gw, {"stream": True, "max_tokens": 1}))[0] == 200  # a's first-token P95: ~5 ms
    streamed_b = b.stats.requests
    for _ in range(20):
        status, headers, _ = await _post(gw, {})
        assert status == 200
    assert b.stats.requests - streamed_b <= 4  # past the whole answers' own P95 only, not all 20


async def test_a_whole_answer_its_client_does_not_read_is_let_go(upstream, gateway, monkeypatch):
    """aiohttp writes a handler's response with no limit on how long the client takes: 24 unread
    answers of 16 MB held 856 MB until their clients closed, long after the requests were counted
    done (review helper's repro). A whole answer past the socket's buffer is written under the
    same bound as a stream's bytes: the connection is closed, the answer's memory given back."""
    monkeypatch.setattr(web_sink, "CLIENT_READ_S", 1.0)
    a = await upstream("a", tokens=2_000_000)  # ~16 MB as one chat completion: past any socket buffer
    gw = await gateway(simple_policy(a))
    s = await _stalled_reader(gw.port, {"model": "gpt-test", "messages": MSG})
    loop = asyncio.get_running_loop()
    try:
        await asyncio.sleep(2.5)  # reading nothing meanwhile
        closed = False
        try:  # what the socket still holds, then its end: the gateway closed it (a kept connection sends no end)
            while await asyncio.wait_for(loop.sock_recv(s, 1 << 20), 1.0):
                pass
            closed = True
        except TimeoutError:
            pass
        assert closed
    finally:
        s.close()
    assert (await _post(gw, {}))[0] == 200


async def _provider_with_a_tpm(limit: int) -> tuple[Any, str, dict[str, int]]:
    """A provider whose per-minute token limit refuses one request past it on its own (OpenAI's
    429 "Request too large"), and is otherwise rate limited like OpenAI ("Rate limit reached")
    once `seen["busy"]` is set."""
    seen = {"too_large": 0, "ok": 0, "busy": 0, "limited": 0}

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        asked = body.get("max_tokens") or 0
        if asked > limit:
            seen["too_large"] += 1
            msg = f"Request too large for m in organization org-x on tokens per min (TPM): Limit {limit}, Requested {asked}. " \
                  "The input or output tokens must be reduced in order to run successfully."
            return web.json_response({"error": {"message": msg, "type": "tokens", "param": None, "code": "rate_limit_exceeded"}},
                                     status=429, headers={"Retry-After": "20"})
        if seen["busy"]:
            seen["limited"] += 1
            msg = f"Rate limit reached for m in organization org-x on tokens per min (TPM): Limit {limit}, Used {limit - 10}, Requested 20."
            return web.json_response({"error": {"message": msg, "type": "tokens", "param": None, "code": "rate_limit_exceeded"}},
                                     status=429, headers={"Retry-After": "20"})
        seen["ok"] += 1
        return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "pong"}, "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(app)
    return runner, f"http://127.0.0.1:{port}/v1", seen


async def test_a_request_too_large_for_the_providers_limit_cools_nothing_down(gateway):
    """One tenant's `max_tokens: 200000` past a provider's per-minute limit is refused by it with a
    429 and Retry-After 20: the backend was cooled down for every tenant for 20 s, and a failover
    sent the same request on to cool the next one (review helper's repro). It is the request's
    doing: passed back as the provider said it, no other backend asked, nobody paused. A 429 that
    says the provider is busy still pauses it."""
    (ra, url_a, a), (rb, url_b, b) = await _provider_with_a_tpm(30_000), await _provider_with_a_tpm(30_000)
    try:
        gw = await gateway({"backends": {"a": {"url": url_a, "models": ["gpt-test"]}, "b": {"url": url_b, "models": ["gpt-test"]}},
                            "models": {"gpt-test": {"backends": ["a", "b"]}}, "cache": {"enabled": False}})
        status, _, raw = await _post(gw, {"max_tokens": 200_000})
        assert status == 429 and b"Request too large" in raw, raw
        assert a["too_large"] + b["too_large"] == 1  # not sent on to the other backend
        for _ in range(6):
            status, _, raw = await _post(gw, {"max_tokens": 20})
            assert status == 200, raw
        seen = await _backends(gw)
        assert a["ok"] >= 1 and b["ok"] >= 1 and {_model_health(seen, name) for name in ("a", "b")} == {("healthy", 0)}
        a["busy"] = b["busy"] = 1  # now the provider is busy: a real rate limit cools both down
        status, headers, _ = await _post(gw, {"max_tokens": 20})
        assert status == 429 and headers.get("Retry-After") and a["limited"] == b["limited"] == 1
        seen = await _backends(gw)
        assert {_model_health(seen, name)[0] for name in ("a", "b")} == {"cooling"}
    finally:
        await ra.cleanup()
        await rb.cleanup()


@pytest.mark.parametrize(("status", "message", "expected"), [
    (429, "Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 200010.", True),
    (429, "Rate limit reached for gpt-4o on tokens per min (TPM): Limit 30000, Requested 200010.", True),  # past the limit alone
    (429, "Rate limit reached for gpt-4o on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000.", False),
    (429, "Rate limit reached: Limit 30000, Requested 2000. Please try again in 2s.", False),
    (429, "You exceeded your current quota, please check your plan and billing details.", False),
    (400, "Request too large", False),  # a 4xx other than 429 is passed back anyway
])
def test_a_request_too_large_is_told_from_a_busy_provider(status: int, message: str, expected: bool) -> None:
    assert request_too_large(status, orjson.dumps({"error": {"message": message, "type": "tokens"}})) is expected
    assert not request_too_large(status, message.encode())  # not an error body: the status decides
