"""The Messages API translation layer (gateway/messages): the wire model and errors, requests both
ways, whole answers both ways, and both stream translators, checked against a strict event grammar
and against the official anthropic and openai SDKs reading the bytes (over httpx2.MockTransport)."""

from __future__ import annotations

import copy
from typing import Any

import anthropic
import httpx2
import openai
import orjson
import pytest

from gateway.errors import (
    AllBackendsFailed,
    BadRequest,
    Forbidden,
    GatewayError,
    InternalError,
    ModelNotFound,
    PayloadTooLarge,
    RateLimited,
    Unauthorized,
    Unavailable,
    UpstreamError,
    UpstreamRejected,
    UpstreamTimeout,
)
from gateway.messages import stream as mstream
from gateway.messages import translate as tr
from gateway.messages import wire
from gateway.messages.stream import DONE, ChatToMessagesStream, MessagesToChatStream, StreamOrderError, UpstreamStreamError
from gateway.messages.translate import BadAnswer, TranslationError, Untranslatable
from gateway.wire.openai_wire import ChatRequest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": SCHEMA}]
OA_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": SCHEMA}}]
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


# ---- helpers: a strict Anthropic request checker, SSE parsing, the event grammar, the SDKs ----

_ANTHROPIC_KEYS = {"model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream", "temperature",
                   "top_p", "top_k", "tools", "tool_choice", "thinking", "service_tier", "cache_control", "output_config"}
_BLOCKS = {"text", "image", "document", "tool_use", "tool_result"}


def anthropic_problem(b: dict[str, Any]) -> str | None:
    """What Anthropic's API would reject in a request body (the rules in the notes), or None."""
    extra = set(b) - _ANTHROPIC_KEYS
    if extra:
        return f"unknown keys {sorted(extra)}"
    if not isinstance(b.get("max_tokens"), int) or b["max_tokens"] < 1:
        return "max_tokens"
    for k in ("temperature", "top_p"):
        if b.get(k) is not None and not 0 <= b[k] <= 1:
            return k
    sy = b.get("system")
    if sy is not None and not isinstance(sy, str) and not all(x.get("type") == "text" and x["text"].strip() for x in sy):
        return "system"
    tc = b.get("tool_choice")
    if tc is not None and (not isinstance(tc, dict) or tc.get("type") not in ("auto", "any", "tool", "none")):
        return "tool_choice"
    for t in b.get("tools") or []:
        if set(t) - {"name", "description", "input_schema", "strict"} or not isinstance(t.get("input_schema"), dict):
            return f"tool {t}"
    if not b.get("messages"):
        return "no messages"
    pending: set[str] = set()
    for i, m in enumerate(b["messages"]):
        role = m.get("role")
        if role not in ("user", "assistant"):
            return f"messages.{i}.role {role}"
        if i and b["messages"][i - 1]["role"] == role:
            return f"messages.{i}: two {role} turns in a row"
        c = m["content"]
        blocks = [{"type": "text", "text": c}] if isinstance(c, str) else c
        if not blocks:
            return f"messages.{i}: empty"
        results = set()
        seen_other = False
        for x in blocks:
            t = x.get("type")
            if t not in _BLOCKS:
                return f"messages.{i} block {t}"
            if t == "text" and not x["text"].strip():
                return f"messages.{i}: empty text block"
            if t == "tool_use" and (role != "assistant" or not isinstance(x.get("input"), dict)):
                return f"messages.{i}: tool_use"
            if t == "tool_result":
                if role != "user" or x.get("tool_use_id") not in pending or seen_other:
                    return f"messages.{i}: tool_result {x.get('tool_use_id')}"
                results.add(x["tool_use_id"])
            else:
                seen_other = True
        if pending and (role != "user" or pending - results):
            return f"messages.{i}: unanswered {pending - results}"
        pending = {x["id"] for x in blocks if x.get("type") == "tool_use"} if role == "assistant" else set()
    if pending:
        return "unanswered tool_use at the end"
    return None


def sse(raw: bytes) -> list[tuple[str | None, Any]]:
    """[(event name, data)] of an SSE body."""
    out: list[tuple[str | None, Any]] = []
    for block in raw.decode().split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            text = "\n".join(data)
            out.append((name, text if text == "[DONE]" else orjson.loads(text)))
    return out


def grammar(raw: bytes) -> list[dict[str, Any]]:
    """The events of an Anthropic stream, asserting the legal order; framing must be exact."""
    assert raw.endswith(b"\n\n")
    evs = sse(raw)
    assert evs, "no events"
    for name, data in evs:
        assert isinstance(data, dict) and name == data["type"], (name, data)
    seq = [d for _, d in evs if d["type"] != "ping"]
    assert seq[0]["type"] == "message_start"
    assert [d["type"] for d in seq[-2:]] == ["message_delta", "message_stop"]
    m = seq[0]["message"]
    assert m["type"] == "message" and m["role"] == "assistant" and m["content"] == [] and m["id"].startswith("msg_")
    assert m["usage"]["input_tokens"] > 0
    open_, kind, nxt = None, None, 0
    for d in seq[1:-2]:
        t, i = d["type"], d.get("index")
        if t == "content_block_start":
            assert open_ is None and i == nxt, (d, open_, nxt)
            open_, kind = i, d["content_block"]["type"]
            if kind == "tool_use":
                assert d["content_block"]["input"] == {} and d["content_block"]["id"] and d["content_block"]["name"]
        elif t == "content_block_delta":
            want = {"text": "text_delta", "tool_use": "input_json_delta"}[kind]  # type: ignore[index]
            assert i == open_ and d["delta"]["type"] == want, (d, open_, kind)
        elif t == "content_block_stop":
            assert i == open_, d
            open_, nxt = None, nxt + 1
        else:
            raise AssertionError(f"{t} between message_start and message_delta")
    assert open_ is None and nxt > 0
    md = seq[-2]
    assert md["delta"]["stop_reason"] in {"end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"}
    assert isinstance(md["usage"]["output_tokens"], int)
    return [d for _, d in evs]


