"""The Responses API over a chat-only backend (gateway/responses/via_chat.py), without sockets:
requests translated to chat (and refused where chat cannot say it), chat answers and chat streams
translated back, checked against the grammar replay.py produces, the gateway's own Responses
monitor, and the official openai SDK reading the bytes (over httpx2.MockTransport)."""

from __future__ import annotations

import json
from typing import Any

import httpx2
import openai
import orjson
import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.errors import BadRequest
from gateway.messages.translate import TranslationError, Untranslatable
from gateway.responses.monitor import ResponsesMonitor
from gateway.responses.replay import replay_events, replayable
from gateway.responses.via_chat import (
    DONE,
    ChatToResponsesStream,
    StreamOrderError,
    chat_completion_to_response,
    responses_to_chat,
)
from gateway.responses.wire import usage_of
from gateway.wire.monitor import Verdict
from gateway.wire.openai_wire import SSEDecoder, event_data

EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": True}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": WEATHER["parameters"], "strict": True}}


# ---- helpers ----------------------------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None) -> dict[str, Any]:
    c = {"index": 0, "delta": delta or {}, "finish_reason": finish}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [c]}


def text(t: str, finish: str | None = None) -> dict[str, Any]:
    return chunk({"content": t}, finish)


def usage_chunk(prompt: int, completion: int, cached: int | None = None, reasoning: int | None = None) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning is not None:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [], "usage": u}


def tool(index: int, *, id: str | None = None, name: str | None = None, args: str | None = None,
         finish: str | None = None) -> dict[str, Any]:
    d: dict[str, Any] = {"index": index, "function": {}}
    if id is not None:
        d["id"], d["type"] = id, "function"
    if name is not None:
        d["function"]["name"] = name
    if args is not None:
        d["function"]["arguments"] = args
    return chunk({"tool_calls": [d]}, finish)


def completion(content: str | None, calls: list[tuple[str, str, str]] | None = None, finish: str = "stop",
               usage: dict[str, Any] | None = None, refusal: str | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": refusal}
    if calls:
        msg["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "served-m",
            "choices": [{"index": 0, "message": msg, "finish_reason": finish, "logprobs": None}],
            "usage": usage if usage is not None else {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}}


def run(chunks: list[Any], request: dict[str, Any] | None = None) -> bytes:
    s = ChatToResponsesStream("m", request or {"model": "m", "input": "hi", "stream": True})
    out = b"".join(s.feed(c) for c in chunks)
    assert s.done and s.feed(DONE) == b"" and s.close() == b""
    return out


def events(data: bytes) -> list[dict[str, Any]]:
    raw = SSEDecoder().feed(data)
    for e in raw:  # the framing replay.py writes: an `event:` line naming the type, then `data:`
        assert e.startswith(b"event: ")
    out = [orjson.loads(event_data(e) or b"") for e in raw]
    for e, r in zip(out, raw, strict=True):
        assert r.startswith(b"event: " + e["type"].encode() + b"\ndata: ")
    return out


def kinds(data: bytes) -> list[str]:
    return [e["type"] for e in events(data)]


def sdk_checked(data: bytes) -> dict[str, Any]:
    """Every event valid for the SDK's types, sequence numbers 0..n-1, and taken in order by the
    SDK's own stream accumulator; the last event's `response`."""
    evs = events(data)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in evs:
        state.handle_event(EVENTS.validate_python(e))
    final: dict[str, Any] = evs[-1]["response"]
    Response.model_validate(final)  # the whole Response, strictly
    return final


def _mock(body: bytes, ctype: str, seen: list[dict[str, Any]] | None = None) -> httpx2.MockTransport:
    def handler(request: httpx2.Request) -> httpx2.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        return httpx2.Response(200, headers={"content-type": ctype}, content=body)

    return httpx2.MockTransport(handler)


def client(body: bytes, ctype: str = "text/event-stream", seen: list[dict[str, Any]] | None = None) -> openai.OpenAI:
    http = openai.DefaultHttpxClient(transport=_mock(body, ctype, seen))
    return openai.OpenAI(api_key="k", base_url="http://gw/v1", http_client=http, max_retries=0)


def refused(body: dict[str, Any]) -> Untranslatable:
    with pytest.raises(Untranslatable) as exc:
        responses_to_chat({"model": "m", "input": "hi", **body})
    err = exc.value
    assert isinstance(err, BadRequest) and err.status == 400 and err.param == err.feature
    assert "OpenAI chat completions" in err.message
    return err


# ---- Responses -> chat ------------------------------------------------------------------------


def test_a_string_input_with_instructions_and_sampling_settings():
    body = {"model": "m", "instructions": "Be brief.", "input": "What is 2+2?", "max_output_tokens": 20,
            "temperature": 0.3, "top_p": 0.9}
    assert responses_to_chat(body) == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
        "max_tokens": 20, "temperature": 0.3, "top_p": 0.9,
    }


