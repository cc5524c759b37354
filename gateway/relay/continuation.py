"""Continuing a stream that broke mid-answer on another backend, so the client sees one answer.

`Transcript` records what a stream gave the client (choice 0's text, and the id, model and
created the client saw). When the stream is cut or stalls, the relay asks the next candidate for
the rest, in one of two ways (`Resume`):

- ``prefill``: the original request plus the delivered text as a trailing assistant message, for
  backends that continue such a message (`prefill: true`); everything it streams is new text. A
  backend that refuses a prefill ending in whitespace (Anthropic's API) gets the text without it,
  and the continuation's leading whitespace, up to what was held back, is skipped;
- ``restart``: the original request as it was, for the others; the new answer must begin with
  exactly the delivered text (a greedy or seeded answer does), which is skipped. A different
  beginning raises `Mismatch`: the client then gets an error event naming the original failure,
  never a spliced or duplicated answer.

Either way each event is re-encoded with the first stream's id, model and created; role-only
events are dropped (the client already had one); the finish event carries `x_gateway`, saying
which backends answered and how; usage counts the delivered tokens too. What the earlier legs
generated beyond what the answering leg's usage counts (a restart generates the delivered text
again; reasoning the client had from an earlier leg) is `Resume.earlier`: the relay adds it to the
usage the quota charges once the continuation answered (rescue.py), not to the client's.

Everything here is chat chunks: a stream in another format is continued through a monitor that
reads it as chat chunks (its `event`) and applies `rewrite` to them, then gives the client its own
format again, keeping its stream translator in `Transcript.carry` across the answer's attempts
(messages/codec.py, messages/as_chat.py: Anthropic's Messages streams, either way round).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from ..wire.tokens import text_tokens

__all__ = ["Transcript", "Resume", "Mismatch", "Prefill"]

Prefill = Callable[[Mapping[str, Any], str], dict[str, Any]]  # codec.Endpoint.prefill


# The most text a transcript keeps (4 Mi characters, far more than a model answers at once): a
# backend streaming without end must not grow the gateway's memory with it.
MAX_CHARS = 4 << 20


class Mismatch(Exception):
    """A restarted answer does not begin with the text the client already has."""


_FOLD = 64  # pieces of a transcript joined into one string


class Transcript:
    """What one streamed answer delivered so far. `continuable` turns False for anything a
    continuation cannot reproduce (tool calls, several choices)."""

    __slots__ = ("parts", "_tail", "chars", "id", "model", "created", "continuable", "tokens", "backends", "carry",
                 "reasoning", "regenerated")

    def __init__(self) -> None:
        # The text in chunks of _FOLD pieces (a str per piece cost ~20 bytes a character: 84 MB
        # for MAX_CHARS), the latest pieces in `_tail` until they make a chunk.
        self.parts: list[str] = []
        self._tail: list[str] = []
        self.chars = 0  # the length of the text (bounded: MAX_CHARS)
        self.id: Any = None
        self.model: Any = None
        self.created: Any = None
        self.continuable = True
        self.tokens = 0  # content events delivered (the completion tokens they stand for)
        self.reasoning = 0  # reasoning events delivered (a continuation's own are dropped: the earlier legs')
        self.regenerated = 0  # tokens of delivered text a restarted leg generated again (and skipped)
        self.backends: list[str] = []  # that streamed part of the answer, in order
        self.carry: Any = None  # a translating leg's stream translator, kept across the answer's attempts

    @property
    def text(self) -> str:
        return "".join(self.parts) + "".join(self._tail)

    def note(self, obj: dict[str, Any], backend: str) -> None:
        """Record one event the client got (an original one, or a rewritten continuation one)."""
        if self.id is None:
            self.id, self.model, self.created = obj.get("id"), obj.get("model"), obj.get("created")
        if not self.backends or self.backends[-1] != backend:
            self.backends.append(backend)
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("index", 0) != 0:
                self.continuable = False
                continue
            text = _text_of(choice)
            if text is None:
                self.continuable = False  # tool calls, a function call, a refusal
            elif not text:
                delta = choice.get("delta")
                if isinstance(delta, dict) and (delta.get("reasoning_content") or delta.get("reasoning")):
                    self.reasoning += 1  # generated, and charged even when the answer is continued elsewhere
            else:
                self.tokens += 1
                if self.continuable:
                    tail = self._tail
                    tail.append(text)
                    if len(tail) >= _FOLD:
                        self.parts.append("".join(tail))
                        tail.clear()
                    self.chars += len(text)
                    if self.chars > MAX_CHARS:  # past any real model's answer: not kept, not continued
                        self.continuable, self.parts, self._tail = False, [], []


def _text_of(choice: dict[str, Any]) -> str | None:
    """The text a choice adds ("" for none); None when it adds something other than text."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        if delta.get("tool_calls") or delta.get("function_call") or delta.get("refusal"):
            return None
        content = delta.get("content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")  # /v1/completions
    return text if isinstance(text, str) else ""


