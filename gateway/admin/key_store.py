"""Where virtual keys are kept: Redis (shared by every worker and replica) or this process's memory.

A store holds each key's record (JSON, by id) and a version number that every change raises. The
processes poll the version (admin/keys.py) and reload the records when it moved: one GET per
process per poll, and a revoke reaches every process within a poll. Records hold digests, never
secrets.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson
from redis.asyncio import Redis
from redis.exceptions import WatchError

from ..store.core import StoreError
from ..store.redis_store import bounded
from .key_ops import KeyOp, apply

__all__ = ["KeyStore", "MemoryKeyStore", "RedisKeyStore"]


class KeyStore(Protocol):
    async def version(self) -> int:
        """A number that moves whenever a record changes."""
        ...

    async def records(self) -> tuple[int, dict[str, dict[str, Any]]]:
        """The version and every record, read together."""
        ...

    async def change(self, op: KeyOp) -> Any:
        """Apply `op` (key_ops.apply) atomically, no other change in between; its result."""
        ...

    async def touch(self, used: dict[str, float]) -> None:
        """Record when keys were last used (id -> epoch seconds); not a change (no new version)."""
        ...

    async def last_used(self) -> dict[str, float]:
        ...

    async def close(self) -> None:
        ...


class MemoryKeyStore:
    """The records in this process (the embedded default: one process sees them)."""

    def __init__(self) -> None:
        self._records: dict[str, dict[str, Any]] = {}
        self._version = 0
        self._used: dict[str, float] = {}

    async def version(self) -> int:
        return self._version

    async def records(self) -> tuple[int, dict[str, dict[str, Any]]]:
        return self._version, {k: dict(v) for k, v in self._records.items()}

    async def change(self, op: KeyOp) -> Any:
        writes, result = apply(op, {k: dict(v) for k, v in self._records.items()})
        _apply(self._records, writes)
        for kid, rec in writes.items():
            if rec is None:
                self._used.pop(kid, None)
        self._version += 1
        return result

    async def touch(self, used: dict[str, float]) -> None:
        self._used.update(used)

    async def last_used(self) -> dict[str, float]:
        return dict(self._used)

    async def close(self) -> None:
        return None


class RedisKeyStore:
    """The records in one Redis hash (`{prefix}keys`), the version in `{prefix}keys:version`, the
    last use of each key in `{prefix}keys:used`. A change is a WATCH/MULTI transaction on the
    hash, retried when another change got in first."""

    _TRIES = 5

    def __init__(self, url: str, *, prefix: str = "gateway:", timeout_s: float = 2.0) -> None:
        self._redis: Any = Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._timeout_s = timeout_s
        self._hash, self._version, self._used = f"{prefix}keys", f"{prefix}keys:version", f"{prefix}keys:used"

    async def version(self) -> int:
        raw = await self._call("read the keys' version", self._redis.get(self._version))
        return int(raw or 0)

    async def records(self) -> tuple[int, dict[str, dict[str, Any]]]:
        async def read() -> tuple[int, dict[str, dict[str, Any]]]:
            async with self._redis.pipeline(transaction=True) as pipe:
                version, raw = await pipe.get(self._version).hgetall(self._hash).execute()
            return int(version or 0), {_s(k): orjson.loads(v) for k, v in raw.items()}

        result: tuple[int, dict[str, dict[str, Any]]] = await self._call("read the keys", read())
        return result

    async def change(self, op: KeyOp) -> Any:
        async def attempt() -> Any:
            for _ in range(self._TRIES):
                async with self._redis.pipeline(transaction=True) as pipe:
                    try:
                        await pipe.watch(self._hash)
                        raw = await pipe.hgetall(self._hash)
                        writes, result = apply(op, {_s(k): orjson.loads(v) for k, v in raw.items()})
                        pipe.multi()
                        for kid, rec in writes.items():
                            if rec is None:
                                pipe.hdel(self._hash, kid).hdel(self._used, kid)
                            else:
                                pipe.hset(self._hash, kid, orjson.dumps(rec))
                        pipe.incr(self._version)
                        await pipe.execute()
                        return result
                    except WatchError:
                        continue
            raise StoreError(f"the keys changed {self._TRIES} times while this change was made; try again")

        return await self._call("change the keys", attempt())

    async def touch(self, used: dict[str, float]) -> None:
        if used:
            await self._call("record the keys' last use", self._redis.hset(self._used, mapping=used))

    async def last_used(self) -> dict[str, float]:
        raw = await self._call("read the keys' last use", self._redis.hgetall(self._used))
        return {_s(k): float(v) for k, v in raw.items()}

    async def close(self) -> None:
        await self._redis.aclose()

    async def _call(self, what: str, aw: Any) -> Any:
        return await bounded(what, aw, self._timeout_s)


def _apply(records: dict[str, dict[str, Any]], writes: dict[str, dict[str, Any] | None]) -> None:
    for kid, rec in writes.items():
        if rec is None:
            records.pop(kid, None)
        else:
            records[kid] = rec


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