def test_message_items_and_their_content_parts():
    items = [
        {"type": "message", "role": "developer", "content": "Answer in French."},
        {"role": "system", "content": [{"type": "input_text", "text": "Be terse."}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "What is in these?"},
            {"type": "input_image", "image_url": "https://x/cat.png", "detail": "low"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "original"},
            {"type": "input_file", "file_data": "data:application/pdf;base64,JVBE", "filename": "a.pdf"},
        ]},
        # an output item of an earlier Response, sent back as it came (id, status, annotations)
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Un chat.", "annotations": [], "logprobs": []}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "A"}, {"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": "Merci"},
    ]
    msgs = responses_to_chat({"model": "m", "input": items})["messages"]
    assert msgs == [
        {"role": "system", "content": "Answer in French."},
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": [
            {"type": "text", "text": "What is in these?"},
            {"type": "image_url", "image_url": {"url": "https://x/cat.png", "detail": "low"}},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBE", "filename": "a.pdf"}},
        ]},
        {"role": "assistant", "content": "Un chat."},
        {"role": "assistant", "content": [{"type": "text", "text": "A"}, {"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": "Merci"},
    ]


def test_function_calls_join_one_assistant_turn_and_outputs_become_tool_messages():
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}',
         "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "21C"},
                                                                         {"type": "input_text", "text": " sunny"}]},
        {"role": "assistant", "content": "Let me also check Oslo."},
        {"type": "function_call", "call_id": "call_3", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
        {"type": "function_call_output", "call_id": "call_3", "output": "2C"},
    ]
    msgs = responses_to_chat({"model": "m", "input": items, "tools": [WEATHER]})["messages"]
    call = lambda i, city: {"id": f"call_{i}", "type": "function",  # noqa: E731
                            "function": {"name": "get_weather", "arguments": json.dumps({"city": city}, separators=(",", ":"))}}
    assert msgs == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call(1, "Paris"), call(2, "Rome")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "21C"}, {"type": "text", "text": " sunny"}]},
        {"role": "assistant", "content": "Let me also check Oslo.", "tool_calls": [call(3, "Oslo")]},
        {"role": "tool", "tool_call_id": "call_3", "content": "2C"},
    ]


