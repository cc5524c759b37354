"""OpenAI's chat completions, text completions and embeddings endpoints (codec.py).

Chat and completions stream `data: {chunk}` events ending with [DONE] (chat_monitor.py); their
whole answers are one JSON object with `choices`, cached as they are and replayed as a stream
(cache/entry.py). Embeddings answer one object with `data`, never streamed nor cached.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from ..cache.entry import Entry, is_complete, replay_json, replay_sse
from .chat_monitor import ChatMonitor
from .codec import Endpoint, NotAnAnswer, Whole, continue_final_turn, count_field, token_ids
from .monitor import Monitor, Rewrite
from .openai_wire import ChatRequest, CompletionRequest, EmbeddingRequest, RequestBody
from .tokens import text_tokens

__all__ = ["CHAT", "COMPLETIONS", "EMBEDDINGS", "ChatEndpoint", "EmbeddingsEndpoint"]


class ChatEndpoint(Endpoint):
    """/v1/chat/completions, or with `prompt` as the text, /v1/completions."""

    asks_usage = True

    def __init__(self, name: str, path: str, request: type[RequestBody], *, chat: bool) -> None:
        self.name, self.path, self.request = name, path, request
        self._chat = chat
        # As vLLM and OpenAI read them: chat prefers max_completion_tokens; completions has max_tokens only.
        self.limit_fields = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
        super().__init__()

    def answers(self, body: Mapping[str, Any]) -> int:
        """`n` answers; on completions, `best_of` candidates (vLLM generates them all and returns
        the best `n`) for each prompt of a list."""
        n = count_field(body.get("n")) or 1
        if self._chat:
            return n
        prompt = body.get("prompt")
        prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
        return max(n, count_field(body.get("best_of")) or 1) * prompts

    def continuable(self, body: Mapping[str, Any]) -> bool:
        """One choice, no tools asked for: text a continuation can reproduce."""
        return body.get("n") in (None, 1) and not body.get("tools")

    def unread_prompt(self, body: Mapping[str, Any]) -> int:
        """A completion's prompt as token ids, and its suffix (the classifier reads `prompt` text)."""
        if self._chat:
            return 0
        suffix = body.get("suffix")
        return token_ids(body.get("prompt")) + (max(1, text_tokens(suffix)) if isinstance(suffix, str) and suffix else 0)

    def batch_chars(self, body: Mapping[str, Any]) -> int:
        """On completions, a prompt list of several strings: their characters."""
        prompt = None if self._chat else body.get("prompt")
        if not isinstance(prompt, list) or len(prompt) < 2:
            return 0
        return sum(len(p) for p in prompt if isinstance(p, str))

    def classify_view(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """On completions, the body without a `messages` field (which the classifier would read
        instead of `prompt`: a 180,000-character prompt behind `"messages": [{"content": "hi"}]`
        was simple, sent to the small model, and reserved 6 tokens: review helper's repro)."""
        if self._chat or "messages" not in body:
            return body
        return {k: v for k, v in body.items() if k != "messages"}

    def recognises(self, body: Mapping[str, Any]) -> bool:
        """A completions body (for /v1/route/explain): `prompt`, no `messages`."""
        return not self._chat and "prompt" in body and "messages" not in body

    def prefills(self, body: Mapping[str, Any]) -> bool:
        """On completions, a prompt that is one string and not echoed: a prefill appends what was
        delivered to it (a token-id prompt, or a list, went on as its Python text, "[101, 102]w0
        w1"; an echoed prompt, already in the delivered text, came a second time)."""
        return self._chat or (isinstance(body.get("prompt"), str) and not body.get("echo"))

    def prefill(self, body: Mapping[str, Any], text: str) -> dict[str, Any]:
        if self._chat:
            return continue_final_turn(body, text)
        return {**body, "prompt": str(body.get("prompt", "")) + text}

    def monitor(self, *, capture: int, strip_usage: bool, rewrite: Rewrite | None, body: Mapping[str, Any] | None = None,
                transcript: Any = None) -> Monitor:
        opts = body.get("stream_options") if body is not None else None
        client_usage = isinstance(opts, dict) and opts.get("include_usage") is True
        return ChatMonitor(capture=capture, strip_usage=strip_usage, rewrite=rewrite, client_usage=client_usage)

    def whole(self, raw: bytes, capture: int, request: Mapping[str, Any] | None = None) -> Whole:
        obj = _answer(raw)
        entry = Entry(raw) if capture and len(raw) <= capture and is_complete(obj) else None
        usage = obj.get("usage")
        return Whole(usage if isinstance(usage, dict) else None, entry)

    def replay(self, entry: Entry, *, stream: bool, include_usage: bool) -> bytes:
        if stream:
            return b"".join(replay_sse(entry, include_usage=include_usage))
        return replay_json(entry)


class EmbeddingsEndpoint(Endpoint):
    """/v1/embeddings: passed through to a backend serving the model; no class, no cache."""

    name, path, request = "embeddings", "/embeddings", EmbeddingRequest
    streams = classifies = cacheable = generates = False

    def unread_prompt(self, body: Mapping[str, Any]) -> int:
        """Input given as token ids: counted one by one (the body's size says half for small ids)."""
        return token_ids(body.get("input"))

    def whole(self, raw: bytes, capture: int, request: Mapping[str, Any] | None = None) -> Whole:
        usage = _answer(raw).get("usage")
        return Whole(usage if isinstance(usage, dict) else None)


def _answer(raw: bytes) -> dict[str, Any]:
    """The answer object (one with `choices` or `data`); raises NotAnAnswer."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or ("choices" not in obj and "data" not in obj):
        raise NotAnAnswer("the backend answered 200 with a malformed body")
    return obj


CHAT = ChatEndpoint("chat", "/chat/completions", ChatRequest, chat=True)
COMPLETIONS = ChatEndpoint("completions", "/completions", CompletionRequest, chat=False)
EMBEDDINGS = EmbeddingsEndpoint()

