"""Response affinity: which backend holds each Responses API id, and whose it is, in the Store.

A backend keeps the responses it made (and the conversations they extended); a follow-up with
`previous_response_id` or `conversation`, and the by-id endpoints, only work there. Every answer
records its ids (`Learner.learn`) before the client can see it; lookups read them back. Entries
expire after `responses.affinity_ttl_s`.

Each record names its owner (the tenant's cache namespace), and ownership fails closed:
- an id without a record is nobody's: callers answer 404, and never search the backends for it,
  unless the policy's migration mode (`responses.adopt_unknown_ids`) is on;
- a record is never overwritten by another owner (`OwnerConflict`, a 409; the record stays);
- the write that makes an answer followable has its own timeout and retries
  (`responses.record_timeout_ms`, `responses.record_attempts`), not the cache's few milliseconds,
  and, with `responses.record_replicas`, counts only once that many Redis replicas hold it (so a
  master's failover cannot lose it);
  when it still fails the answer is not released (`RecordFailed`, a 503), so no id goes out that
  another tenant could later claim;
- a lookup the store cannot answer is a 503 (`MapUnavailable`), not a miss.
Store errors stay in the log (at most once a minute) and the metrics, never in a client's message.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..errors import GatewayError, Unavailable
from ..store.core import Store, StoreError
from .wire import conversation_id, held_ids, held_items, usage_of

__all__ = ["Affinity", "Holder", "Learner", "MapUnavailable", "OwnerConflict", "RecordFailed", "MAX_ID_CHARS", "owner_of"]

log = logging.getLogger("gateway.affinity")

_PREFIX = "gwr:v1:"
_CONTEXT = "gwr:ctx:v1:"  # an id's context size in tokens (what a follow-up makes the backend read again)
MAX_ID_CHARS = 256  # longer "ids" are nobody's: not stored, not looked up
_WARN_EVERY_S = 60.0
_BACKOFF_S = 0.01  # before the 2nd try; doubled for each one after

T = TypeVar("T")


class RecordFailed(Unavailable):
    """The store did not take an answer's record in time: the answer is not released."""

    code = "response_record_failed"


class MapUnavailable(Unavailable):
    """The store could not say who holds an id: nothing is sent anywhere, and nothing is adopted."""

    code = "response_map_unavailable"


class OwnerConflict(GatewayError):
    """An answer names an id whose record belongs to another owner: never overwritten."""

    status = 409
    type = "invalid_request_error"
    code = "response_owner_conflict"


@dataclass(frozen=True, slots=True)
class Holder:
    """Where a response id lives, and whose it is."""

    backend: str
    owner: str


def _value(backend: str, owner: str) -> bytes:
    return f"{backend}\n{owner}".encode()


def _holder(raw: bytes) -> Holder:
    backend, _, owner = raw.decode("utf-8", "replace").partition("\n")
    return Holder(backend, owner)


def owner_of(key: str, raw: bytes) -> str:
    """The owner a record (`raw`, under `key`) names: an in-memory map is shared fairly among
    owners by it (store.core.FairMemoryStore: one tenant's records cannot evict another's)."""
    return raw.partition(b"\n")[2].decode("utf-8", "replace")