@pytest.mark.parametrize(("choice", "chat"), [
    ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
])
def test_function_tools_and_tool_choice(choice: Any, chat: Any):
    out = responses_to_chat({"model": "m", "input": "hi", "tools": [WEATHER, {"type": "function", "name": "now"}],
                             "tool_choice": choice, "parallel_tool_calls": False})
    assert out["tools"] == [CHAT_WEATHER, {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    assert out["tool_choice"] == chat and out["parallel_tool_calls"] is False


def test_tool_settings_without_tools_are_dropped_as_chat_refuses_them():
    out = responses_to_chat({"model": "m", "input": "hi", "tools": [], "tool_choice": "auto", "parallel_tool_calls": True})
    assert "tools" not in out and "tool_choice" not in out and "parallel_tool_calls" not in out
    assert responses_to_chat({"model": "m", "input": "hi", "tool_choice": "none"}) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_text_format_and_verbosity():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True, "description": "d"}
    out = responses_to_chat({"model": "m", "input": "hi", "text": {"format": fmt, "verbosity": "low"}})
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True,
                                                                            "description": "d"}}
    assert out["verbosity"] == "low"
    out = responses_to_chat({"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}}})
    assert out["response_format"] == {"type": "json_object"}
    out = responses_to_chat({"model": "m", "input": "hi", "text": {"format": {"type": "text"}}})
    assert "response_format" not in out


def test_stream_user_and_the_fields_dropped_or_carried():
    body = {"model": "m", "input": "hi", "stream": True, "stream_options": {"include_obfuscation": False},
            "user": "u1", "metadata": {"k": "v"}, "store": True, "truncation": "disabled", "background": False,
            "include": [], "top_logprobs": 0, "reasoning": None, "service_tier": "flex", "prompt_cache_key": "pk",
            "prompt_cache_retention": "24h", "previous_response_id": None, "conversation": None}
    assert responses_to_chat(body) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}, "user": "u1", "service_tier": "flex", "prompt_cache_key": "pk",
        "prompt_cache_retention": "24h"}
    assert responses_to_chat({"model": "m", "input": "hi", "user": "u1", "safety_identifier": "s1"})["user"] == "s1"
    assert "reasoning" not in responses_to_chat({"model": "m", "input": "hi", "reasoning": {"effort": None, "summary": None}})
    assert "stream" not in responses_to_chat({"model": "m", "input": "hi", "stream": False})


@pytest.mark.parametrize(("body", "feature"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"conversation": {"id": "conv_1"}}, "conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1", "version": "2"}}, "prompt"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"n": 2}, "n"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation 'auto'"),
    ({"context_management": [{"type": "compaction"}]}, "context_management"),
    ({"tools": [{"type": "web_search"}]}, "built-in tool 'web_search' (tools[0])"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "built-in tool 'file_search' (tools[1])"),
    ({"tools": [{"type": "code_interpreter", "container": {"type": "auto"}}]}, "built-in tool 'code_interpreter' (tools[0])"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1}]}, "built-in tool 'computer_use_preview' (tools[0])"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "https://x"}]}, "built-in tool 'mcp' (tools[0])"),
    ({"tools": [{"type": "image_generation"}]}, "built-in tool 'image_generation' (tools[0])"),
    ({"tools": [{"type": "custom", "name": "c"}]}, "built-in tool 'custom' (tools[0])"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice 'allowed_tools'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice 'web_search_preview'"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format 'grammar'"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "reasoning items (input[0])"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item references (stored items) (input[0])"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "'web_search_call' items (input[0])"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1", "detail": "auto"}]}]},
     "images by file_id (input[0].content[0])"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "files by file_id or URL (input[0].content[0])"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_url": "https://x/a.pdf"}]}]},
     "files by file_id or URL (input[0].content[0])"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "https://x/a.png"}]}]},
     "input_image parts in a assistant message (input[0].content[0])"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}}]}]},
     "'input_audio' content parts (input[0].content[0])"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": "https://x"}]}]},
     "'input_image' parts in a function_call_output (input[0].output[0])"),
])
def test_what_a_chat_backend_cannot_do_is_refused_naming_the_field(body: dict[str, Any], feature: str):
    assert refused(body).feature == feature


@pytest.mark.parametrize("body", [
    {"input": 5},
    {"input": []},
    {"input": None, "instructions": "x"},
    {"input": ["hi"]},
    {"input": [{"role": "tool", "content": "x"}]},
    {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
    {"input": [{"type": "function_call_output", "output": "x"}]},
    {"input": [{"role": "user", "content": 7}]},
    {"instructions": ["x"]},
    {"tools": {"type": "function"}},
    {"tools": [{"type": "function"}]},
    {"text": "json"},
])
def test_malformed_requests_are_translation_errors_not_refusals(body: dict[str, Any]):
    with pytest.raises(TranslationError) as exc:
        responses_to_chat({"model": "m", "input": "hi", **body})
    assert not isinstance(exc.value, Untranslatable) and exc.value.status == 400


def test_the_request_the_sdk_sends_with_an_earlier_output_fed_back_translates():
    """The stateless multi-turn pattern: input += response.output, then the tool's output."""
    first = chat_completion_to_response(
        completion("Let me look.", [("call_9", "get_weather", '{"city":"Paris"}')], "tool_calls"),
        {"model": "m", "input": "Weather in Paris?", "tools": [WEATHER]})
    parsed = Response.model_validate(first)
    seen: list[dict[str, Any]] = []
    resp = chat_completion_to_response(completion("It is 18C."), {"model": "m"})
    c = client(orjson.dumps(resp), "application/json", seen)
    c.responses.create(model="m", tools=[WEATHER], store=False, input=[  # type: ignore[list-item]
        {"role": "user", "content": "Weather in Paris?"}, *parsed.output,
        {"type": "function_call_output", "call_id": "call_9", "output": "18C"}])
    msgs = responses_to_chat(seen[0])["messages"]
    assert msgs == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "18C"},
    ]


