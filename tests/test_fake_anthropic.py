"""The fake Anthropic Messages API (tests/fake_anthropic.py) behaves as Anthropic's API does: the
official anthropic SDK reads it (plain, streamed, tool use, stop sequences, count_tokens, prompt
caching, models), and raw HTTP checks each validation rule and fault. Real sockets on 127.0.0.1;
every test takes well under a second (the script test about two)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest

from tests.fake_anthropic import FakeAnthropic, prompt_tokens, validate

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-ant-test"
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}  # what a raw client (and the gateway) sends
MODEL = "claude-fake-1"
USER = [{"role": "user", "content": "Hello there"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
                     "required": ["city"]},
}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}


@pytest.fixture
async def fake() -> AsyncIterator[FakeAnthropic]:
    f = await FakeAnthropic("t", key=KEY, words=5).start()
    try:
        yield f
    finally:
        await f.stop()


@pytest.fixture
async def client(fake: FakeAnthropic) -> AsyncIterator[anthropic.AsyncAnthropic]:
    # The SDK adds /v1/... itself: its base_url is the fake's root, not its /v1 url.
    c = anthropic.AsyncAnthropic(api_key=KEY, base_url=fake.root, max_retries=0, timeout=10)
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        yield s


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 100, "messages": copy.deepcopy(USER), **extra}


async def _post(http: aiohttp.ClientSession, fake: FakeAnthropic, body: Any, headers: dict[str, str] | None = None,
                path: str = "/messages") -> tuple[int, Any, Any]:
    kw: dict[str, Any] = {"data": body} if isinstance(body, (bytes, str)) else {"json": body}
    async with http.post(fake.url + path, headers=HEADERS if headers is None else headers, **kw) as r:
        return r.status, await r.json(content_type=None), r.headers.copy()  # case-insensitive


def _assert_error(status: int, body: Any, want_status: int, kind: str, text: str = "") -> None:
    assert status == want_status, body
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    assert text.lower() in body["error"]["message"].lower(), body
    assert body["request_id"].startswith("req_")


async def _events(http: aiohttp.ClientSession, fake: FakeAnthropic, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A stream's (event, data) pairs, checking the SSE framing of each: `event: X\\ndata: {...}\\n\\n`, data.type X."""
    async with http.post(fake.url + "/messages", json=body, headers=HEADERS) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    return _parse(raw)


def _parse(raw: str) -> list[tuple[str, dict[str, Any]]]:
    assert raw.endswith("\n\n") or raw == ""
    out = []
    for frame in raw.split("\n\n")[:-1]:
        lines = frame.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), frame
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name
        out.append((name, data))
    return out


# -- the official SDK as the client ------------------------------------------------------------------


async def test_sdk_plain_message(fake: FakeAnthropic, client: anthropic.AsyncAnthropic) -> None:
    m = await client.messages.create(model=MODEL, max_tokens=100, messages=USER)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == "w0 w1 w2 w3 w4"
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.output_tokens == 5 and m.usage.input_tokens > 0
    assert m.usage.cache_read_input_tokens == 0 and m.usage.cache_creation_input_tokens == 0
    # The SDK 2.14 sends its api_key as a Bearer token, and anthropic-version 2026-10-21.
    assert fake.stats.last_auth == "bearer" and fake.stats.auth == {"bearer": 1}
    assert fake.stats.last_headers["Authorization"] == f"Bearer {KEY}" and "x-api-key" not in fake.stats.last_headers
    assert fake.stats.last_headers["anthropic-version"]
    assert fake.stats.requests == 1 and fake.stats.by_status == {200: 1} and fake.stats.completed == 1
    assert fake.stats.last_body["messages"] == USER


async def test_sdk_max_tokens_cuts_the_answer(client: anthropic.AsyncAnthropic) -> None:
    m = await client.messages.create(model=MODEL, max_tokens=3, messages=USER)
    assert m.content[0].text == "w0 w1 w2" and m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


