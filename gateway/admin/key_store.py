"""Where virtual keys are kept: Redis (shared by every worker and replica) or this process's memory.

A store holds each key's record (JSON, by id) and a version number that every change raises. The
processes poll the version (admin/keys.py) and reload the records when it is not the one they
loaded (`same_version`): one read per process per poll, and a revoke reaches every process within
a poll. Records hold digests, never secrets.
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

__all__ = ["KeyStore", "MemoryKeyStore", "RedisKeyStore", "Version", "same_version"]


class Version(int):
    """A version number with the change that made it (`change`, a random token Redis's store
    writes with each change). The number alone cannot say which change it counts: a failover to a
    replica that missed change V+1 takes the store back to V, and the next change is V+1 again
    with other records; a process that had loaded the lost V+1 saw its own number and never
    reloaded (keeping a key no store holds and nobody can revoke, refusing the keys made since).
    As an int it is the number: what the KeyStore protocol and the relayed stores speak."""

    change: str

    def __new__(cls, number: int, change: str) -> Version:
        v = super().__new__(cls, number)
        v.change = change
        return v


def same_version(a: int, b: int) -> bool:
    """Whether `a` and `b` name the same records: the same number, made by the same change (a
    plain int, as the in-memory and relayed stores give, has no change to compare)."""
    return a == b and getattr(a, "change", "") == getattr(b, "change", "")


class KeyStore(Protocol):
    async def version(self) -> int:
        """A number that moves whenever a record changes (compared by `same_version`)."""
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
        if not writes:
            return result  # nothing changed (an op applied already): the version stays
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


# The records and their version (number and change), read together (one step: no change in between).
_READ = """
return {redis.call('GET', KEYS[1]) or '0', redis.call('GET', KEYS[3]) or '', redis.call('HGETALL', KEYS[2])}
"""

# A change made against version ARGV[1] by change ARGV[2]: written only while the version is
# still that (else 0 and nothing written: another change got in first); ARGV[5..] are (id, record
# JSON or "" to delete). It counts the version up and names itself ARGV[4], a random token (see
# Version). A store without a version (new, or emptied: a restart without persistence) starts
# counting at ARGV[3], a random number, so that a replica of an earlier version, which compares
# numbers only, never finds the number it loaded before either (a rolling upgrade).
_WRITE = """
if (redis.call('GET', KEYS[1]) or '0') ~= ARGV[1] or (redis.call('GET', KEYS[4]) or '') ~= ARGV[2] then
  return 0
end
for i = 5, #ARGV, 2 do
  if ARGV[i + 1] == '' then
    redis.call('HDEL', KEYS[2], ARGV[i])
    redis.call('HDEL', KEYS[3], ARGV[i])
  else
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
  end
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('SET', KEYS[1], ARGV[3])
end
redis.call('SET', KEYS[4], ARGV[4])
return redis.call('INCR', KEYS[1])
"""


class RedisKeyStore:
    """The records in one Redis hash (`{prefix}{keys}`), the version in `{prefix}{keys}:version`
    and the change that made it in `{prefix}{keys}:change`, the last use of each key in
    `{prefix}{keys}:used`: one hash slot (the `{keys}` tag), so the scripts run on a Cluster too.
    A change is computed from a read and written by a script only while the version is still the
    one read; retried when another change got in first. A change whose reply was lost is sent
    again by redis-py and finds the version moved (by itself): it is computed again from the
    records it changed, which hold it already (key_ops: nothing to write)."""

    _TRIES = 5

    def __init__(
        self, url: str, *, prefix: str = "gateway:", timeout_s: float = 2.0, tls: StoreTlsPolicy | None = None
    ) -> None:
        self._redis: Any = connect(url, tls, timeout_s=timeout_s, max_connections=ADMIN_CONNECTIONS,
                                   name=f"gw-keys-{os.getpid()}")
        self._timeout_s = timeout_s
        self._version, self._hash, self._used = f"{prefix}{{keys}}:version", f"{prefix}{{keys}}", f"{prefix}{{keys}}:used"
        self._change = f"{prefix}{{keys}}:change"
        self._read = self._redis.register_script(_READ)
        self._write = self._redis.register_script(_WRITE)

    async def version(self) -> Version:
        number, change = await self._call("read the keys' version", self._redis.mget(self._version, self._change))
        return Version(int(number or 0), _s(change or b""))

    async def records(self) -> tuple[Version, dict[str, dict[str, Any]]]:
        number, change, raw = await self._call("read the keys", self._read(keys=[self._version, self._hash, self._change]))
        pairs = iter(raw)  # HGETALL inside a script: a flat list of field, value
        return Version(int(number), _s(change)), {_s(k): orjson.loads(v) for k, v in zip(pairs, pairs, strict=True)}

    async def change(self, op: KeyOp) -> Any:
        async def attempt() -> Any:
            for _ in range(self._TRIES):
                version, records = await self.records()
                writes, result = apply(op, records)
                if not writes:
                    return result  # read with its version in one step: nothing to write, nothing to check
                args: list[Any] = [int(version), version.change, secrets.randbelow(1 << 40), secrets.token_hex(8)]
                for kid, rec in writes.items():
                    args += [kid, b"" if rec is None else orjson.dumps(rec)]
                if await self._write(keys=[self._version, self._hash, self._used, self._change], args=args):
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