# ---- chat -> Responses: whole answers ---------------------------------------------------------


def test_a_text_answer_is_a_completed_response_echoing_the_request():
    request = {"model": "m", "input": "hi", "instructions": "Be brief.", "max_output_tokens": 50, "temperature": 0.2,
               "top_p": 0.8, "tools": [WEATHER], "tool_choice": "auto", "parallel_tool_calls": False,
               "metadata": {"k": "v"}, "store": True, "user": "u", "text": {"format": {"type": "text"}}}
    usage = {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16, "prompt_tokens_details": {"cached_tokens": 4},
             "completion_tokens_details": {"reasoning_tokens": 2}}
    resp = chat_completion_to_response(completion("Hello there.", usage=usage), request)
    assert resp["id"].startswith("resp_") and resp["object"] == "response" and resp["created_at"] == 1700000000
    assert resp["status"] == "completed" and resp["incomplete_details"] is None and resp["error"] is None
    assert resp["model"] == "served-m"
    [item] = resp["output"]
    assert item["id"].startswith("msg_") and item["type"] == "message" and item["role"] == "assistant"
    assert item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "Hello there.", "annotations": [], "logprobs": []}]
    assert resp["usage"] == {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                             "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 16}
    for key in ("instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice", "metadata", "user", "text"):
        assert resp[key] == request[key], key
    assert resp["parallel_tool_calls"] is False and resp["store"] is False and resp["previous_response_id"] is None
    parsed = Response.model_validate(resp)
    assert parsed.output_text == "Hello there."
    assert replayable(resp) and usage_of(resp) == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}


def test_tool_calls_are_function_call_items_after_the_text():
    resp = chat_completion_to_response(completion(None, [("call_1", "get_weather", '{"city":"Paris"}'),
                                                          ("", "get_weather", '{"city":"Rome"}')], "tool_calls"),
                                       {"model": "m", "input": "hi"})
    assert resp["status"] == "completed"
    a, b = resp["output"]
    assert a == {"id": a["id"], "type": "function_call", "status": "completed", "call_id": "call_1", "name": "get_weather",
                 "arguments": '{"city":"Paris"}'}
    assert a["id"].startswith("fc_") and b["call_id"].startswith("call_") and b["arguments"] == '{"city":"Rome"}'
    assert Response.model_validate(resp).output_text == ""
    assert resp["tools"] == [] and resp["tool_choice"] == "auto" and resp["parallel_tool_calls"] is True
    assert resp["text"] == {"format": {"type": "text"}} and resp["metadata"] == {}
    assert [i["type"] for i in chat_completion_to_response(completion("Checking.", [("c", "f", "{}")]), {})["output"]] == [
        "message", "function_call"]


@pytest.mark.parametrize(("finish", "reason"), [("length", "max_output_tokens"), ("content_filter", "content_filter")])
def test_a_cut_answer_is_incomplete_with_its_reason(finish: str, reason: str):
    resp = chat_completion_to_response(completion("The answer is", finish=finish), {"model": "m", "max_output_tokens": 3})
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": reason}
    assert resp["output"][0]["status"] == "incomplete" and resp["completed_at"] is None
    assert Response.model_validate(resp).output_text == "The answer is"
    assert not replayable(resp)  # never cached


