"""Sans-io monitors of an Anthropic backend's stream (wire/monitor.py): native, for a Messages client,
and translated into chat chunks, for a chat client.

A Messages stream is `event: <type>` + `data: {...}` events: message_start, content blocks
(content_block_start / _delta / _stop; each delta is output), message_delta (the stop reason: the
answer is finished, and the output tokens), message_stop (the end marker), ping, and `error`.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..cache.entry import Entry
from ..wire.monitor import Verdict
from .stream import MessagesToChatStream
from .translate import chat_usage

__all__ = ["AnthropicMonitor", "AnthropicToChatMonitor", "MESSAGE_STOP"]

MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
_VERDICTS = {
    "message_start": Verdict.HELD, "content_block_start": Verdict.HELD, "content_block_stop": Verdict.HELD,
    "message_delta": Verdict.HELD, "content_block_delta": Verdict.CONTENT, "message_stop": Verdict.DONE,
    "error": Verdict.FAILED,
}


class AnthropicMonitor:
    """One Anthropic stream, passed through as it came (a Messages client, a `kind: anthropic` backend)."""

    __slots__ = ("finished", "failure", "timed", "out", "event", "parsed", "_usage")

    first = "first token"
    unfinished = "backend {backend!r} ended its stream before its stop reason"
    relays_failure = True  # its own error event is already in the client's shape, and ends the stream
    ending = MESSAGE_STOP
    record = None

    def __init__(self) -> None:
        self.finished = False
        self.failure: str | None = None
        self.timed = False
        self.out: bytes | None = None
        self.event: dict[str, Any] | None = None
        self.parsed: dict[str, Any] | None = None  # the last event, decoded
        self._usage: dict[str, Any] = {}

    @property
    def usage(self) -> dict[str, Any] | None:
        return chat_usage(self._usage) if self._usage else None

    def feed(self, data: bytes) -> Verdict:
        self.timed = False
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return Verdict.MALFORMED
        if not isinstance(obj, dict):
            return Verdict.MALFORMED
        self.parsed = obj
        kind = obj.get("type")
        v = _VERDICTS.get(kind) if isinstance(kind, str) else None
        if v is None:
            return Verdict.NOISE  # ping, or a type this gateway does not know: passed on once streaming
        if kind == "message_start":
            self._add((obj.get("message") or {}).get("usage"))
        elif kind == "message_delta":
            self._add(obj.get("usage"))
            if (obj.get("delta") or {}).get("stop_reason"):
                self.finished = True
        elif kind == "content_block_delta":
            self.timed = True
        elif kind == "error":
            err = obj.get("error") or {}
            self.failure = f"{err.get('type', 'error')}: {err.get('message', '')}"[:300]
        return v

    def _add(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self._usage.update({k: v for k, v in usage.items() if isinstance(v, int)})

    def entry(self) -> Entry | None:
        return None  # a streamed Message is not kept for the cache (a whole one is)


class AnthropicToChatMonitor:
    """An Anthropic stream read by AnthropicMonitor, given to a chat client as chat chunks."""

    __slots__ = ("_in", "_tr", "_ending", "_include", "out")

    first = "first token"
    unfinished = AnthropicMonitor.unfinished
    relays_failure = False  # the relay ends it with a chat error event
    record = None

    def __init__(self, *, include_usage: bool) -> None:
        self._in = AnthropicMonitor()
        self._tr: MessagesToChatStream | None = None
        self._ending: bytes | None = None
        self._include = include_usage
        self.out: bytes | None = None

    @property
    def finished(self) -> bool:
        return self._in.finished

    @property
    def failure(self) -> str | None:
        return self._in.failure

    @property
    def usage(self) -> dict[str, Any] | None:
        return self._in.usage

    @property
    def timed(self) -> bool:
        return self._in.timed

    @property
    def event(self) -> dict[str, Any] | None:
        return None  # not continued elsewhere (a chat client's transcript would need chat chunks)

    def feed(self, data: bytes) -> Verdict:
        v = self._in.feed(data)
        self.out = None
        if v in (Verdict.HELD, Verdict.CONTENT):
            obj = self._in.parsed or {}
            tr = self._tr
            if tr is None:
                msg = obj.get("message") or {}
                tr = self._tr = MessagesToChatStream(str(msg.get("model") or ""), "chatcmpl-" + str(msg.get("id") or ""),
                                                     include_usage=self._include)
            self.out = tr.feed(obj)
        return v

    @property
    def ending(self) -> bytes:
        if self._ending is None:
            self._ending = b"data: [DONE]\n\n" if self._tr is None else self._tr.feed({"type": "message_stop"})
        return self._ending

    def entry(self) -> Entry | None:
        return None
