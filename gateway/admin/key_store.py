"""Where virtual keys are kept: Redis (shared by every worker and replica) or this process's memory.

A store holds each key's record (JSON, by id) and a version number that every change raises. The
processes poll the version (admin/keys.py) and reload the records when it moved: one GET per
process per poll, and a revoke reaches every process within a poll. Records hold digests, never
secrets.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Protocol

import orjson

from ..config.policy import StoreTlsPolicy
from ..store.connect import ADMIN_CONNECTIONS, close_client, connect
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


# The records and their version, read together (one step: no change in between).
_READ = """
return {redis.call('GET', KEYS[1]) or '0', redis.call('HGETALL', KEYS[2])}
"""

# A change made against version ARGV[1]: written only while the version is still that (else 0 and
# nothing written: another change got in first); ARGV[3..] are (id, record JSON or "" to delete).
# A store without a version (new, or emptied: a restart without persistence, a failover that lost
# writes) starts counting at ARGV[2], a random number: counting from 1 again could come back to
# the very version a replica loaded before, which would then never reload (keeping a key nobody
# can revoke, and refusing the keys made since).
_WRITE = """
if (redis.call('GET', KEYS[1]) or '0') ~= ARGV[1] then
  return 0
end
for i = 3, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('HDEL', KEYS[3], ARGV[i])
  else
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  end
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SET', KEYS[1], ARGV[2])
end
return redis.call('INCR', KEYS[1])
"""


class RedisKeyStore:
    """The records in one Redis hash (`{prefix}{keys}`), the version in `{prefix}{keys}:version`,
    the last use of each key in `{prefix}{keys}:used`: one hash slot (the `{keys}` tag), so the
    scripts run on a Cluster too. A change is computed from a read and written by a script only
    while the version is still the one read; retried when another change got in first."""

    _TRIES = 5

    def __init__(
        self, url: str, *, prefix: str = "gateway:", timeout_s: float = 2.0, tls: StoreTlsPolicy | None = None
    ) -> None:
        self._redis: Any = connect(url, tls, timeout_s=timeout_s, max_connections=ADMIN_CONNECTIONS,
                                   name=f"gw-keys-{os.getpid()}")
        self._timeout_s = timeout_s
        self._version, self._hash, self._used = f"{prefix}{{keys}}:version", f"{prefix}{{keys}}", f"{prefix}{{keys}}:used"
        self._read = self._redis.register_script(_READ)
        self._write = self._redis.register_script(_WRITE)

    async def version(self) -> int:
        raw = await self._call("read the keys' version", self._redis.get(self._version))
        return int(raw or 0)

    async def records(self) -> tuple[int, dict[str, dict[str, Any]]]:
        version, raw = await self._call("read the keys", self._read(keys=[self._version, self._hash]))
        pairs = iter(raw)  # HGETALL inside a script: a flat list of field, value
        return int(version), {_s(k): orjson.loads(v) for k, v in zip(pairs, pairs, strict=True)}

    async def change(self, op: KeyOp) -> Any:
        async def attempt() -> Any:
            for _ in range(self._TRIES):
                version, records = await self.records()
                writes, result = apply(op, records)
                args: list[Any] = [version, secrets.randbelow(1 << 40)]
                for kid, rec in writes.items():
                    args += [kid, b"" if rec is None else orjson.dumps(rec)]
                if await self._write(keys=[self._version, self._hash, self._used], args=args):
                    return result
            raise StoreError(f"the keys changed {self._TRIES} times while this change was made; try again")

        return await self._call("change the keys", attempt())

    async def touch(self, used: dict[str, float]) -> None:
        if used:
            await self._call("record the keys' last use", self._redis.hset(self._used, mapping=used))

    async def last_used(self) -> dict[str, float]:
        raw = await self._call("read the keys' last use", self._redis.hgetall(self._used))
        return {_s(k): float(v) for k, v in raw.items()}

    async def close(self) -> None:
        await close_client(self._redis)

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
