"""Anthropic's Messages API (/v1/messages) as one endpoint codec (wire/codec.py): natively by
`kind: anthropic` backends (passed through), and by the backends that serve chat completions,
through translation (translate.py, stream.py); and the leg of a chat request toward an Anthropic
backend (ChatViaMessages).

The request is validated as a Messages request and checked for translatability at intake (a
feature chat cannot express is a 400 naming it, before any backend is called); each attempt
sends its chat translation to the backend's /chat/completions (`via`). A whole answer is
translated back into a Message; a stream's chat chunks into Anthropic's events, in their order,
by a monitor that wraps the chat monitor (so timing, failover, cut detection and usage are the
chat stream's own). Cache entries keep the backend's chat answer and are replayed as a Message or
its events. Errors are Anthropic-shaped, a status before the stream and an `error` event after.

Every leg's stream can be continued on another backend when it breaks (relay/continuation.py):
its monitor shows the transcript chat chunks and applies the continuation's rewrite to them, and a
Messages client's stream translator is kept in the transcript (`carry`) across the answer's
attempts, whichever legs they take (monitor.py, as_chat.py, ChatToMessagesMonitor). A prefill is
Anthropic's own: the delivered text as the trailing assistant turn (wire.codec.continue_final_turn).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ..cache.entry import Entry, is_complete
from ..errors import GatewayError
from ..relay.continuation import Transcript
from ..web.sink import Sink, SinkWrapper
from ..wire.chat_monitor import ChatMonitor, OverChat
from ..wire.codec import Endpoint, NotAnAnswer, Whole, continue_final_turn, salted
from ..wire.monitor import Monitor, Rewrite, Verdict
from .stream import BadArguments, ChatToMessagesStream, MalformedChunk, StreamOrderError
from ..wire.openai_wire import ChatRequest
from .as_chat import AnthropicToChatMonitor, ResumedMessageMonitor
from .monitor import AnthropicMonitor
from .translate import (
    TranslationError,
    chat_completion_to_message,
    chat_to_messages,
    chat_usage,
    encoded,
    estimate_tokens,
    has_prompt_count,
    message_id,
    message_to_chat_completion,
    messages_to_chat,
)
from .wire import MessagesRequest, error_event, error_type, gateway_error, sse_event

__all__ = ["CHAT_VIA_MESSAGES", "MESSAGES", "MESSAGES_VIA_CHAT", "ChatViaMessages", "MessagesEndpoint", "MessagesSink",
           "MessagesViaChat", "message_events"]


class MessagesEndpoint(Endpoint):
    """/v1/messages, and its native leg toward `kind: anthropic` backends (passed through)."""

    name, path, request = "messages", "/messages", MessagesRequest
    limit_fields = ("max_tokens",)
    kinds = frozenset({"anthropic"})
    id_headers = ("x-request-id", "request-id")  # the SDK's `_request_id` and `APIStatusError.request_id`
    asks_usage = False  # an Anthropic stream always reports usage; the chat leg asks for it itself
    prefill_trims = True  # Anthropic refuses a final assistant turn that ends in whitespace
    client_prefill = True
    stores_streams = False  # a streamed Message is shared live, not stored (a whole one is: MessagesMonitor)

    def continuable(self, body: Mapping[str, Any]) -> bool:
        """Text a continuation can reproduce: no tools asked for, no extended thinking."""
        thinking = body.get("thinking")
        return not body.get("tools") and not (isinstance(thinking, dict) and thinking.get("type") == "enabled")

    def prefill(self, body: Mapping[str, Any], text: str) -> dict[str, Any]:
        return continue_final_turn(body, text)

    def ends_in_prefill(self, body: Mapping[str, Any]) -> bool:
        turns = body.get("messages")
        return bool(turns) and isinstance(turns, list) and isinstance(turns[-1], dict) and turns[-1].get("role") == "assistant"

    def classify_view(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        try:
            return messages_to_chat(dict(body), prefill=True)
        except TranslationError:  # a feature chat lacks: classified by its text alone
            return text_view(body)

    def error_body(self, err: GatewayError) -> bytes:
        return gateway_error(err)[1]

    def wrap(self, sink: Sink) -> Sink:
        return MessagesSink(sink)

    def monitor(self, *, capture: int, strip_usage: bool, rewrite: Rewrite | None, body: Mapping[str, Any] | None = None,
                transcript: Any = None) -> Monitor:
        if rewrite is not None:  # a continuation of the client's message, whichever leg began it
            return ResumedMessageMonitor(rewrite=rewrite, transcript=transcript)
        return AnthropicMonitor(transcript if isinstance(transcript, Transcript) else None)

    def whole(self, raw: bytes, capture: int, request: Mapping[str, Any] | None = None) -> Whole:
        msg = _json(raw)
        if msg is None or msg.get("type") != "message" or not isinstance(msg.get("content"), list):
            raise NotAnAnswer("the backend answered 200 with a body that is not a Message")
        entry = Entry(raw) if capture and len(raw) <= capture and _storable(msg) else None
        return Whole(_usage_of(msg), entry)

    def replay(self, entry: Entry, *, stream: bool, include_usage: bool) -> bytes:
        """Entries hold the Message (whichever leg answered)."""
        return message_events(orjson.loads(entry.body)) if stream else entry.body


class MessagesViaChat(Endpoint):
    """The leg of a Messages request toward an OpenAI backend: sent as chat, answered as a Message."""

    name, path, request, upstream = "messages", "/messages", MessagesRequest, "chat"
    kinds = frozenset()
    continues = True  # as chat underneath: the transcript reads the chat chunks (ChatToMessagesMonitor.event)

    # A final assistant turn (a prefill) is sent as the chat request's last message: a request
    # ending in one reaches only backends that continue it (`prefill: true`; intake narrows the
    # route, config.runtime.Route.prefilled), never one that would start a new turn after it.

    def upstream_request(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return messages_to_chat(dict(body), prefill=True)

    def prefill(self, body: Mapping[str, Any], text: str) -> dict[str, Any]:
        return continue_final_turn(body, text)  # the chat request's: its last turn may be the client's prefill

    def validate(self, body: Mapping[str, Any]) -> None:
        encoded(messages_to_chat(dict(body), prefill=True), "the request")  # raises Untranslatable / TranslationError (400s)

    def upstream_body(self, body: Mapping[str, Any], upstream_model: str, cache_salt: str | None = None) -> bytes:
        return encoded(salted({**messages_to_chat(dict(body), prefill=True), "model": upstream_model}, cache_salt), "the request")

    def monitor(self, *, capture: int, strip_usage: bool, rewrite: Rewrite | None, body: Mapping[str, Any] | None = None,
                transcript: Any = None) -> Monitor:
        return ChatToMessagesMonitor(capture=capture, rewrite=rewrite, transcript=transcript, body=body)

    def whole(self, raw: bytes, capture: int, request: Mapping[str, Any] | None = None) -> Whole:
        obj = _json(raw)
        if obj is None or not isinstance(obj.get("choices"), list) or not obj["choices"]:
            raise NotAnAnswer("the backend answered 200 with a body that is not a chat completion")
        try:
            msg = _message(obj, request)
            body = orjson.dumps(msg)
        except (ValueError, TypeError) as exc:  # TypeError: orjson's, for nesting it cannot write back
            raise NotAnAnswer(f"the backend's answer cannot be read as a Message: {exc}") from None
        # The chat answer finished as the cache stores (stop, length), and the Message made of it is
        # one a lookup accepts: a refusal (finish "stop" with message.refusal) read back as corrupt.
        keep = capture and len(body) <= capture and is_complete(obj) and _storable(msg)
        entry = Entry(body) if keep else None
        usage = obj.get("usage")
        return Whole(usage if isinstance(usage, dict) else None, entry, body=body)


class ChatViaMessages(Endpoint):
    """The leg of a chat request toward an Anthropic backend: sent as a Messages request,
    answered as a chat completion (or its chunks)."""

    name, path, request, upstream = "chat", "/chat/completions", ChatRequest, "messages"
    kinds = frozenset()
    prefill_trims = True  # Anthropic refuses a final assistant turn that ends in whitespace
    stores_streams = False  # translated streams are not stored (AnthropicToChatMonitor)

    def __init__(self, default_max_tokens: int = 4096) -> None:
        super().__init__()
        self.default_max_tokens = default_max_tokens  # Anthropic requires max_tokens; chat does not
        self.default_limit = default_max_tokens

    def validate(self, body: Mapping[str, Any]) -> None:
        encoded(chat_to_messages(body, self.default_max_tokens), "the request")  # raises Untranslatable / TranslationError (400s)

    def upstream_body(self, body: Mapping[str, Any], upstream_model: str, cache_salt: str | None = None) -> bytes:
        # Toward Anthropic's API: no cache_salt there (a launched model speaks chat).
        return encoded({**chat_to_messages(body, self.default_max_tokens), "model": upstream_model}, "the request")

    def upstream_request(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return chat_to_messages(body, self.default_max_tokens)

    def prefill(self, body: Mapping[str, Any], text: str) -> dict[str, Any]:
        return continue_final_turn(body, text)

    def monitor(self, *, capture: int, strip_usage: bool, rewrite: Rewrite | None, body: Mapping[str, Any] | None = None,
                transcript: Any = None) -> Monitor:
        return AnthropicToChatMonitor(include_usage=not strip_usage, rewrite=rewrite, transcript=transcript)

    def whole(self, raw: bytes, capture: int, request: Mapping[str, Any] | None = None) -> Whole:
        msg = _json(raw)
        if msg is None or msg.get("type") != "message" or not isinstance(msg.get("content"), list):
            raise NotAnAnswer("the backend answered 200 with a body that is not a Message")
        try:
            chat = message_to_chat_completion(msg, str(msg.get("model") or ""))
        except ValueError as exc:
            raise NotAnAnswer(f"the backend's Message cannot be read as a chat completion: {exc}") from None
        body = orjson.dumps(chat)
        entry = Entry(body) if capture and len(body) <= capture and is_complete(chat) else None
        return Whole(_usage_of(msg), entry, body=body)


def text_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Messages request chat cannot express (thinking, top_k, a prefill, documents, server
    tools...) as chat messages of its plain text, for the classifier and the prompt estimate:
    the system prompt, each turn's text, thinking, tool inputs and results, text documents, and
    the tools. Only turns whose content was a string were kept: a 100,000-token prompt with
    `thinking` on was estimated at 3 tokens, reserved and charged as such (review helper's repro).
    Images and base64 documents are not text (their size is no measure)."""
    messages: list[dict[str, Any]] = []
    system = _text_of(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    turns = body.get("messages")
    for turn in turns if isinstance(turns, list) else ():
        if isinstance(turn, dict) and turn.get("role") in ("user", "assistant"):
            messages.append({"role": turn["role"], "content": _text_of(turn.get("content"))})
    view: dict[str, Any] = {"messages": messages}
    if body.get("tools"):
        view["tools"] = body["tools"]
    return view


_TEXT_FIELDS = {"text": "text", "thinking": "thinking"}


def _text_of(content: Any, nested: bool = False) -> str:
    """The text of a string or a list of content blocks (a tool result's own blocks, one level down)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    out: list[str] = []
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        text: Any = None
        if kind in _TEXT_FIELDS:
            text = block.get(_TEXT_FIELDS[kind])
        elif kind == "tool_result" and not nested:
            text = _text_of(block.get("content"), nested=True)
        elif kind in ("tool_use", "server_tool_use"):
            try:
                text = orjson.dumps(block.get("input")).decode()
            except orjson.JSONEncodeError:  # nested past what can be sent: a 400 elsewhere
                text = None
        elif kind == "document":
            source = block.get("source")
            if isinstance(source, dict) and source.get("type") == "text":
                text = source.get("data")
            elif isinstance(source, dict) and source.get("type") == "content" and not nested:
                text = _text_of(source.get("content"), nested=True)
        if isinstance(text, str) and text:
            out.append(text)
    return "\n".join(out)


def _json(raw: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _message(chat: dict[str, Any], request: Mapping[str, Any] | None, *, cut_input: bool = True) -> dict[str, Any]:
    """A chat answer as the Message a client of `request` gets: usage the backend did not report
    is the gateway's estimate (input from the request, as count_tokens counts it; output from the
    content), never the 1 or 0 of a missing figure."""
    estimate = 1 if has_prompt_count(chat.get("usage")) else prompt_estimate(request)
    return chat_completion_to_message(chat, str(chat.get("model") or ""), estimate, cut_input=cut_input, estimate_output=True)


def prompt_estimate(request: Mapping[str, Any] | None) -> int:
    """A Messages request's input tokens as count_tokens estimates them (1 without one)."""
    if request is None:
        return 1
    try:
        return estimate_tokens(request)
    except TranslationError:  # nesting orjson cannot write back: intake refused such a request already
        return 1