def test_a_refusal_a_missing_usage_and_an_empty_answer():
    resp = chat_completion_to_response(completion(None, refusal="I can't help with that."), {})
    assert resp["output"][0]["content"] == [{"type": "refusal", "refusal": "I can't help with that."}]
    Response.model_validate(resp)
    chat = completion("x")
    del chat["usage"]
    assert chat_completion_to_response(chat, {})["usage"] is None
    assert chat_completion_to_response(completion(""), {})["output"] == []
    assert chat_completion_to_response({"choices": []}, {"model": "asked"})["model"] == "asked"


def test_the_sdk_reads_a_translated_whole_answer():
    resp = chat_completion_to_response(completion("Paris.", [("call_1", "get_weather", '{"city":"Paris"}')]),
                                       {"model": "m", "input": "hi", "tools": [WEATHER]})
    got = client(orjson.dumps(resp), "application/json").responses.create(model="m", input="hi", tools=[WEATHER])  # type: ignore[list-item]
    assert got.output_text == "Paris." and got.status == "completed"
    call = got.output[1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id == "call_1"
    assert got.usage is not None and got.usage.total_tokens == 16


# ---- chat -> Responses: streams ---------------------------------------------------------------

TEXT_ONLY = [chunk({"role": "assistant", "content": ""}), text("The capital "), text("of France "), text("is Paris."),
             text("", "stop"), usage_chunk(9, 7), DONE]

MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def collapse(ks: list[str]) -> list[str]:
    """Event types with each run of deltas read as one (how many pieces is the backend's choice)."""
    return [k for i, k in enumerate(ks) if not (k.endswith(".delta") and i and ks[i - 1] == k)]


def test_a_text_stream_is_the_replay_grammar():
    data = run(TEXT_ONLY)
    ks = kinds(data)
    assert ks == ["response.created", "response.in_progress", *MESSAGE_EVENTS[:2], *["response.output_text.delta"] * 3,
                  *MESSAGE_EVENTS[3:], "response.completed"]
    final = sdk_checked(data)
    assert final["status"] == "completed" and final["id"].startswith("resp_")
    assert Response.model_validate(final).output_text == "The capital of France is Paris."
    assert final["usage"]["input_tokens"] == 9 and final["usage"]["output_tokens"] == 7
    evs = events(data)
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []
    assert evs[0]["response"]["usage"] is None and evs[0]["response"]["id"] == final["id"]


def _same_as_replay(data: bytes, chunk_chars: int) -> None:
    """The stream, event for event, is what replay.py makes of its own final Response (but the
    lifecycle events' `response`, whose in-progress snapshot replay derives from the final one)."""
    mine = events(data)
    final = mine[-1]["response"]
    if final["status"] == "incomplete":  # replay.py replays completed responses only: compare the rest
        final = {**final, "status": "completed"}
    theirs = events(replay_events(orjson.dumps(final), chunk_chars=chunk_chars))
    assert [e["type"] for e in mine[:-1]] == [e["type"] for e in theirs[:-1]]
    strip = lambda e: {k: v for k, v in e.items() if k != "response"}  # noqa: E731
    assert [strip(e) for e in mine[:-1]] == [strip(e) for e in theirs[:-1]]


def test_a_stream_matches_replay_event_for_event_with_the_same_pieces():
    pieces = ["abcd", "efgh", "ij"]
    _same_as_replay(run([text(p) for p in pieces] + [text("", "stop"), DONE]), 4)
    calls = [text("Looki"), text("ng.."), tool(0, id="call_1", name="get_weather"), tool(0, args='{"cit'),
             tool(0, args='y":"P'), tool(0, args='aris"'), tool(0, args="}"), tool(1, id="call_2", name="now", args="{}"),
             chunk({}, "tool_calls"), usage_chunk(3, 4), DONE]
    _same_as_replay(run(calls), 5)
    _same_as_replay(run([text("abcde"), text("fg", "length"), DONE]), 5)


def test_the_stream_and_the_whole_answer_have_the_same_grammar():
    """ChatToResponsesStream and replay_events(chat_completion_to_response(...)) of the same answer
    send the same event types in the same order (runs of deltas aside)."""
    cases = [
        (TEXT_ONLY, completion("The capital of France is Paris.")),
        ([text("Let me check. "), tool(0, id="call_1", name="get_weather", args='{"city":'), tool(0, args='"Paris"}'),
          chunk({}, "tool_calls"), DONE],
         completion("Let me check. ", [("call_1", "get_weather", '{"city":"Paris"}')], "tool_calls")),
        ([tool(0, id="a", name="f", args="{}"), tool(1, id="b", name="g", args='{"x":1}', finish="tool_calls"), DONE],
         completion(None, [("a", "f", "{}"), ("b", "g", '{"x":1}')], "tool_calls")),
    ]
    for chunks, whole in cases:
        streamed = run(chunks)
        replayed = replay_events(orjson.dumps(chat_completion_to_response(whole, {"model": "m"})), chunk_chars=3)
        assert collapse(kinds(streamed)) == collapse(kinds(replayed))
        mine, theirs = events(streamed)[-1]["response"], events(replayed)[-1]["response"]
        strip = lambda r: [{k: v for k, v in i.items() if k != "id"} for i in r["output"]]  # noqa: E731
        assert strip(mine) == strip(theirs)


def test_text_then_a_tool_call_in_pieces():
    data = run([chunk({"role": "assistant"}), text("Checking "), text("the weather."),
                tool(0, id="call_1", name="get_weather"), tool(0, args='{"ci'), tool(0, args='ty": "Pa'),
                tool(0, args='ris"}'), chunk({}, "tool_calls"), usage_chunk(20, 12), DONE])
    ks = kinds(data)
    assert collapse(ks) == ["response.created", "response.in_progress", *MESSAGE_EVENTS, *CALL_EVENTS, "response.completed"]
    assert ks.count("response.function_call_arguments.delta") == 3
    final = sdk_checked(data)
    msg, call = final["output"]
    assert msg["content"][0]["text"] == "Checking the weather."
    assert call["call_id"] == "call_1" and call["name"] == "get_weather" and call["arguments"] == '{"city": "Paris"}'
    evs = events(data)
    done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == '{"city": "Paris"}' and done["name"] == "get_weather" and done["output_index"] == 1
    assert {e["item_id"] for e in evs if e["type"] == "response.function_call_arguments.delta"} == {call["id"]}


def test_two_tool_calls_and_servers_that_send_every_call_at_index_0():
    by_index = [tool(0, id="call_a", name="f", args='{"q":'), tool(0, args="1}"), tool(1, id="call_b", name="g"),
                tool(1, args='{"q":2}'), chunk({}, "tool_calls"), DONE]
    at_zero = [tool(0, id="call_a", name="f", args='{"q":'), tool(0, args="1}"), tool(0, id="call_b", name="g"),
               tool(0, args='{"q":2}'), chunk({}, "tool_calls"), DONE]
    for chunks in (by_index, at_zero):
        data = run(chunks)
        assert collapse(kinds(data)) == ["response.created", "response.in_progress", *CALL_EVENTS, *CALL_EVENTS,
                                         "response.completed"]
        final = sdk_checked(data)
        assert [(o["call_id"], o["name"], o["arguments"]) for o in final["output"]] == [
            ("call_a", "f", '{"q":1}'), ("call_b", "g", '{"q":2}')]
        assert [o["status"] for o in final["output"]] == ["completed", "completed"]
        assert final["usage"] is None  # the backend sent no usage chunk


def test_a_tool_name_in_pieces_is_whole_in_every_event():
    data = run([tool(0, id="call_a", name="get_", args=""), tool(0, name="weather"), tool(0, args='{"q":1}'),
                tool(1, id="call_b", name="look"), tool(1, name="up"), text("then text", "tool_calls"), DONE])
    added = [e["item"] for e in events(data) if e["type"] == "response.output_item.added"]
    assert [(i["type"], i.get("name")) for i in added] == [("function_call", "get_weather"), ("function_call", "lookup"),
                                                          ("message", None)]
    final = sdk_checked(data)
    assert [(o["type"], o.get("name"), o.get("arguments")) for o in final["output"]] == [
        ("function_call", "get_weather", '{"q":1}'), ("function_call", "lookup", ""), ("message", None, None)]


def test_usage_before_or_after_the_finish_reason_and_only_in_the_last_chunk():
    after = run([text("hi"), text("", "stop"), usage_chunk(5, 1, cached=2, reasoning=0), DONE])
    before = run([text("hi"), usage_chunk(5, 1, cached=2, reasoning=0), text("", "stop"), DONE])
    for data in (after, before):
        final = sdk_checked(data)
        assert final["usage"] == {"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
                                  "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 6}
    s = ChatToResponsesStream("m", {"model": "m"})
    s.feed(text("hi", "stop"))
    assert s.usage is None
    assert s.feed(usage_chunk(5, 1)) == b""  # a usage-only chunk adds no event
    assert s.usage == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6} and not s.done
    assert kinds(s.feed(DONE))[-1] == "response.completed" and s.done


def test_a_stream_cut_by_length_ends_incomplete():
    data = run([text("The answer "), text("is", "length"), usage_chunk(4, 3), DONE],
               {"model": "m", "input": "hi", "max_output_tokens": 3})
    ks = kinds(data)
    assert ks[-1] == "response.incomplete" and "response.completed" not in ks
    final = sdk_checked(data)
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["max_output_tokens"] == 3 and final["output"][0]["status"] == "incomplete"
    item_done = [e for e in events(data) if e["type"] == "response.output_item.done"][-1]
    assert item_done["item"]["status"] == "incomplete"
    assert Response.model_validate(final).output_text == "The answer is"


def test_a_refusal_streams_as_a_refusal_part():
    data = run([text("Sorry: "), chunk({"refusal": "I can't "}), chunk({"refusal": "do that."}), text("", "stop"), DONE])
    ks = kinds(data)
    assert ks[2:] == ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                      "response.output_text.done", "response.content_part.done", "response.content_part.added",
                      "response.refusal.delta", "response.refusal.delta", "response.refusal.done",
                      "response.content_part.done", "response.output_item.done", "response.completed"]
    final = sdk_checked(data)
    assert final["output"][0]["content"] == [{"type": "output_text", "text": "Sorry: ", "annotations": [], "logprobs": []},
                                             {"type": "refusal", "refusal": "I can't do that."}]
    _same_as_replay(run([text("Sorry: "), chunk({"refusal": "I can't "}), chunk({"refusal": "do that."}), DONE]), 8)


