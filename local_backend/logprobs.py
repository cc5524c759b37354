"""Log probabilities in OpenAI's two shapes: chat's ``logprobs.content`` entries and the legacy
completions' parallel lists, with each token's text and UTF-8 bytes."""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from .protocol import TokenLogprob

__all__ = ["TextOffsets", "TokenText", "chat_logprobs", "completion_logprobs"]


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE vocabulary writes for
    each byte (printable bytes as themselves, the others shifted above U+0100) -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    """A token id's text and bytes as OpenAI reports them. A byte-level BPE token (SmolLM2's, GPT-2's,
    Llama 3's) may hold part of a character: its bytes are exact, its text shows U+FFFD for the part."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        known = self._cache.get(token)
        if known is None:
            raw = self._bytes(token)
            known = self._cache[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return known

    def _bytes(self, token: int) -> bytes:
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token)
            table = _byte_of_char()
            if isinstance(piece, str) and all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return str(self._tokenizer.decode([token])).encode("utf-8")


def _entry(text_of: TokenText, token: int, logprob: float) -> dict[str, Any]:
    text, raw = text_of(token)
    return {"token": text, "logprob": logprob, "bytes": raw}


def chat_logprobs(entries: Iterable[TokenLogprob], text_of: TokenText) -> dict[str, Any]:
    """A chat choice's (or chunk's) ``logprobs``: ``{"content": [...], "refusal": null}``."""
    content = [
        {**_entry(text_of, e.token, e.logprob), "top_logprobs": [_entry(text_of, t, lp) for t, lp in e.top]}
        for e in entries
    ]
    return {"content": content, "refusal": None}


class TextOffsets:
    """Where each token of a completion choice starts in its text, in characters. A token holding
    part of a character shows U+FFFD in its own text, but the answer holds the character once: the
    position moves when the character is whole, and every token of it reads the character's start
    (counting each token's shown text instead ran one ahead per split character, as vLLM does)."""

    __slots__ = ("at", "_decoder")

    def __init__(self, start: int = 0) -> None:
        self.at = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, raw: bytes) -> int:
        """The start of a token of these bytes; the position then moves past what they complete."""
        start = self.at
        self.at += len(self._decoder.decode(raw))
        return start


def completion_logprobs(entries: Iterable[TokenLogprob], text_of: TokenText, offsets: TextOffsets) -> dict[str, Any]:
    """A completion choice's legacy ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset),
    its tokens' positions read from (and moved on in) ``offsets``, which a stream keeps for its next
    chunk. Each ``top_logprobs`` map holds the asked number of likeliest tokens and the chosen one,
    as vLLM's."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    starts: list[int] = []
    for e in entries:
        text, raw = text_of(e.token)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        top = {text_of(t)[0]: lp for t, lp in e.top}
        top.setdefault(text, e.logprob)
        tops.append(top)
        starts.append(offsets.advance(bytes(raw)))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": starts}
