"""The Responses API (/v1/responses) on the wire: the request fields the gateway reads, and what it
reads back out of answers (ids, usage), as pure functions.

The endpoint's codec: codec.py (a stream's events: monitor.py). How a cached
answer is replayed: replay.py. Which backend holds a response: affinity.py, pipeline/pinning.py.
The by-id endpoints: api.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import orjson
from pydantic import BeforeValidator, Field, field_validator

from ..errors import GatewayError
from ..web.sink import Sink, SinkWrapper
from ..wire.openai_wire import SSE_HEARTBEAT, JsonInt, _Body
from ..wire.tokens import bytes_tokens

__all__ = [
    "ResponsesRequest",
    "chat_view",
    "error_event",
    "held_ids",
    "held_items",
    "item_ids",
    "MAX_ITEM_REFS",
    "is_item_reference",
    "item_refs",
    "stateful_reason",
    "usage_of",
    "stateful_refs",
    "conversation_id",
    "ResponsesSink",
    "TERMINAL_OK",
    "TERMINAL_FAILED",
]

# Stored items one request may refer to (`item_reference`): each is looked up in the affinity map.
MAX_ITEM_REFS = 256

# Events that end a Responses stream: as an answer, or as a failure.
TERMINAL_OK = frozenset({"response.completed", "response.incomplete"})
TERMINAL_FAILED = frozenset({"response.failed", "error"})


def _conversation_ref(value: Any) -> Any:
    """`conversation` is an id or an object with a string `id`: anything else is the caller's
    mistake (a 400 naming the field), not something to send a backend. Returned as it came."""
    if value is None or (isinstance(value, str) and value):
        return value
    if isinstance(value, dict) and isinstance(value.get("id"), str) and value["id"]:
        return value
    raise ValueError('must be a conversation id (a non-empty string) or an object {"id": "<conversation id>"}')


class ResponsesRequest(_Body):
    """POST /v1/responses: the fields the gateway itself relies on; everything else passes through."""

    input: str | Annotated[list[dict[str, Any]], Field(fail_fast=True)] | None = None
    instructions: str | None = None
    max_output_tokens: JsonInt | None = Field(None, ge=1)
    previous_response_id: str | None = Field(None, min_length=1)
    conversation: Annotated[Any, BeforeValidator(_conversation_ref)] = None
    background: bool | None = Field(None, strict=True)

    @field_validator("input")
    @classmethod
    def _bounded_refs(cls, value: Any) -> Any:
        if isinstance(value, list) and len(item_refs(value)) > MAX_ITEM_REFS:
            raise ValueError(f"at most {MAX_ITEM_REFS} distinct item references (item_reference) a request")
        return value


def conversation_id(body: Mapping[str, Any]) -> str | None:
    """The conversation a request continues (`"conv_..."` or `{"id": "conv_..."}`), if any."""
    conv = body.get("conversation")
    if isinstance(conv, dict):
        conv = conv.get("id")
    return conv if isinstance(conv, str) and conv else None


def is_item_reference(item: Any) -> bool:
    """Whether an input item names a stored item: `{"type": "item_reference", "id": ...}`, or, as
    OpenAI reads it (its `type` is optional), a typeless item with an `id` and no `role`. Only the
    typed form was checked: `{"id": "<another tenant's item>"}` went to the backend unchecked."""
    if not isinstance(item, dict):
        return False
    kind = item.get("type")
    return kind == "item_reference" or (kind is None and "role" not in item and item.get("id") is not None)


def item_refs(items: Any) -> list[str]:
    """The stored items a list of input items names (`item_reference`), each once, in order."""
    if not isinstance(items, list):
        return []
    refs = (item.get("id") for item in items if is_item_reference(item))
    return list(dict.fromkeys(rid for rid in refs if isinstance(rid, str) and rid))


def stateful_refs(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Every (field, id) of server-side state a request refers to: `previous_response_id`, then
    `conversation`, then each stored item of `input` (`item_reference`). Each one must belong to
    the caller (pinning.pin)."""
    out: list[tuple[str, str]] = []
    prev = body.get("previous_response_id")
    if isinstance(prev, str) and prev:
        out.append(("previous_response_id", prev))
    conv = conversation_id(body)
    if conv:
        out.append(("conversation", conv))
    out += [("input", rid) for rid in item_refs(body.get("input"))]
    return out


def stateful_reason(body: Mapping[str, Any]) -> str | None:
    """Why a Responses request must not be answered from the cache, or None. Mostly: its answer
    depends on (or adds to) state a backend keeps, which a replay would neither read nor update."""
    if body.get("previous_response_id"):
        return "previous_response_id: the answer builds on a stored response"
    if conversation_id(body):
        return "conversation: the answer reads and extends a stored conversation"
    if body.get("background"):
        return "background: the answer is polled, not returned"
    include = body.get("include")
    if body.get("top_logprobs") or (isinstance(include, list) and "message.output_text.logprobs" in include):
        return "logprobs requested"
    return None


def _text(content: Any) -> Any:
    """Responses content parts (input_text / output_text / refusal / summary_text /
    reasoning_text) in the chat parts shape the classifier reads (`text` keys); a string stays a
    string, anything else reads as no text."""
    if isinstance(content, list):
        return [{"type": "text", "text": p.get("text") or p.get("refusal")} for p in content if isinstance(p, dict)]
    return content if isinstance(content, str) else ""


