"""The response cache's building blocks: key, rules, entries, stream assembly, replay (read back by
the official openai SDK over a real socket), the fail-open Cache, and single flight."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
import redis.asyncio as aredis
from aiohttp import web

from gateway.cache.core import Cache, SingleFlight, cache_control, cache_key, cacheable_request
from gateway.cache.entry import Entry, StreamAssembler, entry_from_response, replay_json, replay_sse
from gateway.store.core import MemoryStore, Store, StoreError
from gateway.store.redis_store import RedisStore

REDIS_URL = "redis://127.0.0.1:6379/13"
BASE: dict[str, Any] = {
    "model": "gpt-test",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}],
    "temperature": 0,
}


def key(body: dict[str, Any], namespace: str = "acme", endpoint: str = "chat", model: str = "gpt-test") -> str:
    return cache_key(namespace, endpoint, model, body)


# --- the key ---


def test_key_is_versioned_and_ignores_field_order_and_whitespace() -> None:
    k = key(BASE)
    assert k.startswith("gwc:v1:") and len(k) == len("gwc:v1:") + 16 + 1 + 64
    reordered = dict(reversed(list(BASE.items())))
    reordered["messages"] = [dict(reversed(list(m.items()))) for m in BASE["messages"]]
    assert key(reordered) == k
    spaced = b'{ "temperature" : 0 ,\n "messages": [ {"content": "Be brief.", "role": "system"},\n'
    spaced += b' {"role":"user","content":"Capital of France?"} ], "model": "gpt-test" }'
    assert key(orjson.loads(spaced)) == k
    assert key({**BASE, "temperature": 0.0}) == k  # 0 and 0.0 are the same sampling


ANSWER_CHANGING = {
    "temperature": 0.7,
    "top_p": 0.5,
    "max_tokens": 10,
    "max_completion_tokens": 10,
    "stop": ["\n"],
    "seed": 7,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "response_format": {"type": "json_object"},
    "n": 2,
    "logit_bias": {"50256": -100},
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "logprobs": True,
    "reasoning_effort": "low",
    "x_vendor_knob": 1,  # unknown fields count: a needless miss beats a wrong answer
}


@pytest.mark.parametrize("field", sorted(ANSWER_CHANGING))
def test_each_answer_changing_parameter_changes_the_key(field: str) -> None:
    assert key({**BASE, field: ANSWER_CHANGING[field]}) != key(BASE)


def test_answer_changing_parameters_give_distinct_keys() -> None:
    keys = {key({**BASE, f: v}) for f, v in ANSWER_CHANGING.items()}
    assert len(keys) == len(ANSWER_CHANGING)


def test_messages_namespace_endpoint_and_model_change_the_key() -> None:
    k = key(BASE)
    other_prompt = {**BASE, "messages": [*BASE["messages"][:1], {"role": "user", "content": "Capital of Spain?"}]}
    other_role = {**BASE, "messages": [{**BASE["messages"][0], "role": "developer"}, BASE["messages"][1]]}
    assert len({k, key(other_prompt), key(other_role), key(BASE, namespace="globex"),
                key(BASE, endpoint="completions"), key(BASE, model="gpt-other")}) == 6


TRANSPORT = {
    "stream": True,
    "stream_options": {"include_usage": True},
    "user": "u-42",
    "safety_identifier": "s-42",
    "metadata": {"team": "search"},
    "service_tier": "priority",
    "store": True,
    "prompt_cache_key": "abc",
    "model": "upstream-spelling",  # the public model is passed to cache_key separately
}


@pytest.mark.parametrize("field", sorted(TRANSPORT))
def test_transport_fields_do_not_change_the_key(field: str) -> None:
    assert key({**BASE, field: TRANSPORT[field]}) == key(BASE)


# --- what may be cached ---


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({}, None),
        ({"temperature": 0.0, "n": 1}, None),
        ({"temperature": 0.9, "seed": 1}, None),
        ({"temperature": None, "seed": 0}, None),
        ({"temperature": None}, "no temperature 0 or seed (default temperature is 1)"),
        ({"temperature": 0.2}, "temperature > 0 without seed"),
        ({"n": 3}, "n > 1"),
        ({"logprobs": True}, "logprobs requested"),
        ({"logprobs": False}, None),
    ],
)
def test_cacheable_request_rules(extra: dict[str, Any], reason: str | None) -> None:
    body = {k: v for k, v in {**BASE, **extra}.items() if v is not None}
    assert cacheable_request(body) == reason


def test_a_request_without_temperature_counts_as_its_backends_default() -> None:
    """Cacheable when every backend that may answer it decodes greedily by default; the reason
    names those that sample."""
    body = {k: v for k, v in BASE.items() if k != "temperature"}
    assert cacheable_request(body, default_temperatures={"local": 0.0}) is None
    assert cacheable_request(body, default_temperatures={"local": 0.0, "b": 0.0}) is None
    assert cacheable_request(body, default_temperatures={"local": 0.0, "openai": 1.0}) == (
        "no temperature 0 or seed, and backend 'openai' (1) samples by default (default_temperature)"
    )
    assert cacheable_request(body, default_temperatures={"a": 0.7, "b": 1.0}) == (
        "no temperature 0 or seed, and backends 'a' (0.7), 'b' (1) sample by default (default_temperature)"
    )
    # An explicit temperature or a seed decides as before, whatever the defaults.
    assert cacheable_request({**body, "temperature": 0.5}, default_temperatures={"local": 0.0}) == "temperature > 0 without seed"
    assert cacheable_request({**body, "seed": 3}, default_temperatures={"openai": 1.0}) is None
    assert cacheable_request(body, require_deterministic=False, default_temperatures={"openai": 1.0}) is None


def test_policy_may_cache_sampled_requests_but_never_several_choices() -> None:
    assert cacheable_request({**BASE, "temperature": 1.0}, require_deterministic=False) is None
    assert cacheable_request({**BASE, "temperature": 1.0, "n": 2}, require_deterministic=False) == "n > 1"


@pytest.mark.parametrize(
    ("header", "expected"),
    [(None, (False, False)), ("no-cache", (True, False)), ("No-Store", (False, True)),
     ("max-age=0, no-cache, no-store", (True, True)), ("no-transform", (False, False))],
)
def test_cache_control_directives(header: str | None, expected: tuple[bool, bool]) -> None:
    assert cache_control(header) == expected


# --- entries ---

CHAT = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "gpt-test-0125",
    "system_fingerprint": "fp_1",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris. " * 30}, "logprobs": None,
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 61, "total_tokens": 73},
}
TEXT = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1700000000,
    "model": "gpt-test-instruct",
    "choices": [{"index": 0, "text": " Paris, the capital of France — café ☕", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 10, "total_tokens": 14},
}
TOOL = {
    "id": "chatcmpl-2",
    "object": "chat.completion",
    "created": 1700000001,
    "model": "gpt-test",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"tz":"CET"}'}},
    ]}, "logprobs": None, "finish_reason": "stop"}],  # a forced tool_choice finishes with "stop"
    "usage": {"prompt_tokens": 30, "completion_tokens": 20, "total_tokens": 50},
}


def with_choice(answer: dict[str, Any], **changes: Any) -> bytes:
    return orjson.dumps({**answer, "choices": [{**answer["choices"][0], **changes}]})


def test_entry_keeps_the_answer_bytes_as_sent() -> None:
    raw = orjson.dumps(CHAT, option=orjson.OPT_INDENT_2)
    entry = entry_from_response(raw, max_bytes=1 << 20)
    assert entry is not None and entry.body is raw and replay_json(entry) is raw
    assert entry.usage() == CHAT["usage"]
    assert entry_from_response(orjson.dumps(TEXT), 1 << 20) is not None
    assert entry_from_response(orjson.dumps(TOOL), 1 << 20) is not None


@pytest.mark.parametrize(
    "raw",
    [
        with_choice(CHAT, finish_reason="tool_calls"),
        with_choice(CHAT, finish_reason="content_filter"),
        with_choice(CHAT, finish_reason=None),
        with_choice(CHAT, logprobs={"content": []}),
        orjson.dumps({**CHAT, "choices": CHAT["choices"] * 2}),
        orjson.dumps({**CHAT, "choices": []}),
        b'{"error": {"message": "nope"}}',
        b"not json",
    ],
    ids=["tool_calls", "content_filter", "unfinished", "logprobs", "two_choices", "no_choice", "error", "garbage"],
)
def test_incomplete_or_odd_answers_are_not_cached(raw: bytes) -> None:
    assert entry_from_response(raw, max_bytes=1 << 20) is None


def test_answers_over_the_size_limit_are_not_cached() -> None:
    raw = orjson.dumps(CHAT)
    assert entry_from_response(raw, max_bytes=len(raw)) is not None
    assert entry_from_response(raw, max_bytes=len(raw) - 1) is None


# --- stream assembly ---


def chat_stream(answer: dict[str, Any], *, usage: bool = True, piece: int = 5) -> list[dict[str, Any]]:
    """A stream shaped as OpenAI sends it (role chunk, content deltas, finish chunk, usage chunk)."""
    head = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint") if k in answer}
    head["object"] = "chat.completion.chunk"
    msg = answer["choices"][0]["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        out = {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        return {**out, "usage": None} if usage else out

    events = [chunk({"role": "assistant", "content": "", "refusal": None})]
    text = msg.get("content") or ""
    events += [chunk({"content": text[i : i + piece]}) for i in range(0, len(text), piece)]
    for i, tc in enumerate(msg.get("tool_calls") or []):
        args = tc["function"]["arguments"]
        events.append(chunk({"tool_calls": [{"index": i, "id": tc["id"], "type": "function",
                                             "function": {"name": tc["function"]["name"], "arguments": ""}}]}))
        events += [chunk({"tool_calls": [{"index": i, "function": {"arguments": args[j : j + 4]}}]})
                   for j in range(0, len(args), 4)]
    events.append(chunk({}, answer["choices"][0]["finish_reason"]))
    if usage:
        events.append({**head, "choices": [], "usage": answer["usage"]})
    return events


def text_stream(answer: dict[str, Any], piece: int = 4) -> list[dict[str, Any]]:
    head = {k: answer[k] for k in ("id", "object", "created", "model")}
    text = answer["choices"][0]["text"]
    events = [{**head, "choices": [{"index": 0, "text": text[i : i + piece], "logprobs": None, "finish_reason": None}]}
              for i in range(0, len(text), piece)]
    events.append({**head, "choices": [{"index": 0, "text": "", "logprobs": None,
                                        "finish_reason": answer["choices"][0]["finish_reason"]}]})
    events.append({**head, "choices": [], "usage": answer["usage"]})
    return events


def assemble(events: list[dict[str, Any]], max_bytes: int = 1 << 20) -> Entry | None:
    a = StreamAssembler(max_bytes)
    for e in events:
        a.feed(e)
    return a.entry()


@pytest.mark.parametrize("answer", [CHAT, TOOL], ids=["chat", "tool_calls"])
def test_a_chat_stream_assembles_into_the_non_streamed_answer(answer: dict[str, Any]) -> None:
    entry = assemble(chat_stream(answer))
    assert entry is not None and entry.answer() == answer


def test_a_completions_stream_assembles_into_the_non_streamed_answer() -> None:
    entry = assemble(text_stream(TEXT))
    assert entry is not None and entry.answer() == TEXT


def test_a_stream_without_usage_assembles_without_usage() -> None:
    entry = assemble(chat_stream(CHAT, usage=False))
    assert entry is not None and entry.usage() is None
    assert {k: v for k, v in CHAT.items() if k != "usage"} == entry.answer()


@pytest.mark.parametrize(
    "cut",
    [
        lambda ev: ev[:-2],  # cut before the finish chunk
        lambda ev: ev[:3],
        lambda ev: [*ev[:3], {"error": {"message": "overloaded"}}, *ev[3:]],
        lambda ev: [*ev[:-2], {**ev[-2], "choices": [{**ev[-2]["choices"][0], "finish_reason": "tool_calls"}]}],
        lambda ev: [{**ev[1], "choices": [{**ev[1]["choices"][0], "index": 1}]}, *ev],  # a second choice
        lambda ev: [{**ev[1], "choices": [{**ev[1]["choices"][0], "logprobs": {"content": []}}]}, *ev],
        lambda ev: [{**ev[1], "choices": [{**ev[1]["choices"][0], "delta": {"function_call": {"name": "f"}}}]}, *ev],
    ],
    ids=["no_finish", "cut_early", "error_event", "finish_tool_calls", "two_choices", "logprobs", "function_call"],
)
def test_streams_that_cannot_be_rebuilt_faithfully_give_no_entry(cut: Any) -> None:
    assert assemble(cut(chat_stream(CHAT))) is None


def test_a_stream_over_the_size_limit_gives_no_entry() -> None:
    full = assemble(chat_stream(CHAT))
    assert full is not None
    assert assemble(chat_stream(CHAT), max_bytes=len(full.body)) is not None
    assert assemble(chat_stream(CHAT), max_bytes=len(full.body) - 1) is None
    assert assemble(chat_stream(CHAT), max_bytes=100) is None  # gives up while streaming


def test_a_tool_call_without_an_id_is_not_rebuilt() -> None:
    events = [e for e in chat_stream(TOOL) if "id" not in str(e.get("choices"))]  # drop the id-carrying deltas
    assert assemble(events) is None


@pytest.mark.parametrize("stop", ["END", 128001], ids=["sequence", "token"])
def test_a_streams_stop_reason_is_kept_and_replayed(stop: str | int) -> None:
    # vLLM's choice-level stop_reason (the stop string or token that ended the answer) comes on the
    # finish chunk: a stream-captured entry dropped it, and a Messages hit said end_turn, not stop_sequence.
    answer = {**CHAT, "choices": [{**CHAT["choices"][0], "stop_reason": stop}]}
    events = chat_stream(answer)
    events[-2]["choices"][0]["stop_reason"] = stop  # the finish chunk (the last is usage)
    entry = assemble(events)
    assert entry is not None and entry.answer() == answer
    again = assemble(sse_json(replay_sse(entry, include_usage=True)))
    assert again is not None and again.answer() == answer


# --- replay, read back by the openai SDK ---


def sse_json(frames: list[bytes]) -> list[Any]:
    assert frames[-1] == b"data: [DONE]\n\n"
    assert all(f.startswith(b"data: ") and f.endswith(b"\n\n") and f.count(b"\n") == 2 for f in frames)
    return [orjson.loads(f[6:-2]) for f in frames[:-1]]


def test_replay_sse_frames_are_valid_json_events_and_reassemble_to_the_entry() -> None:
    for answer in (CHAT, TEXT, TOOL):
        entry = Entry(orjson.dumps(answer))
        frames = replay_sse(entry, include_usage=True, chunk_chars=7)
        again = assemble(sse_json(frames))
        assert again is not None and again.answer() == answer
        without = sse_json(replay_sse(entry, include_usage=False))
        assert all("usage" not in e for e in without)


@pytest.fixture
async def replay_server() -> AsyncIterator[tuple[str, dict[str, Entry]]]:
    """A tiny server answering /v1/chat/completions and /v1/completions from a given entry."""
    entries: dict[str, Entry] = {}

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        entry = entries[request.path]
        if not body.get("stream"):
            return web.Response(body=replay_json(entry), content_type="application/json")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for frame in replay_sse(entry, include_usage=include_usage, chunk_chars=8):
            await resp.write(frame)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    app.router.add_post("/v1/completions", answer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1", entries
    finally:
        await runner.cleanup()


@pytest.fixture
async def sdk(replay_server: tuple[str, dict[str, Entry]]) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=replay_server[0], api_key="sk-test", max_retries=0)
    try:
        yield client
    finally:
        await client.close()


async def test_the_sdk_reads_a_replayed_chat_stream(sdk: openai.AsyncOpenAI, replay_server: Any) -> None:
    replay_server[1]["/v1/chat/completions"] = Entry(orjson.dumps(CHAT))
    stream = await sdk.chat.completions.create(model="gpt-test", messages=BASE["messages"], stream=True,
                                               stream_options={"include_usage": True})
    text, finish, usage, roles = "", None, None, []
    async for chunk in stream:
        assert chunk.id == "chatcmpl-1" and chunk.object == "chat.completion.chunk"
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert roles == ["assistant"]
    assert text == CHAT["choices"][0]["message"]["content"] and finish == "stop"
    assert usage is not None and usage.total_tokens == 73


async def test_the_sdk_accumulates_replayed_tool_calls(sdk: openai.AsyncOpenAI, replay_server: Any) -> None:
    replay_server[1]["/v1/chat/completions"] = Entry(orjson.dumps(TOOL))
    async with sdk.chat.completions.stream(model="gpt-test", messages=BASE["messages"]) as stream:
        final = await stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        (t["id"], t["function"]["name"], t["function"]["arguments"]) for t in TOOL["choices"][0]["message"]["tool_calls"]
    ]


async def test_the_sdk_reads_a_replayed_completions_stream(sdk: openai.AsyncOpenAI, replay_server: Any) -> None:
    replay_server[1]["/v1/completions"] = Entry(orjson.dumps(TEXT))
    stream = await sdk.completions.create(model="gpt-test-instruct", prompt="Capital?", stream=True)
    text, finish = "", None
    async for chunk in stream:
        assert chunk.usage is None  # not asked for
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert text == TEXT["choices"][0]["text"] and finish == "length"


async def test_the_sdk_reads_a_replayed_json_answer(sdk: openai.AsyncOpenAI, replay_server: Any) -> None:
    replay_server[1]["/v1/chat/completions"] = Entry(orjson.dumps(CHAT))
    out = await sdk.chat.completions.create(model="gpt-test", messages=BASE["messages"])
    assert out.choices[0].message.content == CHAT["choices"][0]["message"]["content"]
    assert out.choices[0].finish_reason == "stop" and out.usage is not None and out.usage.prompt_tokens == 12


# --- Cache over both stores ---


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "memory":
        yield MemoryStore()
        return
    prefix = f"test:cache:{uuid.uuid4().hex}:"
    s = RedisStore(REDIS_URL, timeout_ms=500, prefix=prefix)
    try:
        yield s
    finally:
        await s.close()
        raw = aredis.Redis.from_url(REDIS_URL)
        keys = [k async for k in raw.scan_iter(match=prefix + "*")]
        if keys:
            await raw.delete(*keys)
        await raw.aclose()


async def test_a_saved_answer_is_found_by_its_key(store: Store) -> None:
    cache = Cache(store, ttl_s=60, max_entry_bytes=1 << 20)
    entry = Entry(orjson.dumps(CHAT))
    k = key(BASE)
    assert await cache.lookup(k) is None
    assert await cache.save(k, entry)
    assert await cache.lookup(k) == entry
    assert await cache.lookup(key({**BASE, "stream": True})) == entry  # a streamed request hits too


async def test_tenants_never_see_each_others_answers(store: Store) -> None:
    cache = Cache(store, ttl_s=60, max_entry_bytes=1 << 20)
    await cache.save(key(BASE, namespace="acme"), Entry(orjson.dumps(CHAT)))
    assert await cache.lookup(key(BASE, namespace="globex")) is None
    assert await cache.lookup(key(BASE, namespace="acme")) is not None


async def test_entries_expire_after_their_ttl(store: Store) -> None:
    cache = Cache(store, ttl_s=0.05, max_entry_bytes=1 << 20)
    k = key(BASE)
    await cache.save(k, Entry(orjson.dumps(CHAT)))
    await cache.save(k + ":long", Entry(orjson.dumps(CHAT)), ttl_s=60)
    assert await cache.lookup(k) is not None
    await asyncio.sleep(0.12)
    assert await cache.lookup(k) is None
    assert await cache.lookup(k + ":long") is not None


async def test_entries_over_the_size_limit_are_not_saved() -> None:
    cache = Cache(MemoryStore(), ttl_s=60, max_entry_bytes=10)
    assert not await cache.save("k", Entry(b"x" * 11))
    assert await cache.lookup("k") is None


CORRUPT = {
    "bad json": b"not json at all",
    "truncated": orjson.dumps(CHAT)[:-7],
    "empty": b"",
    "a list": b"[1, 2, 3]",
    "no choices": orjson.dumps({"id": "x", "object": "chat.completion"}),
    "unfinished": orjson.dumps({**CHAT, "choices": [{**CHAT["choices"][0], "finish_reason": None}]}),
    "tool calls not a list": orjson.dumps(
        {**CHAT, "choices": [{"index": 0, "message": {"role": "assistant", "tool_calls": "x"}, "finish_reason": "stop"}]}
    ),
    "binary": bytes(range(256)),
}


@pytest.mark.parametrize("raw", list(CORRUPT.values()), ids=list(CORRUPT))
async def test_a_corrupt_entry_is_a_miss_deleted_and_reported(store: Store, raw: bytes, caplog: pytest.LogCaptureFixture) -> None:
    errors: list[str] = []
    cache = Cache(store, ttl_s=60, max_entry_bytes=1 << 20, on_error=errors.append)
    k = key(BASE)
    await store.set(k, raw, 60)
    assert await cache.lookup(k) is None
    assert await store.get(k) is None  # deleted: the next request stores a good answer
    assert errors == ["corrupt"]
    assert "corrupt" in caplog.text
    assert await cache.lookup(k) is None and errors == ["corrupt"]  # a plain miss now
    assert await cache.save(k, Entry(orjson.dumps(CHAT))) and await cache.lookup(k) == Entry(orjson.dumps(CHAT))


async def test_a_corrupt_entry_on_a_store_that_cannot_delete_is_still_a_miss() -> None:
    errors: list[str] = []
    store = BrokenStore()
    store.down = False
    await store.inner.set("k", b"{", 60)

    async def no_delete(key: str) -> None:
        raise StoreError("redis delete: timed out")

    store.delete = no_delete  # type: ignore[method-assign]
    cache = Cache(store, ttl_s=60, max_entry_bytes=1 << 20, on_error=errors.append)
    assert await cache.lookup("k") is None
    assert errors == ["corrupt", "delete"]


class BrokenStore:
    shared = True  # stands in for a Redis store

    def __init__(self) -> None:
        self.down = True
        self.inner = MemoryStore()

    async def get(self, key: str) -> bytes | None:
        if self.down:
            raise StoreError("redis get: timed out")
        return await self.inner.get(key)

    async def set(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> None:
        if self.down:
            raise StoreError("redis set: ConnectionError: refused")
        await self.inner.set(key, value, ttl_s)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def close(self) -> None:
        pass


async def test_a_failing_store_fails_open_and_warns_at_most_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    errors: list[str] = []
    store = BrokenStore()
    cache = Cache(store, ttl_s=60, max_entry_bytes=1 << 20, on_error=errors.append, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="gateway.cache")
    for _ in range(5):
        assert await cache.lookup("k") is None
        assert not await cache.save("k", Entry(orjson.dumps(CHAT)))
        now[0] += 10
    assert errors == ["get", "set"] * 5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "timed out" in warnings[0].getMessage()
    now[0] += 15  # 65 s after the first warning
    await cache.lookup("k")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "9 more failures" in warnings[1].getMessage()
    store.down = False
    assert await cache.save("k", Entry(orjson.dumps(CHAT))) and await cache.lookup("k") == Entry(orjson.dumps(CHAT))
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == ["cache store answers again"]


# --- single flight ---


async def test_concurrent_identical_misses_make_one_upstream_call() -> None:
    flight = SingleFlight()
    cache = Cache(MemoryStore(), ttl_s=60, max_entry_bytes=1 << 20)
    upstream_calls = 0
    leaders = 0

    async def request() -> Entry | None:
        nonlocal upstream_calls, leaders
        k = key(BASE)
        entry = await cache.lookup(k)
        if entry is not None:
            return entry
        async with flight.hold(k, wait_s=5) as f:
            leaders += f.leader
            entry = None if f.leader else (f.entry or await cache.lookup(k))
            if entry is None:
                upstream_calls += 1
                await asyncio.sleep(0.02)
                entry = Entry(orjson.dumps(CHAT))
                await cache.save(k, entry)
                f.publish(entry)
            return entry

    results = await asyncio.gather(*(request() for _ in range(10)))
    assert upstream_calls == 1 and leaders == 1
    assert all(r == Entry(orjson.dumps(CHAT)) for r in results)
    assert len(flight) == 0


async def test_followers_proceed_on_their_own_when_the_leader_fails() -> None:
    flight = SingleFlight()
    seen: list[tuple[bool, Entry | None]] = []

    async def request(i: int) -> None:
        async with flight.hold("k", wait_s=5) as f:
            seen.append((f.leader, f.entry))
            if f.leader:
                await asyncio.sleep(0.02)
                raise RuntimeError("upstream failed")

    results = await asyncio.gather(*(request(i) for i in range(5)), return_exceptions=True)
    assert sum(isinstance(r, RuntimeError) for r in results) == 1
    assert seen[0] == (True, None) and seen[1:] == [(False, None)] * 4
    assert len(flight) == 0


async def test_followers_stop_waiting_after_wait_s() -> None:
    flight = SingleFlight()
    leader_in = asyncio.Event()

    async def leader() -> None:
        async with flight.hold("k", wait_s=5):
            leader_in.set()
            await asyncio.sleep(1)

    task = asyncio.create_task(leader())
    await leader_in.wait()
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with flight.hold("k", wait_s=0.05) as f:
        assert not f.leader and f.entry is None
    assert 0.04 < loop.time() - started < 0.5
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert len(flight) == 0


async def test_cancelled_leaders_and_followers_leave_nothing_behind() -> None:
    flight = SingleFlight()
    leader_in = asyncio.Event()
    woke: list[bool] = []

    async def leader() -> None:
        async with flight.hold("k", wait_s=5):
            leader_in.set()
            await asyncio.sleep(10)

    async def follower() -> None:
        async with flight.hold("k", wait_s=5) as f:
            woke.append(f.leader)
            await asyncio.sleep(0.01)  # its own call, as a leader

    lead = asyncio.create_task(leader())
    await leader_in.wait()
    followers = [asyncio.create_task(follower()) for _ in range(3)]
    await asyncio.sleep(0)
    followers[0].cancel()  # a follower gives up while waiting
    await asyncio.sleep(0)
    lead.cancel()  # then the leader is cancelled mid-call (its client left): the rest form a new flight
    done = await asyncio.gather(lead, *followers, return_exceptions=True)
    assert isinstance(done[0], asyncio.CancelledError) and isinstance(done[1], asyncio.CancelledError)
    assert woke == [True, False]  # one leads it, the other follows (its leader stored nothing: it goes on alone)
    assert len(flight) == 0
    async with flight.hold("k", wait_s=5) as f:  # the key is free for the next miss
        assert f.leader


async def test_the_flight_map_is_bounded() -> None:
    flight = SingleFlight(max_flights=3)
    release = asyncio.Event()
    leaders: list[bool] = []

    async def request(k: str) -> None:
        async with flight.hold(k, wait_s=5, stream=True) as f:
            leaders.append(f.leader)
            await release.wait()

    tasks = [asyncio.create_task(request(f"k{i}")) for i in range(3)]
    await asyncio.sleep(0.01)
    assert len(flight) == 3
    extra = [asyncio.create_task(request("k-extra")) for _ in range(2)]  # past the cap: no single flight
    extra.append(asyncio.create_task(request("k0")))  # a key already held is still followed
    await asyncio.sleep(0.01)
    assert len(flight) == 3 and flight.overflows == 2
    assert leaders == [True] * 3 + [True, True, False]
    release.set()
    await asyncio.gather(*tasks, *extra)
    assert len(flight) == 0
    async with flight.hold("k-extra", wait_s=5) as f:  # room again
        assert f.leader and len(flight) == 1


async def test_a_cross_process_follower_gets_an_answer_stored_between_its_two_reads():
    """claim() polls the answer, then the lock; a leader that stores its answer and lets go of the
    lock between those two reads must still give a hit, not send the follower upstream."""
    from gateway.cache import shared_flight as cache_flight

    class LeaderInBetween(Cache):
        """On the follower's first miss, the other process stores the answer and releases the lock."""

        leader_token = ""  # the other process's lock

        async def lookup(self, key: str) -> Entry | None:
            entry = await super().lookup(key)
            if entry is None and not getattr(self, "leader_done", False):
                self.leader_done = True
                await self.save(key, Entry(orjson.dumps(CHAT)))
                await cache_flight.release(self, key, self.leader_token)
            return entry

    cache = LeaderInBetween(MemoryStore(), ttl_s=60, max_entry_bytes=1 << 20)
    token, entry = await cache_flight.claim(cache, "k", wait_s=5, lock_s=5)  # the other process leads
    assert token is not None and entry is None
    cache.leader_token = token
    token, entry = await cache_flight.claim(cache, "k", wait_s=5, lock_s=5)
    assert token is None and entry is not None and entry.answer()["id"] == CHAT["id"]