def blocks_of(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The blocks a stream built: text, or tool_use with its accumulated JSON."""
    out: list[dict[str, Any]] = []
    for d in events:
        if d["type"] == "content_block_start":
            out.append({**d["content_block"], "json": ""})
        elif d["type"] == "content_block_delta":
            out[-1]["text" if d["delta"]["type"] == "text_delta" else "json"] = (
                out[-1].get("text" if d["delta"]["type"] == "text_delta" else "json", "")
                + d["delta"].get("text", d["delta"].get("partial_json", ""))
            )
    return out


def _mock(body: bytes, status: int = 200, ctype: str = "text/event-stream") -> httpx2.Client:
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, headers={"content-type": ctype}, content=body)

    return httpx2.Client(transport=httpx2.MockTransport(handler))


def anthropic_client(body: bytes, status: int = 200, ctype: str = "text/event-stream") -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="k", base_url="http://gw", http_client=_mock(body, status, ctype), max_retries=0)


def openai_client(body: bytes, status: int = 200, ctype: str = "text/event-stream") -> openai.OpenAI:
    return openai.OpenAI(api_key="k", base_url="http://gw/v1", http_client=_mock(body, status, ctype), max_retries=0)


def sdk_final(raw: bytes) -> tuple[str, anthropic.types.Message]:
    """(text_stream joined, the final message) as the anthropic SDK reads a stream."""
    with anthropic_client(raw).messages.stream(model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join(s.text_stream)
        return text, s.get_final_message()


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **choice: Any) -> dict[str, Any]:
    c = {"index": 0, "delta": delta or {}, "finish_reason": finish, **choice}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [c]}


def usage_chunk(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [], "usage": u}


def tool_delta(index: int, *, id: str | None = None, name: str | None = None, args: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"index": index, "function": {}}
    if id is not None:
        d["id"], d["type"] = id, "function"
    if name is not None:
        d["function"]["name"] = name
    if args is not None:
        d["function"]["arguments"] = args
    return {"tool_calls": [d]}


def run_chat(chunks: list[Any], estimate: int = 7) -> bytes:
    s = ChatToMessagesStream("claude-x", "msg_test", estimate)
    out = b"".join(s.feed(c) for c in chunks)
    assert s.done and s.feed(DONE) == b"" and s.close() == b""
    return out


# ---- wire: the request model ------------------------------------------------------------------


def _parse(body: dict[str, Any]) -> wire.MessagesRequest:
    return wire.parse_messages(orjson.dumps(body))[0]


def _parse_error(body: dict[str, Any]) -> str:
    with pytest.raises(BadRequest) as exc:
        _parse(body)
    return exc.value.message


BASE = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


def test_a_full_request_parses_and_unknown_top_level_fields_are_kept():
    body = {**BASE, "system": [{"type": "text", "text": "be terse", "cache_control": {"type": "ephemeral"}}],
            "tools": TOOLS + [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}],
            "tool_choice": {"type": "tool", "name": "get_weather"}, "stop_sequences": ["x"], "temperature": 0.5,
            "top_p": 0.9, "top_k": 5, "metadata": {"user_id": "u"}, "stream": True,
            "output_config": {"effort": "low"}, "speed": "fast", "inference_geo": "us"}
    req, raw = wire.parse_messages(orjson.dumps(body))
    assert req.max_tokens == 10 and req.stream is True and req.tool_choice and req.tool_choice.name == "get_weather"
    assert req.model_extra == {"output_config": {"effort": "low"}, "speed": "fast", "inference_geo": "us"}
    assert raw == body


def test_unknown_block_types_pass_the_wire_model():
    body = {**BASE, "messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "x"}},
                                                              {"type": "text", "text": "sum it up"}]}]}
    assert _parse(body).messages[0].content[0].type == "document"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"max_tokens": None}, "max_tokens", "is required"),
        ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({"max_tokens": "5"}, "max_tokens", "JSON number"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "'user' or 'assistant'"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "valid list"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]", "text block needs 'text'"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type", "required"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
         "messages[0].content[0]", "tool_use block needs"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages[0]", "tool_use blocks belong in assistant turns"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
         "messages[0]", "tool_result blocks belong in user turns"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
         "messages[0].content[0]", "media_type"),
        ({"system": [{"type": "image", "source": {}}]}, "system[0].type", "'text'"),
        ({"system": 3}, "system", "valid list"),
        ({"temperature": 1.5}, "temperature", "less than or equal to 1"),
        ({"top_k": -1}, "top_k", "greater than or equal to 0"),
        ({"stream": "yes"}, "stream", "valid boolean"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice", "needs the tool's 'name'"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type", "'auto'"),
        ({"tools": [{"name": "f"}]}, "tools[0]", "input_schema"),
        # Anthropic's own refusals, which translation would have sent on
        ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema", "has type 'object'"),
        ({"tools": [{"name": "f", "type": "custom", "input_schema": {"type": ["object", "null"]}}]}, "tools[0].input_schema",
         "has type 'object'"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}, "messages[0].content[0]", "'text' is empty"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/svg+xml",
                                                                                  "data": "x"}}]}]},
         "messages[0].content[0]", "'media_type' is one of image/jpeg, image/png, image/gif, image/webp, not 'image/svg+xml'"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": 1}]}]},
         "messages[0].content[0]", "'is_error' is a boolean"),
        ({"stop_sequences": "x"}, "stop_sequences", "valid list"),
        ({"model": ""}, "model", "at least 1 character"),
    ],
)
def test_an_invalid_request_is_a_400_naming_the_field(change, field, words):
    body = {**BASE, **change}
    body = {k: v for k, v in body.items() if v is not None}
    message = _parse_error(body)
    assert f"invalid field '{field}'" in message and words in message, message


# ---- wire: errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"), (404, "not_found_error"),
     (413, "request_too_large"), (422, "invalid_request_error"), (429, "rate_limit_error"), (500, "api_error"),
     (502, "api_error"), (503, "overloaded_error"), (504, "timeout_error"), (529, "overloaded_error"), (507, "api_error")],
)
def test_error_type_per_status(status, kind):
    assert wire.error_type(status) == kind


@pytest.mark.parametrize(
    ("err", "status", "kind"),
    [
        (BadRequest("bad"), 400, "invalid_request_error"),
        (Unauthorized("no key"), 401, "authentication_error"),
        (Forbidden("not yours"), 403, "permission_error"),
        (ModelNotFound("no such model"), 404, "not_found_error"),
        (PayloadTooLarge("too big"), 413, "request_too_large"),
        (RateLimited("slow down", retry_after_s=2), 429, "rate_limit_error"),
        (InternalError("bug"), 500, "api_error"),
        (UpstreamError("broke"), 502, "api_error"),
        (Unavailable("full"), 503, "overloaded_error"),
        (UpstreamTimeout("slow"), 504, "timeout_error"),
        (AllBackendsFailed([("a", Unavailable("full")), ("b", RateLimited("later"))]), 503, "overloaded_error"),
        (Untranslatable("top_k", tr.CHAT_API), 400, "invalid_request_error"),
    ],
)
def test_gateway_errors_in_anthropics_shape(err: GatewayError, status, kind):
    got_status, body = wire.gateway_error(err)
    parsed = orjson.loads(body)
    assert got_status == status == err.status
    assert parsed["type"] == "error" and parsed["error"]["type"] == kind and parsed["error"]["message"] == err.message
    assert parsed["error"].get("details", {}).get("error_code") == err.code


def test_a_backends_own_rejection_keeps_its_message_and_an_anthropic_type():
    oa = UpstreamRejected(400, b'{"error": {"message": "context too long", "type": "invalid_request_error"}}', "oa")
    an = UpstreamRejected(400, b'{"type": "error", "error": {"type": "invalid_request_error", "message": "bad block"}}', "an")
    an404 = UpstreamRejected(404, b'{"type": "error", "error": {"type": "not_found_error", "message": "no model"}}', "an")
    text = UpstreamRejected(422, b"nope", "oa")
    assert orjson.loads(wire.gateway_error(oa)[1])["error"] == {"type": "invalid_request_error", "message": "context too long"}
    assert orjson.loads(wire.gateway_error(an)[1])["error"] == {"type": "invalid_request_error", "message": "bad block"}
    assert wire.gateway_error(an404)[0] == 404 and orjson.loads(wire.gateway_error(an404)[1])["error"]["type"] == "not_found_error"
    status, body = wire.gateway_error(text)
    assert status == 422 and orjson.loads(body)["error"]["message"].endswith(": nope")


def test_error_body_and_event_bytes():
    assert wire.error_body("api_error", "boom") == b'{"type":"error","error":{"type":"api_error","message":"boom"}}'
    assert wire.error_body("api_error", "boom", request_id="req_1").endswith(b',"request_id":"req_1"}')
    assert wire.error_event("overloaded_error", "Overloaded") == (
        b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    )


@pytest.mark.parametrize(
    ("err", "exc_type"),
    [(ModelNotFound("no such model"), anthropic.NotFoundError), (Unauthorized("bad key"), anthropic.AuthenticationError),
     (RateLimited("later"), anthropic.RateLimitError), (BadRequest("bad"), anthropic.BadRequestError),
     (Unavailable("full"), anthropic.InternalServerError)],
)
def test_the_anthropic_sdk_reads_our_error_bodies(err, exc_type):
    status, body = wire.gateway_error(err)
    client = anthropic_client(body, status, "application/json")
    with pytest.raises(exc_type) as exc:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == status and exc.value.body["error"]["type"] == wire.error_type(status)  # type: ignore[index]
    assert exc.value.error_code == err.code


# ---- messages_to_chat -------------------------------------------------------------------------


def test_messages_to_chat_maps_every_supported_field():
    body = {
        "model": "claude-x", "max_tokens": 300, "system": "be terse", "temperature": 0.3, "top_p": 0.9,
        "stop_sequences": ["END", "STOP"], "metadata": {"user_id": "u-1"}, "stream": True, "tools": TOOLS,
        "tool_choice": {"type": "auto"},
        "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                                         {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}},
                                         {"type": "text", "text": "What is the weather here?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                                              {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                                         {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                                          "content": [{"type": "text", "text": "no station"}]},
                                         {"type": "text", "text": "And tomorrow?"}]},
        ],
    }
    chat = tr.messages_to_chat(body)
    assert chat == {
        "model": "claude-x", "max_tokens": 300, "temperature": 0.3, "top_p": 0.9, "stop": ["END", "STOP"], "user": "u-1",
        "stream": True, "stream_options": {"include_usage": True}, "tool_choice": "auto",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA,
                                                     "description": "Current weather in a city"}}],
        "messages": [
            {"role": "system", "content": "be terse"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                                         {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                                         {"type": "text", "text": "What is the weather here?"}]},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
                {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no station"},
            {"role": "user", "content": "And tomorrow?"},
        ],
    }
    ChatRequest.model_validate(chat)  # what the gateway's chat endpoint accepts


def test_messages_to_chat_system_blocks_and_text_only_turns():
    one = tr.messages_to_chat({**BASE, "system": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}]})
    two = tr.messages_to_chat({**BASE, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    assert one["messages"][0] == {"role": "system", "content": "a"}
    assert two["messages"][0] == {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    multi = tr.messages_to_chat({**BASE, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                   {"type": "text", "text": "b"}]}]})
    assert multi["messages"] == [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tr.messages_to_chat(BASE) == {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}


def test_a_tool_result_with_several_text_blocks_stays_several_parts():
    body = {**BASE, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}]}
    chat = tr.messages_to_chat(body)
    assert chat["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "t1",
                                   "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert len(chat["messages"]) == 3  # no empty user message after the tool results


@pytest.mark.parametrize(
    ("choice", "expect"),
    [({"type": "auto"}, {"tool_choice": "auto"}), ({"type": "any"}, {"tool_choice": "required"}),
     ({"type": "none"}, {"tool_choice": "none"}),
     ({"type": "tool", "name": "get_weather"}, {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
     ({"type": "any", "disable_parallel_tool_use": True}, {"tool_choice": "required", "parallel_tool_calls": False}),
     ({"type": "none", "disable_parallel_tool_use": True}, {"tool_choice": "none"})],
)
def test_messages_tool_choice_to_chat(choice, expect):
    chat = tr.messages_to_chat({**BASE, "tools": TOOLS, "tool_choice": choice})
    assert {k: chat[k] for k in ("tool_choice", "parallel_tool_calls") if k in chat} == expect


def test_messages_tool_choice_without_tools():
    assert tr.messages_to_chat({**BASE, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, "tools": []}) == (
        tr.messages_to_chat(BASE))
    assert tr.messages_to_chat({**BASE, "tool_choice": {"type": "none"}}) == tr.messages_to_chat(BASE)
    for forced in ({"type": "any"}, {"type": "tool", "name": "f"}):  # Anthropic's 400, whatever the chat backend would do
        with pytest.raises(tr.TranslationError, match="needs tools"):
            tr.messages_to_chat({**BASE, "tool_choice": forced})
    assert tr.messages_to_chat({**BASE, "tool_choice": {"type": "any"}, "tools": TOOLS})["tool_choice"] == "required"
    ordered = tr.messages_to_chat({**BASE, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}, "tools": TOOLS})
    assert ordered["tool_choice"] == "auto" and ordered["parallel_tool_calls"] is False


def test_messages_to_chat_drops_only_what_cannot_change_the_answer():
    cc = {"type": "ephemeral"}
    body = {**BASE, "cache_control": cc, "diagnostics": {"previous_message_id": None}, "workspace_id": "w",
            "user_profile_id": "p", "speed": "standard", "thinking": {"type": "disabled"}, "top_k": None,
            "system": [{"type": "text", "text": "s", "cache_control": cc}],
            "tools": [{**TOOLS[0], "cache_control": cc}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": cc}]}]}
    plain = {**BASE, "system": "s", "tools": TOOLS}
    assert tr.messages_to_chat(body) == tr.messages_to_chat(plain)


def test_messages_to_chat_structured_output_strict_tools_and_service_tier():
    body = {**BASE, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}, "service_tier": "standard_only",
            "tools": [{**TOOLS[0], "strict": True}]}
    chat = tr.messages_to_chat(body)
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA, "strict": True}}
    assert chat["service_tier"] == "default" and chat["tools"][0]["function"]["strict"] is True
    assert tr.messages_to_chat({**BASE, "service_tier": "auto"})["service_tier"] == "auto"


def test_a_final_assistant_turn_is_a_prefill_only_where_the_backend_continues_one():
    body = {**BASE, "messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": "1, 2,"}]}
    with pytest.raises(Untranslatable, match="final assistant turn"):
        tr.messages_to_chat(body)
    assert tr.messages_to_chat(body, prefill=True)["messages"][-1] == {"role": "assistant", "content": "1, 2,"}


def _user(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


@pytest.mark.parametrize(
    ("change", "feature"),
    [
        ({"top_k": 5}, "top_k"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
        ({"thinking": {"type": "adaptive"}}, "thinking"),
        ({"container": "c1"}, "container"),
        ({"context_management": {"edits": []}}, "context_management"),
        ({"mcp_servers": [{"url": "https://x"}]}, "mcp_servers"),
        ({"inference_geo": "us"}, "inference_geo"),
        ({"speed": "fast"}, "speed 'fast'"),
        ({"output_config": {"effort": "low"}}, "output_config.effort"),
        ({"metadata": {"user_id": "u", "team": "t"}}, "metadata.team"),
        ({"some_new_field": 1}, "some_new_field"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool 'web_search_20250305'"),
        ({"tools": [{**TOOLS[0], "input_examples": [{"city": "Paris"}]}]}, "tools[0].input_examples"),
        ({"messages": _user({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}})},
         "document blocks"),
        ({"messages": _user({"type": "search_result", "source": "s", "title": "t", "content": []})}, "'search_result' blocks"),
        ({"messages": _user({"type": "image", "source": {"type": "file", "file_id": "f"}})}, "image source 'file'"),
        ({"messages": _user({"type": "text", "text": "x", "citations": [{"type": "char_location"}]})}, "citations"),
        ({"messages": [{"role": "user", "content": "q"},
                       {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                         {"type": "text", "text": "a"}]},
                       {"role": "user", "content": "more"}]}, "thinking blocks"),
        ({"messages": [{"role": "user", "content": "q"},
                       {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                           {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}]}]}]},
         "images in a tool_result"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "a final assistant turn"),
    ],
)
def test_messages_features_chat_cannot_express_are_refused_by_name(change, feature):
    with pytest.raises(Untranslatable) as exc:
        tr.messages_to_chat({**BASE, **change})
    assert exc.value.feature.startswith(feature) and feature in exc.value.message
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, BadRequest) and exc.value.status == 400
    assert tr.CHAT_API in exc.value.message and exc.value.code == "unsupported_feature"


# ---- chat_to_messages -------------------------------------------------------------------------


def test_chat_to_messages_maps_every_supported_field():
    body = {
        "model": "claude-x", "max_completion_tokens": 200, "max_tokens": 50, "temperature": 0.7, "top_p": 0.8, "stop": "END",
        "stream": True, "stream_options": {"include_usage": True}, "n": 1, "user": "u-1", "tools": OA_TOOLS,
        "tool_choice": "auto", "parallel_tool_calls": True, "service_tier": "default",
        "messages": [
            {"role": "system", "content": "be terse"},
            {"role": "developer", "content": [{"type": "text", "text": "use metric"}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                         {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}", "detail": "low"}},
                                         {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C", "name": "get_weather"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "2 C"}]},
            {"role": "user", "content": "Thanks. Tomorrow?"},
        ],
    }
    msgs = tr.chat_to_messages(body, 4096)
    assert msgs == {
        "model": "claude-x", "max_tokens": 200, "temperature": 0.7, "top_p": 0.8, "stop_sequences": ["END"], "stream": True,
        "metadata": {"user_id": "u-1"}, "tool_choice": {"type": "auto"},
        "system": [{"type": "text", "text": "be terse"}, {"type": "text", "text": "use metric"}],
        "tools": [{"name": "get_weather", "description": "Current weather in a city", "input_schema": SCHEMA}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Weather?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "call_2", "name": "get_weather", "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "18 C"},
                {"type": "tool_result", "tool_use_id": "call_2", "content": [{"type": "text", "text": "2 C"}]},
                {"type": "text", "text": "Thanks. Tomorrow?"}]},
        ],
    }
    assert anthropic_problem(msgs) is None


def test_consecutive_messages_of_a_role_are_one_turn_tool_results_first_in_order():
    """A user text before the tool results of the turn before still comes after them, each group
    in the order sent; 12,000 user messages in a row are one turn of 12,000 blocks (each merge
    copied and sorted the turn: 9 s of the event loop for that body, review helper's repro)."""
    body = {"model": "c", "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(3)]},
        {"role": "user", "content": "by the way"},
        {"role": "tool", "tool_call_id": "c0", "content": "r0"},
        {"role": "user", "content": "and"},
        {"role": "tool", "tool_call_id": "c1", "content": "r1"},
        {"role": "tool", "tool_call_id": "c2", "content": "r2"},
    ]}
    last = tr.chat_to_messages(body, 100)["messages"][-1]["content"]
    assert [b.get("tool_use_id") or b.get("text") for b in last] == ["c0", "c1", "c2", "by the way", "and"]
    many = tr.chat_to_messages({"model": "c", "messages": [{"role": "user", "content": str(i)} for i in range(12_000)]}, 100)
    assert [b["text"] for b in many["messages"][0]["content"]] == [str(i) for i in range(12_000)]


@pytest.mark.parametrize(
    ("limits", "expect"),
    [({"max_completion_tokens": 7, "max_tokens": 9}, 7), ({"max_tokens": 9}, 9), ({}, 4096), ({"max_tokens": None}, 4096),
     ({"max_tokens": 9.0}, 9), ({"max_completion_tokens": 7.0}, 7)],
)
def test_chat_to_messages_max_tokens(limits, expect):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **limits}
    out = tr.chat_to_messages(body, 4096)
    assert out["max_tokens"] == expect and type(out["max_tokens"]) is int
    assert "max_completion_tokens" not in out and anthropic_problem(out) is None


