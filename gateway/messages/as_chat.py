"""Sans-io monitors that read an Anthropic backend's stream as chat chunks (wire/monitor.py).

Each event (AnthropicEvents: verdicts, stop reason, usage, failure) becomes the chat chunk
MessagesToChatStream makes of it, which is what a continuation's transcript reads (`event`). In a
continuation (relay/continuation.py) the chunk first goes through the continuation's `rewrite`:
its role chunk and anything the client already has are dropped, the rest carries the first
stream's identity, the finish chunk says what happened (`x_gateway`) and the usage chunk counts the
delivered tokens too. Then:

- AnthropicToChatMonitor gives the chunks to a chat client (a chat request answered by a
  `kind: anthropic` backend), with the usage chunk when the client asked, then [DONE];
- ResumedMessageMonitor gives them to a Messages client whose answer this stream continues,
  through the translator of the stream it continues (Transcript.carry: a native stream's
  follower, or a chat stream's translator), so the client's message goes on: no second
  message_start, the open text block continued, one message_delta and message_stop at the end.

Anthropic's `ping` and unknown events are dropped: they mean nothing to either client here.
"""

from __future__ import annotations

from typing import Any

from ..cache.entry import Entry
from ..relay.continuation import Transcript
from ..wire.chat_monitor import has_content
from ..wire.monitor import Rewrite, Verdict
from ..wire.openai_wire import SSE_DONE
from ..wire.openai_wire import sse_event as chat_event
from .monitor import AnthropicEvents, AnthropicMonitor, other_output
from .stream import DONE, ChatToMessagesStream, MessagesToChatStream, StreamOrderError
from .translate import message_id

__all__ = ["AnthropicToChatMonitor", "OverAnthropic", "ResumedMessageMonitor"]


class OverAnthropic:
    """The part of a monitor that reads an Anthropic stream as chat chunks (`_read`)."""

    __slots__ = ("_in", "_chunks", "_rewrite", "_transcript", "_final", "_ending", "event", "out")

    first = "first token"
    unfinished = AnthropicMonitor.unfinished
    relays_failure = False  # the relay ends a broken stream with the client's error event, after any rescue
    record = None

    def __init__(self, rewrite: Rewrite | None, transcript: Any) -> None:
        self._in = AnthropicEvents()
        self._chunks: MessagesToChatStream | None = None
        self._rewrite = rewrite
        self._transcript = transcript if isinstance(transcript, Transcript) else None
        self._final: dict[str, Any] | None = None  # the usage chunk that ends the answer (rewritten in a continuation)
        self._ending: bytes | None = None
        self.event: dict[str, Any] | None = None
        self.out: bytes | None = None

    @property
    def finished(self) -> bool:
        return self._in.finished

    @property
    def failure(self) -> str | None:
        return self._in.failure

    @property
    def timed(self) -> bool:
        return self._in.timed

    @property
    def usage(self) -> dict[str, Any] | None:
        """The answer's usage: the final usage chunk's once the stop reason came (in a
        continuation, the delivered tokens counted too), else what the stream reported so far."""
        usage = self._final.get("usage") if self._final is not None else None
        return usage if isinstance(usage, dict) else self._in.usage

    def _read(self, data: bytes) -> Verdict:
        """Read one event: its verdict, and in `event` its chat chunk (None: it makes none)."""
        v = self._in.feed(data)
        self.event = self.out = None
        if v is Verdict.NOISE:
            return Verdict.DROP
        if v is not Verdict.HELD and v is not Verdict.CONTENT:
            return v
        obj = self._in.parsed or {}
        chunks = self._chunks
        if chunks is None:
            msg = obj.get("message") or {}
            chunks = self._chunks = MessagesToChatStream(str(msg.get("model") or ""), "chatcmpl-" + str(msg.get("id") or ""))
        chunk = chunks.chunk(obj)
        rewrite = self._rewrite
        if rewrite is None:
            if v is Verdict.CONTENT and self._transcript is not None and other_output(obj):
                self._transcript.continuable = False
            self.event = chunk
            if obj.get("type") == "message_delta":
                self._final = chunks.usage_chunk()
            return v
        if chunk is not None:
            chunk = rewrite(chunk)  # raises continuation.Mismatch
        if obj.get("type") == "message_delta":
            self._final = rewrite(chunks.usage_chunk())
        if chunk is None:
            return Verdict.DROP  # the role chunk, block starts and stops, text the client already has
        self.event = chunk
        return Verdict.CONTENT if has_content(chunk) else Verdict.HELD

    def _usage_chunk(self) -> dict[str, Any] | None:
        """The usage chunk at the end (made now if the stream ended without its message_delta)."""
        if self._final is None and self._chunks is not None:
            chunk = self._chunks.usage_chunk()
            self._final = chunk if self._rewrite is None else self._rewrite(chunk)
        return self._final

    def entry(self) -> Entry | None:
        return None  # translated streams are not kept for the cache

    def estimated_usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return b""  # `ending` makes the usage chunk from the Anthropic stream's own usage


class AnthropicToChatMonitor(OverAnthropic):
    """An Anthropic stream given to a chat client as chat chunks (the first attempt's, or a
    continuation's, rewritten)."""

    __slots__ = ("_include",)

    def __init__(self, *, include_usage: bool, rewrite: Rewrite | None = None, transcript: Any = None) -> None:
        super().__init__(rewrite, transcript)
        self._include = include_usage

    def feed(self, data: bytes) -> Verdict:
        v = self._read(data)
        if v is Verdict.HELD or v is Verdict.CONTENT:
            self.out = b"" if self.event is None else chat_event(self.event)
        return v

    @property
    def ending(self) -> bytes:
        """The usage chunk when the client asked for it, then [DONE]."""
        if self._ending is None:
            final = self._usage_chunk() if self._include else None
            self._ending = (b"" if final is None else chat_event(final)) + SSE_DONE
        return self._ending


class ResumedMessageMonitor(OverAnthropic):
    """An Anthropic stream that continues a Messages client's answer (see the module's note)."""

    __slots__ = ("_tr",)

    def __init__(self, *, rewrite: Rewrite, transcript: Any) -> None:
        super().__init__(rewrite, transcript)
        carried = self._transcript.carry if self._transcript is not None else None
        # Always there: a continuation follows content, and each stream that gave the client
        # content left its translator; a fresh one would start a second message.
        self._tr = carried if isinstance(carried, ChatToMessagesStream) else ChatToMessagesStream("", message_id(), 1)

    def feed(self, data: bytes) -> Verdict:
        v = self._read(data)
        if self.event is not None:
            try:
                self.out = self._tr.feed(self.event)
            except StreamOrderError as exc:  # cannot happen for text; a tool's arguments after its block closed
                self._in.failure = f"untranslatable stream: {exc}"
                return Verdict.FAILED
        return v

    @property
    def ending(self) -> bytes:
        """The message's end: its last block's stop, message_delta (stop reason, usage), message_stop."""
        if self._ending is None:
            final = self._usage_chunk()
            self._ending = (b"" if final is None else self._tr.feed(final)) + self._tr.feed(DONE)
        return self._ending
