"""Response affinity: which backend holds each Responses API id, in the Store (shared by replicas).

A backend keeps the responses it made (and the conversations they extended); a follow-up with
`previous_response_id` or `conversation`, and GET/DELETE/cancel/input_items by id, only work
there. Every answer teaches the map its ids (`Learner.learn`, before the client can see them
complete); lookups read it back. Entries expire after `responses.affinity_ttl_s`.

Each entry also names its owner (the tenant's cache namespace: the tenants that may see each
other's answers), so one tenant cannot reach another's stored responses by id.
A store that fails is reported (`on_event`) and counts as "not known": the caller says so clearly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .responses import held_ids
from .store import Store, StoreError

__all__ = ["Affinity", "Holder", "Learner", "MAX_ID_CHARS"]

log = logging.getLogger("gateway.affinity")

_PREFIX = "gwr:v1:"
MAX_ID_CHARS = 256  # longer "ids" are nobody's: not stored, not looked up
_WARN_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class Holder:
    """Where a response id lives, and whose it is."""

    backend: str
    owner: str


class Affinity:
    """The id -> (backend, owner) map on a Store."""

    __slots__ = ("store", "ttl_s", "_on_event", "_last_warn")

    def __init__(self, store: Store, ttl_s: float, on_event: Callable[[str, str], None] | None = None) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._on_event = on_event
        self._last_warn = -_WARN_EVERY_S

    async def remember(self, ids: list[str], backend: str, owner: str) -> None:
        """Record that `backend` holds `ids` for `owner` (a store failure is reported, not raised)."""
        value = f"{backend}\n{owner}".encode()
        for rid in ids:
            if len(rid) > MAX_ID_CHARS:
                continue
            try:
                await self.store.set(_PREFIX + rid, value, self.ttl_s)
            except StoreError as exc:
                self._failed("learn", exc)
                return
            self._event("learn", "ok")

    async def lookup(self, rid: str) -> Holder | None:
        """The holder of `rid`, or None when the gateway does not know it (never answered here,
        expired, or the store failed)."""
        if not rid or len(rid) > MAX_ID_CHARS:
            self._event("lookup", "miss")
            return None
        try:
            raw = await self.store.get(_PREFIX + rid)
        except StoreError as exc:
            self._failed("lookup", exc)
            return None
        if raw is None:
            self._event("lookup", "miss")
            return None
        backend, _, owner = raw.decode("utf-8", "replace").partition("\n")
        self._event("lookup", "hit")
        return Holder(backend, owner)

    async def forget(self, rid: str) -> None:
        """Drop `rid` (its response was deleted)."""
        if not rid or len(rid) > MAX_ID_CHARS:
            return
        try:
            await self.store.delete(_PREFIX + rid)
        except StoreError as exc:
            self._failed("forget", exc)

    def learner(self, owner: str) -> Learner:
        """What one request's relay uses to record the ids of its answer."""
        return Learner(self, owner)

    def _event(self, op: str, result: str) -> None:
        if self._on_event is not None:
            self._on_event(op, result)

    def _failed(self, op: str, exc: StoreError) -> None:
        self._event(op, "error")
        now = time.monotonic()
        if now - self._last_warn >= _WARN_EVERY_S:
            self._last_warn = now
            log.warning("response affinity store failed (%s): follow-ups by id may not find their backend: %s", op, exc)


@dataclass(frozen=True, slots=True)
class Learner:
    """One request's handle on the map: the owner is bound, the backend comes with each answer."""

    affinity: Affinity
    owner: str

    async def learn(self, response: Mapping[str, Any], backend: str) -> None:
        """Record the ids `response` (a Responses object) makes `backend` hold."""
        ids = held_ids(response)
        if ids:
            await self.affinity.remember(ids, backend, self.owner)