def _variables(prompt: Any) -> str:
    """The text of a prompt template's `variables` (strings, or input_text parts): what the
    backend puts into the stored prompt, read as instructions."""
    variables = prompt.get("variables") if isinstance(prompt, dict) else None
    if not isinstance(variables, dict):
        return ""
    texts = (v if isinstance(v, str) else v.get("text") if isinstance(v, dict) else None for v in variables.values())
    return "\n".join(t for t in texts if isinstance(t, str) and t)


def chat_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses body as the chat body the classifier reads: `instructions` as the system
    message, `input` (a string, or a list of items) as the messages, `max_output_tokens` as
    max_tokens; tools and text format carried over."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    variables = _variables(body.get("prompt"))
    if variables:
        messages.append({"role": "system", "content": variables})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict) or is_item_reference(item):
                continue
            kind = item.get("type", "message")
            if kind == "message" or "role" in item:
                messages.append({"role": item.get("role", "user"), "content": _text(item.get("content"))})
            elif kind in ("function_call_output", "custom_tool_call_output"):
                # a string, or a list of input_text (and image, file) parts
                messages.append({"role": "tool", "content": _text(item.get("output"))})
            elif kind == "function_call":
                messages.append({"role": "assistant", "content": item.get("arguments") or ""})
            elif kind == "custom_tool_call":
                messages.append({"role": "assistant", "content": _text(item.get("input"))})
            elif kind == "reasoning":  # its summary and its text (encrypted_content is not text)
                parts = [part for key in ("summary", "content") if isinstance(item.get(key), list) for part in item[key]]
                messages.append({"role": "assistant", "content": _text(parts)})
            # Other kinds (a search's results, a shell's output, ...): not read here; a large
            # share of the body unread makes the prompt complex (pipeline/intake.py `_hidden`).
    view: dict[str, Any] = {"messages": messages}
    if body.get("max_output_tokens") is not None:
        view["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        view["tools"] = body["tools"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        view["response_format"] = {"type": "json_schema", "json_schema": fmt}
    return view


def usage_of(response: Mapping[str, Any]) -> dict[str, Any] | None:
    """A response's usage in the gateway's own terms (prompt/completion/total tokens), which the
    quotas, spend and token metrics read; None when it has none."""
    usage = response.get("usage")
    if not isinstance(usage, dict):
        return None
    p, c = usage.get("input_tokens"), usage.get("output_tokens")
    p = p if isinstance(p, int) else 0
    c = c if isinstance(c, int) else 0
    total = usage.get("total_tokens")
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": total if isinstance(total, int) else p + c}


def held_ids(response: Mapping[str, Any]) -> list[str]:
    """The ids a backend keeps state under for this response: the response's own, the
    conversation it extended (later turns of that conversation must reach the same backend)."""
    out = []
    rid = response.get("id")
    if isinstance(rid, str) and rid:
        out.append(rid)
    conv = conversation_id(response)
    if conv:
        out.append(conv)
    return out


def held_items(response: Mapping[str, Any]) -> dict[str, int]:
    """The output items a backend keeps for this response (a later `item_reference` names one),
    those of a stored response or of one that extended a conversation: id -> its size in tokens."""
    if response.get("store") is False and not conversation_id(response):
        return {}
    return item_ids(response.get("output"))


def item_ids(items: Any) -> dict[str, int]:
    """The items of a list (a response's `output`, a listing's `data`): id -> its size in tokens
    (the tokens of its JSON: what a request naming it makes the backend read)."""
    if not isinstance(items, list):
        return {}
    return {rid: _size(item) for item in items if isinstance(item, dict) and isinstance(rid := item.get("id"), str) and rid}


def _size(item: Mapping[str, Any]) -> int:
    try:
        return bytes_tokens(orjson.dumps(item))
    except orjson.JSONEncodeError:  # nested past what orjson writes: not an item anyone can send back
        return 0


def error_event(err: GatewayError, sequence_number: int) -> bytes:
    """The event that ends a cut Responses stream: a valid `error` event (type, code, message,
    param, sequence_number) that also carries the OpenAI error object, on which the official
    SDKs raise (APIError) instead of returning a stream that merely stops."""
    e = err.to_dict()["error"]
    data = {"type": "error", "sequence_number": sequence_number, "code": e["code"], "message": e["message"], "param": e["param"], "error": e}
    return b"event: error\ndata: " + orjson.dumps(data) + b"\n\n"


_SEQ = b'"sequence_number":'


def last_sequence_number(data: bytes) -> int | None:
    at = data.rfind(_SEQ)
    if at < 0:
        return None
    i = at + len(_SEQ)
    while i < len(data) and data[i : i + 1] == b" ":
        i += 1
    j = i
    while j < len(data) and data[j : j + 1].isdigit():
        j += 1
    return int(data[i:j]) if j > i else None


class ResponsesSink(SinkWrapper):
    """A Sink for /v1/responses: once streaming, a failure ends the stream with a Responses
    `error` event (error_event), numbered after the last event the client got."""

    __slots__ = ("_last",)

    def __init__(self, inner: Sink) -> None:
        super().__init__(inner)
        self._last = b""  # the last events written (the next sequence number is read from them on failure)

    async def write(self, data: bytes) -> None:
        if data and data != SSE_HEARTBEAT:
            self._last = data
        await self._inner.write(data)

    async def fail(self, err: GatewayError) -> None:
        if not self._inner.committed:
            await self._inner.fail(err)
            return
        last = last_sequence_number(self._last)
        await self._inner.write(error_event(err, 0 if last is None else last + 1))
        await self._inner.end()

