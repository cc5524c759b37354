"""The Responses API toward a backend that serves only chat completions (our local model, many
self-hosted servers): a translating leg of the Responses codec (wire/codec.py `toward`).

Stateless parts only (via_chat.py): a request that builds on stored state (`previous_response_id`,
`conversation`) is pinned to the backend holding it, never translated. The backend holds nothing
of the answer, so no id of it is recorded (a later GET of it is a 404, as for `store: false`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ..cache.entry import Entry
from ..wire.chat_monitor import ChatMonitor, OverChat
from ..wire.codec import Endpoint, NotAnAnswer, Whole, salted
from ..wire.monitor import Monitor, Rewrite, Verdict
from .replay import replayable
from ..messages.translate import encoded
from .via_chat import ECHOED, ChatToResponsesStream, StreamOrderError, chat_completion_to_response, responses_to_chat
from .wire import ResponsesRequest, stateful_refs

__all__ = ["RESPONSES_VIA_CHAT", "ResponsesViaChat"]


class ResponsesViaChat(Endpoint):
    name, path, request, upstream = "responses", "/responses", ResponsesRequest, "chat"
    kinds = frozenset()
    continues = False

    def validate(self, body: Mapping[str, Any]) -> None:
        if not stateful_refs(body):  # a follow-up goes to the backend holding its state (pinning), as it is
            # Encoded too: orjson reads deeper nesting (a tool's schema) than it writes: a 400, not a 500
            encoded(responses_to_chat(body), "the request")
            for key in ECHOED:  # and what the Response echoes, as deep as a stream's event holds it
                if body.get(key) is not None:
                    encoded({"event": {"response": {key: body[key]}}}, key)

    def upstream_body(self, body: Mapping[str, Any], upstream_model: str, cache_salt: str | None = None) -> bytes:
        return encoded(salted({**responses_to_chat(body), "model": upstream_model}, cache_salt), "the request")

    def monitor(self, *, capture: int, strip_usage: bool, rewrite: Rewrite | None,
                body: Mapping[str, Any] | None = None, transcript: Any = None) -> Monitor:
        return ChatToResponsesMonitor(body or {}, capture=capture)

    def whole(self, raw: bytes, capture: int, request: Mapping[str, Any] | None = None) -> Whole:
        try:
            chat = orjson.loads(raw)
        except orjson.JSONDecodeError:
            chat = None
        if not isinstance(chat, dict) or not isinstance(chat.get("choices"), list) or not chat["choices"]:
            raise NotAnAnswer("the backend answered 200 with a body that is not a chat completion")
        usage = chat.get("usage")
        # The Response echoes the request's settings, as a streamed one (and OpenAI's) does: a
        # cached answer, stored from either, replays the same Response.
        try:
            out = orjson.dumps(chat_completion_to_response(chat, request or {}))
        except (ValueError, TypeError) as exc:  # a field of a type the translation cannot take, nesting orjson cannot write
            raise NotAnAnswer(f"the backend's answer cannot be read as a Response: {exc}") from None
        entry = Entry(out) if capture and len(out) <= capture and replayable(orjson.loads(out)) else None
        return Whole(usage if isinstance(usage, dict) else None, entry, None, out)


class ChatToResponsesMonitor(OverChat):
    """A chat stream read by the chat monitor, given to the client as Responses events."""

    __slots__ = ("_request", "out")

    first = "first output"
    unfinished = "backend {backend!r} ended its stream before its finish reason"
    relays_failure = False  # the relay ends it with a Responses error event (ResponsesSink)
    record = None  # the backend holds nothing under the ids this leg makes up

    def __init__(self, request: Mapping[str, Any], *, capture: int = 0) -> None:
        self._chat = ChatMonitor(capture=capture)
        self._tr: ChatToResponsesStream | None = None
        self._ending: bytes | None = None
        self._request = request
        self.out: bytes | None = None

    @property
    def event(self) -> dict[str, Any] | None:
        return None  # not continued elsewhere

    def feed(self, data: bytes) -> Verdict:
        v = self._chat.feed(data)
        self.out = None
        if v in (Verdict.CONTENT, Verdict.HELD, Verdict.DROP):
            obj = orjson.loads(data)
            tr = self._tr
            if tr is None:
                tr = self._tr = ChatToResponsesStream(str(obj.get("model") or self._request.get("model") or ""), self._request)
            try:
                self.out = tr.feed(obj)
            except StreamOrderError as exc:  # arguments for a call already closed: not an answer we can give
                self._chat.failure = f"untranslatable stream: {exc}"
                return Verdict.FAILED
        return v

    def entry(self) -> Entry | None:
        """The assembled chat answer, kept as the Response (what a Responses hit replays)."""
        if (chat := self.assembled()) is None:
            return None
        response = chat_completion_to_response(chat, self._request)
        return Entry(orjson.dumps(response)) if replayable(response) else None


RESPONSES_VIA_CHAT = ResponsesViaChat()