def test_messages_to_chat_max_tokens_is_an_integer():
    out = tr.messages_to_chat({"model": "m", "max_tokens": 10.0, "messages": [{"role": "user", "content": "hi"}]})
    assert out["max_tokens"] == 10 and type(out["max_tokens"]) is int


def test_chat_to_messages_merges_same_role_turns_and_never_sends_empty_text():
    body = {"model": "m", "messages": [
        {"role": "system", "content": ""},
        {"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": " "}]},
        {"role": "assistant", "content": "c"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "t1", "content": ""},
        {"role": "user", "content": ""},
        {"role": "user", "content": "d"},
    ]}
    out = tr.chat_to_messages(body, 100)
    assert "system" not in out
    assert out["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "c"}, {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}, {"type": "text", "text": "d"}]},
    ]
    assert anthropic_problem(out) is None


@pytest.mark.parametrize(
    ("body", "expect"),
    [
        ({"tool_choice": "required"}, {"tool_choice": {"type": "any"}}),
        ({"tool_choice": "none"}, {"tool_choice": {"type": "none"}}),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
         {"tool_choice": {"type": "tool", "name": "get_weather"}}),
        ({"parallel_tool_calls": False}, {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}),
        ({"tool_choice": "required", "parallel_tool_calls": False}, {"tool_choice": {"type": "any", "disable_parallel_tool_use": True}}),
        ({"tool_choice": "none", "parallel_tool_calls": False}, {"tool_choice": {"type": "none"}}),
        ({"parallel_tool_calls": True}, {}),
    ],
)
def test_chat_tool_choice_to_messages(body, expect):
    out = tr.chat_to_messages({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": OA_TOOLS, **body}, 10)
    assert {k: out[k] for k in ("tool_choice",) if k in out} == expect and anthropic_problem(out) is None


def test_chat_tool_choice_without_tools():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert "tool_choice" not in tr.chat_to_messages({**base, "tool_choice": "auto"}, 10)
    assert "tool_choice" not in tr.chat_to_messages({**base, "tool_choice": "none", "tools": []}, 10)
    with pytest.raises(TranslationError, match="needs tools"):
        tr.chat_to_messages({**base, "tool_choice": "required"}, 10)


def test_chat_to_messages_options_with_a_faithful_equivalent():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    schema = {"name": "w", "schema": SCHEMA, "strict": True}
    out = tr.chat_to_messages({**base, "response_format": {"type": "json_schema", "json_schema": schema}, "top_k": 40,
                               "stop": ["a", "b"], "safety_identifier": "h1", "user": "u", "temperature": 1,
                               "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "logprobs": False,
                               "modalities": ["text"], "response_format_extra": None, "store": True, "metadata": {"k": "v"},
                               "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k"}, 10)
    assert out == {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}], "top_k": 40,
                   "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}, "stop_sequences": ["a", "b"],
                   "metadata": {"user_id": "h1"}, "temperature": 1}
    assert "top_k" not in tr.chat_to_messages({**base, "top_k": -1}, 10)
    assert "response_format" not in tr.chat_to_messages({**base, "response_format": {"type": "text"}}, 10)


