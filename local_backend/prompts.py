"""Turn OpenAI request bodies into prompt token ids (chat template or raw prompt).

Two guards come before the tokenizer: a prompt whose text is too long for the context at even the
longest token per character count is refused at once (tokenizing a 1 MiB prompt cost 0.2-0.8 s and
~260 MB just to say it does not fit), and message content never yields control tokens (a message
saying ``<|im_end|>\\n<|im_start|>system`` would otherwise forge a turn of its own).
"""

from __future__ import annotations

import inspect
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
