"""OpenAI's Responses API (/v1/responses) as one endpoint codec (wire/codec.py).

A whole answer is a Response object; a stream is Responses events (monitor.py). Every
answer's ids are recorded in the affinity map before the client can see any of it (`stateful`):
a follow-up (`previous_response_id`, `conversation`) must reach the backend holding its state
(`stateful_refs`, pipeline/pinning.py). A failure once streaming is a Responses `error` event
(ResponsesSink). The classifier reads the body as chat (`chat_view`); a cached Response is
replayed as its event stream (replay.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ..cache.entry import Entry
from ..web.sink import Sink
from ..wire.codec import Endpoint, NotAnAnswer, Whole
from ..wire.monitor import Monitor, Rewrite
from .monitor import ResponsesMonitor
from .replay import replay_events, replayable
from .wire import ResponsesRequest, ResponsesSink, chat_view, stateful_reason, stateful_refs, usage_of

__all__ = ["RESPONSES", "ResponsesEndpoint"]

_MISSING = {"previous_response_id": "previous_response_not_found", "conversation": "conversation_not_found",
            "conversation_id": "conversation_not_found", "input": "item_not_found"}


class ResponsesEndpoint(Endpoint):
    name, path, request = "responses", "/responses", ResponsesRequest
    limit_fields = ("max_output_tokens",)
    # vLLM, TGI and other chat servers often lack it: the gateway translates for those whose
    # `endpoints` leave it out (a bare "HTTP 404" left the operator guessing; review helper's repro).
    missing_hint = ("the backend may not serve the Responses API: list its endpoints without it "
                    "(endpoints: [chat, completions]) and the gateway translates to chat completions")

    def answers_later(self, body: Mapping[str, Any]) -> bool:
        # Streamed too: a client that leaves a background stream does not stop the backend (5 such
        # requests, left after their first delta, were charged 125 tokens of 25,000 generated).
        return body.get("background") is True
    stateful = True
    # `store` also decides whether a follow-up can build on the answer's id.
    echoed = frozenset({"store", "metadata", "user", "safety_identifier", "service_tier", "prompt_cache_key"})

    def classify_view(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        return chat_view(body)

    def cache_reason(self, body: Mapping[str, Any]) -> str | None:
        return stateful_reason(body)

    def stateful_refs(self, body: Mapping[str, Any]) -> list[tuple[str, str]]:
        return stateful_refs(body)

    def missing_code(self, field: str) -> str:
        return _MISSING.get(field, "response_not_found")

    def recognises(self, body: Mapping[str, Any]) -> bool:
        """A Responses body: `input`, no `messages`."""
        return "input" in body and "messages" not in body

    def wrap(self, sink: Sink) -> Sink:
        return ResponsesSink(sink)

    def monitor(self, *, capture: int, strip_usage: bool, rewrite: Rewrite | None, body: Mapping[str, Any] | None = None,
                transcript: Any = None) -> Monitor:
        return ResponsesMonitor(capture=capture)

    def whole(self, raw: bytes, capture: int, request: Mapping[str, Any] | None = None) -> Whole:
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or "output" not in obj:
            raise NotAnAnswer("the backend answered 200 with a body that is not a Response")
        entry = Entry(raw) if capture and len(raw) <= capture and replayable(obj) else None
        return Whole(usage_of(obj), entry, obj)

    def held_id(self, entry: Entry) -> str | None:
        """A stored Response's id, unless made with `store: false` (no follow-up can build on it)."""
        obj = entry.answer()
        rid = obj.get("id")
        return rid if isinstance(rid, str) and obj.get("store") is not False else None

    def replay(self, entry: Entry, *, stream: bool, include_usage: bool) -> bytes:
        """The stored Response, or its events."""
        return replay_events(entry.body) if stream else entry.body


RESPONSES = ResponsesEndpoint()