def test_chat_pdf_file_parts_become_document_blocks():
    part = {"type": "file", "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0x"}}
    out = tr.chat_to_messages({"model": "m", "messages": [{"role": "user", "content": [part, {"type": "text", "text": "sum"}]}]}, 10)
    assert out["messages"][0]["content"][0] == {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                                                               "data": "JVBERi0x"}}


def test_a_trailing_assistant_message_is_sent_only_as_the_gateways_own_prefill():
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}, {"role": "assistant", "content": "1, 2,"}]}
    with pytest.raises(Untranslatable, match="trailing assistant message"):
        tr.chat_to_messages(body, 10)
    out = tr.chat_to_messages(body, 10, prefill=True)
    assert out["messages"][-1] == {"role": "assistant", "content": "1, 2,"}


def _chat(*msgs: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(msgs) or [{"role": "user", "content": "hi"}], **kw}


U = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("body", "feature"),
    [
        (_chat(temperature=1.5), "temperature above 1"),
        (_chat(n=2), "n > 1"),
        (_chat(response_format={"type": "json_object"}), "response_format json_object"),
        (_chat(seed=7), "seed"),
        (_chat(frequency_penalty=0.5), "frequency_penalty"),
        (_chat(presence_penalty=-1), "presence_penalty"),
        (_chat(logit_bias={"50256": -100}), "logit_bias"),
        (_chat(logprobs=True, top_logprobs=3), "logprobs"),
        (_chat(modalities=["text", "audio"]), "modalities"),
        (_chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
        (_chat(reasoning_effort="high"), "reasoning_effort"),
        (_chat(verbosity="low"), "verbosity"),
        (_chat(web_search_options={}), "web_search_options"),
        (_chat(functions=[{"name": "f", "parameters": {}}]), "functions"),
        (_chat(tools=[{"type": "custom", "custom": {"name": "grammar"}}]), "'custom' tools"),
        (_chat(tools=OA_TOOLS, tool_choice={"type": "allowed_tools", "allowed_tools": {}}), "tool_choice"),
        (_chat({"role": "user", "content": "hi", "name": "alice"}), "names on messages"),
        (_chat(U, {"role": "system", "content": "late rule"}, U), "a system message after the conversation started"),
        (_chat({"role": "system", "content": "only rules"}), "a conversation without a user or assistant message"),
        (_chat(U, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}, U), "function_call"),
        (_chat(U, {"role": "function", "name": None, "content": "x"}), "function messages"),
        (_chat({"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}]}),
         "'input_audio' content parts"),
        (_chat({"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}), "files by id"),
        (_chat({"role": "user", "content": [{"type": "file", "file": {"file_data": "data:text/csv;base64,YQ=="}}]}), "text/csv files"),
        (_chat({"role": "system", "content": [{"type": "image_url", "image_url": {"url": "https://x"}}]}, U),
         "'image_url' content parts in a system message"),
        (_chat(U, {"role": "assistant", "content": "ok"}), "a trailing assistant message"),
    ],
)
def test_chat_features_anthropic_cannot_express_are_refused_by_name(body, feature):
    with pytest.raises(Untranslatable) as exc:
        tr.chat_to_messages(body, 10)
    assert exc.value.feature.startswith(feature) and tr.MESSAGES_API in exc.value.message


@pytest.mark.parametrize(
    ("msgs", "words"),
    [
        ([U, {"role": "tool", "tool_call_id": "t9", "content": "x"}], "does not follow the assistant message that made it"),
        ([U, {"role": "assistant", "content": None, "tool_calls": [{"id": "t1", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]}, U],
         "has no tool message answering it"),
        ([U, {"role": "assistant", "content": None, "tool_calls": [{"id": "t1", "type": "function",
                                                                     "function": {"name": "f", "arguments": "[1]"}}]},
          {"role": "tool", "tool_call_id": "t1", "content": "x"}], "arguments: not a JSON object"),
        ([{"role": "wizard", "content": "x"}], "unknown role"),
    ],
)
def test_chat_conversations_anthropic_would_reject_are_400s_naming_the_problem(msgs, words):
    with pytest.raises(TranslationError, match=words):
        tr.chat_to_messages(_chat(*msgs), 10)


# ---- round trips ------------------------------------------------------------------------------


MESSAGES_CONVERSATION = {
    "model": "m", "max_tokens": 256, "system": "be terse", "stop_sequences": ["END"], "temperature": 0.2,
    "metadata": {"user_id": "u-1"}, "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
    "messages": [
        {"role": "user", "content": "What's the weather in Paris and Oslo?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking both."},
                                          {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}},
                                          {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "18 C, sunny"},
                                     {"type": "tool_result", "tool_use_id": "toolu_b",
                                      "content": [{"type": "text", "text": "2 C"}, {"type": "text", "text": "snow"}]},
                                     {"type": "text", "text": "Which is warmer?"}]},
    ],
}


def test_messages_to_chat_to_messages_keeps_the_conversation():
    back = tr.chat_to_messages(tr.messages_to_chat(MESSAGES_CONVERSATION), 1)
    assert anthropic_problem(back) is None
    assert back == MESSAGES_CONVERSATION


def test_chat_to_messages_to_chat_keeps_the_conversation():
    chat = {"model": "m", "max_tokens": 99, "temperature": 0.5, "stop": ["x", "y"], "tools": OA_TOOLS, "tool_choice": "required",
            "parallel_tool_calls": False, "user": "u", "messages": [
                {"role": "system", "content": "rules"},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                {"role": "user", "content": "Thanks"}]}
    back = tr.messages_to_chat(tr.chat_to_messages(chat, 1))
    assert back == chat


# ---- whole answers ----------------------------------------------------------------------------

ANTHROPIC_MESSAGE = {
    "id": "msg_01abc", "type": "message", "role": "assistant", "model": "claude-x",
    "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "Checking "},
                {"type": "text", "text": "the weather."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}],
    "stop_reason": "tool_use", "stop_sequence": None,
    "usage": {"input_tokens": 20, "output_tokens": 12, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 5},
}


def test_message_to_chat_completion():
    out = tr.message_to_chat_completion(ANTHROPIC_MESSAGE, "gw-model", created=5)
    assert out == {
        "id": "chatcmpl-01abc", "object": "chat.completion", "created": 5, "model": "gw-model",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Checking the weather.", "refusal": None, "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}}],
        "usage": {"prompt_tokens": 125, "completion_tokens": 12, "total_tokens": 137,
                  "prompt_tokens_details": {"cached_tokens": 100}},
    }
    parsed = openai_client(orjson.dumps(out), ctype="application/json").chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}])
    assert parsed.choices[0].message.tool_calls[0].function.name == "get_weather"  # type: ignore[index,union-attr]
    assert parsed.usage and parsed.usage.prompt_tokens_details and parsed.usage.prompt_tokens_details.cached_tokens == 100