# An answer's length limit, in the fields any leg's request may carry it (chat, completions, the
# Responses and Messages APIs).
_LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


class Resume:
    """One continuation attempt: the body to send, and how its events become the client's."""

    __slots__ = ("transcript", "mode", "backend", "reason", "earlier", "_pending", "_loose", "_delivered_tokens", "_spent")

    def __init__(self, transcript: Transcript, mode: str, backend: str, reason: str) -> None:
        assert mode in ("prefill", "restart")
        self.transcript = transcript
        self.mode = mode
        self.backend = backend  # the backend this attempt goes to
        self.reason = reason  # why the original stream broke (for x_gateway and logs)
        self._pending = transcript.text if mode == "restart" else ""  # delivered text not yet matched
        self._loose = ""  # a prefill's trailing whitespace held back: skipped where the continuation repeats it
        # Content events are tokens for most backends, but one event may carry several (Anthropic's
        # text deltas, a busy vLLM's): the text's estimate when it says more (12 tokens in 4 events
        # left a limit of 20 with 16 to go, and the answer ran to 28; review helper's repro).
        text = transcript.text if transcript.continuable else ""
        self._delivered_tokens = max(transcript.tokens, text_tokens(text))
        self._spent = False  # a prefill's limit was used up before the cut: only its finish is wanted
        # Output the earlier legs generated that this leg's usage, once it answers, does not count
        # (the relay charges it, rescue.py): their reasoning, what earlier restarts generated
        # again, and for a restart the delivered text, which its usage counts only as its own
        # (a restart after 5 of 12 words was charged 12, and the cut backend's 5 were lost).
        # A prefill's usage counts the delivered text already (`_plus_completion`).
        self.earlier = transcript.reasoning + transcript.regenerated + (self._delivered_tokens if mode == "restart" else 0)

    def body(self, body: dict[str, Any], upstream_model: str, prefill: Prefill, *, trim: bool = False) -> bytes:
        """The request to send: the original, for `upstream_model`, plus the prefill if any
        (`prefill(body, text)`: the endpoint's way to ask a backend to go on from `text`; `trim`:
        the backend refuses a prefill that ends in whitespace, so it goes without)."""
        out = {**body, "model": upstream_model}
        if self.mode == "prefill":
            text = self.transcript.text
            sent = text.rstrip() if trim else text
            self._loose = text[len(sent):]
            if sent:
                out = prefill(out, sent)
            # The answer's limit counts what was delivered: a backend going on from the delivered
            # text gets what is left of it (with max_tokens 5, a cut after 3 came back with 8, each
            # cut another whole limit, past a quota's bound too; review helper's repro).
            for name in _LIMIT_FIELDS:
                limit = out.get(name)
                if type(limit) is int and limit > 0:
                    out[name] = max(1, limit - self._delivered_tokens)
                    # Used up (the cut came after the last token, before its finish): the backend
                    # is asked for one token, which the client does not get; the answer ends at
                    # its limit ("length"), as it would have (it got one token past it).
                    self._spent = self._spent or limit <= self._delivered_tokens
        return orjson.dumps(out)

    def rewrite(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The event the client gets in place of `obj`, or None to drop it. Raises Mismatch."""
        t = self.transcript
        finished = False
        has_text = False
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            text = _text_of(choice)
            if text and self._spent:
                _set_text(choice, "")
                choice.pop("logprobs", None)
                text = ""
            if text:
                kept = self._skip(text)
                _set_text(choice, kept)
                if len(kept) != len(text) and choice.get("logprobs") is not None:
                    choice["logprobs"] = _trim_logprobs(choice["logprobs"], len(text) - len(kept))
                text = kept
                has_text = has_text or bool(text)
            delta = choice.get("delta")
            if isinstance(delta, dict):
                delta.pop("role", None)  # the client had its role event from the first backend
                # The client has its thinking from the first backend: the continuation's own
                # (a new backend thinking again from the start) would read as a second one.
                delta.pop("reasoning_content", None)
                delta.pop("reasoning", None)
            if choice.get("finish_reason"):
                finished = True
                if self._spent:
                    choice["finish_reason"] = "length"
                if self._pending:
                    raise Mismatch(f"the restarted answer ended {len(self._pending)} characters before the delivered text did")
        usage = obj.get("usage")
        if isinstance(usage, dict) and self.mode == "prefill":
            usage = obj["usage"] = _plus_completion(usage, self._delivered_tokens, none_kept=self._spent)
        if not (has_text or finished or isinstance(usage, dict)):
            return None  # role-only or empty events, and everything within the skipped prefix
        obj["id"], obj["model"], obj["created"] = t.id, t.model, t.created
        if finished:
            backends = t.backends if t.backends and t.backends[-1] == self.backend else [*t.backends, self.backend]
            obj["x_gateway"] = {"backends": backends, "continued": self.mode, "after": self.reason}
        return obj

    def _skip(self, text: str) -> str:
        """Drop what the client already has from a restarted answer's text (or the whitespace a
        prefill held back, where the continuation begins with it)."""
        loose = self._loose
        if loose:
            n = 0
            while n < len(loose) and n < len(text) and text[n] == loose[n]:
                n += 1
            self._loose = loose[n:] if n == len(text) else ""  # all of it was whitespace: the next piece may go on
            text = text[n:]
        pending = self._pending
        if not pending:
            return text
        n = min(len(pending), len(text))
        if text[:n] != pending[:n]:
            raise Mismatch("the restarted answer does not begin with the text already delivered")
        self._pending = pending[n:]
        self.transcript.regenerated += text_tokens(text[:n])  # generated again: a later leg's `earlier`
        return text[n:]


def _trim_logprobs(logprobs: Any, skipped: int) -> Any:
    """A chunk's logprobs without the tokens of its first `skipped` characters (a restart's part
    the client already has): its tokens spelled "Hello wor world" where its text said "Hello
    world" (review helper's repro). Chat's token list is cut where the tokens meet the cut; a
    cut inside a token, or another shape (completions' arrays), leaves the chunk without logprobs."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    if not isinstance(content, list):
        return None
    n = 0
    for i, entry in enumerate(content):
        if n == skipped:
            return {**logprobs, "content": content[i:]}
        token = entry.get("token") if isinstance(entry, dict) else None
        if not isinstance(token, str):
            return None
        n += len(token)
        if n > skipped:
            return None
    return {**logprobs, "content": []} if n == skipped else None


def _set_text(choice: dict[str, Any], text: str) -> None:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        delta["content"] = text
    else:
        choice["text"] = text


def _plus_completion(usage: dict[str, Any], delivered: int, *, none_kept: bool = False) -> dict[str, Any]:
    """Usage of the whole answer: the continuation's completion plus the tokens delivered before
    it (prompt_tokens stay as the continuing backend counted them, the prefill included);
    `none_kept`: the client got none of the continuation's tokens."""
    out = dict(usage)
    c = out.get("completion_tokens")
    if isinstance(c, int):
        c = 0 if none_kept else c
        out["completion_tokens"] = c + delivered
        p = out.get("prompt_tokens")
        if isinstance(p, int):
            out["total_tokens"] = p + c + delivered
    return out
