"""Streamed answers between the two APIs: sans-io translators, fed one parsed event at a time,
each call returning the bytes to send (b"" when there is nothing yet).

ChatToMessagesStream: an OpenAI backend's chat.completion.chunk stream -> Anthropic's events, in
the order the SDK's accumulator requires: message_start (content [], usage.input_tokens > 0: the
estimate), ping, then each block's content_block_start / _delta / _stop with indexes 0, 1, ...
(text: text_delta; a tool call: a tool_use block and its arguments as input_json_delta pieces, so
OpenAI tool index 0 is Anthropic index 1 after a text block), then message_delta (stop_reason,
stop_sequence, usage: the backend's usage chunk when it came, else a count of the pieces) and
message_stop. The finish reason and the usage chunk may come in separate chunks, in either order:
both wait for [DONE] (or close()). At least one block is sent (an empty text block when the backend
sent nothing), as Anthropic does.

`follow` keeps a ChatToMessagesStream in step with a native Anthropic stream the client gets as it
came, so that the chat chunks of its continuation on another backend go on as the same message.

MessagesToChatStream: an Anthropic backend's events -> chat chunks: a role chunk, text and tool
call deltas (the OpenAI tool index counts tool blocks only), a finish chunk at message_delta, the
usage chunk when the client asked (stream_options.include_usage), then `data: [DONE]`. An `error`
event raises UpstreamStreamError for the caller to end the stream its own way. `chunk` gives one
event's chunk decoded (what a continuation's transcript reads and rewrites, messages/as_chat.py).

Mapping rules (stop reasons, usage) are translate.py's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
import pydantic_core

from ..wire.openai_wire import SSE_DONE, due_calls, tool_call_delta
from ..wire.openai_wire import sse_event as chat_event
from .translate import FINISH_REASONS, anthropic_usage, chat_usage, stop_reason, tool_id
from .wire import error_event
from .wire import sse_event as anthropic_event

__all__ = ["DONE", "BadArguments", "ChatToMessagesStream", "MalformedChunk", "MessagesToChatStream", "StreamOrderError", "UpstreamStreamError"]

DONE = "[DONE]"  # the chat stream's last `data:` payload, as fed to ChatToMessagesStream


class StreamOrderError(ValueError):
    """A chat stream Anthropic's events cannot express: arguments for a tool call after a later
    block began (Anthropic blocks are sequential and never reopened)."""


class MalformedChunk(ValueError):
    """A chat chunk whose parts are not the JSON types the API gives them (a `delta` that is a
    string, ...): the backend's answer is broken, and its attempt fails."""


def _obj(value: Any) -> Mapping[str, Any]:
    """An event's sub-object, or {} when absent or not an object (the monitors refuse such events
    before they get here: this only keeps a translator from raising AttributeError)."""
    return value if isinstance(value, dict) else {}


class UpstreamStreamError(Exception):
    """An Anthropic backend's `error` event mid-stream: `err_type` (overloaded_error, ...) and `message`."""

    def __init__(self, err_type: str, message: str) -> None:
        super().__init__(f"{err_type}: {message}")
        self.err_type = err_type
        self.message = message


@dataclass(slots=True)
class _Call:
    """One OpenAI tool call while it streams."""

    id: str | None
    name: str
    held: list[str]  # argument pieces that came before its name
    index: int = -1  # its Anthropic block index, once opened
    sent: list[str] = field(default_factory=list)  # its arguments as sent to the client so far, in pieces
    sent_chars: int = 0
    order: int = 0  # its place among the answer's calls


class BadArguments(ValueError):
    """A tool call's arguments that are not (the start of) a JSON object: Anthropic's `input` is
    one, and the SDK's accumulator raises on anything else."""


# Each piece's check re-reads the arguments so far (partial JSON); past this many characters the
# pieces go unchecked (a long argument would cost quadratic time) until the call's finish.
_PARTIAL_CHECK_CHARS = 4096