async def test_sdk_stream(fake: FakeAnthropic, client: anthropic.AsyncAnthropic) -> None:
    async with client.messages.stream(model=MODEL, max_tokens=100, messages=USER) as s:
        pieces = [t async for t in s.text_stream]
        final = await s.get_final_message()
    assert pieces == ["w0", " w1", " w2", " w3", " w4"]
    assert final.content[0].text == "w0 w1 w2 w3 w4" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 5 and final.usage.input_tokens > 0
    assert fake.stats.streams == 1 and fake.stats.completed == 1


async def test_sdk_tool_use_round_trip(fake: FakeAnthropic, client: anthropic.AsyncAnthropic) -> None:
    fake.set(tool_call="get_weather")
    first = await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, TIME], messages=USER)
    assert [b.type for b in first.content] == ["text", "tool_use"] and first.stop_reason == "tool_use"
    call = first.content[1]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert call.input == {"city": "x", "unit": "c"}  # made from the input_schema
    follow = [
        *USER,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C"}]},
    ]
    second = await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, TIME], messages=follow)
    assert second.stop_reason == "end_turn" and second.content[0].text == "w0 w1 w2 w3 w4"  # no loop
    # The same round trip streamed: the SDK accumulates the input_json_delta pieces.
    async with client.messages.stream(model=MODEL, max_tokens=100, tools=[WEATHER], messages=USER) as s:
        streamed = await s.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[1].input == {"city": "x", "unit": "c"}


async def test_sdk_tool_input_knob_and_parallel_calls(fake: FakeAnthropic, client: anthropic.AsyncAnthropic) -> None:
    fake.set(tool_call="get_weather,get_time,not_offered", tool_input={"city": "Paris"}, tool_text=None)
    m = await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, TIME], messages=USER)
    assert [(b.type, b.name, b.input) for b in m.content] == [("tool_use", "get_weather", {"city": "Paris"}),
                                                             ("tool_use", "get_time", {"city": "Paris"})]
    assert m.content[0].id != m.content[1].id
    m = await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, TIME], messages=USER,
                                     tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    assert [b.name for b in m.content] == ["get_weather"]


async def test_sdk_tool_triggers(fake: FakeAnthropic, client: anthropic.AsyncAnthropic) -> None:
    ask = [{"role": "user", "content": "please use_tool:get_time now"}]
    m = await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, TIME], messages=ask)
    assert m.stop_reason == "tool_use" and m.content[-1].name == "get_time"
    m = await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, TIME], messages=ask, tool_choice={"type": "none"})
    assert m.stop_reason == "end_turn" and [b.type for b in m.content] == ["text"]
    m = await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, TIME], messages=USER)
    assert m.stop_reason == "end_turn"  # tools offered, nothing asks for one
    m = await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, TIME], messages=USER,
                                     tool_choice={"type": "tool", "name": "get_time"})
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "get_time")]  # forced: no text first
    m = await client.messages.create(model=MODEL, max_tokens=100, tools=[WEATHER, TIME], messages=USER, tool_choice={"type": "any"})
    assert [(b.type, b.name) for b in m.content] == [("tool_use", "get_weather")]
    m = await client.messages.create(model=MODEL, max_tokens=100, messages=ask)
    assert m.stop_reason == "end_turn"  # no tools offered


async def test_sdk_stop_sequence(client: anthropic.AsyncAnthropic) -> None:
    m = await client.messages.create(model=MODEL, max_tokens=100, messages=USER, stop_sequences=["zz", "w3"])
    assert m.content[0].text == "w0 w1 w2" and m.stop_reason == "stop_sequence" and m.stop_sequence == "w3"
    assert m.usage.output_tokens == 3
    async with client.messages.stream(model=MODEL, max_tokens=100, messages=USER, stop_sequences=["w2"]) as s:
        final = await s.get_final_message()
    assert final.content[0].text == "w0 w1" and final.stop_reason == "stop_sequence" and final.stop_sequence == "w2"
    m = await client.messages.create(model=MODEL, max_tokens=100, messages=USER, stop_sequences=["nope"])
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    m = await client.messages.create(model=MODEL, max_tokens=100, messages=USER, stop_sequences=["w0"])
    assert m.content == [] and m.stop_reason == "stop_sequence" and m.usage.output_tokens == 1  # stopped at once


