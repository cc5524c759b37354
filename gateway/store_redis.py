"""The Redis Store: one pooled redis.asyncio client (hiredis parser when installed), every call
bounded by a few milliseconds, every failure turned into StoreError so callers fail open.

Reconnecting needs no supervisor: a dead pooled connection is dropped and the next call opens a
fresh one. The connect timeout equals the call timeout, so while Redis is down each call fails in
about `timeout_ms` (a refused connect fails at once) rather than waiting seconds for a socket.
"""

from __future__ import annotations

import asyncio

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from .store import StoreError

__all__ = ["RedisStore"]


class RedisStore:
    """A Store on Redis. `url` as redis-py reads it (redis://host:port/db, rediss://, unix://);
    `prefix` is prepended to every key (a namespace per deployment or per test)."""

    __slots__ = ("_pool", "_redis", "_timeout_s", "prefix")

    def __init__(self, url: str, *, timeout_ms: float = 5.0, max_connections: int = 64, prefix: str = "") -> None:
        if timeout_ms <= 0:
            raise ValueError("timeout_ms must be positive")
        t = timeout_ms / 1000
        self._timeout_s = t
        self.prefix = prefix
        self._pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=t,  # waiting for a free pooled connection counts against the same budget
            socket_timeout=t,
            socket_connect_timeout=t,
            # One immediate retry: after a Redis restart, the first command on each stale pooled
            # connection fails; the retry on a fresh connection hides that. No backoff: we have ms.
            retry=Retry(NoBackoff(), 1),
        )
        self._redis = Redis(connection_pool=self._pool)

    async def get(self, key: str) -> bytes | None:
        try:
            async with asyncio.timeout(self._timeout_s):
                value: bytes | None = await self._redis.get(self.prefix + key)
                return value
        except (RedisError, OSError, TimeoutError) as exc:
            raise _error("get", exc) from None

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                if ttl_s <= 0:
                    await self._redis.delete(self.prefix + key)
                else:
                    await self._redis.set(self.prefix + key, value, px=max(1, round(ttl_s * 1000)))
        except (RedisError, OSError, TimeoutError) as exc:
            raise _error("set", exc) from None

    async def delete(self, key: str) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.delete(self.prefix + key)
        except (RedisError, OSError, TimeoutError) as exc:
            raise _error("delete", exc) from None

    async def close(self) -> None:
        await self._redis.aclose()
        await self._pool.aclose()


def _error(op: str, exc: BaseException) -> StoreError:
    if isinstance(exc, TimeoutError) and not str(exc):
        return StoreError(f"redis {op}: timed out")
    return StoreError(f"redis {op}: {type(exc).__name__}: {exc}")
