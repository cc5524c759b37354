"""Single flight across processes: on a shared (Redis) store, one process calls upstream for a
request, and the others wait for its stored answer.

The leader takes a short lock next to the cache key (SET NX with a TTL: a leader that dies frees
it when the TTL ends). Followers poll the cache key (and the lock): the stored answer when it
comes, or, once the lock is gone without an answer (an error, an answer that may not be stored),
they go upstream themselves. A streamed follower gets the answer replayed as a stream when it is
complete: what crosses processes is the stored entry, not the live stream (flight.py shares the
live stream within one process). Every store failure fails open: the request goes upstream.
"""

from __future__ import annotations

import asyncio
import time

from .cache import Cache
from .cache_entry import Entry
from .store import MemoryStore, StoreError

__all__ = ["claim", "release", "shared"]

_LOCK = "gwlock:"
_POLL_S = 0.05


def shared(cache: Cache) -> bool:
    """Whether other processes see this cache (a process's own store needs no lock: SingleFlight)."""
    return not isinstance(cache.store, MemoryStore)


async def claim(cache: Cache, key: str, *, wait_s: float, lock_s: float) -> tuple[bool, Entry | None]:
    """(True, None): this process leads, holding the lock (give it back with `release`).
    (False, entry): another process stored the answer while we waited.
    (False, None): go upstream without the lock (the leader stored nothing, the wait ran out, or
    the store failed)."""
    try:
        if await cache.store.add(_LOCK + key, b"1", lock_s):
            return True, None
    except StoreError:
        return False, None
    deadline = time.monotonic() + min(wait_s, lock_s)
    while time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
        entry = await cache.lookup(key)
        if entry is not None:
            return False, entry
        try:
            if await cache.store.get(_LOCK + key) is None:
                # The leader may have stored the answer and let go between our two reads.
                return False, await cache.lookup(key)
        except StoreError:
            return False, None
    return False, None


async def release(cache: Cache, key: str) -> None:
    """Give the lock back (after the answer was stored, or not)."""
    try:
        await cache.store.delete(_LOCK + key)
    except StoreError:
        pass  # its TTL frees it