async def test_sdk_count_tokens(fake: FakeAnthropic, client: anthropic.AsyncAnthropic) -> None:
    msgs = [{"role": "user", "content": "x" * 400}]
    counted = await client.messages.count_tokens(model=MODEL, messages=msgs, system="be brief", tools=[WEATHER])
    assert counted.input_tokens == prompt_tokens({"messages": msgs, "system": "be brief", "tools": [WEATHER]}) > 100
    m = await client.messages.create(model=MODEL, max_tokens=10, messages=msgs, system="be brief", tools=[WEATHER])
    assert m.usage.input_tokens == counted.input_tokens  # no cache_control: the same count
    assert fake.stats.count_tokens == 1 and fake.stats.requests == 1


async def test_sdk_prompt_caching(fake: FakeAnthropic, client: anthropic.AsyncAnthropic) -> None:
    system = [{"type": "text", "text": "You are a careful assistant. " * 40, "cache_control": {"type": "ephemeral"}}]
    first = await client.messages.create(model=MODEL, max_tokens=10, system=system, messages=USER)
    u1 = first.usage
    assert u1.cache_creation_input_tokens > 200 and u1.cache_read_input_tokens == 0 and u1.input_tokens > 0
    second = await client.messages.create(model=MODEL, max_tokens=10, system=system, messages=USER)
    u2 = second.usage
    assert u2.cache_read_input_tokens == u1.cache_creation_input_tokens and u2.cache_creation_input_tokens == 0
    assert u2.input_tokens == u1.input_tokens  # the uncached rest
    # A longer conversation with a second breakpoint: the system prefix is read, the rest up to it written.
    longer = [*USER, {"role": "assistant", "content": "w0 w1"},
              {"role": "user", "content": [{"type": "text", "text": "more " * 50, "cache_control": {"type": "ephemeral"}}]}]
    third = await client.messages.create(model=MODEL, max_tokens=10, system=system, messages=longer)
    u3 = third.usage
    assert u3.cache_read_input_tokens == u1.cache_creation_input_tokens and u3.cache_creation_input_tokens > 50
    total = (await client.messages.count_tokens(model=MODEL, system=system, messages=longer)).input_tokens
    # input_tokens is the uncached rest, at least 1 (here the breakpoint is the prompt's end).
    assert u3.input_tokens == max(1, total - u3.cache_read_input_tokens - u3.cache_creation_input_tokens) == 1
    # Streamed: message_start carries the cache counts; the SDK keeps them in the final usage.
    async with client.messages.stream(model=MODEL, max_tokens=10, system=system, messages=longer) as s:
        u4 = (await s.get_final_message()).usage
    assert u4.cache_read_input_tokens == u3.cache_read_input_tokens + u3.cache_creation_input_tokens
    assert u4.cache_creation_input_tokens == 0
    # Another model has its own cache; a prefix under cache_min_tokens is not cached at all.
    other = await client.messages.create(model="claude-fake-2", max_tokens=10, system=system, messages=USER)
    assert other.usage.cache_creation_input_tokens == u1.cache_creation_input_tokens
    fake.clear_cache()
    fake.set(cache_min_tokens=100_000)
    small = await client.messages.create(model=MODEL, max_tokens=10, system=system, messages=USER)
    assert small.usage.cache_creation_input_tokens == 0 and small.usage.cache_read_input_tokens == 0
    assert fake.stats.cache_writes == 3 and fake.stats.cache_reads == 3


async def test_sdk_top_level_cache_control(client: anthropic.AsyncAnthropic) -> None:
    msgs = [{"role": "user", "content": "y" * 800}]
    first = await client.messages.create(model=MODEL, max_tokens=10, messages=msgs, cache_control={"type": "ephemeral"})
    again = await client.messages.create(model=MODEL, max_tokens=10, messages=msgs, cache_control={"type": "ephemeral"})
    assert first.usage.cache_creation_input_tokens > 150 and again.usage.cache_read_input_tokens == first.usage.cache_creation_input_tokens


