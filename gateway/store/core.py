"""The Store that the cache and the quotas sit on, and its in-memory implementations.

A Store holds opaque bytes under string keys, each with a TTL, and the quota counters (one atomic
check-and-take per request: tenants/quota_counters.py, tenants/quota_lua.py). Implementations raise StoreError
when they cannot answer (unavailable, timed out); callers treat that as a miss and fail open.
The Redis implementation lives in redis_store.py, so the embedded default never imports redis.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from ..tenants.quota_counters import Ask, Decision, MemoryQuota, Settle, Usage
from .holdings import Holdings

__all__ = ["StoreError", "Store", "MemoryStore", "FairMemoryStore"]


class StoreError(Exception):
    """The store could not answer in time (down, slow, refused). Callers fail open."""


@runtime_checkable
class Store(Protocol):
    # Whether other processes see what this store holds (Redis): single flight then takes a lock
    # across processes (cache/shared_flight.py); a process's own store needs none.
    shared: bool

    async def get(self, key: str) -> bytes | None:
        """The value under `key`, or None when absent or expired."""
        ...

    async def set(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> None:
        """Store `value` under `key` for `ttl_s` seconds (replacing any previous value). With
        `replicas`, only once that many replicas hold it too (StoreError when fewer acknowledged
        in time: the write may stand on the master alone); a store without replicas ignores it."""
        ...

    async def delete(self, key: str) -> None:
        """Remove `key`; absent keys are fine."""
        ...

    async def add(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> bool:
        """Store `value` under `key` only when no live value is there; True when it was stored
        (a short lock: cache/shared_flight.py). `replicas` as for set."""
        ...

    async def delete_if(self, key: str, value: bytes) -> bool:
        """Remove `key` only while it holds `value`, atomically; True when it was removed (a lock
        given back by its owner alone, not after its TTL ended and another process took it)."""
        ...

    async def close(self) -> None:
        """Release connections; the store is not used afterwards."""
        ...

    def own(self, name: str, owner_of: Callable[[str, bytes], str] | None = None) -> Store:
        """The part of this store that only `name`'s entries use: for a process's memory, an LRU
        of its own (another user's traffic cannot push them out), shared fairly among the owners
        `owner_of` reads from each entry (key, value) when given (FairMemoryStore); a shared store (Redis,
        whose keys are prefixed per use) is itself."""
        ...

    async def quota_take(self, tenant: str, ask: Ask) -> Decision:
        """Check every limit of `ask` for `tenant` and, when all pass, take them: atomically."""
        ...

    async def quota_settle(self, tenant: str, settle: Settle) -> None:
        """Correct a reservation with what was used, and release its lease."""
        ...

    async def quota_undo(self, tenant: str, ask: Ask) -> bool:
        """Reverse a quota_take whose answer never came back (it timed out): what it took, if it
        ran; a take of it still on its way takes nothing. True when a take was reversed."""
        ...

    def take_now(self, tenant: str, ask: Ask) -> Decision | None:
        """quota_take at once when it needs no round trip (this process's own counters); None,
        having done nothing, when it does (await quota_take)."""
        ...

    def settle_now(self, tenant: str, settle: Settle) -> bool:
        """quota_settle at once when it needs no round trip (this process's own counters): True.
        False, having done nothing, when it does (call quota_settle)."""
        ...

    async def quota_usage(self, tenant: str, scope: str) -> Usage:
        """A tenant scope's current use (window, in flight, today)."""
        ...


class MemoryStore:
    """A per-process LRU with a TTL per key, bounded by total bytes and by item count.

    get/set are O(1) (an OrderedDict in recency order). Expired items are dropped when read, and
    otherwise age out through the LRU order, so no sweeper task is needed. `clock` is injectable
    for tests. A value larger than `max_bytes` is not stored at all.
    """

    __slots__ = ("_items", "_bytes", "max_bytes", "max_items", "_clock", "quota", "_parts")
    shared = False  # this process's own

    def __init__(
        self,
        *,
        max_bytes: int = 256 << 20,
        max_items: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes <= 0 or max_items <= 0:
            raise ValueError("max_bytes and max_items must be positive")
        self._items: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self._bytes = 0
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._clock = clock
        self.quota = MemoryQuota()  # quota counters: this process's own (see tenants/quota_counters.py)
        self._parts: dict[str, MemoryStore] = {}  # see own()

    def own(self, name: str, owner_of: Callable[[str, bytes], str] | None = None) -> MemoryStore:
        """An LRU of `name`'s own, with this one's bounds, made once (the Responses API's records
        beside the cache: tenant B's cacheable requests must not evict tenant A's records); with
        `owner_of`, shared fairly among the owners it names (B's records must not evict A's)."""
        part = self._parts.get(name)
        if part is None:
            n, items, clock = self.max_bytes, self.max_items, self._clock
            part = (MemoryStore(max_bytes=n, max_items=items, clock=clock) if owner_of is None
                    else FairMemoryStore(owner_of, max_bytes=n, max_items=items, clock=clock))
            self._parts[name] = part
        return part

    def __len__(self) -> int:
        return len(self._items)

    @property
    def used_bytes(self) -> int:
        """Bytes held (keys and values), the quantity bounded by max_bytes."""
        return self._bytes

    async def get(self, key: str) -> bytes | None:
        item = self._items.get(key)
        if item is None:
            return None
        if item[1] <= self._clock():
            self._drop(key)
            return None
        self._items.move_to_end(key)
        return item[0]

    async def set(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> None:
        if key in self._items:
            self._drop(key)
        size = len(key) + len(value)
        if ttl_s <= 0 or size > self.max_bytes:
            return
        self._items[key] = (value, self._clock() + ttl_s)
        self._bytes += size
        while self._bytes > self.max_bytes or len(self._items) > self.max_items:
            self._drop(next(iter(self._items)))  # the least recently used

    async def delete(self, key: str) -> None:
        if key in self._items:
            self._drop(key)

    async def add(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> bool:
        if await self.get(key) is not None:
            return False
        await self.set(key, value, ttl_s)
        return True

    async def delete_if(self, key: str, value: bytes) -> bool:
        if await self.get(key) != value:  # absent and expired included
            return False
        self._drop(key)
        return True

    async def close(self) -> None:
        self._items.clear()
        self._bytes = 0

    async def quota_take(self, tenant: str, ask: Ask) -> Decision:
        return self.quota.take(tenant, ask)

    async def quota_settle(self, tenant: str, settle: Settle) -> None:
        self.quota.settle(tenant, settle)

    async def quota_undo(self, tenant: str, ask: Ask) -> bool:
        return False  # a take here never times out: its caller always has its answer

    def take_now(self, tenant: str, ask: Ask) -> Decision | None:
        return self.quota.take(tenant, ask)

    def settle_now(self, tenant: str, settle: Settle) -> bool:
        self.quota.settle(tenant, settle)
        return True

    async def quota_usage(self, tenant: str, scope: str) -> Usage:
        return self.quota.usage(tenant, scope)

    def _drop(self, key: str) -> None:
        value, _ = self._items.pop(key)
        self._bytes -= len(key) + len(value)


class FairMemoryStore(MemoryStore):
    """An in-memory LRU shared fairly by its owners: the Responses API's records of every tenant
    live in one (responses/affinity.py). With one plain LRU, a tenant creating conversations (cheap
    requests, each recorded) pushed the other tenants' records out, and their follow-ups were 404s;
    here it evicts its own, and an owner holding fewer than `max_items` / N entries (N: the owners
    present) loses none to the others.

    A MemoryStore whose entries each belong to an owner (`owner_of(key, value)`), each owner's in
    an LRU of its own; past `max_items` the least recently used entry of an owner holding the most
    entries goes, past `max_bytes` that of an owner holding the most bytes (the response cache's
    entries differ in size by 1,000x: counted in entries, a tenant of large answers evicted the
    others'). get/set stay O(1) (an owner's count moves in O(log owners))."""

    __slots__ = ("_owner_of", "_lrus", "_where", "_held", "_weight")

    def __init__(
        self,
        owner_of: Callable[[str, bytes], str],
        *,
        max_bytes: int = 256 << 20,
        max_items: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(max_bytes=max_bytes, max_items=max_items, clock=clock)
        self._owner_of = owner_of
        self._lrus: dict[str, OrderedDict[str, tuple[bytes, float]]] = {}
        self._where: dict[str, str] = {}  # key -> its owner
        self._held = Holdings()
        self._weight = Holdings()  # bytes per owner

    def __len__(self) -> int:
        return len(self._where)

    def owners(self) -> dict[str, int]:
        """Entries held per owner (expired ones included until read or evicted)."""
        return {o: len(lru) for o, lru in self._lrus.items()}

    async def get(self, key: str) -> bytes | None:
        owner = self._where.get(key)
        if owner is None:
            return None
        lru = self._lrus[owner]
        value, expires = lru[key]
        if expires <= self._clock():
            self._drop(key)
            return None
        lru.move_to_end(key)
        return value

    async def set(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> None:
        if key in self._where:
            self._drop(key)
        size = len(key) + len(value)
        if ttl_s <= 0 or size > self.max_bytes:
            return
        owner = self._owner_of(key, value)
        self._lrus.setdefault(owner, OrderedDict())[key] = (value, self._clock() + ttl_s)
        self._where[key] = owner
        self._held.move(owner, 1)
        self._weight.move(owner, size)
        self._bytes += size
        while self._bytes > self.max_bytes or len(self._where) > self.max_items:
            heaviest = self._held.heaviest() if len(self._where) > self.max_items else self._weight.heaviest()
            assert heaviest is not None  # something is held: the bounds were passed
            self._drop(next(iter(self._lrus[heaviest])))  # its least recently used

    async def delete(self, key: str) -> None:
        if key in self._where:
            self._drop(key)

    async def close(self) -> None:
        self._lrus.clear()
        self._where.clear()
        self._held, self._weight = Holdings(), Holdings()
        self._bytes = 0

    def _drop(self, key: str) -> None:
        owner = self._where.pop(key)
        lru = self._lrus[owner]
        value, _ = lru.pop(key)
        if not lru:
            del self._lrus[owner]
        self._held.move(owner, -1)
        self._weight.move(owner, -(len(key) + len(value)))
        self._bytes -= len(key) + len(value)