def test_odd_but_valid_chat_streams():
    # arguments before the name (held, then sent), and text after a call (a second message item)
    data = run([tool(0, args='{"a":'), tool(0, id="c1", name="f"), tool(0, args="1}"), text("Done."), text("", "stop"), DONE])
    final = sdk_checked(data)
    assert [o["type"] for o in final["output"]] == ["function_call", "message"]
    assert final["output"][0]["arguments"] == '{"a":1}' and final["output"][1]["content"][0]["text"] == "Done."
    # a call whose name never came is sent as it is; its id is made up when the backend sent none
    final = sdk_checked(run([tool(0, args="{}"), DONE]))
    assert final["output"][0]["name"] == "" and final["output"][0]["call_id"].startswith("call_")
    # reasoning text is not an output item; other choices are ignored
    final = sdk_checked(run([chunk({"reasoning_content": "hmm"}), {"choices": [{"index": 1, "delta": {"content": "x"}}]},
                             text("ok", "stop"), DONE]))
    assert [o["type"] for o in final["output"]] == ["message"] and final["output"][0]["content"][0]["text"] == "ok"


def test_an_empty_stream_and_close_without_done():
    data = run([DONE])
    assert kinds(data) == ["response.created", "response.in_progress", "response.completed"]
    assert sdk_checked(data)["output"] == []
    s = ChatToResponsesStream("", {"model": "asked"})
    out = s.feed(text("x")) + s.close()
    assert events(out)[-1]["response"]["model"] == "m"  # the backend's, when none was given
    assert s.done and s.close() == b"" and s.feed(text("y")) == b"" and s.feed(DONE) == b""