async def test_sdk_models_and_errors(fake: FakeAnthropic, client: anthropic.AsyncAnthropic) -> None:
    page = await client.models.list()
    assert [m.id for m in page.data] == ["claude-fake-1", "claude-fake-2"] and page.has_more is False
    assert (await client.models.retrieve("claude-fake-2")).display_name
    with pytest.raises(anthropic.NotFoundError):
        await client.models.retrieve("claude-nope")
    fake.set(fail_status=529, fail_count=1)
    with pytest.raises(anthropic.OverloadedError):
        await client.messages.create(model=MODEL, max_tokens=10, messages=USER)
    assert (await client.messages.create(model=MODEL, max_tokens=10, messages=USER)).stop_reason == "end_turn"
    fake.set(fail_status=429, fail_count=1, retry_after_s=0)
    with pytest.raises(anthropic.RateLimitError):
        await client.messages.create(model=MODEL, max_tokens=10, messages=USER)
    fake.set(error_event_after=2)
    with pytest.raises(anthropic.APIStatusError, match="overloaded_error"):
        async with client.messages.stream(model=MODEL, max_tokens=10, messages=USER) as s:
            await s.get_final_message()
    bad = anthropic.AsyncAnthropic(api_key="wrong", base_url=fake.root, max_retries=0, timeout=10)
    try:
        with pytest.raises(anthropic.AuthenticationError):
            await bad.messages.create(model=MODEL, max_tokens=10, messages=USER)
    finally:
        await bad.close()
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        await client.messages.create(model=MODEL, max_tokens=10, messages=USER, extra_body={"temperature": 1.5})


# -- auth, headers and the other endpoints (raw HTTP) ---------------------------------------------------


async def test_auth_headers(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    status, body, hdrs = await _post(http, fake, _body())
    assert status == 200 and hdrs["request-id"].startswith("req_") and fake.stats.last_auth == "x-api-key"
    _assert_error(*(await _post(http, fake, _body(), {"anthropic-version": "2023-06-01"}))[:2], 401, "authentication_error", "x-api-key")
    _assert_error(*(await _post(http, fake, _body(), {**HEADERS, "x-api-key": "nope"}))[:2], 401, "authentication_error")
    _assert_error(*(await _post(http, fake, _body(), {"x-api-key": KEY}))[:2], 400, "invalid_request_error", "anthropic-version")
    bearer = {"authorization": f"Bearer {KEY}", "anthropic-version": "2023-06-01"}
    assert (await _post(http, fake, _body(), bearer))[0] == 200 and fake.stats.last_auth == "bearer"
    assert fake.stats.auth == {"x-api-key": 2, "bearer": 1}
    fake.set(allow_bearer=False)
    _assert_error(*(await _post(http, fake, _body(), bearer))[:2], 401, "authentication_error")
    fake.set(key=None)  # any key
    assert (await _post(http, fake, _body(), {**HEADERS, "x-api-key": "anything"}))[0] == 200
    assert fake.stats.by_status == {200: 3, 401: 3, 400: 1}


async def test_models_health_count_tokens_and_404(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    async with http.get(fake.url + "/models", headers=HEADERS) as r:
        body = await r.json()
        assert r.status == 200 and body["has_more"] is False and body["first_id"] == "claude-fake-1"
        assert body["data"][0] == {"type": "model", "id": "claude-fake-1", "display_name": "Claude Fake 1",
                                   "created_at": "2025-01-01T00:00:00Z"}
    async with http.get(fake.url + "/models", headers={"anthropic-version": "2023-06-01"}) as r:
        _assert_error(r.status, await r.json(), 401, "authentication_error")
    async with http.get(fake.url + "/models", headers={"x-api-key": KEY}) as r:
        _assert_error(r.status, await r.json(), 400, "invalid_request_error", "anthropic-version")
    async with http.get(fake.root + "/health") as r:
        assert r.status == 200
    async with http.get(fake.url + "/nothing", headers=HEADERS) as r:
        _assert_error(r.status, await r.json(), 404, "not_found_error")
    status, body, _ = await _post(http, fake, {"model": MODEL, "messages": USER}, path="/messages/count_tokens")
    assert status == 200 and body == {"input_tokens": prompt_tokens({"messages": USER})}
    status, body, _ = await _post(http, fake, _body(), path="/messages/count_tokens")
    _assert_error(status, body, 400, "invalid_request_error", "max_tokens: Extra inputs are not permitted")
    status, body, _ = await _post(http, fake, {"model": MODEL, "messages": USER}, {"x-api-key": KEY}, path="/messages/count_tokens")
    _assert_error(status, body, 400, "invalid_request_error", "anthropic-version")
    status, body, _ = await _post(http, fake, b"{not json")
    _assert_error(status, body, 400, "invalid_request_error", "json")


# -- validation: each rule, raw ---------------------------------------------------------------------------


def _without(key: str) -> dict[str, Any]:
    b = _body()
    del b[key]
    return b


ASSISTANT_CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}]}
RESULT_1 = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 C"}

