"""Sans-io monitors of an Anthropic backend's stream (wire/monitor.py), passed to a Messages client
as it came; the ones that read it as chat chunks are in as_chat.py.

A Messages stream is `event: <type>` + `data: {...}` events: message_start, content blocks
(content_block_start / _delta / _stop; each delta is output), message_delta (the stop reason: the
answer is finished, and the output tokens), message_stop (the end marker), ping, and `error`.

Where the answer may be continued on another backend when the stream breaks
(relay/continuation.py), the monitor also shows the transcript each event as a chat chunk
(`event`) and keeps a ChatToMessagesStream in step with what the client got (`follow`): the
translator a continuation's chunks go through, kept in the transcript's `carry`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ..cache.entry import Entry
from ..relay.continuation import Transcript
from ..wire.monitor import Verdict
from .stream import ChatToMessagesStream, MessagesToChatStream
from .translate import chat_usage, message_id

__all__ = ["AnthropicEvents", "AnthropicMonitor", "MESSAGE_STOP", "other_output"]

MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
_VERDICTS = {
    "message_start": Verdict.HELD, "content_block_start": Verdict.HELD, "content_block_stop": Verdict.HELD,
    "message_delta": Verdict.HELD, "content_block_delta": Verdict.CONTENT, "message_stop": Verdict.DONE,
    "error": Verdict.FAILED,
}
# The object each event type carries (None or absent is tolerated as {}, as before).
_PARTS = {"message_start": "message", "content_block_start": "content_block", "content_block_delta": "delta",
          "message_delta": "delta", "error": "error"}


class AnthropicEvents:
    """Reads one Anthropic stream's events: each one's verdict, the stop reason, usage, an error's words."""

    __slots__ = ("finished", "failure", "malformed", "timed", "parsed", "_usage", "_counted")

    def __init__(self) -> None:
        self.finished = False
        self.failure: str | None = None
        self.malformed = False  # the failure is a broken event of the backend's, not its own error event
        self.timed = False
        self.parsed: dict[str, Any] | None = None  # the last event, decoded
        self._usage: dict[str, Any] = {}
        self._counted = False  # message_delta brought its usage: the output count is the answer's

    @property
    def usage(self) -> dict[str, Any] | None:
        """The answer's usage, once message_delta counted its output. message_start's says 1 or
        so output token: taken as final, a client that left before message_delta was charged 2
        tokens for 390 deltas. Until then None, and the quota counts the deltas delivered."""
        return chat_usage(self._usage) if self._counted else None

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
        part = _PARTS.get(str(kind))
        if part is not None and not isinstance(obj.get(part), dict | None):
            # A broken answer, not something to drop: the client's stream (and the translators)
            # would go on without it. The attempt fails, with the relay's own error event.
            self.malformed = True
            self.failure = f"malformed {kind} event: {part!r} is not an object"
            return Verdict.FAILED
        if kind == "message_start":
            self._add((obj.get("message") or {}).get("usage"))
        elif kind == "message_delta":
            self._counted = self._add(obj.get("usage")) or self._counted
            if (obj.get("delta") or {}).get("stop_reason"):
                self.finished = True
        elif kind == "content_block_delta":
            self.timed = True
        elif kind == "error":
            err = obj.get("error") or {}
            self.failure = f"{err.get('type', 'error')}: {err.get('message', '')}"[:300]
        return v

    def _add(self, usage: Any) -> bool:
        """Take what `usage` counts; whether it was a usage object."""
        if isinstance(usage, dict):
            self._usage.update({k: v for k, v in usage.items() if isinstance(v, int)})
            return True
        return False


class AnthropicMonitor(AnthropicEvents):
    """One Anthropic stream, passed through as it came (a Messages client, a `kind: anthropic`
    backend). With a `transcript` (the answer may be continued elsewhere), each event is also
    shown to it as a chat chunk (`event`), and the backend's own error event is left to the
    relay while the answer can still be continued."""

    __slots__ = ("out", "event", "_transcript", "_chunks", "_follow")

    first = "first token"
    unfinished = "backend {backend!r} ended its stream before its stop reason"
    ending = MESSAGE_STOP
    record = None

    def __init__(self, transcript: Transcript | None = None) -> None:
        super().__init__()
        self.out: bytes | None = None  # passed through: never rewritten
        self.event: dict[str, Any] | None = None
        self._transcript = transcript
        self._chunks: MessagesToChatStream | None = None  # the events as chat chunks, for the transcript
        self._follow: ChatToMessagesStream | None = None  # what the client got, for a continuation

    @property
    def relays_failure(self) -> bool:
        """The backend's error event is already in the client's shape and ends the stream, unless
        the relay may still continue the answer elsewhere (it then writes its own, if it cannot)."""
        if self.malformed:  # a broken event is not the client's to see: the relay writes the error
            return False
        return self._transcript is None or not self._transcript.continuable

    def feed(self, data: bytes) -> Verdict:
        v = super().feed(data)
        self.event = None
        if self._transcript is not None and v in (Verdict.HELD, Verdict.CONTENT):
            self._show(self.parsed or {}, self._transcript, v)
        return v

    def _show(self, obj: dict[str, Any], transcript: Transcript, v: Verdict) -> None:
        chunks, follow = self._chunks, self._follow
        if chunks is None or follow is None:
            msg = obj.get("message") or {}
            model, ident = str(msg.get("model") or ""), str(msg.get("id") or "")
            chunks = self._chunks = MessagesToChatStream(model, "chatcmpl-" + ident)
            follow = self._follow = ChatToMessagesStream(model, ident or message_id(), 1)
        follow.follow(obj)
        self.event = chunks.chunk(obj)
        if v is Verdict.CONTENT:
            if other_output(obj):
                transcript.continuable = False
            transcript.carry = follow  # the stream that gave the client content (a hedge's winner)

    def entry(self) -> Entry | None:
        return None  # a streamed Message is not kept for the cache (a whole one is)

    def estimated_usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return b""  # message_start and message_delta carry the usage


def other_output(obj: Mapping[str, Any]) -> bool:
    """An output event other than text (a tool's input, thinking, citations): what a
    continuation, which goes on from the text, cannot reproduce."""
    delta = obj.get("delta")
    return obj.get("type") == "content_block_delta" and (delta.get("type") if isinstance(delta, dict) else None) != "text_delta"
