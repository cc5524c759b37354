"""How a launcher tells the child it started from another process on the child's port.

Each launch gets a random token, in the child's environment (`HEALTH_TOKEN_ENV`, not on its
command line where `ps` shows it); each /healthz check sends a fresh nonce (`X-Health-Nonce`),
and only an answer carrying HMAC-SHA256(token, nonce) in `X-Health-Proof` counts. Another process
on the port (one that took it after a restart, another gateway's model) answers 200 without that
proof and is not taken for the model. An HMAC of a nonce rather than the token echoed back: the
token never crosses the wire, so nothing that receives or asks for a health check learns it.
local_backend's server computes the same proof (it imports nothing from the gateway).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
from typing import Literal
from urllib.parse import urlsplit

import aiohttp

__all__ = ["HEALTH_TOKEN_ENV", "Check", "check", "health_url", "other_answers", "proof"]

# The launch's secret, in the child's environment (local_backend's server reads the same name).
HEALTH_TOKEN_ENV = "LOCAL_BACKEND_HEALTH_TOKEN"
_NONCE_HEADER = "X-Health-Nonce"
_PROOF_HEADER = "X-Health-Proof"
# What one /healthz check found: the launched model (200 with the proof), nothing ready (no answer,
# or not 200), or something else (a 200 without the proof: not the model this launch started).
Check = Literal["ok", "down", "other"]


def health_url(base_url: str) -> str:
    """The /healthz URL of the server at `base_url`."""
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}/healthz"


def other_answers(where: str) -> str:
    return (
        f"something else answers /healthz on {where}: a 200 without the proof of this launch's "
        "health token, so not the model the gateway started (another process holds the port?)"
    )


def proof(token: str, nonce: str) -> str:
    """What the launched model's /healthz answers in X-Health-Proof (local_backend computes the same)."""
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


async def check(http: aiohttp.ClientSession, url: str, token: str | None) -> Check:
    """One /healthz check with a fresh nonce: "ok" only for a 200 with the proof of `token` (with
    no token known, a 200 proves nothing: "other")."""
    nonce = secrets.token_urlsafe(16)
    try:
        async with http.get(url, headers={_NONCE_HEADER: nonce}) as resp:
            await resp.read()
            if resp.status != 200:
                return "down"
            answered = resp.headers.get(_PROOF_HEADER, "")
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return "down"
    given = answered.encode("utf-8", "replace")  # compare_digest takes ASCII str only: bytes, whatever was sent
    return "ok" if token is not None and hmac.compare_digest(given, proof(token, nonce).encode()) else "other"