INVALID = {
    "missing model": (_without("model"), "model"),
    "empty model": (_body(model=""), "model"),
    "missing max_tokens": (_without("max_tokens"), "max_tokens: Field required"),
    "max_tokens 0": (_body(max_tokens=0), "max_tokens"),
    "max_tokens string": (_body(max_tokens="5"), "max_tokens"),
    "max_tokens bool": (_body(max_tokens=True), "max_tokens"),
    "missing messages": (_without("messages"), "messages"),
    "empty messages": (_body(messages=[]), "messages"),
    "system role": (_body(messages=[{"role": "system", "content": "be brief"}, *USER]), 'Unexpected role "system"'),
    "tool role": (_body(messages=[*USER, {"role": "tool", "content": "x"}]), "'user' or 'assistant'"),
    "starts with assistant": (_body(messages=[{"role": "assistant", "content": "hi"}, *USER]), "first message"),
    "two user turns": (_body(messages=[*USER, *USER]), "alternate"),
    "two assistant turns": (_body(messages=[*USER, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]), "alternate"),
    "stream_options": (_body(stream=True, stream_options={"include_usage": True}), "stream_options: Extra inputs"),
    "n": (_body(n=1), "n: Extra inputs"),
    "user": (_body(user="u1"), "user: Extra inputs"),
    "max_completion_tokens": (_body(max_completion_tokens=5), "max_completion_tokens: Extra inputs"),
    "response_format": (_body(response_format={"type": "json_object"}), "response_format: Extra inputs"),
    "unknown key": (_body(frobnicate=1), "frobnicate: Extra inputs"),
    "message extra key": (_body(messages=[{"role": "user", "content": "q", "name": "bob"}]), "messages.0.name"),
    "temperature above 1": (_body(temperature=1.5), "temperature"),
    "temperature negative": (_body(temperature=-0.1), "temperature"),
    "top_p above 1": (_body(top_p=2), "top_p"),
    "stream not bool": (_body(stream="yes"), "stream"),
    "stop_sequences string": (_body(stop_sequences="w3"), "stop_sequences"),
    "metadata extra": (_body(metadata={"user_id": "u", "x": 1}), "metadata"),
    "system not text": (_body(system=[{"type": "image"}]), "system.0"),
    "empty system block": (_body(system=[{"type": "text", "text": ""}]), "non-whitespace"),
    "empty string content": (_body(messages=[{"role": "user", "content": ""}]), "non-empty"),
    "empty content list": (_body(messages=[{"role": "user", "content": []}]), "non-empty"),
    "empty text block": (_body(messages=[{"role": "user", "content": [{"type": "text", "text": ""}]}]), "non-whitespace"),
    "whitespace text block": (_body(messages=[{"role": "user", "content": [{"type": "text", "text": "  \n"}]}]), "non-whitespace"),
    "empty assistant text mid-conversation": (
        _body(messages=[*USER, {"role": "assistant", "content": [{"type": "text", "text": ""}, ASSISTANT_CALL["content"][0]]},
                        {"role": "user", "content": [RESULT_1]}]), "non-whitespace"),
    "openai image_url block": (_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]), "image_url"),
    "tool_result without tool_use": (_body(messages=[{"role": "user", "content": [RESULT_1]}]), "corresponding `tool_use`"),
    "tool_result for another id": (
        _body(messages=[*USER, ASSISTANT_CALL, {"role": "user", "content": [{**RESULT_1, "tool_use_id": "toolu_2"}]}]), "toolu_2"),
    "tool_result two turns later": (
        _body(messages=[*USER, ASSISTANT_CALL, {"role": "user", "content": [RESULT_1]}, {"role": "assistant", "content": "ok"},
                        {"role": "user", "content": [RESULT_1]}]), "corresponding `tool_use`"),
    "tool_use unanswered by the next turn": (
        _body(messages=[*USER, ASSISTANT_CALL, {"role": "user", "content": "and?"}]), "without `tool_result`"),
    "tool_use unanswered at the end": (_body(messages=[*USER, ASSISTANT_CALL]), "without `tool_result`"),
    "tool_result after text": (
        _body(messages=[*USER, ASSISTANT_CALL, {"role": "user", "content": [{"type": "text", "text": "here"}, RESULT_1]}]), "first"),
    "tool_use in a user turn": (_body(messages=[{"role": "user", "content": ASSISTANT_CALL["content"]}]), "assistant"),
    "tool_use without input": (
        _body(messages=[*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "n"}]}]), "input"),
    "openai-shaped tool": (
        _body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]), "input_schema"),
    "tool without input_schema": (_body(tools=[{"name": "f", "description": "d"}]), "input_schema"),
    "tool with parameters": (_body(tools=[{"name": "f", "parameters": {"type": "object"}, "input_schema": {"type": "object"}}]), "parameters"),
    "tool bad name": (_body(tools=[{"name": "a b", "input_schema": {"type": "object"}}]), "name"),
    "tool schema not object": (_body(tools=[{"name": "f", "input_schema": {"type": "string"}}]), "input_schema.type"),
    "tools not a list": (_body(tools={"name": "f"}), "tools"),
    "tool_choice string": (_body(tools=[WEATHER], tool_choice="auto"), "tool_choice"),
    "tool_choice openai object": (_body(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice"),
    "tool_choice unknown tool": (_body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), "nope"),
    "tool_choice any without tools": (_body(tool_choice={"type": "any"}), "tool_choice"),
}


