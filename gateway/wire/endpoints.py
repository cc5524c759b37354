"""The endpoints the gateway serves: one codec each (codec.py), by the policy's name for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..messages.codec import CHAT_VIA_MESSAGES, MESSAGES, MESSAGES_VIA_CHAT
from ..responses.chat_leg import RESPONSES_VIA_CHAT
from ..responses.codec import RESPONSES
from .chat import CHAT, COMPLETIONS, EMBEDDINGS
from .codec import Endpoint

__all__ = ["ENDPOINTS", "at_path", "explained"]

ENDPOINTS: dict[str, Endpoint] = {e.name: e for e in (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES)}
# Translating legs, after the native way: a Messages client answered by an OpenAI backend's chat,
# a chat client by an Anthropic backend's Messages API (messages/codec.py).
MESSAGES.legs["openai"] = [MESSAGES_VIA_CHAT]
CHAT.legs["anthropic"] = [CHAT_VIA_MESSAGES]
# The Responses API from a backend that serves only chat (the local model): stateless parts.
RESPONSES.legs["openai"].append(RESPONSES_VIA_CHAT)


def explained(body: Mapping[str, Any]) -> Endpoint:
    """Which endpoint's body /v1/route/explain was given: the one that recognises it, else chat."""
    return next((e for e in ENDPOINTS.values() if e.recognises(body)), CHAT)


def at_path(path: str) -> Endpoint:
    """The endpoint a request path of the gateway's belongs to (`/v1/messages/count_tokens` is the
    Messages API's), for an error in its shape; chat's (OpenAI's shape) for any other path."""
    return next((e for e in ENDPOINTS.values() if path == f"/v1{e.path}" or path.startswith(f"/v1{e.path}/")), CHAT)
