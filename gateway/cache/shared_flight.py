"""Single flight across processes: on a shared (Redis) store, one process calls upstream for a
request, and the others wait for its stored answer.

The leader takes a short lock next to the cache key (SET NX with a TTL: a leader that dies frees
it when the TTL ends). The lock holds a random token of its leader's, and is given back only while
it still holds that token: a leader slower than the TTL finds its lock taken by another and leaves
that one alone. Followers poll the cache key (and the lock): the stored answer when it
comes, or, once the lock is gone without an answer (an error, an answer that may not be stored),
they go upstream themselves. A streamed follower gets the answer replayed as a stream when it is
complete: what crosses processes is the stored entry, not the live stream (broadcast.py shares the
live stream within one process). Store failures fail open: the request goes upstream (a waiting
follower after a few failed reads in a row, so that one slow reply does not make a second call).
While the cache's breaker is open (its store kept timing out: cache/core.py), the lock is neither
taken nor waited on: the request goes upstream at once (single flight in this process still holds).

The lock also says the leader's terms (cache.core.Terms: its whole deadline, its band's rank): a
request whose terms they do not cover does not wait on it, as within one process (a leader's short
deadline or low band must not hold another caller's answer); it goes upstream without the lock.

The leader stores its answer before it lets go of the lock (pipeline/core.py does both in one shielded
step, even when its own client has already left), and the lock alone cannot tell "nobody started"
from "somebody finished": a process that wins the lock looks the answer up once more.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time

from ..store.core import StoreError
from .core import ANY_TERMS, Cache, Skipped, Terms
from .entry import Entry

__all__ = ["claim", "release", "release_later", "shared"]

_LOCK = "gwlock:"
_POLL_S = 0.05
# A release that failed is tried again after these pauses, then every _RELEASE_EVERY_S (jittered:
# the releases of a whole outage do not come back together) until the lock's own TTL ends: a
# store failing over answers within the first few, but a stall (a fork, a slow command, a Cluster
# failover of cluster-node-timeout, 15 s by default) may last longer, and a lock given up on held
# the same request on every replica for the rest of `cache.lock_ms`.
_RELEASE_PAUSES_S = (0.1, 0.4, 1.0)
_RELEASE_EVERY_S = 2.0
_UNKNOWN_TTL_S = 30.0  # a token that does not say when its lock ends (cache.lock_ms's default)
_READ_FAILURES = 3  # failed lock reads in a row that make a follower stop waiting (the store is down)


def shared(cache: Cache) -> bool:
    """Whether other processes see this cache (a process's own store needs no lock: SingleFlight)."""
    return cache.store.shared


def _terms_of(raw: bytes) -> Terms:
    """The terms a lock's value says ("<token> <timeout_ms> <rank>"); a value without them (a
    replica of an earlier version) covers everyone, as it did."""
    parts = raw.split()
    try:
        return Terms(int(parts[1]), int(parts[2])) if len(parts) == 3 else ANY_TERMS
    except ValueError:
        return ANY_TERMS


async def claim(cache: Cache, key: str, *, wait_s: float, lock_s: float, terms: Terms = ANY_TERMS,
                take: bool = True) -> tuple[str | None, Entry | None]:
    """(token, None): this process leads, holding the lock (give it back with `release(cache,
    key, token)`).
    (None, entry): another process stored the answer (before we took the lock, or while we waited).
    (None, None): go upstream without the lock (the leader stored nothing, the wait ran out, its
    terms do not cover `terms`, or the store failed).
    `take=False`: a request that stores nothing waits on a lock another holds but never takes one
    (nobody may wait on it for an answer it will not store)."""
    # The token's first part ends with when the lock ends here (monotonic ms): release_later's
    # bound. Other replicas read only the other two parts (_terms_of).
    token = f"{secrets.token_hex(16)}.{int((time.monotonic() + lock_s) * 1000)} {terms.timeout_ms} {terms.rank}"
    store = cache.store
    try:
        if take:
            if await cache.call(store.add, _LOCK + key, token.encode(), lock_s):
                return await _recheck(cache, key, token)
        elif await cache.call(store.get, _LOCK + key) is None:
            return None, None  # nobody is answering it elsewhere
    except Skipped:
        return None, None  # the store was not asked: no lock of ours anywhere
    except StoreError:
        # A SET that timed out here may still have run there: the lock is then ours, and given
        # back at the end like any (release deletes it only while it holds our token), not left
        # for the other replicas to wait on until its TTL when our answer is not stored.
        return (token if take else None), None
    deadline = time.monotonic() + min(wait_s, lock_s)
    failures = 0
    while time.monotonic() < deadline:
        await asyncio.sleep(_POLL_S)
        entry = await cache.lookup(key)
        if entry is not None:
            return None, entry
        try:
            lock = await cache.call(store.get, _LOCK + key)
        except Skipped:
            return None, None  # the store keeps timing out (the breaker opened): the answer could not be read
        except StoreError:
            # One slow reply on a busy store is no reason to call upstream a second time; a
            # store that keeps failing is (the leader's answer could not be read anyway).
            failures += 1
            if failures >= _READ_FAILURES:
                return None, None
            continue
        failures = 0
        if lock is None:
            # The leader may have stored the answer and let go between our two reads.
            return None, await cache.lookup(key)
        if take and lock == token.encode():
            # Our own SET NX: it ran, but its reply was lost with its connection and redis-py sent
            # it again, which found the key taken (by us). Nobody else answers it or lets it go:
            # we lead (the lookup above missed while we held it), instead of waiting for ourselves
            # until lock_s (30 s by default; a Cluster failover's reconnects lose such replies).
            return token, None
        if not _terms_of(lock).covers(terms):
            return None, None  # its deadline or band is not ours to wait on
    return None, None


async def _recheck(cache: Cache, key: str, token: str) -> tuple[str | None, Entry | None]:
    """We hold the lock, but our caller's lookup missed before it: a leader elsewhere may have
    stored the answer and released the lock in between (it stores first, then releases)."""
    try:
        entry = await cache.lookup(key)
    except BaseException:  # cancelled: the lock must not outlive us until its TTL
        await asyncio.shield(release(cache, key, token))
        raise
    if entry is None:
        return token, None
    await release(cache, key, token)
    return None, entry


async def release(cache: Cache, key: str, token: str, *, past_breaker: bool = False) -> bool:
    """Give the lock back (after the answer was stored, or not), if it is still ours: one held
    past its TTL may have been taken by another leader since, whose lock it now is. False when
    the store failed, or was skipped by the cache's breaker (`release_later`, whose tries go
    `past_breaker`: they run in a task of their own, and no request waits on them)."""
    delete_if = cache.store.delete_if
    try:
        if past_breaker:
            await delete_if(_LOCK + key, token.encode())
        else:
            await cache.call(delete_if, _LOCK + key, token.encode())
    except StoreError:
        return False
    return True


async def release_later(cache: Cache, key: str, token: str) -> None:
    """A release that failed, tried again while the store recovers, until the lock would have
    ended by its TTL anyway (in a task of its own: the answer does not wait for it; a shutdown
    cancels it). Left to its TTL, the lock kept every request for the same answer, here and on
    the other replicas, waiting on an answer nobody stores (the leader's save failed too) until
    `cache.lock_ms` (30 s by default) or their own deadline. Also while the cache's breaker is
    open: no request waits on these tries, and a stall may end before the breaker closes (other
    replicas would wait on the lock meanwhile)."""
    ends = _lock_end(token)
    pauses = iter(_RELEASE_PAUSES_S)
    while True:
        pause = next(pauses, None)
        if pause is None:
            pause = _RELEASE_EVERY_S * (0.75 + random.random() / 2)
        left = ends - time.monotonic()
        if left <= 0:
            return  # gone by itself by now (Redis ends a key by its clock, a stall's time included)
        await asyncio.sleep(min(pause, left))
        if await release(cache, key, token, past_breaker=True):
            return


def _lock_end(token: str) -> float:
    """When the lock with `token` (claim's) ends by its TTL, on time.monotonic()'s clock."""
    _, dot, ms = token.split(" ", 1)[0].rpartition(".")
    try:
        return int(ms) / 1000 if dot else time.monotonic() + _UNKNOWN_TTL_S
    except ValueError:
        return time.monotonic() + _UNKNOWN_TTL_S
