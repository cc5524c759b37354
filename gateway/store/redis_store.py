"""The Redis Store: pooled redis.asyncio clients (hiredis parser when installed) on one Redis, a
Sentinel master or a Cluster (store/connect.py), every call bounded by a few milliseconds, every
failure turned into StoreError so callers fail open. Multi-key scripts keep their keys in one
hash slot (a `{tag}` in each name), so they run on a Cluster too.

Reconnecting needs no supervisor: a dead pooled connection is dropped and the next call opens a
fresh one. Each call is bounded by its own timeout (asyncio.timeout), so while Redis is down or
stalled it fails in about `timeout_ms` (a refused connect fails at once) rather than waiting
seconds for a socket.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from ..config.policy import StoreTlsPolicy
from ..tenants import quota_lua
from ..tenants.quota_counters import Ask, Decision, Settle, Usage
from .connect import FAILURES, close_client, connect, write_acked
from .core import StoreError

__all__ = ["RedisStore", "bounded"]

T = TypeVar("T")

# delete_if: DEL only while the key holds the caller's value, in one step (no other client between).
_DELETE_IF = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class RedisStore:
    """A Store on Redis. `url`: a `store.url` (store/target.py: one Redis, Sentinel or Cluster);
    `tls`: its `store.tls`; `prefix` is prepended to every key (a namespace per deployment or per
    test); `role` names its connections (gw-<role>-<pid>; the quotas' pool: gw-quota-<pid>);
    `quotas`: False for a store that holds none (no pool of their own)."""

    __slots__ = (
        "_redis", "_timeout_s", "prefix", "_qredis", "_quota_timeout_s", "_take", "_settle", "_undo", "_usage", "_delete_if",
        "_peek",
    )  # fmt: skip
    shared = True  # every replica on this Redis sees it

    def __init__(
        self,
        url: str,
        *,
        timeout_ms: float = 5.0,
        max_connections: int = 64,
        prefix: str = "",
        quota_timeout_ms: float = 250.0,
        tls: StoreTlsPolicy | None = None,
        role: str = "store",
        quotas: bool = True,
    ) -> None:
        if timeout_ms <= 0 or quota_timeout_ms <= 0:
            raise ValueError("timeout_ms and quota_timeout_ms must be positive")
        self._timeout_s = timeout_ms / 1000
        self.prefix = prefix
        pid = os.getpid()
        self._redis = connect(url, tls, timeout_s=self._timeout_s, max_connections=max_connections, name=f"gw-{role}-{pid}")
        self._delete_if = self._redis.register_script(_DELETE_IF)  # EVALSHA, as the quota scripts below
        # Quotas get their own pool and a longer bound: a cache lookup that is slow is a miss,
        # but a quota decision that gives up falls back to this process's own counters, which are not
        # exact across replicas. A Redis that is down still fails at once (connection refused).
        self._quota_timeout_s = quota_timeout_ms / 1000
        # (A store that holds no quotas, the Responses records', sends any on its own pool.)
        self._qredis = self._redis if not quotas else connect(
            url, tls, timeout_s=self._quota_timeout_s, max_connections=max_connections, name=f"gw-quota-{pid}")
        # EVALSHA, loading the script again after a Redis restart (NOSCRIPT) by itself.
        self._take = self._qredis.register_script(quota_lua.TAKE)
        self._settle = self._qredis.register_script(quota_lua.SETTLE)
        self._undo = self._qredis.register_script(quota_lua.UNDO)
        self._usage = self._qredis.register_script(quota_lua.USAGE)
        self._peek = self._qredis.register_script(quota_lua.PEEK)

    async def get(self, key: str) -> bytes | None:
        try:
            async with asyncio.timeout(self._timeout_s):
                # the pool does not decode (no decode_responses): a value comes back as bytes
                return cast("bytes | None", await self._redis.get(self.prefix + key))
        except FAILURES as exc:
            raise _error("get", exc) from None

    async def set(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                if ttl_s <= 0:
                    await self._redis.delete(self.prefix + key)
                elif replicas:
                    await self._acked(replicas, "SET", self.prefix + key, value, "PX", max(1, round(ttl_s * 1000)))
                else:
                    await self._redis.set(self.prefix + key, value, px=max(1, round(ttl_s * 1000)))
        except FAILURES as exc:
            raise _error("set", exc) from None

    async def add(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> bool:
        try:
            async with asyncio.timeout(self._timeout_s):
                if replicas:
                    args = ("SET", self.prefix + key, value, "PX", max(1, round(ttl_s * 1000)), "NX")
                    return bool(await self._acked(replicas, *args))
                return bool(await self._redis.set(self.prefix + key, value, px=max(1, round(ttl_s * 1000)), nx=True))
        except FAILURES as exc:
            raise _error("add", exc) from None

    async def _acked(self, replicas: int, *command: Any) -> Any:
        """`command` (a write of one key), then WAIT for `replicas` replicas on the same connection;
        StoreError when fewer acknowledged it before the call's timeout."""
        # WAIT answers with its count at its own timeout, which must come before ours (that would
        # lose the count); Redis sees a blocked client's timeout up to 100 ms late (hz 10).
        t_ms = self._timeout_s * 1000
        got, acks = await write_acked(self._redis, command, replicas, max(1, round(min(t_ms / 2, t_ms - 120))))
        if acks < replicas:
            raise StoreError(f"redis: {acks} of {replicas} replica(s) acknowledged the write in time")
        return got

    async def delete(self, key: str) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._redis.delete(self.prefix + key)
        except FAILURES as exc:
            raise _error("delete", exc) from None

    async def delete_if(self, key: str, value: bytes) -> bool:
        try:
            async with asyncio.timeout(self._timeout_s):
                return bool(await self._delete_if(keys=[self.prefix + key], args=[value]))
        except FAILURES as exc:
            raise _error("delete_if", exc) from None

    async def quota_take(self, tenant: str, ask: Ask) -> Decision:
        keys: list[str] = []
        args: list[str | int] = [ask.tokens, ask.lease, ask.lease_ttl_ms, ask.spend_micro]
        for sc in ask.scopes:
            keys += quota_lua.scope_keys(self.prefix, tenant, sc.name)
            args += [sc.name, sc.rpm, sc.tpm, sc.concurrency, sc.tokens_per_day, sc.spend_per_day_micro]
        keys.append(quota_lua.take_key(self.prefix, tenant, ask.lease))
        try:
            async with asyncio.timeout(self._quota_timeout_s):
                r = await self._take(keys=keys, args=args)
        except FAILURES as exc:
            raise _error("quota", exc) from None
        return Decision(
            ok=int(r[0]) == 1, limit=_s(r[1]) or None, scope=_s(r[2]), retry_after_s=float(r[3]),
            bucket=int(r[4]), day=int(r[5]), limit_requests=int(r[6]), remaining_requests=int(r[7]),
            reset_requests_s=float(r[8]), limit_tokens=int(r[9]), remaining_tokens=int(r[10]), reset_tokens_s=float(r[11]),
        )

    async def quota_peek(self, tenant: str, ask: Ask) -> Decision:
        """What quota_take(tenant, ask) would answer now, writing nothing (/v1/route/explain's
        quota verdict); StoreError as quota_take's."""
        keys: list[str] = []
        args: list[str | int] = [ask.tokens, ask.lease, ask.lease_ttl_ms, ask.spend_micro]
        for sc in ask.scopes:
            keys += quota_lua.scope_keys(self.prefix, tenant, sc.name)
            args += [sc.name, sc.rpm, sc.tpm, sc.concurrency, sc.tokens_per_day, sc.spend_per_day_micro]
        try:
            async with asyncio.timeout(self._quota_timeout_s):
                r = await self._peek(keys=keys, args=args)
        except FAILURES as exc:
            raise _error("quota peek", exc) from None
        return _decision(r)

    def take_now(self, tenant: str, ask: Ask) -> Decision | None:
        return None  # a round trip: quota_take

    def settle_now(self, tenant: str, settle: Settle) -> bool:
        return False  # a round trip: quota_settle, in a task

    async def quota_settle(self, tenant: str, settle: Settle) -> None:
        keys: list[str] = []
        for name in settle.scopes:
            keys += quota_lua.scope_keys(self.prefix, tenant, name)
        keys.append(quota_lua.take_key(self.prefix, tenant, settle.lease))
        args: list[int | str] = [settle.bucket, settle.day, settle.token_delta, settle.spend_micro, settle.lease]
        try:
            async with asyncio.timeout(self._quota_timeout_s):
                await self._settle(keys=keys, args=args)
        except FAILURES as exc:
            raise _error("quota settle", exc) from None

    async def quota_undo(self, tenant: str, ask: Ask) -> bool:
        keys: list[str] = []
        for sc in ask.scopes:
            keys += quota_lua.scope_keys(self.prefix, tenant, sc.name)
        keys.append(quota_lua.take_key(self.prefix, tenant, ask.lease))
        try:
            async with asyncio.timeout(self._quota_timeout_s):
                return int(await self._undo(keys=keys, args=[ask.lease, ask.lease_ttl_ms + 1000])) == 1
        except FAILURES as exc:
            raise _error("quota undo", exc) from None

    async def quota_usage(self, tenant: str, scope: str) -> Usage:
        try:
            async with asyncio.timeout(self._quota_timeout_s):
                r = await self._usage(keys=quota_lua.scope_keys(self.prefix, tenant, scope))
        except FAILURES as exc:
            raise _error("quota usage", exc) from None
        return Usage(*(int(x) for x in r))

    async def warm(self, timeout_s: float = 2.0) -> None:
        """Open a connection in each pool now (at start), so the first requests do not pay the
        connect inside their few-millisecond budget (and turn into misses). Errors are left to
        the calls that follow (they fail open)."""
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(c.ping() for c in self._clients()))
        except FAILURES:
            pass

    def own(self, name: str, owner_of: Callable[[str, bytes], str] | None = None) -> RedisStore:
        """Itself: every use's keys have a prefix of their own on the one server (see Store.own);
        what evicts there is the server's maxmemory policy, and records have a TTL."""
        return self

    async def close(self) -> None:
        for c in self._clients():
            await close_client(c)

    def _clients(self) -> list[Any]:
        return [self._redis] if self._qredis is self._redis else [self._redis, self._qredis]


def _decision(r: list[Any]) -> Decision:
    """A Decision from the reply of QUOTA_PEEK (TAKE's layout)."""
    return Decision(
        ok=int(r[0]) == 1, limit=_s(r[1]) or None, scope=_s(r[2]), retry_after_s=float(r[3]),
        bucket=int(r[4]), day=int(r[5]), limit_requests=int(r[6]), remaining_requests=int(r[7]),
        reset_requests_s=float(r[8]), limit_tokens=int(r[9]), remaining_tokens=int(r[10]), reset_tokens_s=float(r[11]),
    )


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _error(op: str, exc: BaseException) -> StoreError:
    if isinstance(exc, TimeoutError) and not str(exc):
        return StoreError(f"redis {op}: timed out")
    return StoreError(f"redis {op}: {type(exc).__name__}: {exc}")


async def bounded(what: str, aw: Awaitable[T], timeout_s: float) -> T:
    """`await aw` within `timeout_s`; any Redis failure (down, slow, refused) as a StoreError
    saying what could not be done."""
    try:
        async with asyncio.timeout(timeout_s):
            return await aw
    except FAILURES as exc:
        raise StoreError(f"cannot {what} in Redis: {type(exc).__name__}: {exc}") from exc
