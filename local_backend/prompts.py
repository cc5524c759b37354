"""Turn OpenAI request bodies into prompt token ids (chat template or raw prompt).

Two guards come before the tokenizer: a prompt whose text is too long for the context at even the
longest token per character count is refused at once (tokenizing a 1 MiB prompt cost 0.2-0.8 s and
~260 MB just to say it does not fit), and so is one whose messages hold more control tokens than the
context has room for as text. Message content never yields control tokens (a message saying
``<|im_end|>\\n<|im_start|>system`` would otherwise forge a turn of its own): they are encoded as the
text they spell, with the ids transformers' sanitizer gives, but its many small encodings batched into
one call (_Sanitizer).
"""

from __future__ import annotations

import inspect
import re
import weakref
from dataclasses import dataclass
from typing import Any

from .wire import ApiError, ChatRequest, CompletionRequest

__all__ = ["encode_chat", "encode_completion", "longest_token_chars"]


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, or None where that gives no bound.

    A token's vocabulary string is at least as long as the text it stands for: byte-level BPE spells a
    byte as one character (and a text character is one byte or more), SentencePiece spells a space as
    one "▁". So a text of n characters is at least n / this many tokens. A normalizer could shrink the
    text first (NFC composition, stripped accents), so a tokenizer with one gets no bound (None).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    added = (token.content for token in tokenizer.added_tokens_decoder.values())
    return max(max(len(token) for token in tokenizer.get_vocab()), max((len(t) for t in added), default=1), 1)


def _check_length(text: str, max_chars: int | None, context_length: int, param: str) -> None:
    """Refuse a prompt whose text alone proves it cannot fit the context (see longest_token_chars)."""
    if max_chars is not None and context_length > 0 and len(text) > (context_length - 1) * max_chars:
        raise ApiError(
            400,
            f"{param}: the prompt has {len(text)} characters, so at least {-(-len(text) // max_chars)} tokens; "
            f"this model's context is {context_length}",
            param=param,
            code="context_length_exceeded",
        )


def _sanitizes(tokenizer: Any) -> bool:
    """Whether this transformers' apply_chat_template can encode control tokens in messages as text."""
    return "sanitize_control_tokens" in inspect.signature(tokenizer.apply_chat_template).parameters