class Affinity:
    """The id -> (backend, owner) map on a Store.

    `timeout_s` bounds each try of a record write or a lookup and `attempts` is how many tries
    each gets; `adopt_unknown` is the migration mode (ids without a record may be searched for
    and recorded as the first asker's)."""

    __slots__ = ("store", "ttl_s", "timeout_s", "attempts", "adopt_unknown", "replicas", "_on_event", "_last_warn")

    def __init__(
        self,
        store: Store,
        ttl_s: float,
        on_event: Callable[[str, str], None] | None = None,
        *,
        timeout_s: float = 0.25,
        attempts: int = 3,
        adopt_unknown: bool = False,
        replicas: int = 0,
    ) -> None:
        if timeout_s <= 0 or attempts < 1:
            raise ValueError("timeout_s must be positive and attempts at least 1")
        self.store = store
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.attempts = attempts
        self.adopt_unknown = adopt_unknown
        self.replicas = replicas
        self._on_event = on_event
        self._last_warn = -_WARN_EVERY_S

    async def record(self, ids: Sequence[str], backend: str, owner: str, *, required: bool = True) -> None:
        """Record that `backend` holds `ids` for `owner` (written at once, not one after another);
        an id already `owner`'s is refreshed (its TTL starts again). Raises OwnerConflict when
        another owner holds one (that record stays), and RecordFailed when the store did not take a
        write in `attempts` tries (`required=False`: reported and logged only, for answers nobody
        can follow up)."""
        value = _value(backend, owner)
        ids = [rid for rid in dict.fromkeys(ids) if rid and len(rid) <= MAX_ID_CHARS]
        # Not required: one try, so an answer nobody can follow is not held up by a slow store.
        tries = self.attempts if required else 1
        results = await asyncio.gather(
            *(self._retrying(functools.partial(self._claim, rid, value, owner), tries) for rid in ids), return_exceptions=True
        )
        for rid, result in zip(ids, results, strict=True):
            if isinstance(result, OwnerConflict):
                self._event("learn", "conflict")
                log.warning("response affinity: %r is recorded for another owner than %r; not re-assigned", rid, owner)
                raise result
        for rid, result in zip(ids, results, strict=True):
            if isinstance(result, StoreError):
                self._failed("learn", result)
                log.info("response affinity: no record written for %r (backend %r)", rid, backend)
                if required:
                    # The message names no id: the id itself is what must not reach the client.
                    raise RecordFailed(
                        "the gateway could not record who owns this answer in time, so it is not released "
                        "(nobody could follow it up); try again",
                        retry_after_s=1,
                    ) from None
            elif isinstance(result, BaseException):
                raise result
            else:
                self._event("learn", "ok")

    async def _claim(self, rid: str, value: bytes, owner: str) -> None:
        key = _PREFIX + rid
        for _ in range(3):
            if await self.store.add(key, value, self.ttl_s, replicas=self.replicas):
                return
            raw = await self.store.get(key)
            if raw is None:
                continue  # it expired (or was forgotten) between the two calls: try to take it again
            if _holder(raw).owner != owner:
                raise OwnerConflict("this answer names a response or conversation that belongs to another owner; "
                                    "it is not released")
            # ours: a conversation in use stays known (and a write whose replicas did not all
            # acknowledge it in an earlier try is acknowledged now)
            await self.store.set(key, value, self.ttl_s, replicas=self.replicas)
            return
        raise StoreError(f"the record of {rid!r} kept disappearing while it was written")

    async def _retrying(self, step: Callable[[], Awaitable[T]], attempts: int | None = None) -> T:
        """`step` under the record timeout, tried up to `attempts` times (the policy's by default;
        a write that timed out but landed is found as ours on the next try). Raises the last
        StoreError."""
        last: StoreError | None = None
        for i in range(self.attempts if attempts is None else attempts):
            if i:
                await asyncio.sleep(_BACKOFF_S * 2 ** (i - 1))
            try:
                async with asyncio.timeout(self.timeout_s):
                    return await step()
            except TimeoutError:
                last = StoreError(f"no answer from the store within {self.timeout_s * 1000:g} ms")
            except StoreError as exc:
                last = exc
        assert last is not None
        raise last

    async def lookup(self, rid: str) -> Holder | None:
        """The holder of `rid`, or None when the gateway has no record of it (never answered here,
        expired, or deleted). Raises MapUnavailable when the store cannot say."""
        if not rid or len(rid) > MAX_ID_CHARS:
            self._event("lookup", "miss")
            return None
        try:
            raw = await self._retrying(lambda: self.store.get(_PREFIX + rid))
        except StoreError as exc:
            self._failed("lookup", exc)
            raise MapUnavailable(
                f"the gateway cannot look up who holds {rid[:80]!r} right now; try again", retry_after_s=1
            ) from None
        if raw is None:
            self._event("lookup", "miss")
            return None
        self._event("lookup", "hit")
        return _holder(raw)

    async def forget(self, rid: str) -> None:
        """Drop `rid` (its response or conversation was deleted); a store failure is reported and
        the record stays until it expires (its backend answers 404 for it meanwhile)."""
        if not rid or len(rid) > MAX_ID_CHARS:
            return
        try:
            await self._retrying(lambda: self.store.delete(_PREFIX + rid))
        except StoreError as exc:
            self._failed("forget", exc)

    async def record_context(self, ids: Sequence[str] | Mapping[str, int], tokens: int, owner: str) -> None:
        """Record that a follow-up of each of `ids` makes its backend read `tokens` tokens of
        stored context (a response's input and output, a conversation's latest), or, `ids` a map
        of stored items to their sizes, that a request naming one makes it read that many. One
        try, a failure logged: the estimate is then the new input alone. (Apart from the holder
        records, whose format replicas of an earlier version read too.)"""
        sizes = ids if isinstance(ids, Mapping) else dict.fromkeys(ids, tokens)
        # The owner: an in-memory map's fair share (owner_of)
        results = await asyncio.gather(
            *(self._retrying(functools.partial(self.store.set, _CONTEXT + rid, f"{n}\n{owner}".encode(), self.ttl_s), 1)
              for rid, n in sizes.items() if rid and len(rid) <= MAX_ID_CHARS), return_exceptions=True)
        for result in results:
            if isinstance(result, StoreError):
                self._failed("learn", result)
            elif isinstance(result, BaseException):
                raise result

    async def context(self, rid: str) -> int:
        """The tokens of stored context a follow-up of `rid` makes its backend read (0: unknown)."""
        if not rid or len(rid) > MAX_ID_CHARS:
            return 0
        try:
            raw = await self._retrying(lambda: self.store.get(_CONTEXT + rid), 1)
        except StoreError as exc:
            self._failed("lookup", exc)
            return 0
        head = (raw or b"").partition(b"\n")[0]
        return int(head) if head.isdigit() and len(head) < 12 else 0

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
            log.warning("response affinity store failed (%s) after %d tries: %s", op, self.attempts, exc)