def _storable(msg: Mapping[str, Any]) -> bool:
    """Whether a Message may be stored: a lookup accepts it (is_complete: a refusal or pause_turn
    read back as corrupt, deleted and counted at every lookup) and a hit replays it as it was."""
    return is_complete(msg) and all(map(_replayable, msg["content"]))


def _replayable(block: Any) -> bool:
    """Whether message_events replays a block as it was: plain text and tool_use. Any other block
    (thinking and its signature, server tools, text with citations) would come back as an empty
    text block on a stream hit, so a Message holding one is not cached at all."""
    if not isinstance(block, dict):
        return False
    if block.get("type") == "text":
        return isinstance(block.get("text"), str) and not block.get("citations")
    return block.get("type") == "tool_use" and isinstance(block.get("input"), dict)


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


class ChatToMessagesMonitor(OverChat):
    """A chat stream read by the chat monitor (the relay's verdicts, usage, cache capture), its
    events given to the client as Anthropic's (`out`; `ending`: message_delta and message_stop).

    A continuation (relay/continuation.py) works on the chat chunks underneath: `rewrite` applies
    to them, `event` is the (rewritten) chunk the transcript reads, and the stream translator is
    kept in the transcript (`carry`), so a continued answer goes on as the same message."""

    __slots__ = ("_transcript", "_body", "out")

    first = "first token"
    unfinished = "backend {backend!r} ended its stream before its finish reason"
    relays_failure = False  # the relay ends a broken stream with an Anthropic error event (MessagesSink)
    record = None

    def __init__(self, *, capture: int = 0, rewrite: Rewrite | None = None, transcript: Any = None,
                 body: Mapping[str, Any] | None = None) -> None:
        self._chat = ChatMonitor(capture=capture, rewrite=rewrite)
        self._transcript = transcript if isinstance(transcript, Transcript) else None
        self._body = body  # the client's request: its estimated input tokens, for a backend that counts none
        # A continuation goes on with the translator of the stream it continues (no second
        # message_start); any other attempt starts its own (a failed one's events never left).
        carried = self._transcript.carry if self._transcript is not None and rewrite is not None else None
        self._tr: ChatToMessagesStream | None = carried if isinstance(carried, ChatToMessagesStream) else None
        self._ending: bytes | None = None
        self.out: bytes | None = None

    @property
    def event(self) -> dict[str, Any] | None:
        return self._chat.event  # the chat chunk underneath: what a continuation's transcript reads

    def feed(self, data: bytes) -> Verdict:
        v = self._chat.feed(data)
        self.out = None
        if v in (Verdict.CONTENT, Verdict.HELD):
            obj = self._chat.event or {}  # parsed (and rewritten, in a continuation) by the chat monitor
            tr = self._tr
            if tr is None:  # input_tokens: the estimate; the backend's usage, if any, comes at the end (message_delta)
                tr = self._tr = ChatToMessagesStream(str(obj.get("model") or ""), message_id(), prompt_estimate(self._body))
            if v is Verdict.CONTENT and self._transcript is not None:
                self._transcript.carry = tr  # the stream that gave the client content (a hedge's winner)
            try:
                self.out = tr.feed(obj)
            except StreamOrderError as exc:  # arguments for a block already closed: no answer we can give
                self._chat.failure = f"untranslatable stream: {exc}"
                return Verdict.FAILED
            except MalformedChunk as exc:  # a broken answer: the attempt fails (another backend may do better)
                self._chat.failure = f"malformed chunk: {exc}"
                return Verdict.FAILED
            except BadArguments as exc:  # a Message's tool input is a JSON object: before the client has it, another backend may do better
                self._chat.failure = str(exc)
                return Verdict.FAILED
        return v

    def entry(self) -> Entry | None:
        """The assembled chat answer, kept as the Message (what a Messages hit replays)."""
        if (chat := self.assembled()) is None:
            return None
        try:
            msg = _message(chat, self._body, cut_input=False)
            body = orjson.dumps(msg)
        # ValueError: a tool call cut by max_tokens (a hit could not replay the partial input the client
        # got); TypeError: orjson's, for tool input nested deeper than it writes back.
        except (ValueError, TypeError):
            return None
        return Entry(body) if _storable(msg) else None  # as whole(): only what a lookup accepts (not a refusal)


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
MESSAGES_VIA_CHAT = MessagesViaChat()
CHAT_VIA_MESSAGES = ChatViaMessages()


def _usage_of(msg: Mapping[str, Any]) -> dict[str, Any] | None:
    """A Message's usage in chat terms; None when it has none (the quota then charges the
    reservation, as for any answer without usage: read as zeros, it cost nothing)."""
    usage = msg.get("usage")
    return chat_usage(usage) if isinstance(usage, dict) else None