def test_arguments_for_a_call_after_a_later_item_began_are_a_stream_order_error():
    s = ChatToResponsesStream("m", {})
    s.feed(tool(0, id="a", name="f", args="{"))
    s.feed(tool(1, id="b", name="g", args="{}"))
    with pytest.raises(StreamOrderError):
        s.feed(tool(0, args="}"))


def test_the_gateways_responses_monitor_reads_the_stream_as_a_backends():
    data = run([text("Hello "), text("world."), text("", "stop"), usage_chunk(6, 2), DONE])
    mon = ResponsesMonitor(capture=1 << 20)
    verdicts = [mon.feed(event_data(e) or b"") for e in SSEDecoder().feed(data)]
    assert verdicts.count(Verdict.CONTENT) == 2 and mon.finished and mon.failure is None
    assert mon.created is not None and mon.created["id"] == events(data)[0]["response"]["id"]
    assert mon.usage == {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
    entry = mon.entry()
    assert entry is not None and replayable(orjson.loads(entry.body))  # a hit can be replayed later


# ---- the official SDK reading the stream ------------------------------------------------------

ANSWER = [chunk({"role": "assistant", "content": ""}), text("Let me "), text("check."),
          tool(0, id="call_7", name="get_weather", args=""), tool(0, args='{"city":'), tool(0, args='"Paris"}'),
          chunk({}, "tool_calls"), usage_chunk(30, 15), DONE]


def test_the_sdk_streams_events_and_assembles_the_final_response():
    data = run(ANSWER)
    c = client(data)
    with c.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER], stream=True) as stream:  # type: ignore[list-item]
        got = list(stream)
    assert [e.type for e in got] == kinds(data)
    assert "".join(e.delta for e in got if e.type == "response.output_text.delta") == "Let me check."
    assert "".join(e.delta for e in got if e.type == "response.function_call_arguments.delta") == '{"city":"Paris"}'

    with c.responses.stream(model="m", input="Weather in Paris?", tools=[WEATHER]) as s:  # type: ignore[list-item]
        texts = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(texts) == "Let me check." and final.output_text == "Let me check."
    call = final.output[1]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id == "call_7"
    assert call.arguments == '{"city":"Paris"}' and call.parsed_arguments == {"city": "Paris"}
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens) == (30, 15)
    assert final.status == "completed"


