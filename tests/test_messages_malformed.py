"""Malformed backend events on the Messages paths: an object-valued part (`delta`, `message`,
`content_block`, `error`) that is not an object fails the attempt (a FAILED verdict, the relay's
own error event) instead of raising in the gateway; a broken chat backend fails over."""

from __future__ import annotations

from typing import Any

import anthropic
import orjson
import pytest
from aiohttp import web

from gateway.messages.codec import ChatToMessagesMonitor
from gateway.messages.monitor import AnthropicMonitor
from gateway.messages.stream import BadArguments, ChatToMessagesStream, MalformedChunk, MessagesToChatStream
from gateway.messages.as_chat import AnthropicToChatMonitor
from gateway.relay.continuation import Transcript
from gateway.tenants.auth import hash_key
from gateway.wire.monitor import Verdict
from tests.servers import serve_app

KEY = "sk-test"


def _chunk(choice: Any) -> bytes:
    return orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]})


@pytest.mark.parametrize("choice", [{"index": 0, "delta": "oops"}, {"index": 0, "delta": {"tool_calls": 5}}])
def test_a_chat_chunk_with_a_broken_delta_fails_the_attempt(choice):
    mon = ChatToMessagesMonitor()
    assert mon.feed(_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}})) is Verdict.HELD
    assert mon.feed(_chunk(choice)) is Verdict.FAILED
    assert mon.failure is not None and "malformed" in mon.failure


def test_the_chat_translator_refuses_a_broken_chunk_by_name():
    with pytest.raises(MalformedChunk):
        ChatToMessagesStream("m", "msg_1", 1).feed({"choices": [{"index": 0, "delta": "oops"}]})
    with pytest.raises(MalformedChunk):
        ChatToMessagesStream("m", "msg_1", 1).feed({"choices": 5})


START = b'{"type":"message_start","message":{"id":"msg_1","model":"c","usage":{"input_tokens":3}}}'
BAD_EVENTS = [
    b'{"type":"message_start","message":"x"}',
    b'{"type":"content_block_start","index":0,"content_block":"x"}',
    b'{"type":"content_block_delta","index":0,"delta":"x"}',
    b'{"type":"message_delta","delta":"x","usage":{}}',
    b'{"type":"error","error":"boom"}',
]


@pytest.mark.parametrize("event", BAD_EVENTS, ids=lambda e: orjson.loads(e)["type"])
@pytest.mark.parametrize("make", [lambda: AnthropicMonitor(), lambda: AnthropicMonitor(Transcript()),
                                  lambda: AnthropicToChatMonitor(include_usage=True)],
                         ids=["native", "native+transcript", "as-chat"])
def test_an_anthropic_event_with_a_non_object_part_fails_the_attempt(make, event):
    mon = make()
    first = [] if event.startswith(b'{"type":"message_start"') else [START]
    for ev in first:
        assert mon.feed(ev) is Verdict.HELD
    assert mon.feed(event) is Verdict.FAILED
    assert mon.failure is not None and "malformed" in mon.failure
    assert mon.relays_failure is False  # the broken event never reaches the client: the relay writes the error


def test_the_anthropic_translator_reads_a_non_object_part_as_empty():
    tr = MessagesToChatStream("m", "c")
    for ev in ({"type": "message_start", "message": "x"}, {"type": "content_block_start", "index": 0, "content_block": "x"},
               {"type": "content_block_delta", "index": 0, "delta": "x"}):
        tr.feed(ev)  # no AttributeError
    follow = ChatToMessagesStream("m", "msg_1", 1)
    follow.follow({"type": "message_start", "message": "x"})
    follow.follow({"type": "content_block_start", "index": 0, "content_block": 5})


async def test_a_chat_backend_sending_a_broken_delta_fails_over(upstream, gateway):
    async def broken(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: " + _chunk({"index": 0, "delta": "oops", "finish_reason": None}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", broken)
    runner, port = await serve_app(app)
    try:
        good = await upstream("good")
        gw = await gateway({"backends": {"bad": {"url": f"http://127.0.0.1:{port}/v1", "models": ["m"]},
                                         "good": {"url": good.url, "models": ["m"]}},
                            "models": {"m": {"backends": ["bad", "good"], "strategy": "ordered"}},
                            "reload": {"watch": False}, "cache": {"enabled": False},
                            "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=10) as c:
            async with c.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as s:
                msg = await s.get_final_message()
        assert msg.content and msg.stop_reason is not None and good.stats.requests == 1
    finally:
        await runner.cleanup()


def _tool_chunk(args: str | None, *, name: str | None = "get_weather", finish: str | None = None) -> bytes:
    call: dict[str, Any] = {"index": 0, "function": {}}
    if name is not None:
        call.update(id="call_1", type="function")
        call["function"]["name"] = name
    if args is not None:
        call["function"]["arguments"] = args
    return _chunk({"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": finish})


def _finish(reason: str) -> bytes:
    return _chunk({"index": 0, "delta": {}, "finish_reason": reason})


@pytest.mark.parametrize("first", ["{'city': 'Paris'}", '"Paris"', "[1, 2]", "city=Paris"])
def test_tool_arguments_that_are_no_json_object_fail_the_attempt_before_the_client_gets_them(first):
    # Anthropic's tool input is a JSON object, and the SDK's accumulator raises on anything else.
    mon = ChatToMessagesMonitor()
    mon.feed(_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}}))
    assert mon.feed(_tool_chunk(first)) is Verdict.FAILED
    assert mon.failure is not None and "get_weather" in mon.failure and "JSON" in mon.failure


