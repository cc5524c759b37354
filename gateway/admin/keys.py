"""Virtual keys: issued, listed, rotated and revoked through /admin/keys, without a deploy.

A key acts as its tenant's key (the tenant's quotas, priority and models; a key may narrow the
models). The store (admin/key_store.py) holds each key's record, with the sha256 digests of its
secrets only: the secret is shown once, in the answer that made it. Every process keeps all
records in memory (`KeyBook`), so a lookup on the request path is a dict lookup: no round trip. It
polls the store's version every `admin.keys.poll_ms`, on the same wall-clock ticks in every
process, and reloads when it is not the one loaded, so a revoke or a rotation reaches every worker
and replica within a poll, all at once; a store that is down leaves the keys this process knows
working (and revoked ones refused).

A record: {id, tenant, name, created_at, expires_at, models, revoked, revoked_at,
digests: {digest: until}} where `until` is null for the current secret and the end of the grace
for a rotated one.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.policy import VirtualKeysPolicy
from ..errors import BadRequest
from ..tenants.auth import VIRTUAL_KEY_PREFIX
from .key_ops import Add, KeyOp, Revoke, Rotate
from .key_store import KeyStore, same_version

__all__ = ["KeyBook", "KeyCursor", "KeyPage", "VirtualKey", "KEY_PREFIX", "LIST_DEFAULT", "LIST_MAX"]

log = logging.getLogger("gateway.admin.keys")

KEY_PREFIX = VIRTUAL_KEY_PREFIX
_TOUCH_EVERY_S = 5.0  # last_used_at is written in batches: a request costs a dict write, not a round trip
# An unknown `sk-gw-` key asks the store whether keys changed, at most this often per process: a
# key made on another replica a moment ago works at once, and a flood of made-up keys costs the
# store a few reads a second (and each made-up key waits up to this for its 401).
_CATCH_UP_EVERY_S = 0.05


_LIST_PAUSE = 1_000  # keys a listing scans between two pauses for other requests
LIST_DEFAULT, LIST_MAX = 100, 1000  # keys a page holds, unless asked for fewer or more


@dataclass(frozen=True, slots=True)
class KeyCursor:
    """Where a page of the listing ended: its last key's (created_at, id), the listing's order
    (newest first; keys made in the same instant by id). As text, `created_at~id`."""

    created_at: float
    id: str

    def __str__(self) -> str:
        return f"{self.created_at!r}~{self.id}"

    @staticmethod
    def parse(raw: str) -> KeyCursor:
        """The cursor `str()` wrote; ValueError for anything else."""
        at, sep, kid = raw.partition("~")
        if not sep or not kid or len(raw) > 100:
            raise ValueError(f"not a key listing cursor: {raw[:100]!r}")
        t = float(at)
        if not math.isfinite(t):
            raise ValueError(f"not a key listing cursor: {raw[:100]!r}")
        return KeyCursor(t, kid)


@dataclass(frozen=True, slots=True)
class KeyPage:
    """A page of the listing; `next` the cursor of the page after it (None: this is the last)."""

    data: list[dict[str, Any]]
    next: KeyCursor | None


def _cursor_of(listed: dict[str, Any]) -> KeyCursor:
    return KeyCursor(float(listed["created_at"] or 0.0), listed["id"])


@dataclass(frozen=True, slots=True)
class VirtualKey:
    """One key as the request path sees it (one per digest: a rotated key's old secret too)."""

    id: str
    tenant: str
    models: frozenset[str] | None  # None: the tenant's models
    expires_at: float | None  # epoch seconds
    until: float | None  # this secret's end (a rotated key's grace), epoch seconds

    def live(self, now: float) -> bool:
        return (self.expires_at is None or now < self.expires_at) and (self.until is None or now < self.until)


class KeyBook:
    """This process's copy of every virtual key, kept in step with the store."""

    def __init__(self, store: KeyStore, policy: VirtualKeysPolicy, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.policy = policy
        self._clock = clock
        self._by_digest: dict[str, VirtualKey] = {}
        self._records: dict[str, dict[str, Any]] = {}  # as loaded: the listing's (replaced whole by each load)
        self._order: list[tuple[float, str]] = []  # the listing's order of `_order_of`'s records
        self._order_of: dict[str, dict[str, Any]] | None = None
        self._version = -1
        self._used: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self._catching: asyncio.Future[None] | None = None
        self._checked_at = 0.0  # time.monotonic() of the last version check
        # Refreshes one at a time: two in flight could load in the other order (an older read
        # after a newer one), bringing a revoked key back until the next poll.
        self._refreshing = asyncio.Lock()

    # ---- the request path ------------------------------------------------------------------------

    def lookup(self, digest: str) -> VirtualKey | None:
        """The live key with this secret digest, or None (unknown, revoked, expired, past its grace)."""
        key = self._by_digest.get(digest)
        if key is None:
            return None
        now = self._clock()
        if not key.live(now):
            return None
        self._used[key.id] = now
        return key

    async def catch_up(self) -> None:
        """Check the store for keys made since the last poll (a key this process does not know
        yet). Concurrent callers share one check; checks are at least _CATCH_UP_EVERY_S apart."""
        if self._catching is None:
            self._catching = asyncio.ensure_future(self._catch_up())
        await asyncio.shield(self._catching)

    async def _catch_up(self) -> None:
        try:
            wait = self._checked_at + _CATCH_UP_EVERY_S - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            await self._check()
        except Exception:
            pass  # the poll reports a store that fails
        finally:
            self._catching = None

    async def _check(self) -> None:
        self._checked_at = time.monotonic()
        # The change too, not the number only: after a failover lost change V+1, the next is V+1
        # again with other records (key_store.Version).
        if not same_version(await self.store.version(), self._version):
            await self.refresh()

    # ---- keeping in step -------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the keys (a store that is down is retried by the poll) and start polling."""
        with contextlib.suppress(Exception):
            await self.refresh()
        self._task = asyncio.create_task(self._poll(), name="virtual-keys-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self._flush_used()
        await self.store.close()

    async def refresh(self) -> None:
        """Reload every record from the store (StoreError when it cannot answer)."""
        async with self._refreshing:
            version, records = await self.store.records()
            self._load(version, records)

    async def _poll(self) -> None:
        last_touch = time.monotonic()
        while True:
            await asyncio.sleep(_to_next_tick(self.policy.poll_ms / 1000, time.time()))
            try:
                await self._check()
                if time.monotonic() - last_touch >= _TOUCH_EVERY_S:
                    last_touch = time.monotonic()
                    await self._flush_used()
                if self._failing:
                    log.warning("virtual keys: the store answers again")
                self._failing = False
            except Exception as exc:  # a store outage: the keys known here keep working
                if not self._failing:
                    log.warning("virtual keys: cannot reach the store (the keys known here stay in force): %s", exc)
                self._failing = True

    async def _flush_used(self) -> None:
        used, self._used = self._used, {}
        try:
            await self.store.touch(used)
        except Exception:
            for kid, t in used.items():  # kept for the next try
                self._used[kid] = max(t, self._used.get(kid, 0.0))
            raise

    def _load(self, version: int, records: dict[str, dict[str, Any]]) -> None:
        by_digest: dict[str, VirtualKey] = {}
        for rec in records.values():
            if rec.get("revoked"):
                continue
            models = rec.get("models")
            for digest, until in (rec.get("digests") or {}).items():
                by_digest[digest] = VirtualKey(rec["id"], rec["tenant"], None if models is None else frozenset(models),
                                               rec.get("expires_at"), until)
        self._by_digest, self._records, self._version = by_digest, records, version

    # ---- the admin API ---------------------------------------------------------------------------

    async def create(self, tenant: str, name: str, expires_in_s: float | None, models: list[str] | None) -> dict[str, Any]:
        """A new key: its record's public view plus `key`, the secret (shown this once)."""
        now = self._clock()
        secret = _secret()
        kid = "key_" + secrets.token_hex(8)
        rec = {"id": kid, "tenant": tenant, "name": name, "created_at": round(now, 3),
               "expires_at": None if expires_in_s is None else round(now + expires_in_s, 3),
               "models": models, "revoked": False, "revoked_at": None, "digests": {_digest(secret): None}}  # fmt: skip

        await self._change(Add(rec, now, self.policy.keep_revoked_s, self.policy.max_keys))
        return {**public(rec, self._clock()), "key": secret}

    async def rotate(self, kid: str, grace_s: float) -> dict[str, Any]:
        """A new secret for key `kid`; the old one works `grace_s` more seconds (0: stops now)."""
        if not 0 <= grace_s <= self.policy.max_grace_s:
            raise BadRequest(f"grace_s must be between 0 and {self.policy.max_grace_s:g} (admin.keys.max_grace_s)", param="grace_s")
        secret = _secret()
        rec = await self._change(Rotate(kid, self._clock(), grace_s, _digest(secret)))
        return {**public(rec, self._clock()), "key": secret}

    async def revoke(self, kid: str) -> None:
        """Revoke key `kid` (every secret of it), everywhere within a poll. Revoking twice is fine."""
        await self._change(Revoke(kid, self._clock()))

    async def page(self, tenant: str | None, limit: int = LIST_DEFAULT, before: KeyCursor | None = None) -> KeyPage:
        """A page of the keys (of `tenant`), newest first, as the API shows them: never a secret or
        a digest; `before` a page's `next`. From the records this process holds, reloaded first
        when the store's version moved (one read of the version, not of every record). The whole
        list in one answer was ~6 MB of JSON for 10,000 keys; a page holds at most LIST_MAX, and
        the scan for a tenant's keys pauses every _LIST_PAUSE keys (three viewers listing 10,000
        keys in a loop held every request up to 387 ms)."""
        await self._check()
        records = self._records  # this load's: a reload meanwhile replaces it, never changes it
        order = self._newest_last(records)
        try:
            used = await self.store.last_used()
        except Exception:
            used = {}
        for kid, t in self._used.items():  # not yet written
            used[kid] = max(t, used.get(kid, 0.0))
        now = self._clock()
        out: list[dict[str, Any]] = []
        i = len(order) if before is None else bisect.bisect_left(order, (before.created_at, before.id))
        scanned = 0
        while i > 0:
            i -= 1
            scanned += 1
            if not scanned % _LIST_PAUSE:
                await asyncio.sleep(0)
            r = records[order[i][1]]
            if tenant is not None and r["tenant"] != tenant:
                continue
            if len(out) == limit:  # one more there is: the page ends at its last key
                return KeyPage(out, _cursor_of(out[-1]))
            out.append({**public(r, now), "last_used_at": None if r["id"] not in used else round(used[r["id"]], 3)})
        return KeyPage(out, None)

    def _newest_last(self, records: dict[str, dict[str, Any]]) -> list[tuple[float, str]]:
        """(created_at, id) of every record, oldest first: sorted once per load, when listed."""
        if self._order_of is not records:
            self._order = sorted((float(r.get("created_at") or 0.0), kid) for kid, r in records.items())
            self._order_of = records
        return self._order

    async def _change(self, change: KeyOp) -> Any:
        result = await self.store.change(change)
        with contextlib.suppress(Exception):
            await self.refresh()  # in force here at once; elsewhere within a poll
        return result


def _to_next_tick(period_s: float, now: float) -> float:
    """Seconds to the next multiple of `period_s` on the wall clock. Every process polls on the
    same ticks, so the workers and replicas see a revoke together, within a round trip of each
    other (each polling on its own phase, a replica's two workers were up to a period apart)."""
    return period_s - now % period_s


def public(rec: dict[str, Any], now: float) -> dict[str, Any]:
    """A record without its digests: when it was last rotated, and until when the secret it
    replaced still works (null: none does)."""
    out = {k: rec.get(k) for k in ("id", "tenant", "name", "created_at", "expires_at", "models", "revoked", "revoked_at", "rotated_at")}
    graces = [until for until in (rec.get("digests") or {}).values() if until is not None and until > now]
    out["previous_secret_until"] = max(graces, default=None)
    return out


def _secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()