@pytest.mark.parametrize(
    ("stop", "finish"),
    [("end_turn", "stop"), ("max_tokens", "length"), ("stop_sequence", "stop"), ("tool_use", "tool_calls"),
     ("refusal", "content_filter"), ("pause_turn", "stop"), ("model_context_window_exceeded", "length"), (None, "stop")],
)
def test_stop_reasons_to_finish_reasons(stop, finish):
    msg = {**ANTHROPIC_MESSAGE, "content": [{"type": "text", "text": "x"}], "stop_reason": stop,
           "stop_sequence": "END" if stop == "stop_sequence" else None}
    choice = tr.message_to_chat_completion(msg, "m")["choices"][0]
    assert choice["finish_reason"] == finish
    assert choice.get("stop_reason") == ("END" if stop == "stop_sequence" else None)


def _completion(message: dict[str, Any], finish: str | None = "stop", usage: Any = None, **choice: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"id": "chatcmpl-xyz", "object": "chat.completion", "created": 1, "model": "m",
                           "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish, **choice}]}
    if usage is not None:
        out["usage"] = usage
    return out


def test_chat_completion_to_message():
    resp = _completion({"content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        "tool_calls", {"prompt_tokens": 120, "completion_tokens": 9, "total_tokens": 129,
                       "prompt_tokens_details": {"cached_tokens": 100}})
    msg = tr.chat_completion_to_message(resp, "claude-x", 50)
    assert msg == {
        "id": "msg_xyz", "type": "message", "role": "assistant", "model": "claude-x",
        "content": [{"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 20, "output_tokens": 9, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 100},
    }
    parsed = anthropic_client(orjson.dumps(msg), ctype="application/json").messages.create(
        model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert parsed.content[1].type == "tool_use" and parsed.content[1].input == {"city": "Paris"}
    assert parsed.usage.input_tokens == 20 and parsed.usage.cache_read_input_tokens == 100


@pytest.mark.parametrize(
    ("finish", "extra", "stop", "seq"),
    [("stop", {}, "end_turn", None), ("length", {}, "max_tokens", None), ("tool_calls", {}, "tool_use", None),
     ("content_filter", {}, "refusal", None), (None, {}, "end_turn", None),
     ("stop", {"stop_reason": "END"}, "stop_sequence", "END"), ("stop", {"stop_reason": 50256}, "end_turn", None)],
)
def test_finish_reasons_to_stop_reasons(finish, extra, stop, seq):
    msg = tr.chat_completion_to_message(_completion({"content": "x"}, finish, **extra), "m", 5)
    assert (msg["stop_reason"], msg["stop_sequence"]) == (stop, seq)


def test_chat_answers_edge_cases():
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}]
    stop_with_calls = tr.chat_completion_to_message(_completion({"content": None, "tool_calls": calls}, "stop"), "m", 5)
    assert stop_with_calls["stop_reason"] == "tool_use" and stop_with_calls["content"] == [
        {"type": "tool_use", "id": "c1", "name": "f", "input": {}}]
    no_usage = tr.chat_completion_to_message(_completion({"content": "x"}), "m", 33)
    assert no_usage["usage"]["input_tokens"] == 33 and no_usage["usage"]["output_tokens"] == 0
    zero = tr.chat_completion_to_message(_completion({"content": "x"}, usage={"prompt_tokens": 0, "completion_tokens": 3}), "m", 0)
    assert zero["usage"]["input_tokens"] == 1 and zero["usage"]["output_tokens"] == 3
    refusal = tr.chat_completion_to_message(_completion({"content": None, "refusal": "I can't."}), "m", 5)
    assert refusal["content"] == [{"type": "text", "text": "I can't."}] and refusal["stop_reason"] == "refusal"
    parts = tr.chat_completion_to_message(_completion({"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}), "m", 5)
    assert parts["content"] == [{"type": "text", "text": "ab"}]
    empty = tr.chat_completion_to_message({"choices": []}, "m", 5)
    assert empty["content"] == [] and empty["id"].startswith("msg_") and empty["stop_reason"] == "end_turn"
    with pytest.raises(BadAnswer, match="not a JSON object"):
        tr.chat_completion_to_message(_completion({"tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"city": "Pa'}}]}, "tool_calls"), "m", 5)


def test_usage_mappings():
    assert tr.chat_usage({"input_tokens": 3, "output_tokens": 4}) == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0}}
    assert tr.chat_usage(None)["total_tokens"] == 0
    assert tr.anthropic_usage({"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 10}}, 4) == {
        "input_tokens": 1, "output_tokens": 2, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 10}
    assert tr.anthropic_usage(None, 0)["input_tokens"] == 1


# ---- ChatToMessagesStream ---------------------------------------------------------------------

ROLE = chunk({"role": "assistant", "content": ""})


def test_a_text_stream_in_anthropics_order_read_by_the_sdk():
    raw = run_chat([ROLE, chunk({"content": "Hello"}), chunk({"content": ", world"}), chunk(finish="stop"),
                    usage_chunk(11, 3), DONE])
    events = grammar(raw)
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert raw.startswith(b"event: message_start\ndata: {")
    assert events[0]["message"]["usage"]["input_tokens"] == 7 and events[0]["message"]["model"] == "claude-x"
    assert events[-2]["usage"] == {"input_tokens": 11, "output_tokens": 3, "cache_read_input_tokens": 0}
    text, final = sdk_final(raw)
    assert text == "Hello, world" and final.content[0].text == "Hello, world"  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.input_tokens == 11 and final.usage.output_tokens == 3
    assert final.id == "msg_test"


def test_text_then_a_tool_call_streamed_in_pieces():
    args = '{"city": "Paris", "days": [1, 2], "unit": "°C"}'
    pieces = [args[i:i + 5] for i in range(0, len(args), 5)]
    chunks = [ROLE, chunk({"content": "Let me check."}),
              chunk(tool_delta(0, id="call_1", name="get_weather", args=""))]
    chunks += [chunk(tool_delta(0, args=p)) for p in pieces]
    chunks += [chunk(finish="tool_calls"), usage_chunk(30, 12), DONE]
    raw = run_chat(chunks)
    events = grammar(raw)
    blocks = blocks_of(events)
    assert [b["type"] for b in blocks] == ["text", "tool_use"]
    assert blocks[1]["id"] == "call_1" and blocks[1]["name"] == "get_weather" and blocks[1]["json"] == args
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert starts[1]["index"] == 1  # OpenAI tool index 0 follows the text block
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    _, final = sdk_final(raw)
    assert final.content[1].input == orjson.loads(args) and final.stop_reason == "tool_use"  # type: ignore[union-attr]


def test_two_tool_calls_without_text():
    a, b = '{"city":"Paris"}', '{"city":"Oslo"}'
    chunks = [ROLE, chunk(tool_delta(0, id="c1", name="get_weather", args=a[:4])), chunk(tool_delta(0, args=a[4:])),
              chunk(tool_delta(1, id="c2", name="get_weather")), chunk(tool_delta(1, args=b[:9])),
              chunk(tool_delta(1, args=b[9:])), chunk(finish="tool_calls"), DONE]
    raw = run_chat(chunks)
    blocks = blocks_of(grammar(raw))
    assert [(x["type"], x["id"], x["json"]) for x in blocks] == [("tool_use", "c1", a), ("tool_use", "c2", b)]
    _, final = sdk_final(raw)
    assert [c.input for c in final.content] == [{"city": "Paris"}, {"city": "Oslo"}]  # type: ignore[union-attr]


def test_a_finish_only_chunk_then_a_usage_only_chunk_are_both_kept():
    raw = run_chat([chunk({"role": "assistant", "content": "Hi"}), chunk(finish="length"),
                    usage_chunk(40, 1, cached=32), DONE])
    events = grammar(raw)
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2]["usage"] == {"input_tokens": 8, "output_tokens": 1, "cache_read_input_tokens": 32}
    _, final = sdk_final(raw)
    assert final.stop_reason == "max_tokens" and final.usage.input_tokens == 8 and final.usage.cache_read_input_tokens == 32


def test_usage_before_the_finish_and_usage_on_the_finish_chunk():
    late_finish = run_chat([chunk({"content": "a"}), usage_chunk(5, 2), chunk(finish="stop"), DONE])
    assert grammar(late_finish)[-2]["usage"]["output_tokens"] == 2
    both = {**chunk(finish="stop"), "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}
    events = grammar(run_chat([chunk({"content": "a"}), both, DONE]))
    assert events[-2]["usage"]["output_tokens"] == 4 and events[-2]["delta"]["stop_reason"] == "end_turn"


def test_a_stream_without_usage_counts_its_pieces_and_keeps_the_estimate():
    raw = run_chat([ROLE, chunk({"content": "a"}), chunk({"content": "b"}), chunk({"content": ""}), chunk(finish="stop"), DONE],
                   estimate=0)
    events = grammar(raw)
    assert events[0]["message"]["usage"]["input_tokens"] == 1
    assert events[-2]["usage"] == {"output_tokens": 2}
    _, final = sdk_final(raw)
    assert final.usage.input_tokens == 1 and final.usage.output_tokens == 2


def test_a_matched_stop_sequence_is_stop_sequence():
    raw = run_chat([chunk({"content": "w0 w1 w2 "}), chunk(finish="stop", stop_reason="w3"), DONE])
    _, final = sdk_final(raw)
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "w3"


def test_an_empty_answer_is_still_one_empty_text_block():
    raw = run_chat([ROLE, chunk(finish="stop"), DONE])
    events = grammar(raw)
    assert blocks_of(events) == [{"type": "text", "text": "", "json": ""}]
    assert grammar(run_chat([DONE]))[2]["type"] == "content_block_start"
    _, final = sdk_final(raw)
    assert final.content[0].text == ""  # type: ignore[union-attr]


def test_a_tool_name_that_comes_after_arguments_and_text_after_a_tool_call():
    chunks = [chunk(tool_delta(0, id="c1", args='{"a"')), chunk(tool_delta(0, name="f", args=": 1}")),
              chunk({"content": "done"}), chunk(finish="tool_calls"), DONE]
    blocks = blocks_of(grammar(run_chat(chunks)))
    assert [(b["type"], b.get("name"), b["json"] or b.get("text")) for b in blocks] == [
        ("tool_use", "f", '{"a": 1}'), ("text", None, "done")]


def test_a_tool_name_in_pieces_is_sent_whole_and_calls_keep_their_order():
    # Some servers stream a function's name in pieces; tool_use's name goes out once, at its start.
    chunks = [ROLE, chunk(tool_delta(0, id="c1", name="get_", args="")), chunk(tool_delta(0, name="weather")),
              chunk(tool_delta(0, args='{"city": "Paris"}')),
              chunk(tool_delta(1, id="c2", name="look")), chunk(tool_delta(1, name="up")),
              chunk(tool_delta(2, id="c3", name="third", args="{}")), chunk(tool_delta(2, args="")),
              chunk(finish="tool_calls"), DONE]
    raw = run_chat(chunks)
    blocks = blocks_of(grammar(raw))
    assert [(b["id"], b["name"], b["json"]) for b in blocks] == [
        ("c1", "get_weather", '{"city": "Paris"}'), ("c2", "lookup", ""), ("c3", "third", "{}")]
    _, final = sdk_final(raw)
    assert [(c.name, c.input) for c in final.content] == [  # type: ignore[union-attr]
        ("get_weather", {"city": "Paris"}), ("lookup", {}), ("third", {})]
    named = run_chat([chunk(tool_delta(0, id="c1", name="sea")), chunk(tool_delta(0, name="rch")),
                      chunk({"content": "then text"}), chunk(finish="stop"), DONE])
    assert [(b["type"], b.get("name")) for b in blocks_of(grammar(named))] == [("tool_use", "search"), ("text", None)]


def test_a_tool_call_without_an_id_gets_one_and_a_nameless_call_is_sent_at_the_end():
    blocks = blocks_of(grammar(run_chat([chunk(tool_delta(0, name="f", args="{}")), chunk(finish="tool_calls"), DONE])))
    assert blocks[0]["id"].startswith("toolu_")
    s = ChatToMessagesStream("m", "msg_1", 3)
    s.feed(chunk(tool_delta(0, id="c1", args="{}")))
    assert blocks_of(sse_data(s.feed(DONE)))[0]["json"] == "{}"


def sse_data(raw: bytes) -> list[dict[str, Any]]:
    return [d for _, d in sse(raw)]


def test_calls_that_all_come_at_index_0_are_told_apart_by_id():
    chunks = [chunk(tool_delta(0, id="c1", name="f", args='{"x":1}')), chunk(tool_delta(0, id="c2", name="g", args="{")),
              chunk(tool_delta(0, args="}")), chunk(finish="tool_calls"), DONE]
    blocks = blocks_of(grammar(run_chat(chunks)))
    assert [(b["id"], b["name"], b["json"]) for b in blocks] == [("c1", "f", '{"x":1}'), ("c2", "g", "{}")]


def test_arguments_for_an_earlier_tool_call_after_a_later_one_began_cannot_be_expressed():
    s = ChatToMessagesStream("m", "msg_1", 3)
    s.feed(chunk(tool_delta(0, id="c1", name="f", args="{")))
    s.feed(chunk(tool_delta(1, id="c2", name="g", args="{")))
    with pytest.raises(StreamOrderError):
        s.feed(chunk(tool_delta(0, args="}")))


def test_an_error_mid_stream_reaches_the_sdk_as_its_error():
    s = ChatToMessagesStream("m", "msg_1", 3)
    raw = s.feed(chunk({"content": "partial"})) + s.error("overloaded_error", "every backend is busy")
    assert raw.endswith(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"every backend is busy"}}\n\n')
    assert s.done and s.feed(chunk({"content": "more"})) == b"" and s.close() == b""
    with pytest.raises(anthropic.APIStatusError) as exc:
        sdk_final(raw)
    assert exc.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


def test_choices_other_than_the_first_and_unknown_deltas_are_ignored():
    other = {"choices": [{"index": 1, "delta": {"content": "other"}, "finish_reason": None}]}
    raw = run_chat([chunk({"content": "a", "reasoning_content": "hm"}), other, chunk(finish="stop"), DONE])
    assert blocks_of(grammar(raw)) == [{"type": "text", "text": "a", "json": ""}]


def test_a_refusal_delta_is_text_with_stop_reason_refusal():
    events = grammar(run_chat([chunk({"refusal": "I can't help with that."}), chunk(finish="stop"), DONE]))
    assert blocks_of(events)[0]["text"] == "I can't help with that." and events[-2]["delta"]["stop_reason"] == "refusal"
    events = grammar(run_chat([chunk({"refusal": "No."}), DONE]))
    assert events[-2]["delta"]["stop_reason"] == "refusal"


# ---- MessagesToChatStream ---------------------------------------------------------------------

TOOL_JSON = ["", '{"ci', 'ty": "Pa', 'ris"}']


def anthropic_events(blocks: list[dict[str, Any]], stop: str, seq: str | None = None,
                     usage: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The events an Anthropic backend sends for a message with these blocks (as the fake does)."""
    u = usage or {"input_tokens": 25, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0, "output_tokens": 1}
    msg = {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-x", "content": [],
           "stop_reason": None, "stop_sequence": None, "usage": u}
    out: list[dict[str, Any]] = [{"type": "message_start", "message": msg}]
    for i, blk in enumerate(blocks):
        start = {"type": "text", "text": ""} if blk["type"] == "text" else {**blk, "input": {}}
        out.append({"type": "content_block_start", "index": i, "content_block": start})
        if i == 0:
            out.append({"type": "ping"})
        if blk["type"] == "text":
            words = blk["text"].split(" ")
            out += [{"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": w if k == 0 else " " + w}}
                    for k, w in enumerate(words)]
        else:
            out += [{"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": p}}
                    for p in blk.get("pieces", TOOL_JSON)]
        out.append({"type": "content_block_stop", "index": i})
    out.append({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": seq}, "usage": {"output_tokens": 12}})
    out.append({"type": "message_stop"})
    return out


def run_messages(events: list[dict[str, Any]], include_usage: bool = False) -> bytes:
    s = MessagesToChatStream("gw-model", "chatcmpl-1", include_usage=include_usage, created=3)
    out = b"".join(s.feed(e) for e in events)
    assert s.done and s.feed({"type": "ping"}) == b""
    return out


def openai_read(raw: bytes) -> tuple[str, dict[int, dict[str, str]], str | None, Any]:
    """(text, tool calls by index, finish reason, usage) as the openai SDK reads a chat stream."""
    text, calls, finish, usage = "", {}, None, None
    client = openai_client(raw)
    for ch in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True):
        if ch.usage:
            usage = ch.usage
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "args": ""})
                call["id"] = d.id or call["id"]
                if d.function:
                    call["name"] += d.function.name or ""
                    call["args"] += d.function.arguments or ""
    return text, calls, finish, usage


def test_an_anthropic_text_stream_as_chat_chunks():
    raw = run_messages(anthropic_events([{"type": "text", "text": "w0 w1 w2"}], "end_turn"))
    evs = sse(raw)
    assert all(name is None for name, _ in evs) and evs[-1][1] == "[DONE]" and raw.endswith(b"data: [DONE]\n\n")
    first = evs[0][1]
    assert first["object"] == "chat.completion.chunk" and first["id"] == "chatcmpl-1" and first["model"] == "gw-model"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text, calls, finish, usage = openai_read(raw)
    assert (text, calls, finish, usage) == ("w0 w1 w2", {}, "stop", None)


def test_an_anthropic_tool_stream_as_chat_tool_call_deltas():
    events = anthropic_events([{"type": "text", "text": "Checking the weather."},
                               {"type": "tool_use", "id": "toolu_1", "name": "get_weather"},
                               {"type": "tool_use", "id": "toolu_2", "name": "get_time", "pieces": ["{}"]}], "tool_use")
    raw = run_messages(events)
    tool_chunks = [d for _, d in sse(raw)[:-1] if d["choices"] and d["choices"][0]["delta"].get("tool_calls")]
    assert {c["choices"][0]["delta"]["tool_calls"][0]["index"] for c in tool_chunks} == {0, 1}  # tool blocks only
    text, calls, finish, _ = openai_read(raw)
    assert text == "Checking the weather." and finish == "tool_calls"
    assert calls == {0: {"id": "toolu_1", "name": "get_weather", "args": '{"city": "Paris"}'},
                     1: {"id": "toolu_2", "name": "get_time", "args": "{}"}}


def test_the_usage_chunk_only_when_asked():
    usage = {"input_tokens": 20, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 5, "output_tokens": 1}
    events = anthropic_events([{"type": "text", "text": "hi"}], "max_tokens", usage=usage)
    raw = run_messages(events, include_usage=True)
    last = sse(raw)[-2][1]
    assert last["choices"] == [] and last["usage"] == {"prompt_tokens": 125, "completion_tokens": 12, "total_tokens": 137,
                                                       "prompt_tokens_details": {"cached_tokens": 100}}
    _, _, finish, u = openai_read(raw)
    assert finish == "length" and u.prompt_tokens == 125 and u.completion_tokens == 12
    assert all(not d["choices"] or "usage" not in d for _, d in sse(run_messages(events))[:-1])


def test_a_stop_sequence_is_finish_stop_with_the_matched_string():
    raw = run_messages(anthropic_events([{"type": "text", "text": "w0 w1"}], "stop_sequence", "w2"))
    finish_chunk = [d for _, d in sse(raw)[:-1] if d["choices"][0]["finish_reason"]][0]
    assert finish_chunk["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop", "stop_reason": "w2"}


def test_an_anthropic_error_event_raises_for_the_caller():
    s = MessagesToChatStream("m", "c")
    s.feed(anthropic_events([{"type": "text", "text": "a"}], "end_turn")[0])
    with pytest.raises(UpstreamStreamError) as exc:
        s.feed({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    assert exc.value.err_type == "overloaded_error" and exc.value.message == "Overloaded"


def test_pings_thinking_blocks_and_unknown_events_are_ignored():
    events = anthropic_events([{"type": "text", "text": "a"}], "end_turn")
    events[1:1] = [{"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": ""}},
                   {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hm"}},
                   {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "s"}},
                   {"type": "content_block_stop", "index": 0}, {"type": "some_future_event"}]
    for e in events[6:]:
        if "index" in e:
            e["index"] = 1
    text, calls, finish, _ = openai_read(run_messages(events))
    assert (text, calls, finish) == ("a", {}, "stop")


def test_a_stream_round_trip_through_both_translators():
    """Anthropic events -> chat chunks -> Anthropic events: the SDK's final message is the original."""
    original = anthropic_events([{"type": "text", "text": "Checking the weather."},
                                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather"}], "tool_use")
    chat_raw = run_messages(original, include_usage=True)
    back = ChatToMessagesStream("claude-x", "msg_rt", 5)
    out = b"".join(back.feed(d) for _, d in sse(chat_raw))
    assert back.done
    events = grammar(out)
    _, final = sdk_final(out)
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Checking the weather." and final.content[1].input == {"city": "Paris"}  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use" and final.usage.input_tokens == 25 and final.usage.output_tokens == 12
    assert events[-2]["usage"]["input_tokens"] == 25


def test_public_surfaces():
    assert set(mstream.__all__) <= set(dir(mstream)) and set(tr.__all__) <= set(dir(tr)) and set(wire.__all__) <= set(dir(wire))
    import gateway.messages as pkg

    assert set(pkg.__all__) <= set(dir(pkg))


def test_translation_never_mutates_its_input():
    body = copy.deepcopy(MESSAGES_CONVERSATION)
    tr.messages_to_chat(body)
    assert body == MESSAGES_CONVERSATION
    chat = tr.messages_to_chat(MESSAGES_CONVERSATION)
    frozen = copy.deepcopy(chat)
    tr.chat_to_messages(chat, 5)
    assert chat == frozen


def test_nesting_orjson_cannot_write_back_is_a_translation_error_naming_the_field():
    deep: object = []
    for _ in range(300):
        deep = [deep]
    turns = [{"role": "user", "content": "hi"},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"x": deep}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]
    with pytest.raises(TranslationError, match=r"messages\[1\]\.content\[0\]\.input: nested too deeply"):
        tr.messages_to_chat({"model": "m", "max_tokens": 5, "messages": turns})
    tools = [{"name": "f", "input_schema": {"x": deep}}]
    with pytest.raises(TranslationError, match=r"tools\[0\]\.input_schema: nested too deeply"):
        tr.messages_to_chat({"model": "m", "max_tokens": 5, "messages": turns[:1], "tools": tools})


def test_a_tool_use_id_used_twice_is_refused_naming_the_second():
    # A chat backend took both calls of one id, the single tool_result answering them both.
    call = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}
    twice_in_a_turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [call, call]}, result]
    with pytest.raises(TranslationError, match=r"messages\[1\]\.content\[1\]\.id: tool_use id 't1' is used twice"):
        tr.messages_to_chat({**BASE, "messages": twice_in_a_turn})
    twice_in_the_conversation = [*twice_in_a_turn[:1], {"role": "assistant", "content": [call]}, result,
                                 {"role": "assistant", "content": [call]}, result]
    with pytest.raises(TranslationError, match=r"messages\[3\]\.content\[0\]\.id: tool_use id 't1' is used twice"):
        tr.messages_to_chat({**BASE, "messages": twice_in_the_conversation})


def test_a_schema_without_a_type_is_sent_as_the_object_it_is():
    # Anthropic's tool input is an object: a schema-following backend must not be free to answer another type.
    chat = tr.messages_to_chat({**BASE, "tools": [{"name": "f", "input_schema": {"properties": {"a": {"type": "string"}}}},
                                                  {"name": "g", "input_schema": {}}]})
    params = [t["function"]["parameters"] for t in chat["tools"]]
    assert params == [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "object"}]


def test_token_counts_of_an_unexpected_type_read_as_zero_not_as_a_crash():
    """A backend's usage with "10" (or 10.5, or true) where a count belongs: the translation
    raised TypeError, a 500 (review helper's repro); such a count is 0 now."""
    assert tr.chat_usage({"input_tokens": "10", "output_tokens": 2, "cache_read_input_tokens": 1.5})["prompt_tokens"] == 0
    out = tr.anthropic_usage({"prompt_tokens": 10, "completion_tokens": True, "prompt_tokens_details": {"cached_tokens": "3"}}, 5)
    assert out["input_tokens"] == 10 and out["cache_read_input_tokens"] == 0 and out["output_tokens"] == 0


def test_an_answer_that_cannot_be_written_back_as_a_message_is_not_an_answer():
    """Tool arguments nested 300 deep (orjson reads them, cannot write them back): the leg raised
    orjson's TypeError, a 500; now NotAnAnswer, so the relay fails over (review helper's repro)."""
    from gateway.messages.codec import MESSAGES_VIA_CHAT
    from gateway.wire.codec import NotAnAnswer

    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": ' + "[" * 300 + "]" * 300 + "}"}}
    chat = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            "choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]}, "finish_reason": "tool_calls"}]}
    with pytest.raises(NotAnAnswer):
        MESSAGES_VIA_CHAT.whole(orjson.dumps(chat), 0)