@pytest.mark.parametrize("case", list(INVALID))
async def test_validation_rejects(case: str, fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    body, text = INVALID[case]
    status, answer, hdrs = await _post(http, fake, body)
    _assert_error(status, answer, 400, "invalid_request_error", text)
    assert hdrs["request-id"] == answer["request_id"]
    assert fake.stats.by_status == {400: 1} and fake.stats.completed == 0


VALID = {
    "a round trip": [*USER, ASSISTANT_CALL, {"role": "user", "content": [RESULT_1, {"type": "text", "text": "thanks"}]}],
    "tool_result with block content": [*USER, ASSISTANT_CALL, {"role": "user", "content": [
        {**RESULT_1, "content": [{"type": "text", "text": "3 C"}], "is_error": False}]}],
    "an empty final assistant prefill": [*USER, {"role": "assistant", "content": ""}],
    "an image": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                                              {"type": "text", "text": "what is it?"}]}],
}


@pytest.mark.parametrize("case", list(VALID))
async def test_validation_accepts(case: str, fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    status, answer, _ = await _post(http, fake, _body(messages=VALID[case], tools=[WEATHER]))
    assert status == 200, answer
    assert answer["type"] == "message"


async def test_sdk_fields_and_relaxed_knobs(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    # Newer top-level fields the SDK sends are known; sampling fields within range too.
    extra = {"cache_control": {"type": "ephemeral"}, "inference_geo": "us", "service_tier": "auto", "temperature": 1,
             "top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u"}, "system": "short", "stop_sequences": ["x"],
             "tools": [WEATHER, {"type": "web_search_20250305", "name": "web_search"}], "tool_choice": {"type": "auto"}}
    assert (await _post(http, fake, _body(**extra)))[0] == 200
    fake.set(strict_keys=False, alternate=False)
    assert (await _post(http, fake, _body(frobnicate=1, messages=[*USER, *USER])))[0] == 200
    status, body, _ = await _post(http, fake, _body(n=1))  # OpenAI-only fields stay refused
    _assert_error(status, body, 400, "invalid_request_error", "n: Extra inputs")
    validate(_body())  # the validator on its own, for other tests' use
    with pytest.raises(Exception, match="max_tokens"):
        validate(_body(), count=True)


async def test_prefill_is_continued(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    status, body, _ = await _post(http, fake, _body(messages=[*USER, {"role": "assistant", "content": "w0 w1"}]))
    assert status == 200 and body["content"] == [{"type": "text", "text": " w2 w3 w4"}] and body["stop_reason"] == "end_turn"


# -- streams, raw -------------------------------------------------------------------------------------------


async def test_stream_events_exactly(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    events = await _events(http, fake, _body(stream=True, max_tokens=3))
    names = [n for n, _ in events]
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * 3, "content_block_stop",
                     "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant" and start["model"] == MODEL
    assert start["usage"]["input_tokens"] > 0 and start["id"].startswith("msg_")
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert [d["delta"] for _, d in events[3:6]] == [{"type": "text_delta", "text": t} for t in ("w0", " w1", " w2")]
    assert events[6][1] == {"type": "content_block_stop", "index": 0}
    assert events[7][1] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                            "usage": {"output_tokens": 3}}
    assert events[8][1] == {"type": "message_stop"}


async def test_stream_tool_use_events(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    fake.set(tool_call="get_weather", tool_input={"city": "Paris", "unit": "c"})
    events = await _events(http, fake, _body(stream=True, tools=[WEATHER]))
    starts = [d for n, d in events if n == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1] and starts[0]["content_block"]["type"] == "text"
    tool = starts[1]["content_block"]
    assert tool["type"] == "tool_use" and tool["name"] == "get_weather" and tool["input"] == {} and tool["id"].startswith("toolu_")
    pieces = [d["delta"]["partial_json"] for n, d in events if n == "content_block_delta" and d["index"] == 1]
    assert pieces[0] == "" and len(pieces) > 3 and all(d["delta"]["type"] == "input_json_delta"
                                                       for n, d in events if n == "content_block_delta" and d["index"] == 1)
    assert json.loads("".join(pieces)) == {"city": "Paris", "unit": "c"}
    assert any(_broken(p) for p in pieces[1:])  # split mid-token: parse the whole, never each piece
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["delta"]["stop_reason"] == "tool_use" and delta["usage"]["output_tokens"] > 0
    assert [n for n, _ in events][-1] == "message_stop"


def _broken(piece: str) -> bool:
    try:
        json.loads(piece)
        return False
    except ValueError:
        return True


async def test_stream_timing(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    fake.set(ttft_ms=150, itl_ms=40)
    t0 = time.monotonic()
    first = last = 0.0
    async with http.post(fake.url + "/messages", json=_body(stream=True), headers=HEADERS) as r:
        async for line in r.content:
            if line.startswith(b"event: content_block_delta") and not first:
                first = time.monotonic() - t0
        last = time.monotonic() - t0
    assert 0.14 <= first < 1.0 and last >= first + 4 * 0.04 - 0.01
    t0 = time.monotonic()
    assert (await _post(http, fake, _body(max_tokens=2)))[0] == 200
    assert time.monotonic() - t0 >= 0.15 + 0.04 - 0.01


# -- faults -------------------------------------------------------------------------------------------------


async def test_fail_status_529(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    fake.set(fail_status=529, fail_count=2)
    for _ in range(2):
        status, body, hdrs = await _post(http, fake, _body(stream=True))
        _assert_error(status, body, 529, "overloaded_error", "Overloaded")
        assert "retry-after" not in {k.lower() for k in hdrs}  # a 529 usually has none
    assert (await _post(http, fake, _body()))[0] == 200
    assert fake.stats.by_status == {529: 2, 200: 1} and fake.stats.faults == 2
    # An invalid request is refused before any fault, and does not use one up.
    fake.set(fail_status=500, fail_count=1)
    assert (await _post(http, fake, _body(n=2)))[0] == 400
    _assert_error(*(await _post(http, fake, _body()))[:2], 500, "api_error")


async def test_fail_status_429_with_retry_after_and_always(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    fake.set(fail_status=429, fail_count=1, retry_after_s=2)
    status, body, hdrs = await _post(http, fake, _body())
    _assert_error(status, body, 429, "rate_limit_error")
    assert hdrs["retry-after"] == "2"
    async with http.get(fake.url + "/models", headers=HEADERS) as r:
        assert r.status == 200  # a 429 on messages leaves the models list up
    fake.set(fail_status=529, fail_count=0, retry_after_s=None)  # every request, until set() changes it
    for _ in range(3):
        assert (await _post(http, fake, _body()))[0] == 529
    async with http.get(fake.url + "/models", headers=HEADERS) as r:
        _assert_error(r.status, await r.json(), 529, "overloaded_error")  # down everywhere: health probes see it
    fake.set(fail_status=0)
    assert (await _post(http, fake, _body()))[0] == 200


async def test_cut_stream_closes_the_connection(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    fake.set(cut_after=2)
    got = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(fake.url + "/messages", json=_body(stream=True), headers=HEADERS) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                got += chunk
    events = _parse(got.decode())
    assert [d["delta"]["text"] for n, d in events if n == "content_block_delta"] == ["w0", " w1"]
    assert "message_stop" not in [n for n, _ in events] and "message_delta" not in [n for n, _ in events]
    assert fake.stats.faults == 1 and fake.stats.completed == 0
    # A JSON request gets no answer at all.
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await _post(http, fake, _body())
    assert fake.stats.by_status == {200: 1, 0: 1}  # 0: closed without an answer


async def test_cut_clean_and_cut_before_any_word(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    fake.set(cut_after=3, cut_clean=True)
    events = await _events(http, fake, _body(stream=True))  # a clean EOF: no error reading
    assert [n for n, _ in events][-1] == "content_block_delta" and len([n for n, _ in events if n == "content_block_delta"]) == 3
    fake.set(cut_after=0)
    assert [n for n, _ in await _events(http, fake, _body(stream=True))] == ["message_start"]
    fake.set(cut_after=50)  # more than the answer has: it strikes after the last block
    names = [n for n, _ in await _events(http, fake, _body(stream=True))]
    assert names[-1] == "content_block_stop" and "message_stop" not in names


async def test_error_event_mid_stream(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    fake.set(error_event_after=2)
    events = await _events(http, fake, _body(stream=True))
    names = [n for n, _ in events]
    assert names == ["message_start", "content_block_start", "ping", "content_block_delta", "content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    assert (await _post(http, fake, _body()))[0] == 200  # streams only


async def test_control_and_stats_endpoints(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    async with http.post(fake.root + "/_control", json={"words": 2, "models": ["m1"], "tool_call": ["a", "b"]}) as r:
        assert (await r.json())["words"] == 2
    assert fake.behaviour.models == ("m1",) and fake.behaviour.tool_call == "a,b"
    status, body, _ = await _post(http, fake, _body())
    assert body["content"][0]["text"] == "w0 w1"
    async with http.get(fake.root + "/_stats") as r:
        stats = await r.json()
    assert stats["requests"] == 1 and stats["by_status"] == {"200": 1} and stats["last_body"]["model"] == MODEL


async def test_concurrent_requests_counted(fake: FakeAnthropic, http: aiohttp.ClientSession) -> None:
    import asyncio

    fake.set(ttft_ms=100)
    results = await asyncio.gather(*(_post(http, fake, _body()) for _ in range(4)))
    assert [r[0] for r in results] == [200] * 4 and fake.stats.peak_active == 4 and fake.stats.active == 0
    assert len({r[1]["id"] for r in results}) == 4


def test_script_runs_and_exits_by_itself() -> None:
    """`python -m tests.fake_anthropic --port 0 --key K --words N --fail-status S --fail-count C --max-seconds T`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.fake_anthropic", "--port", "0", "--key", "k1", "--words", "3",
         "--fail-status", "529", "--fail-count", "1", "--max-seconds", "1.5"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        line = proc.stdout.readline().decode()  # type: ignore[union-attr]
        assert "fake anthropic" in line and "http://127.0.0.1:" in line
        url = line.split(" on ")[1].split()[0]
        assert url.endswith("/v1")
        req = urllib.request.Request(url + "/messages", data=json.dumps(_body()).encode(), method="POST",
                                     headers={"x-api-key": "k1", "anthropic-version": "2023-06-01", "content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 529 and json.loads(e.value.read())["error"]["type"] == "overloaded_error"
        with urllib.request.urlopen(req, timeout=5) as r:
            assert json.loads(r.read())["content"][0]["text"] == "w0 w1 w2"
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