@dataclass(slots=True)
class Learner:
    """One request's handle on the map: the owner is bound, the backend comes with each answer."""

    affinity: Affinity
    owner: str
    claimed: set[str] = field(default_factory=set)  # ids this request recorded already (a stream's events repeat them)
    item_sizes: dict[str, int] = field(default_factory=dict)  # its stored items' sizes as recorded (they grow as a stream goes)
    followable: list[str] = field(default_factory=list)  # its response's and conversation's ids, once recorded
    sized: bool = False  # their context size was recorded (from the answer's usage)

    def unsized(self) -> bool:
        """Whether a follow-up of this answer could be made and its context size is unknown: the
        answer came without usage (its client left mid-stream, a background answer is `queued`)."""
        return bool(self.followable) and not self.sized

    async def size(self, tokens: int) -> None:
        """Record `tokens` (what the request was charged: its prompt and what it streamed) as the
        context a follow-up makes the backend read, where no usage said it. A follow-up of an
        answer whose client left after its first delta was charged its 26 new tokens of a
        10,000-token context, and so was each of its own follow-ups (review helper's repro)."""
        if tokens > 0 and self.unsized():
            self.sized = True
            await self.affinity.record_context(self.followable, tokens, self.owner)

    async def learn(self, response: Mapping[str, Any], backend: str) -> None:
        """Record the ids `response` (a Responses object, or the part of one a stream's event
        adds) makes `backend` hold: its own, its conversation's, its stored output items' and, in
        the migration mode, the previous response it continued (adopted when it had no record).
        Raises RecordFailed or OwnerConflict: then the answer must not reach the client. A
        `store: false` answer without a conversation can be followed by nobody, so its record is
        not required; nor are its items' (a miss there makes only the owner's own later
        `item_reference` a 404, never another tenant's)."""
        own = held_ids(response)
        held = list(own)
        prev = response.get("previous_response_id")
        if self.affinity.adopt_unknown and isinstance(prev, str) and prev:
            held.append(prev)
        ids = [rid for rid in held if rid not in self.claimed]
        sizes = held_items(response)
        items = [rid for rid in sizes if rid not in self.claimed]
        # An item's size grows as a stream goes (recorded at output_item.added, whole at completed)
        grown = {rid: n for rid, n in sizes.items() if n > self.item_sizes.get(rid, 0)}
        required = response.get("store") is not False or conversation_id(response) is not None
        writes = [self.affinity.record(ids, backend, self.owner, required=required)] if ids else []
        if items:
            writes.append(self.affinity.record(items, backend, self.owner, required=False))
        if grown:
            writes.append(self.affinity.record_context(grown, 0, self.owner))
            self.item_sizes.update(grown)
        usage = usage_of(response)
        tokens = usage["total_tokens"] if usage is not None else 0
        if own and required:
            self.followable.extend(rid for rid in own if rid not in self.followable)
            if tokens > 0:
                # A follow-up makes the backend read this much again: charged with its new input (pinning.pin)
                writes.append(self.affinity.record_context(own, tokens, self.owner))
                self.sized = True
        if len(writes) == 1:
            await writes[0]
        elif writes:
            await asyncio.gather(*writes)
        self.claimed.update(ids, items)