def _check_partial(call: _Call, piece: str) -> None:
    """Add `piece` to what was sent of `call`; raise BadArguments when it is no longer the start
    of a JSON object (single quotes, a bare string, ...), before the client gets it."""
    call.sent.append(piece)  # pieces, joined when read: a string grown piece by piece is copied each time
    call.sent_chars += len(piece)
    if call.sent_chars - len(piece) >= _PARTIAL_CHECK_CHARS:
        return
    sent = "".join(call.sent)
    try:
        parsed = pydantic_core.from_json(sent, allow_partial=True)
    except ValueError as exc:
        raise _bad(call, sent, f"not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise _bad(call, sent, "not a JSON object")


def _check_whole(call: _Call) -> None:
    """At the answer's finish: `call`'s arguments (sent, or held while its name did not come) are
    one whole JSON object ("" is {})."""
    text = "".join(call.sent) + "".join(call.held)
    if not text.strip():
        return
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise _bad(call, text, f"not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise _bad(call, text, "not a JSON object")


def _bad(call: _Call, text: str, why: str) -> BadArguments:
    # Not quoted: the model's output belongs in the request log only for a tenant that logs payloads.
    return BadArguments(f"tool call {call.name[:100]!r}: arguments are {why} ({len(text)} characters)")


class ChatToMessagesStream:
    """Chat chunks -> Anthropic stream events (see the module's note)."""

    def __init__(self, model: str, message_id: str, input_tokens_estimate: int) -> None:
        self.model = model
        self.message_id = message_id
        self.input_tokens_estimate = max(1, input_tokens_estimate)
        self.usage: dict[str, Any] | None = None  # the backend's chat usage, once reported
        self.done = False
        self._started = False
        self._blocks = 0  # blocks opened so far
        self._open: str | None = None  # "text" or "tool": the open block's kind
        self._calls: dict[int, _Call] = {}  # by OpenAI index: the latest call there
        self._all: list[_Call] = []  # every call, in order
        self._named: list[_Call] = []  # calls named but not opened yet (waiting for their first argument piece)
        self._refused = False  # a refusal streamed (OpenAI still finishes it with "stop")
        self._finish: str | None = None
        self._matched: Any = None  # vLLM's stop_reason: the stop string that matched
        self._pieces = 0  # text and argument pieces: the output count when no usage comes
        self._gateway: Any = None  # a continued answer's `x_gateway` (relay/continuation.py), for message_delta

    def feed(self, chunk: Mapping[str, Any] | str) -> bytes:
        """One chat chunk (a parsed `data:` payload), or DONE: the events it makes."""
        if self.done:
            return b""
        if isinstance(chunk, str):  # DONE
            return self.close()
        out = [self._start()]
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        if chunk.get("x_gateway") is not None:
            self._gateway = chunk["x_gateway"]
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise MalformedChunk(f"'choices' is not a list but {type(choices).__name__}")  # not quoted: it may hold output
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if not isinstance(delta, dict):
                raise MalformedChunk(f"'delta' is not an object but {type(delta).__name__}")
            if not isinstance(delta.get("tool_calls") or [], list):
                raise MalformedChunk("'delta.tool_calls' is not a list")
            for key in ("content", "refusal"):
                text = delta.get(key)
                if isinstance(text, str) and text:
                    out.append(self._text(text))
                    self._refused = self._refused or key == "refusal"
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    out.append(self._tool(call))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
                self._matched = choice.get("stop_reason")
                if self._finish != "length":  # cut by max_tokens: its last arguments may stop anywhere, as Anthropic's do
                    for c in self._all:
                        _check_whole(c)
        return b"".join(out)

    def close(self) -> bytes:
        """The end of the stream ([DONE], or the backend's clean end): the open block's stop,
        message_delta and message_stop. Idempotent."""
        if self.done:
            return b""
        out = [self._start()]
        for call in self._all:
            if call.index < 0:  # a call without arguments yet, or whose name never came: sent as it is
                out.append(self._open_tool(call, check=False))  # checked at the finish (_check_whole); close never raises
        if not self._blocks:
            out.append(self._begin("text", {"type": "text", "text": ""}))
        out.append(self._stop_block())
        finish = "content_filter" if self._refused and self._finish in (None, "stop") else self._finish
        reason, sequence = stop_reason(finish, has_tool_calls=bool(self._all), matched=self._matched)
        usage: dict[str, Any] = {"output_tokens": self._pieces}
        if self.usage is not None:
            full = anthropic_usage(self.usage, self.input_tokens_estimate, self._pieces)
            usage = {"input_tokens": full["input_tokens"], "output_tokens": full["output_tokens"],
                     "cache_read_input_tokens": full["cache_read_input_tokens"]}
        delta_event: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": usage}
        if self._gateway is not None:  # which backends answered a continued message, and how (as chat's finish chunk says)
            delta_event["x_gateway"] = self._gateway
        out.append(anthropic_event(delta_event))
        out.append(anthropic_event({"type": "message_stop"}))
        self.done = True
        return b"".join(out)

    def error(self, err_type: str, message: str) -> bytes:
        """An `error` event ending the stream (a failure after the first byte)."""
        self.done = True
        return error_event(err_type, message)

    def follow(self, event: Mapping[str, Any]) -> None:
        """Keep in step with an Anthropic stream the client gets as the backend sent it (a native
        backend's), sending nothing: chat chunks fed afterwards (a continuation of that answer,
        relay/continuation.py) go on with the same message, with no second message_start, the
        open text block continued and new blocks numbered after the client's."""
        kind = event.get("type")
        if kind == "message_start":
            self._started = True
            message = _obj(event.get("message"))
            self.message_id = str(message.get("id") or self.message_id)
            self.model = str(message.get("model") or self.model)
            tokens = _obj(message.get("usage")).get("input_tokens")
            if isinstance(tokens, int) and tokens > 0:
                self.input_tokens_estimate = tokens
        elif kind == "content_block_start":
            index, block = event.get("index"), _obj(event.get("content_block"))
            if isinstance(index, int):
                self._blocks = max(self._blocks, index + 1)
            self._open = "text" if block.get("type") == "text" else "tool"  # "tool": any block text must not go on in
        elif kind == "content_block_stop":
            self._open = None
        elif kind == "content_block_delta":
            self._pieces += 1

    def _start(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        usage = {"input_tokens": self.input_tokens_estimate, "output_tokens": 0,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        message: dict[str, Any] = {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage}
        return anthropic_event({"type": "message_start", "message": message}) + anthropic_event({"type": "ping"})

    def _stop_block(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return anthropic_event({"type": "content_block_stop", "index": self._blocks - 1})

    def _begin(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._stop_block()
        self._open = kind
        self._blocks += 1
        return out + anthropic_event({"type": "content_block_start", "index": self._blocks - 1, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        self._pieces += 1
        return anthropic_event({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})

    def _text(self, text: str) -> bytes:
        out = self._open_pending()
        out += b"" if self._open == "text" else self._begin("text", {"type": "text", "text": ""})
        return out + self._delta({"type": "text_delta", "text": text})

    def _open_pending(self, keep: _Call | None = None) -> bytes:
        """Open the calls waiting for their first argument piece: something after them begins."""
        named, self._named = self._named, []
        return b"".join(self._open_tool(c) for c in due_calls(named, keep)) if named else b""

    def _open_tool(self, call: _Call, *, check: bool = True) -> bytes:
        call.id = call.id or tool_id()
        out = self._begin("tool", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        call.index = self._blocks - 1
        held, call.held = "".join(call.held), []
        if held and check:
            _check_partial(call, held)
        return out + (self._delta({"type": "input_json_delta", "partial_json": held}) if held else b"")

    def _tool(self, delta: Mapping[str, Any]) -> bytes:
        at, ident, name, args = tool_call_delta(delta)
        call = self._calls.get(at)
        if call is None or (ident is not None and call.id is not None and ident != call.id):
            # a new call; a new id at a used index too (servers that send every call at index 0)
            call = self._calls[at] = _Call(id=None, name="", held=[], order=len(self._all))
            self._all.append(call)
        if call.id is None and ident is not None:
            call.id = ident
        if call.index < 0:
            if isinstance(name, str) and name:
                if not call.name:
                    self._named.append(call)
                call.name += name
            if isinstance(args, str) and args:
                call.held.append(args)
            # Its block opens with its first argument piece: a name may come in pieces until then
            # (tool_use's name is sent once, in content_block_start). Calls before it open first.
            if not (call.name and call.held):
                return b""
            return self._open_pending(keep=call) + self._open_tool(call)
        if not (isinstance(args, str) and args):
            return b""
        if self._open != "tool" or call.index != self._blocks - 1:
            raise StreamOrderError(f"arguments for tool call {at} after a later block began")
        _check_partial(call, args)
        return self._delta({"type": "input_json_delta", "partial_json": args})


class MessagesToChatStream:
    """Anthropic stream events -> chat chunk SSE bytes (see the module's note)."""

    def __init__(self, model: str, chunk_id: str, *, include_usage: bool = False, created: int | None = None) -> None:
        self.model = model
        self.chunk_id = chunk_id
        self.include_usage = include_usage
        self.created = int(time.time()) if created is None else created
        self.done = False
        self._usage: dict[str, Any] = {}  # Anthropic usage, updated by message_start and message_delta
        self._tools: dict[int, int] = {}  # Anthropic block index -> OpenAI tool call index
        self._whole: set[int] = set()  # tool blocks whose input came whole in content_block_start

    @property
    def usage(self) -> dict[str, Any]:
        """The answer's usage in chat terms (so far)."""
        return chat_usage(self._usage)

    def feed(self, event: Mapping[str, Any]) -> bytes:
        """One Anthropic event (a parsed `data:` payload): the chat chunks it makes.

        Raises UpstreamStreamError for an `error` event."""
        if self.done:
            return b""
        if event.get("type") == "message_stop":
            self.done = True
            return (chat_event(self.usage_chunk()) if self.include_usage else b"") + SSE_DONE
        chunk = self.chunk(event)
        return b"" if chunk is None else chat_event(chunk)

    def chunk(self, event: Mapping[str, Any]) -> dict[str, Any] | None:
        """The chat chunk one Anthropic event makes, decoded (None: none; message_stop's usage
        chunk and [DONE] are `feed`'s). Raises UpstreamStreamError for an `error` event."""
        kind = event.get("type")
        if kind == "message_start":
            message = _obj(event.get("message"))
            self._add_usage(message.get("usage"))
            return self._chunk({"role": "assistant", "content": ""})
        if kind == "content_block_start":
            return self._block_start(event.get("index"), _obj(event.get("content_block")))
        if kind == "content_block_delta":
            return self._block_delta(event.get("index"), _obj(event.get("delta")))
        if kind == "message_delta":
            self._add_usage(event.get("usage"))
            delta = _obj(event.get("delta"))
            reason = delta.get("stop_reason")
            return self._chunk({}, finish=FINISH_REASONS.get(str(reason), "stop"), matched=delta.get("stop_sequence"))
        if kind == "error":
            err = _obj(event.get("error"))
            raise UpstreamStreamError(str(err.get("type") or "api_error"), str(err.get("message") or "stream error"))
        return None  # ping, content_block_stop, message_stop, and event types added later

    def usage_chunk(self) -> dict[str, Any]:
        """The chunk with the answer's usage (so far) that ends a stream whose client asked for it."""
        return {"id": self.chunk_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage}

    def _add_usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self._usage.update({k: v for k, v in usage.items() if v is not None})

    def _block_start(self, index: Any, block: Mapping[str, Any]) -> dict[str, Any] | None:
        kind = block.get("type")
        if kind == "text" and block.get("text"):
            return self._chunk({"content": block["text"]})
        if kind != "tool_use" or not isinstance(index, int):
            return None  # thinking and other blocks the chat client did not ask for
        at = self._tools[index] = len(self._tools)
        args = ""
        if block.get("input"):  # whole input up front (Anthropic itself streams it as deltas)
            args = orjson.dumps(block["input"]).decode()
            self._whole.add(index)
        call = {"index": at, "id": block.get("id"), "type": "function",
                "function": {"name": block.get("name"), "arguments": args}}
        return self._chunk({"tool_calls": [call]})

    def _block_delta(self, index: Any, delta: Mapping[str, Any]) -> dict[str, Any] | None:
        kind = delta.get("type")
        if kind == "text_delta" and delta.get("text"):
            return self._chunk({"content": delta["text"]})
        if kind == "input_json_delta" and delta.get("partial_json") and index in self._tools and index not in self._whole:
            piece = {"index": self._tools[index], "function": {"arguments": delta["partial_json"]}}
            return self._chunk({"tool_calls": [piece]})
        return None

    def _chunk(self, delta: dict[str, Any], *, finish: str | None = None, matched: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if isinstance(matched, str):
            choice["stop_reason"] = matched  # vLLM's field: the stop sequence that matched
        return {"id": self.chunk_id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [choice]}