def test_an_answer_whose_content_is_not_a_string_is_not_stored() -> None:
    # Some OpenAI-compatible servers answer `content` as a list of parts: stored, a streamed hit
    # replayed it as a role chunk, a finish and [DONE], with no text (review helper's repro).
    parts = orjson.dumps({"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]}, "finish_reason": "stop"}]})
    assert entry_from_response(parts, 1 << 20) is None
    plain = parts.replace(b'[{"type":"text","text":"Paris."}]', b'"Paris."')
    assert entry_from_response(plain, 1 << 20) is not None and b"Paris." in b"".join(replay_sse(entry_from_response(plain, 1 << 20), include_usage=False))
    null = parts.replace(b'[{"type":"text","text":"Paris."}]', b"null")
    assert entry_from_response(null, 1 << 20) is not None  # no text (a tool call's answer): as before


def test_a_beta_header_that_reaches_the_backend_is_part_of_the_key() -> None:
    """A client's beta header changes what the backend answers (interleaved thinking): requests
    with and without it shared a cached answer and a flight (review of the change)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    plain = cache_key("t", "chat", "m", body)
    assert cache_key("t", "chat", "m", body, headers=()) == plain  # no beta: the key as before
    beta = cache_key("t", "chat", "m", body, headers=(("anthropic-beta", "interleaved-thinking-2025-05-14"),))
    assert beta != plain and beta == cache_key("t", "chat", "m", body, headers=(("anthropic-beta", "interleaved-thinking-2025-05-14"),))