def test_the_sdk_reads_an_incomplete_stream_through_create():
    data = run([text("The answer "), text("is", "length"), DONE])
    got = list(client(data).responses.create(model="m", input="hi", max_output_tokens=3, stream=True))
    assert got[-1].type == "response.incomplete"
    assert got[-1].response.incomplete_details is not None and got[-1].response.incomplete_details.reason == "max_output_tokens"
    assert got[-1].response.output_text == "The answer is"


async def test_the_async_sdk_reads_the_stream():
    data = run(ANSWER)
    http = openai.DefaultAsyncHttpxClient(transport=_mock(data, "text/event-stream"))
    c = openai.AsyncOpenAI(api_key="k", base_url="http://gw/v1", http_client=http, max_retries=0)
    stream = await c.responses.create(model="m", input="hi", stream=True)
    got = [e async for e in stream]
    assert got[-1].type == "response.completed" and got[-1].response.output_text == "Let me check."
    async with c.responses.stream(model="m", input="hi", tools=[WEATHER]) as s:  # type: ignore[list-item]
        final = await s.get_final_response()
    assert final.output[1].type == "function_call" and final.output[1].name == "get_weather"
    await c.close()


def test_a_finish_reason_of_an_unexpected_type_is_no_crash():
    """A backend's finish_reason ["stop"] (a list: unhashable) raised TypeError in the
    translation, a 500 (review helper's repro); it reads as an unknown reason now."""
    resp = chat_completion_to_response(completion("hi", finish=["stop"]), {"model": "m"})  # type: ignore[arg-type]
    assert resp["output"][0]["status"] == "completed"
