"""/v1/messages, a second review's findings: a chat backend that reports no usage gets the gateway's
estimate in the Message (whole, streamed, and replayed from the cache), not input_tokens 1;
Anthropic's 400s for whitespace-only text, a prefill ending in whitespace, a tool_use answered twice
and blank stop sequences; and errors the HTTP edge answers itself (431, 400, 408, 413, 401) in
Anthropic's shape on /v1/messages paths, OpenAI's elsewhere."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import anthropic
import orjson
import pytest
from aiohttp import web

from gateway.messages.translate import estimate_tokens
from gateway.tenants.auth import hash_key
from tests.rawhttp import Answer, exchange, json_error
from tests.servers import serve_app

KEY = "sk-test"
OK = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
TEXT = ["Hello", " there", " friend"]


def _policy(url: str, **extra: Any) -> dict[str, Any]:
    return {"backends": {"a": {"url": url, "models": ["m"]}}, "reload": {"watch": False},
            "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}, **extra}


_CLIENTS: list[anthropic.AsyncAnthropic] = []


@pytest.fixture(autouse=True)
async def _close_clients():
    yield
    while _CLIENTS:
        await _CLIENTS.pop().close()


def _client(gw: Any) -> anthropic.AsyncAnthropic:
    c = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=10)
    _CLIENTS.append(c)
    return c


# ---- 1. usage a chat backend did not report -----------------------------------------------------------


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    obj = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _usageless_backend(usage: dict[str, Any] | None = None) -> tuple[web.AppRunner, str]:
    """A chat backend that answers TEXT, whole or streamed, with `usage` (none: no usage at all,
    even when the stream asks for it)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            answer: dict[str, Any] = {"id": "c1", "object": "chat.completion", "created": 1, "model": "m", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "".join(TEXT)}, "finish_reason": "stop"}]}
            if usage is not None:
                answer["usage"] = usage
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_chunk({"role": "assistant", "content": ""}))
        for piece in TEXT:
            await resp.write(_chunk({"content": piece}))
        await resp.write(_chunk({}, "stop"))
        if usage is not None:
            await resp.write(b"data: " + orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                                       "choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner, port = await serve_app(app)
    return runner, f"http://127.0.0.1:{port}/v1"


BODY = {"model": "m", "max_tokens": 64, "system": "Be brief, and kind to whoever asks.",
        "messages": [{"role": "user", "content": "Say hello to a friend of mine, in three words or so."}]}


async def test_a_whole_message_without_backend_usage_has_the_gateways_estimate(gateway):
    runner, url = await _usageless_backend()
    try:
        gw = await gateway(_policy(url))
        client = _client(gw)
        msg = await client.messages.create(**BODY)  # type: ignore[arg-type]
        counted = await client.messages.count_tokens(model="m", system=BODY["system"], messages=BODY["messages"])  # type: ignore[arg-type]
    finally:
        await runner.cleanup()
    assert msg.content[0].text == "".join(TEXT)  # type: ignore[union-attr]
    # count_tokens' estimate (was 1: the translator's floor), and output from the text (was 0)
    assert msg.usage.input_tokens == counted.input_tokens == estimate_tokens(BODY) > 10
    assert msg.usage.output_tokens == 5  # "Hello there friend": 18 characters / 4, rounded up


async def test_a_streamed_message_without_backend_usage_has_the_gateways_estimate(upstream, gateway):
    up = await upstream("a", tokens=6, ignore_usage=True)
    gw = await gateway(_policy(up.url))
    async with _client(gw).messages.stream(**BODY) as stream:  # type: ignore[arg-type]
        events = [e async for e in stream]
        final = await stream.get_final_message()
    start = next(e for e in events if e.type == "message_start")
    assert start.message.usage.input_tokens == estimate_tokens(BODY) > 10  # type: ignore[union-attr]
    assert final.usage.input_tokens == estimate_tokens(BODY) and final.usage.output_tokens == 6


async def test_a_backends_own_counts_still_win_and_a_missing_completion_count_is_estimated(gateway):
    runner, url = await _usageless_backend(usage={"prompt_tokens": 42})
    try:
        gw = await gateway(_policy(url))
        client = _client(gw)
        whole = await client.messages.create(**BODY)  # type: ignore[arg-type]
        async with client.messages.stream(**BODY) as stream:  # type: ignore[arg-type]
            streamed = await stream.get_final_message()
    finally:
        await runner.cleanup()
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (42, 5)
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (42, 3)  # 3 pieces streamed


async def test_a_cached_stream_without_usage_replays_the_estimate(gateway):
    runner, url = await _usageless_backend()
    try:
        gw = await gateway(_policy(url, cache={"enabled": True}))
        client = _client(gw)
        body = {**BODY, "temperature": 0}
        async with client.messages.stream(**BODY, extra_body={"temperature": 0}) as stream:  # type: ignore[arg-type]
            first = await stream.get_final_message()
        for _ in range(50):  # stored as the stream ends: a moment after the client has it
            async with aiohttp.ClientSession() as http:
                async with http.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
                    hit, replayed = r.headers.get("x-gateway-cache"), await r.json()
            if hit == "hit":
                break
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()
    assert first.usage.input_tokens == estimate_tokens(body)
    assert hit == "hit" and replayed["usage"]["input_tokens"] == estimate_tokens(body), replayed
    assert replayed["usage"]["output_tokens"] == 5


# ---- 2, 3. what Anthropic refuses ------------------------------------------------------------------


def _turns(*turns: tuple[str, Any]) -> dict[str, Any]:
    return {**OK, "messages": [{"role": r, "content": c} for r, c in turns]}


_TOOLS = [{"name": "f", "input_schema": {"type": "object"}}]
_CALL = [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]
_RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": "ok"}

REFUSED = [
    (_turns(("user", " \n\t")), "messages[0]", "text content blocks must contain non-whitespace text"),
    (_turns(("user", [{"type": "text", "text": "  "}, {"type": "text", "text": "\n"}])), "messages[0]",
     "text content blocks must contain non-whitespace text"),
    (_turns(("user", "hi"), ("assistant", "ok"), ("user", [{"type": "text", "text": " "}])), "messages[2]", "non-whitespace"),
    (_turns(("user", "hi"), ("assistant", "Sure, ")), "messages", "final assistant content cannot end with trailing whitespace"),
    (_turns(("user", "hi"), ("assistant", [{"type": "text", "text": "Sure"}, {"type": "text", "text": "then\n"}])),
     "messages", "trailing whitespace"),
    ({**OK, "system": [{"type": "text", "text": " "}]}, "system", "non-whitespace"),
    ({**OK, "system": [{"type": "text", "text": ""}]}, "system[0].text", "empty"),
    ({**OK, "stop_sequences": ["END", ""]}, "stop_sequences", "each stop sequence must be non-empty"),
    ({**OK, "stop_sequences": ["\n\n"]}, "stop_sequences", "each stop sequence must contain non-whitespace"),
    ({**_turns(("user", "hi"), ("assistant", _CALL), ("user", [_RESULT, _RESULT])), "tools": _TOOLS},
     "messages[2].content[1]", "each tool_use must have a single result"),
]


@pytest.mark.parametrize("body,param,words", REFUSED, ids=[f"{p}:{w[:30]}" for _, p, w in REFUSED])
async def test_what_anthropic_refuses_is_its_400_naming_the_field_and_reaches_no_backend(upstream, gateway, body, param, words):
    up = await upstream("a")
    gw = await gateway(_policy(up.url))
    async with aiohttp.ClientSession() as http:
        for path, sent in (("/v1/messages", body), ("/v1/messages/count_tokens", {k: v for k, v in body.items() if k != "max_tokens"})):
            async with http.post(gw.url + path, json=sent, headers={"x-api-key": KEY}) as r:
                answer = await r.json(content_type=None)
            assert r.status == 400, (path, answer)
            assert answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
            assert words in answer["error"]["message"] and param in answer["error"]["message"], answer
    assert up.stats.requests == 0


ALLOWED = [
    _turns(("user", [{"type": "text", "text": " "}, {"type": "text", "text": "hi"}])),  # Anthropic takes it (probed)
    _turns(("user", "hi"), ("assistant", "")),  # an empty prefill
    _turns(("user", "hi"), ("assistant", "Sure,")),
    _turns(("user", "hi"), ("assistant", "Sure, "), ("user", "go on")),  # only the final turn's end counts
    {**OK, "stop_sequences": [" END", "\nHuman:"]},
    {**OK, "system": " "},  # not confirmed for a string: passed on
]


@pytest.mark.parametrize("body", ALLOWED, ids=range(len(ALLOWED)))
async def test_what_anthropic_takes_is_still_answered(upstream, gateway, body):
    up = await upstream("a", tokens=3)
    policy = _policy(up.url)
    policy["backends"]["a"]["prefill"] = True  # continues a final assistant turn
    gw = await gateway(policy)
    async with aiohttp.ClientSession() as http, http.post(gw.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
        answer = await r.json(content_type=None)
    assert r.status == 200 and answer["type"] == "message", answer


# ---- 4. errors the HTTP edge answers itself ---------------------------------------------------------


def _anthropic_error(a: Answer, status: int) -> dict[str, Any]:
    assert a.status == status, (a.status, a.raw[:300])
    assert a.ctype.startswith("application/json"), a.raw[:300]
    body = orjson.loads(a.body)
    assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
    return body["error"]


def _head(path: str, extra: str = "") -> str:
    return f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"


EDGE = {
    "a head over max_header_bytes": (lambda p: (_head(p) + "".join(f"X-H{i}: {'v' * 1000}\r\n" for i in range(40)) + "\r\n").encode(),
                                     431, "request_header_fields_too_large"),
    "a header line of 9000 bytes": (lambda p: (_head(p, "X-Big: " + "b" * 9000 + "\r\n") + "Content-Length: 2\r\n\r\n{}").encode(),
                                    431, "request_header_fields_too_large"),
    "200 headers": (lambda p: (_head(p) + "".join(f"X-H{i}: v\r\n" for i in range(200)) + "Content-Length: 2\r\n\r\n{}").encode(),
                    431, "request_header_fields_too_large"),
    "two Content-Lengths": (lambda p: (_head(p) + "Content-Length: 2\r\nContent-Length: 3\r\n\r\n{} ").encode(),
                            400, "malformed_request"),
    "a bare LF in a header": (lambda p: (_head(p) + "X-Probe: a\nX-Other: b\r\nContent-Length: 2\r\n\r\n{}").encode(),
                              400, "malformed_request"),
    "an unknown Expect": (lambda p: (_head(p) + "Expect: 100-maybe\r\nContent-Length: 2\r\n\r\n{}").encode(), 417, None),
    "a body over the limit with Expect": (lambda p: (_head(p, "Expect: 100-continue\r\n") + f"x-api-key: {KEY}\r\n"
                                                     "Content-Length: 999999\r\n\r\n").encode(), 413, None),
    "no key with Expect": (lambda p: (_head(p, "Expect: 100-continue\r\n") + "Content-Length: 2\r\n\r\n").encode(), 401, None),
}


@pytest.mark.parametrize("name", list(EDGE))
async def test_edge_errors_on_v1_messages_are_anthropic_shaped_and_openai_shaped_elsewhere(upstream, gateway, name):
    up = await upstream("a")
    gw = await gateway(_policy(up.url, server={"max_header_bytes": 16384, "max_body_bytes": 65536}))
    make, status, code = EDGE[name]
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/messages?beta=true"):
        a = await asyncio.to_thread(exchange, gw.port, make(path), (), timeout=5)
        err = _anthropic_error(a, status)
        assert err["type"] == ("authentication_error" if status == 401 else "request_too_large" if status == 413
                               else "invalid_request_error"), (path, err)
        if code is not None:
            assert err["details"]["error_code"] == code, err
    a = await asyncio.to_thread(exchange, gw.port, make("/v1/chat/completions"), (), timeout=5)
    assert a.status == status and json_error(a.body) is not None, a.raw[:300]  # OpenAI's, as before
    assert up.stats.requests == 0


async def test_a_head_that_never_ends_on_v1_messages_is_an_anthropic_shaped_408(upstream, gateway):
    up = await upstream("a")
    gw = await gateway(_policy(up.url, server={"header_timeout_ms": 300}))
    for path, anthropic_shape in (("/v1/messages", True), ("/v1/chat/completions", False)):
        pieces = [b"POST " + path.encode(), b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"]  # the line in two reads, no blank line
        a = await asyncio.to_thread(exchange, gw.port, pieces[0], pieces[1:], timeout=5, pause_s=0.05, wait_close=True)
        if anthropic_shape:
            assert _anthropic_error(a, 408)["type"] == "invalid_request_error"
        else:
            assert a.status == 408 and json_error(a.body) is not None, a.raw[:300]
        assert a.closed
