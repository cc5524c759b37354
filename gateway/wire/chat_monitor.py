"""The chat and completions stream monitor (sans-io, see monitor.py).

A stream is `data: {chunk}` events ending with `data: [DONE]`. A chunk with text, a tool call, a
function call, a refusal or reasoning text in a choice is output; one with a `finish_reason` finishes the answer
(its usage chunk and [DONE] may follow); one with an `error` is the backend's failure. The usage
chunk (empty choices) the gateway asked for itself (`strip_usage`) is dropped; one the client asked
for and the backend did not send is the gateway's estimate, before [DONE] (`estimated_usage`). A continuation's
chunks are rewritten by its `rewrite` hook (continuation.Resume.rewrite) before anything else
reads them. With `capture`, the answer is assembled for the cache (cache_entry.StreamAssembler).
"""

from __future__ import annotations

from typing import Any

import orjson

from ..cache.entry import Entry, StreamAssembler
from .monitor import Rewrite, Verdict
from .openai_wire import SSE_DONE, sse_event

__all__ = ["ChatMonitor", "OverChat", "has_content"]

_DONE, _DROP, _MALFORMED, _HELD, _CONTENT, _FAILED = (
    Verdict.DONE, Verdict.DROP, Verdict.MALFORMED, Verdict.HELD, Verdict.CONTENT, Verdict.FAILED,
)


class ChatMonitor:
    """Monitors one chat or completions stream (monitor.Monitor)."""

    __slots__ = ("finished", "failure", "usage", "timed", "out", "event", "_assembler", "_strip_usage", "_rewrite", "_open", "_closed",
                 "_client_usage", "_head")

    first = "first token"
    unfinished = "backend {backend!r} ended its stream before its finish reason"
    relays_failure = False  # the relay ends a broken stream with its own error event, after any rescue
    ending = SSE_DONE
    record = None  # chat answers hold no state on a backend

    def __init__(self, *, capture: int = 0, strip_usage: bool = False, rewrite: Rewrite | None = None,
                 client_usage: bool = False) -> None:
        self.finished = False
        self.failure: str | None = None
        self.usage: dict[str, Any] | None = None
        self.timed = False
        self.out: bytes | None = None
        self.event: dict[str, Any] | None = None
        self._assembler = StreamAssembler(capture) if capture else None
        self._strip_usage = strip_usage
        self._rewrite = rewrite
        self._open: set[Any] = set()  # the choices (indexes) seen that have not finished yet
        self._closed: set[Any] = set()  # and those that have
        self._client_usage = client_usage and not strip_usage  # the client asked for the usage chunk
        self._head: dict[str, Any] | None = None  # id, object, created, model of the first chunk, as the client got it

    def feed(self, data: bytes) -> Verdict:
        self.timed = False
        self.out = None
        if data == b"[DONE]":
            return _DONE
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return _MALFORMED
        if not isinstance(obj, dict):
            return _MALFORMED
        if "error" in obj:
            err = obj["error"]
            self.failure = str(err.get("message") if isinstance(err, dict) else err)
            return _FAILED
        content = self.timed = has_content(obj)
        if self._rewrite is not None:
            obj = self._rewrite(obj)  # raises continuation.Mismatch
            if obj is None:
                return _DROP
            self.out = b"data: " + orjson.dumps(obj) + b"\n\n"
            content = content and has_content(obj)
        if self._head is None:
            self._head = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        choices = obj.get("choices")
        if choices:
            self._track(choices)
        if self._assembler is not None:
            self._assembler.feed(obj)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            if self._strip_usage and not choices:
                return _DROP  # the usage chunk the gateway asked for, not the client
        self.event = obj
        return _CONTENT if content else _HELD

    def _track(self, choices: Any) -> None:
        """The answer is finished once every choice seen has its finish reason (n > 1, a list of
        prompts: one choice's `stop` while another was mid-answer ended a cut stream with [DONE])."""
        for c in choices if isinstance(choices, list) else ():
            if not isinstance(c, dict):
                continue
            i = c.get("index", 0)
            i = i if isinstance(i, int | str) else repr(i)
            if c.get("finish_reason"):
                self._open.discard(i)
                self._closed.add(i)
                self.finished = not self._open
            elif i not in self._closed:  # a chunk after its finish (usage, an empty delta) reopens nothing
                self._open.add(i)
                self.finished = False

    def entry(self) -> Entry | None:
        return self._assembler.entry() if self._assembler is not None else None

    def estimated_usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        if not self._client_usage or self.usage is not None or not self.finished or self._head is None:
            return b""
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        return sse_event({**self._head, "choices": [], "usage": usage})


class OverChat:
    """The part of a translating monitor that is its chat stream's: a monitor that reads a chat
    stream with the ChatMonitor in `_chat` and gives the client another API's events."""

    __slots__ = ("_chat", "_tr", "_ending")
    _chat: ChatMonitor
    _tr: Any  # the stream translator: feed(chunk | "[DONE]") -> the client's bytes
    _ending: bytes | None

    @property
    def ending(self) -> bytes:
        """The client's end of the stream: what the translator makes of [DONE] (once)."""
        if self._ending is None:
            self._ending = b"" if self._tr is None else self._tr.feed("[DONE]")
        return self._ending

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

    def estimated_usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return b""  # the client's format carries usage in its finish event (what the translator makes of the chat stream's)

    def assembled(self) -> dict[str, Any] | None:
        """The chat answer the stream made, as a whole chat completion (None: not captured, or not
        one that may be stored), for the translating monitor's cache entry in its own format."""
        chat = self._chat.entry()
        return None if chat is None else orjson.loads(chat.body)


def has_content(obj: dict[str, Any]) -> bool:
    """Whether a chunk carries output: text, a tool or function call, a refusal, or a reasoning
    model's thinking (`reasoning_content`: vLLM, DeepSeek; `reasoning`: OpenRouter, Ollama), which
    is generated tokens too: the first one is the first token, and a stream that thinks is alive."""
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if (delta.get("content") or delta.get("tool_calls") or delta.get("function_call") or delta.get("refusal")
                    or delta.get("reasoning_content") or delta.get("reasoning")):
                return True
        elif choice.get("text"):
            return True
    return False
