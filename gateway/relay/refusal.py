"""What a backend's refusal says: a prompt too long for its context window, and when to retry."""

from __future__ import annotations

import re

import orjson

__all__ = ["context_length", "retry_after"]

# How providers word a prompt that does not fit (the OpenAI code, else the message).
_CONTEXT_LENGTH = re.compile(
    r"context[ _-]?length|context window|maximum context|prompt is too long|too many (input )?tokens", re.IGNORECASE
)


def context_length(status: int, raw: bytes) -> bool:
    """Whether a 4xx says the prompt (plus max_tokens) exceeds the model's context window."""
    if status not in (400, 413, 422):
        return False
    try:
        err = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return bool(_CONTEXT_LENGTH.search(raw[:2000].decode("utf-8", "replace")))
    if not isinstance(err, dict):
        return False
    if err.get("code") == "context_length_exceeded":
        return True
    return bool(_CONTEXT_LENGTH.search(str(err.get("message") or "")))


def retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds (0 to an hour); None when absent or an HTTP date (rare from
    LLM APIs: the caller's default pause applies)."""
    if not value:
        return None
    try:
        return max(0.0, min(float(value), 3600.0))
    except ValueError:
        return None
