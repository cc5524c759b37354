"""What a backend's refusal says: a prompt too long for its context window, a request too large
for any rate limit, and when to retry."""

from __future__ import annotations

import re

import orjson

__all__ = ["context_length", "request_too_large", "retry_after"]

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


# OpenAI's 429 for one request past the per-minute limit on its own ("Request too large for gpt-4o
# ... on tokens per min (TPM): Limit 30000, Requested 200010."), against its rate limit's 429
# ("Rate limit reached ...: Limit 30000, Used 29000, Requested 2000. Please try again in 2s.").
_TOO_LARGE = re.compile(r"request too large|limit (\d+), requested (\d+)", re.IGNORECASE)


def request_too_large(status: int, raw: bytes) -> bool:
    """Whether a 429 says the request alone exceeds the provider's limit: no wait makes it fit, and
    the provider is not busy (one tenant's `max_tokens: 200000` cooled the backend down for every
    tenant for its Retry-After, and each failover cooled the next: review helper's repro)."""
    if status != 429:
        return False
    try:
        err = orjson.loads(raw).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    message = err.get("message") if isinstance(err, dict) else None
    if not isinstance(message, str):
        return False
    m = _TOO_LARGE.search(message[:2000])
    return m is not None and (m.group(1) is None or int(m.group(2)) > int(m.group(1)))


def retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds (0 to an hour); None when absent or an HTTP date (rare from
    LLM APIs: the caller's default pause applies)."""
    if not value:
        return None
    try:
        return max(0.0, min(float(value), 3600.0))
    except ValueError:
        return None
