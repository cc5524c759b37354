"""Anthropic's Messages API (/v1/messages) as one endpoint codec (wire/codec.py), answered by the
backends that serve chat completions, through translation (translate.py, stream.py).

The request is validated as a Messages request and checked for translatability at intake (a
feature chat cannot express is a 400 naming it, before any backend is called); each attempt
sends its chat translation to the backend's /chat/completions (`via`). A whole answer is
translated back into a Message; a stream's chat chunks into Anthropic's events, in their order,
by a monitor that wraps the chat monitor (so timing, failover, cut detection and usage are the
chat stream's own). Cache entries keep the backend's chat answer and are replayed as a Message or
its events. Errors are Anthropic-shaped, a status before the stream and an `error` event after.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ..cache.entry import Entry, is_complete
from ..errors import GatewayError
from ..web.sink import Sink, SinkWrapper
from ..wire.chat_monitor import ChatMonitor
from ..wire.codec import Endpoint, NotAnAnswer, Whole
from ..wire.monitor import Monitor, Rewrite, Verdict
from .stream import DONE, ChatToMessagesStream
from .translate import TranslationError, chat_completion_to_message, message_id, messages_to_chat
from .wire import MessagesRequest, error_event, error_type, gateway_error, sse_event

__all__ = ["MESSAGES", "MessagesEndpoint", "MessagesSink", "message_events"]


class MessagesEndpoint(Endpoint):
    name, path, request = "messages", "/messages", MessagesRequest
    via = "chat"  # answered by chat backends, translated
    asks_usage = False  # the translation asks a chat stream for its usage itself

    def validate(self, body: Mapping[str, Any]) -> None:
        messages_to_chat(dict(body))  # raises Untranslatable / TranslationError (400s) before any backend

    def classify_view(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        try:
            return messages_to_chat(dict(body))
        except TranslationError:  # refused at intake anyway (validate)
            return {"messages": []}

    def upstream_body(self, body: Mapping[str, Any], upstream_model: str) -> bytes:
        return orjson.dumps({**messages_to_chat(dict(body)), "model": upstream_model})

    def error_body(self, err: GatewayError) -> bytes:
        return gateway_error(err)[1]

    def wrap(self, sink: Sink) -> Sink:
        return MessagesSink(sink)

    def monitor(self, *, capture: int, strip_usage: bool, rewrite: Rewrite | None) -> Monitor:
        return ChatToMessagesMonitor(capture=capture)

    def whole(self, raw: bytes, capture: int) -> Whole:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("choices"), list) or not obj["choices"]:
            raise NotAnAnswer("the backend answered 200 with a body that is not a chat completion")
        try:
            msg = _message(obj)
        except ValueError as exc:
            raise NotAnAnswer(f"the backend's answer cannot be read as a Message: {exc}") from None
        entry = Entry(raw) if capture and len(raw) <= capture and is_complete(obj) else None
        usage = obj.get("usage")
        return Whole(usage if isinstance(usage, dict) else None, entry, body=orjson.dumps(msg))

    def replay(self, entry: Entry, *, stream: bool, include_usage: bool) -> bytes:
        msg = _message(orjson.loads(entry.body))
        return message_events(msg) if stream else orjson.dumps(msg)


def _message(chat: dict[str, Any]) -> dict[str, Any]:
    usage = chat.get("usage")
    estimate = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return chat_completion_to_message(chat, str(chat.get("model") or ""), estimate if isinstance(estimate, int) else 1)


def message_events(msg: Mapping[str, Any]) -> bytes:
    """A whole Message as Anthropic's stream events (a cached answer replayed as a stream)."""
    usage = dict(msg.get("usage") or {})
    start = {**msg, "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
    out = [sse_event({"type": "message_start", "message": start}), sse_event({"type": "ping"})]
    for i, block in enumerate(msg.get("content") or []):
        if block.get("type") == "tool_use":
            out.append(sse_event({"type": "content_block_start", "index": i, "content_block": {**block, "input": {}}}))
            delta: dict[str, Any] = {"type": "input_json_delta", "partial_json": orjson.dumps(block.get("input") or {}).decode()}
        else:
            out.append(sse_event({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}}))
            delta = {"type": "text_delta", "text": block.get("text", "")}
        out.append(sse_event({"type": "content_block_delta", "index": i, "delta": delta}))
        out.append(sse_event({"type": "content_block_stop", "index": i}))
    out.append(sse_event({"type": "message_delta", "delta": {"stop_reason": msg.get("stop_reason"), "stop_sequence": msg.get("stop_sequence")},
                          "usage": {"output_tokens": usage.get("output_tokens", 0)}}))
    out.append(sse_event({"type": "message_stop"}))
    return b"".join(out)


class ChatToMessagesMonitor:
    """A chat stream read by the chat monitor (the relay's verdicts, usage, cache capture), its
    events given to the client as Anthropic's (`out`; `ending`: message_delta and message_stop)."""

    __slots__ = ("_chat", "_tr", "_ending", "out")

    first = "first token"
    unfinished = "backend {backend!r} ended its stream before its finish reason"
    relays_failure = False  # the relay ends a broken stream with an Anthropic error event (MessagesSink)
    record = None

    def __init__(self, *, capture: int = 0) -> None:
        self._chat = ChatMonitor(capture=capture)
        self._tr: ChatToMessagesStream | None = None
        self._ending: bytes | None = None
        self.out: bytes | None = None

    @property
    def finished(self) -> bool:
        return self._chat.finished

    @property
    def failure(self) -> str | None:
        return self._chat.failure

    @property
    def usage(self) -> dict[str, Any] | None:
        return self._chat.usage

    @property
    def timed(self) -> bool:
        return self._chat.timed

    @property
    def event(self) -> dict[str, Any] | None:
        return None  # no transcript: a Messages stream is not continued elsewhere

    def feed(self, data: bytes) -> Verdict:
        v = self._chat.feed(data)
        self.out = None
        if v in (Verdict.CONTENT, Verdict.HELD, Verdict.DROP):
            obj = orjson.loads(data)  # the chat monitor parsed it: a JSON object
            tr = self._tr
            if tr is None:  # input_tokens: the backend's usage comes at the end (message_delta)
                tr = self._tr = ChatToMessagesStream(str(obj.get("model") or ""), message_id(), 1)
            self.out = tr.feed(obj)
        return v

    @property
    def ending(self) -> bytes:
        if self._ending is None:
            self._ending = b"" if self._tr is None else self._tr.feed(DONE)
        return self._ending

    def entry(self) -> Entry | None:
        return self._chat.entry()


class MessagesSink(SinkWrapper):
    """A Sink for /v1/messages: errors in Anthropic's shape, a status before the stream and an
    `error` event once it started."""

    __slots__ = ()

    async def fail(self, err: GatewayError) -> None:
        if self._inner.committed:
            await self._inner.write(error_event(error_type(err.status), err.message))
            await self._inner.end()
            return
        status, body = gateway_error(err)
        for name, value in err.headers().items():
            self._inner.set_header(name, value)
        await self._inner.send(status, body)


MESSAGES = MessagesEndpoint()