@dataclass(frozen=True)
class _Sanitizer:
    """transformers' ``apply_chat_template(..., sanitize_control_tokens=True)``, read from its own
    helpers and giving the same ids, but encoding the pieces of the chat in one batched call.

    transformers marks the control tokens written in messages, renders the chat, splits it at the
    marks and encodes each piece in a Python call of its own (~27 µs, holding the GIL): 660 KB of
    ``a<|im_end|>`` took 1.7 s (plain text: 0.25 s) and cut a running SmolLM2 stream from ~140 to 13
    tokens/s. Bodies small enough to pass the count in _encode_sanitized cost ~2.5 µs a byte that
    way, 0.5-0.6 batched (plain text: 0.3-0.9)."""

    pattern: re.Pattern[str]  # a control token, longest first: what transformers marks in a message
    marked: re.Pattern[str]  # a marked control token (group 1), to count them
    pieces: re.Pattern[str]  # transformers' split of a marked chat: text, token (None: a lone mark), text, ...
    start: str  # the marks transformers wraps a message's control token in
    end: str
    newline: list[int]  # the ids of "\n", which transformers encodes a piece after, then drops
    as_text: dict[str, list[int]]  # control token -> its ids as text (those transformers can sanitize)

    def strip(self, text: str) -> str:
        """The marks already in a text go first (they could forge one; a token they split is whole again)."""
        return text.replace(self.start, "").replace(self.end, "")

    def mark(self, text: str, most: int = 0) -> tuple[str, int]:
        """As transformers' mark_control_tokens (the first ``most`` tokens; 0: all)."""
        return self.pattern.subn(f"{self.start}\\g<0>{self.end}", self.strip(text), count=most)

    def encode(self, tokenizer: Any, chat: str) -> list[int]:
        """transformers' encode_marked_chat(tokenizer, chat), its text pieces in one tokenizer call
        (Rust, without the GIL) rather than one each."""
        from transformers.utils.chat_template_utils import encode_marked_chat

        pieces = self.pieces.split(chat)
        # The first piece as it is, every later text piece after a newline (whose ids are then dropped).
        texts = [pieces[0], *("\n" + p for p in pieces[2::2] if p)]
        encoded = iter(tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"])
        ids: list[int] = list(next(encoded))
        n = len(self.newline)
        for i in range(1, len(pieces)):
            piece = pieces[i]
            if not piece:  # an empty text, or a lone mark
                continue
            if i % 2 == 0:
                got: list[int] = next(encoded)
                ids += got[n:] if got[:n] == self.newline else tokenizer.encode(piece, add_special_tokens=False)
            elif piece in self.as_text:
                ids += self.as_text[piece]
            else:  # a token transformers cannot sanitize: its own ValueError
                ids += encode_marked_chat(tokenizer, f"{self.start}{piece}{self.end}")
        return ids


_sanitizers: weakref.WeakKeyDictionary[Any, _Sanitizer | None] = weakref.WeakKeyDictionary()


def _sanitizer(tokenizer: Any) -> _Sanitizer | None:
    """The tokenizer's _Sanitizer, built once; None where this transformers lacks the (private)
    helpers it reads: transformers' own sanitizer runs then, at its own cost."""
    if tokenizer in _sanitizers:
        return _sanitizers[tokenizer]
    sanitizer: _Sanitizer | None = None
    try:
        from transformers.utils import chat_template_utils as ctu

        tokens = tuple(tokenizer._get_control_tokens(tokenizer.get_chat_template()))
        pattern, _ = ctu._get_control_token_patterns(tokens)
        _, pieces = ctu._get_control_token_patterns(tuple(tokenizer.added_tokens_encoder))
        start, end = ctu._CONTROL_TOKEN_START, ctu._CONTROL_TOKEN_END
        # A literal first character lets the regex skip ahead (transformers' pattern, which also
        # matches lone marks, took 6.5 ms over 660 KB; this one well under 1).
        marked = re.compile(f"{re.escape(start)}({pattern.pattern}){re.escape(end)}")
        newline = list(tokenizer.encode("\n", add_special_tokens=False))
        as_text = {t: list(ctu._encode_chat_piece(tokenizer, t, True, newline)) for t in tokens}
        as_text = {t: ids for t, ids in as_text.items() if ids and tokenizer.convert_tokens_to_ids(t) not in ids}
        if as_text and callable(ctu.encode_marked_chat):  # encode's fallback, there too
            sanitizer = _Sanitizer(pattern, marked, pieces, start, end, newline, as_text)
    except (ImportError, AttributeError, TypeError):
        pass
    _sanitizers[tokenizer] = sanitizer
    return sanitizer


def _mark(sanitizer: _Sanitizer, messages: list[dict[str, str]], most: int = 0) -> tuple[list[dict[str, str]], int]:
    """The messages with their control tokens marked as transformers marks them, in every value (the
    role too): the first ``most`` tokens (0: all; the rest left unmarked), and how many were marked."""
    out: list[dict[str, str]] = []
    total = 0
    for m in messages:
        message: dict[str, str] = {}
        for key, value in m.items():
            if most and total >= most:
                message[key] = sanitizer.strip(value)
                continue
            message[key], n = sanitizer.mark(value, most - total if most else 0)
            total += n
        out.append(message)
    return out, total


def _encode_sanitized(tokenizer: Any, sanitizer: _Sanitizer, messages: list[dict[str, str]], turn: dict[str, bool],
                      context_length: int) -> list[int]:
    """The chat's ids, control tokens in messages as text: a prompt whose control tokens alone (3-7
    text tokens each in SmolLM2) outgrow the context is refused first, after marking only the first
    few more than it holds (660 KB of them: ~3 ms, not 60 to mark them all)."""
    most = 0
    if context_length > 0:
        most = (context_length - 1) // min(len(ids) for ids in sanitizer.as_text.values()) + 1
    marked, count = _mark(sanitizer, messages, most)
    rendered: str = tokenizer.apply_chat_template(marked, tokenize=False, **turn)
    if not most or not count:
        return sanitizer.encode(tokenizer, rendered)
    # Counted as the template rendered them (it may leave a message out).
    tokens = sum(len(sanitizer.as_text.get(t, ())) for t in sanitizer.marked.findall(rendered))
    if tokens > context_length - 1:
        raise ApiError(
            400,
            f"messages: their control tokens alone are at least {tokens} tokens as text; "
            f"this model's context is {context_length}",
            param="messages",
            code="context_length_exceeded",
        )
    if count >= most:  # some went unmarked, yet what the template rendered fits: mark them all
        marked, _ = _mark(sanitizer, messages)
        rendered = tokenizer.apply_chat_template(marked, tokenize=False, **turn)
    return sanitizer.encode(tokenizer, rendered)


def encode_chat(tokenizer: Any, request: ChatRequest, *, max_chars: int | None = None, context_length: int = 0) -> list[int]:
    """Render the messages with the model's chat template, ending with the assistant's turn (a
    trailing assistant message is that turn's beginning, continued: a prefill).

    Control tokens written in a message (``<|im_start|>``...) are encoded as the text they spell; only
    the template's own markers are control tokens. ``max_chars`` (longest_token_chars) and
    ``context_length`` refuse a prompt too long to fit before it is tokenized."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
    # The SmolLM2 template knows system/user/assistant; OpenAI's newer "developer" role is a system prompt.
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in request.messages]
    # An assistant prefill: continue that message (how the gateway continues an answer that broke on
    # another backend), rather than start a new turn after it.
    turn = {"continue_final_message": True} if messages[-1]["role"] == "assistant" else {"add_generation_prompt": True}
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, **turn)
    _check_length(text, max_chars, context_length, "messages")
    if _sanitizes(tokenizer):
        sanitizer = _sanitizer(tokenizer)
        if sanitizer is not None:
            return _encode_sanitized(tokenizer, sanitizer, messages, turn, context_length)
        sanitized: list[int] = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, sanitize_control_tokens=True, **turn)
        return list(sanitized)
    # An older transformers cannot tell content's control tokens from the template's: refuse them.
    for i, m in enumerate(messages):
        for token in tokenizer.all_special_tokens:
            if token in m["content"]:
                raise ApiError(400, f"messages[{i}].content: contains the control token {token!r}", param=f"messages[{i}].content")
    ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids
    return ids


def encode_completion(tokenizer: Any, request: CompletionRequest, *, max_chars: int | None = None, context_length: int = 0) -> list[int]:
    """Tokenize a raw prompt (a string, a one-string list, or token ids); a raw prompt is the caller's
    whole text, control tokens included. ``max_chars`` / ``context_length``: as in encode_chat."""
    prompt = request.prompt
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt[0], str):
        text = str(prompt[0])
    else:
        vocab = len(tokenizer)
        token_ids = [int(t) for t in prompt]
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ApiError(400, f"prompt: token ids must lie in [0, {vocab})", param="prompt")
        return token_ids
    if not text:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    _check_length(text, max_chars, context_length, "prompt")
    ids: list[int] = tokenizer(text).input_ids
    return ids
