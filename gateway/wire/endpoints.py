"""The endpoints the gateway serves: one codec each (codec.py), by the policy's name for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..messages.codec import MESSAGES
from ..responses.codec import RESPONSES
from .chat import CHAT, COMPLETIONS, EMBEDDINGS
from .codec import Endpoint

__all__ = ["ENDPOINTS", "explained"]

ENDPOINTS: dict[str, Endpoint] = {e.name: e for e in (CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES, MESSAGES)}


def explained(body: Mapping[str, Any]) -> Endpoint:
    """Which endpoint's body /v1/route/explain was given: the one that recognises it, else chat."""
    return next((e for e in ENDPOINTS.values() if e.recognises(body)), CHAT)
