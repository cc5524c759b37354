"""The Responses API stream monitor (sans-io, see wire/monitor.py).

Events before the first output delta (`response.created`, `response.in_progress`, `...added`) are
held back; output is any `*.delta` (or an image's partial); `response.completed` /
`response.incomplete` finish the answer (with its usage); `response.failed` and `error` are the
backend's failure, which reaches the client as it was sent once output has (and ends the stream);
a `response.failed` after output brings the usage the backend spent, which the quota charges.
A `[DONE]` some servers add is not part of the answer. `response.created` names the response the
backend now holds (`record`): the pump records it before anything of the stream is released.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ..cache.entry import Entry
from ..wire.monitor import Verdict
from .replay import replayable
from .wire import TERMINAL_FAILED, TERMINAL_OK, conversation_id, usage_of

__all__ = ["ResponsesMonitor"]


class ResponsesMonitor:
    """Monitors one Responses event stream (monitor.Monitor)."""

    __slots__ = ("created", "final", "failure", "deltas", "finished", "usage", "timed", "record", "_capture")

    first = "first output"
    unfinished = "backend {backend!r}: the stream ended before response.completed"
    relays_failure = True  # the backend's response.failed / error event is the client's answer
    ending = b""  # response.completed ends it: the backend's own event
    out = None  # events pass as the backend sent them
    event = None  # no transcript: a Responses answer is not continued elsewhere

    def estimated_usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return b""  # response.completed carries the usage

    def __init__(self, *, capture: int = 0) -> None:
        self.created: dict[str, Any] | None = None  # the `response` of response.created
        self.final: dict[str, Any] | None = None  # the `response` of response.completed / .incomplete
        self.failure: str | None = None  # the message of a response.failed / error event
        self.deltas = 0
        self.finished = False
        self.usage: dict[str, Any] | None = None
        self.timed = False
        self.record: dict[str, Any] | None = None
        self._capture = capture

    def feed(self, data: bytes) -> Verdict:
        self.timed = False
        self.record = None
        if data == b"[DONE]":
            return Verdict.NOISE
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return Verdict.MALFORMED
        if not isinstance(event, dict):
            return Verdict.MALFORMED
        return self.feed_event(event)

    def feed_event(self, event: Mapping[str, Any]) -> Verdict:
        """Take one event, decoded."""
        kind = event.get("type")
        if not isinstance(kind, str):
            return self._failed(event) if event.get("error") else Verdict.DROP
        if kind in TERMINAL_FAILED or event.get("error"):
            return self._failed(event)
        if kind in TERMINAL_OK:
            resp = event.get("response")
            self.final = resp if isinstance(resp, dict) else {}
            self.finished = True
            self.usage = usage_of(self.final)
            if self.usage is not None and self.created is not None:
                self.record = self.final  # its usage: the context a follow-up makes the backend read
            return Verdict.HELD
        if kind.endswith(".delta") or kind == "response.image_gen_call.partial_image":
            self.deltas += 1
            self.timed = True
            return Verdict.CONTENT
        if kind == "response.created":
            resp = event.get("response")
            if isinstance(resp, dict):
                self.created = self.record = resp
        elif kind == "response.output_item.added":
            item = event.get("item")
            created = self.created or {}
            if isinstance(item, dict) and item.get("id") and (created.get("store") is not False or conversation_id(created)):
                self.record = {"output": [item]}  # the part of the response this event adds: a stored item
        return Verdict.HELD

    def entry(self) -> Entry | None:
        final = self.final
        if not self._capture or final is None or not replayable(final):
            return None
        body = orjson.dumps(final)
        return Entry(body) if len(body) <= self._capture else None

    def _failed(self, event: Mapping[str, Any]) -> Verdict:
        msg: Any = event.get("message")
        err = event.get("error")
        resp = event.get("response")
        if isinstance(resp, dict) and isinstance(resp.get("error"), dict):
            err = resp["error"]
        if isinstance(err, dict):
            msg = err.get("message") or msg
        elif isinstance(err, str):
            msg = err
        self.failure = str(msg or event.get("type") or "error")
        if self.deltas and isinstance(resp, dict):
            # After output the failure is the client's answer: what the backend says it spent is
            # charged, as a completed answer's is (it was charged the prompt estimate and one token
            # a delta: 14 tokens of 940 spent). Not before output: the relay fails over, and these
            # figures would stand for an answer from another backend that brings none.
            usage = usage_of(resp)
            if usage is not None:
                self.usage = usage
        return Verdict.FAILED