def test_tool_arguments_checked_whole_at_the_finish_and_left_alone_when_cut_by_length():
    mon = ChatToMessagesMonitor()
    mon.feed(_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}}))
    for piece in ('{"city": ', '"Paris"', "}"):
        assert mon.feed(_tool_chunk(piece, name=None if piece != '{"city": ' else "get_weather")) is Verdict.CONTENT
    assert mon.feed(_finish("tool_calls")) is not Verdict.FAILED
    # A piece after the object closed: each prefix reads as partial JSON, the whole does not.
    mon = ChatToMessagesMonitor()
    mon.feed(_tool_chunk('{"city": "Paris"}'))
    assert mon.feed(_tool_chunk("}", name=None)) is Verdict.CONTENT
    assert mon.feed(_finish("tool_calls")) is Verdict.FAILED and "not JSON" in (mon.failure or "")
    # max_tokens cut the arguments: sent as they are, as Anthropic's own max_tokens answers are.
    mon = ChatToMessagesMonitor()
    mon.feed(_tool_chunk('{"city": "Par'))
    assert mon.feed(_finish("length")) is not Verdict.FAILED
    assert b"max_tokens" in mon.ending


def test_arguments_held_until_the_name_came_are_checked_too():
    tr = ChatToMessagesStream("m", "msg_1", 1)
    tr.feed(orjson.loads(_tool_chunk("{'a'", name=None)))  # no name yet: held, nothing sent
    with pytest.raises(BadArguments):
        tr.feed(orjson.loads(_tool_chunk(None)))  # the name opens the block: the held pieces are checked first


async def _tool_backend(chunks: list[bytes]) -> tuple[web.AppRunner, int]:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(b"data: " + c + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return await serve_app(app)


_TOOLS = [{"name": "get_weather", "description": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


async def test_a_backend_streaming_broken_tool_json_fails_over_and_one_caught_late_ends_with_an_error_event(upstream, gateway):
    role = _chunk({"index": 0, "delta": {"role": "assistant", "content": ""}})
    early, early_port = await _tool_backend([role, _tool_chunk("{'city': 'Paris'}"), _finish("tool_calls")])
    late, late_port = await _tool_backend([role, _chunk({"index": 0, "delta": {"content": "Let me look."}}),
                                          _tool_chunk('{"city": "Paris"}'), _tool_chunk("}", name=None), _finish("tool_calls")])
    try:
        good = await upstream("good")
        backends = {"early": {"url": f"http://127.0.0.1:{early_port}/v1", "models": ["m"]},
                    "late": {"url": f"http://127.0.0.1:{late_port}/v1", "models": ["n"]},
                    "good": {"url": good.url, "models": ["m"]}}
        gw = await gateway({"backends": backends,
                            "models": {"m": {"backends": ["early", "good"], "strategy": "ordered"}, "n": {"backends": ["late"]}},
                            "reload": {"watch": False}, "cache": {"enabled": False},
                            "tenants": {"t": {"key_sha256": [hash_key(KEY)]}}})
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=10) as c:
            # Nothing had reached the client: the next backend answers.
            async with c.messages.stream(model="m", max_tokens=8, tools=_TOOLS, messages=[{"role": "user", "content": "hi"}]) as s:
                msg = await s.get_final_message()
            assert msg.stop_reason is not None and good.stats.requests == 1
            # The text was out already: the stream ends with Anthropic's error event, which the SDK
            # raises as an APIError (not a JSON decoding error inside its accumulator).
            with pytest.raises(anthropic.APIStatusError) as caught:
                async with c.messages.stream(model="n", max_tokens=8, tools=_TOOLS, messages=[{"role": "user", "content": "hi"}]) as s:
                    await s.get_final_message()
            assert "get_weather" in str(caught.value)
    finally:
        await early.cleanup()
        await late.cleanup()


async def test_a_broken_tool_call_is_reported_without_quoting_the_models_output(gateway, caplog):
    """A tenant without `log_payloads`: the arguments the model wrote (cut JSON here) are its
    output, which reaches neither the request log (every viewer key reads it) nor the process log."""
    import aiohttp

    secret = "PATIENT Jane Roe SSN 123-45-6789"
    args = '{"q": "' + secret + '"'
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}

    async def chat(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]}, "finish_reason": "tool_calls"}]})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for c in (_chunk({"index": 0, "delta": {"role": "assistant", "tool_calls": [{"index": 0, **call}]}}), _finish("tool_calls")):
            await resp.write(b"data: " + c + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    runner, port = await serve_app(app)
    viewer = "sk-viewer-of-the-log"
    try:
        gw = await gateway({"backends": {"up": {"url": f"http://127.0.0.1:{port}/v1", "models": ["m"]}},
                            "reload": {"watch": False}, "cache": {"enabled": False},
                            "tenants": {"t": {"key_sha256": [hash_key(KEY)]}},
                            "admin": {"key_sha256": [hash_key("sk-admin-x")], "viewer_key_sha256": [hash_key(viewer)]}})
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEY, max_retries=0, timeout=10) as c:
            with pytest.raises(anthropic.APIStatusError):
                await c.messages.create(model="m", max_tokens=8, tools=_TOOLS, messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(anthropic.APIStatusError):
                async with c.messages.stream(model="m", max_tokens=8, tools=_TOOLS, messages=[{"role": "user", "content": "hi"}]) as s:
                    await s.get_final_message()
        async with aiohttp.ClientSession() as http, http.get(gw.url + "/admin/requests",
                                                             headers={"Authorization": f"Bearer {viewer}"}) as r:
            entries = (await r.json())["data"]
    finally:
        await runner.cleanup()
    errors = [e.get("error") or "" for e in entries]
    assert len(entries) == 2 and all("not a JSON object" in e or "arguments are not JSON" in e for e in errors), errors
    assert not [e for e in errors if "PATIENT" in e], errors
    assert not [rec.getMessage() for rec in caplog.records if "PATIENT" in rec.getMessage()]
