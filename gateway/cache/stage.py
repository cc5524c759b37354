"""The cache stage: answer from the cache, or have the relay answer and store what it answered.

Single flight lives here, in both of its forms: identical misses in this process make one
upstream call (cache.SingleFlight; a streamed answer is shared live, broadcast.py), and on a shared
store identical misses in other processes wait for this one's stored answer (shared_flight.py).

A miss joins a flight only on terms no worse than its own (cache.Terms: its leader's deadline is
no shorter, its band no lower); else it goes upstream itself. A `cache-control: no-store` miss
never leads others, in this process or across them (it keeps no lock): it stores nothing for
them to wait on; it may follow them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..admission.gate import BANDS
from ..config.runtime import CachePlan, Route, Runtime
from ..errors import Unavailable
from ..pipeline.call import CacheResult, Call, Finish, key_live, revoked
from ..relay.attempt import ClientGone, client_write
from ..relay.context import RelayContext
from ..tenants.auth import Tenant
from ..tenants.priority import Band
from ..web.drain import SHUTDOWN_CUT, cut_by_shutdown
from ..web.sink import Sink, SinkWrapper
from . import shared_flight as cache_flight
from .broadcast import Broadcast, TeeSink, follow, owner_of, waited_for_leader, wants_usage
from .core import Cache, Flight, Terms
from .entry import Entry

__all__ = ["CacheStage", "Produce"]

# The stage after the cache: answers the call into the sink it is given (the relay).
Produce = Callable[[Sink], Coroutine[Any, Any, None]]

_RANK = {band: i for i, band in enumerate(BANDS)}  # a band's place in the admission queues: 0 is served first
_WAITED_S = 0.001  # time in a flight's hold past which its leader had waited for another (never, without an await)


def _terms(call: Call) -> Terms:
    """The call's terms in a flight: its whole deadline, and its band's rank (intake set both)."""
    band = call.ticket.band if call.ticket is not None else Band.DEFAULT
    return Terms(call.timeout_ms(), _RANK[band])


async def _still_held(rt: Runtime, rid: str) -> bool:
    """Whether the id a stored answer hands out is still the gateway's record (a Response: not
    deleted since, nor expired): a follow-up on an id its backend no longer holds would be a 404.
    A store that cannot say counts as no."""
    try:
        return await rt.affinity.lookup(rid) is not None
    except Unavailable:
        return False


class CacheStage:
    """One per process: the lookup, the flights, the store, and the `lookup` metric."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: RelayContext) -> None:
        self.ctx = ctx

    async def serve(self, rt: Runtime, call: Call, route: Route, tenant: Tenant, sink: Sink, produce: Produce) -> None:
        """Answer `call` into `sink`: a cache hit, a flight's answer, or `produce`'s (stored)."""
        plan = rt.cache_plan(call, route, tenant)
        cache = rt.cache
        if plan.key is None or cache is None:
            self._count(call, sink, CacheResult.BYPASS)
            await self._produce(call, sink, produce)
            return
        entry = await cache.lookup(plan.key)
        if entry is not None and (rid := call.endpoint.held_id(entry)) is not None and not await _still_held(rt, rid):
            # Its id was deleted (or forgotten): a fresh answer, stored over it. Deleted first: on
            # a shared store the miss looks the key up again once it holds the lock, and replayed it.
            entry = None
            await cache.forget(plan.key)
        if entry is None:
            entry = await self._miss(call, route, cache, plan, plan.key, rt.policy.cache.lock_ms / 1000, sink, produce)
        if entry is not None:
            await self._replay(call, entry, sink)

    async def explain(self, rt: Runtime, call: Call, route: Route, tenant: Tenant) -> dict[str, Any]:
        """The stage's part of /v1/route/explain: hit or miss now (nothing stored), and why not cached."""
        plan = rt.cache_plan(call, route, tenant)
        if plan.key is not None and rt.cache is not None:
            call.cache.result = CacheResult.MISS if await rt.cache.lookup(plan.key) is None else CacheResult.HIT
        return {"cache": call.cache.result, "cache_reason": plan.reason}

    async def _miss(
        self, call: Call, route: Route, cache: Cache, plan: CachePlan, key: str, lock_s: float, sink: Sink, produce: Produce
    ) -> Entry | None:
        """Lead the flight for `key` or follow the one in progress. Returns an entry still to be
        replayed to the client, or None once the client has its answer."""
        if plan.store:
            call.ask_usage()  # what is stored has the usage a later hit may be asked for
        terms = _terms(call)
        # A stream some candidate's leg does not store (a Messages stream): shared live, never waited for.
        publishes = not call.stream or call.endpoint.name not in route.pool(call.cls, call.endpoint.name).unstored_streams
        joined = time.perf_counter()
        async with self.ctx.flight.hold(key, wait_s=call.remaining_s(), stream=call.stream, include_usage=wants_usage(call),
                                        terms=terms, stores=plan.store, publishes=publishes, owner=owner_of(call)) as flight:
            # A follower's wait for its leader's answer is queue time, not the gateway's own work;
            # so is a leader's that waited (it followed a flight whose leader's client left, then
            # took it over). A leader that did not wait spent µs of dict work here: not counted.
            if not flight.leader or time.perf_counter() - joined >= _WAITED_S:
                waited_for_leader(call, sink, joined)
            if not flight.leader:
                if flight.stream is not None and await follow(flight.stream, call, sink):
                    self.ctx.metrics.lookup[CacheResult.HIT].inc()  # answered from its leader's live stream
                    return None
                if flight.entry is not None:
                    return flight.entry
            # The leader, or a follower whose leader stored (or streamed) nothing.
            tee = TeeSink(sink, flight.stream, _deadline(call)) if flight.leader and flight.stream is not None else sink
            lagging = tee if isinstance(tee, TeeSink) else None
            token, entry = None, None
            # Another process may be answering it: wait for its answer, or lock it as ours. Not a
            # leader beside a flight here: it would wait on that one's lock, on the terms it did not join.
            if flight.leader and not flight.beside and cache_flight.shared(cache):
                claimed = time.perf_counter()
                token, entry = await cache_flight.claim(cache, key, wait_s=call.remaining_s(), lock_s=lock_s, terms=terms,
                                                        take=plan.store and publishes)
                if entry is not None:  # another replica's leader answered it: waited for, as a follower here is
                    waited_for_leader(call, sink, claimed)
            if entry is not None:
                flight.publish(entry)
                flight.finish()  # complete: its followers need not wait for this client to read it
                await self._replay(call, entry, tee)
            else:
                try:
                    await self._lead_and_land(call, cache, plan, key, tee, produce, flight, token)
                except ClientGone:
                    if lagging is None or not _cut_off(call, lagging):
                        raise
        # The flight is over, its answer stored and handed to its followers: only now does a
        # leader's client that fell behind get the rest of its stream, holding nobody else.
        if lagging is not None:
            await _settle(call, lagging)
        return None

    async def _lead_and_land(self, call: Call, cache: Cache, plan: CachePlan, key: str, sink: Sink, produce: Produce,
                             flight: Flight, token: str | None) -> None:
        """Answer as the flight's leader, then store the answer and give back the lock (`token`).
        A whole answer lands before its client is sent it (_Landing): a client that reads slowly,
        or never, holds none of the flight's followers here or on other replicas."""
        landing = _Landing(call, cache, plan, key, flight, token, self.ctx.carried)
        try:
            self._count(call, sink, CacheResult.MISS)
            call.cache.capture = cache.max_entry_bytes
            if not isinstance(sink, TeeSink):  # a stream's followers read it as it comes (TeeSink)
                call.cache.land = landing.land
            await self._lead(call, sink, produce)
        except BaseException as exc:
            # Its client gets no more; but one cut off (too far behind) gets its error event (_miss).
            if isinstance(sink, TeeSink) and not (isinstance(exc, ClientGone) and sink.lost is Finish.CUT):
                sink.detach()
            raise
        finally:
            # Also when _lead raised: a client that closes its connection as soon as it has
            # the last byte gets this handler cancelled (handler_cancellation) before the
            # store, and a lock let go without the answer stored sends the other replicas'
            # waiting requests upstream again.
            if not landing.landed:
                await landing.land()

    def _count(self, call: Call, sink: Sink, result: CacheResult) -> None:
        call.cache.result = result
        self.ctx.metrics.lookup[result].inc()
        sink.set_header("x-gateway-cache", result)

    async def _replay(self, call: Call, entry: Entry, sink: Sink) -> None:
        """Answer from the cache: the stored answer, or the same answer replayed as a stream.
        Not to a caller whose key stopped working while it waited for a flight's answer (a 401)."""
        if not key_live(call):
            raise revoked()
        call.cache.result, call.out.backend = CacheResult.HIT, "cache"
        sink.set_header("x-gateway-cache", CacheResult.HIT)
        sink.set_header("x-gateway-backend", "cache")
        try:
            body = call.endpoint.replay(entry, stream=call.stream, include_usage=wants_usage(call))
            if call.stream:
                await sink.write(body)
                await sink.end()
            else:
                await sink.send(200, body)
        except ConnectionError:  # reset, or lost while a write waited on a slow reader
            raise ClientGone() from None
        call.out.finish = Finish.OK
        self.ctx.metrics.lookup[CacheResult.HIT].inc()

    async def _lead(self, call: Call, sink: Sink, produce: Produce) -> None:
        """The flight leader's answer. A streamed leader's answer is its followers' too (TeeSink):
        if its own client leaves after content reached them, the relay goes on for them to the
        end, in a task of its own so that the handler's cancellation does not end it. The leader
        is then a client_disconnect, charged the whole answer (the upstream call was its own, and ran)."""
        if not isinstance(sink, TeeSink):
            await self._produce(call, sink, produce)
            return
        task = asyncio.ensure_future(produce(sink))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError as exc:
            if cut_by_shutdown(exc):
                await _shut_down(task)  # the relay writes the error ending, its followers' too
                return
            if task.done() or not sink.keeps_followers():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise
            await self._carry(task, sink)

    async def _produce(self, call: Call, sink: Sink, produce: Produce) -> None:
        """The relay's answer into `sink`, a stream decoupled from its client: a TeeSink over a
        Broadcast of its own, which nobody joins. Once the client falls behind, the relay reads on
        at the backend's pace into a backlog (bounded like a follower's: DEFAULT_MAX_BYTES, and the
        process's Budget), so the backend's slot and the admission place are given back when the
        backend's answer ends, not when a slow client has read it; the rest is written here, at
        the client's pace, within its deadline. A client too far behind is cut off with an error
        event (the upstream call stops). Before, a client that read nothing held its backend's
        slot 60 s a write, and one that read a trickle until its deadline (review helper's repro).
        A flight leader's stream is decoupled already (`_lead`: its TeeSink). A whole answer is
        written once the relay has returned (_Later)."""
        if not call.stream:
            later = _Later(sink)
            await produce(later)
            await later.flush()
            return
        bc = Broadcast(budget=self.ctx.flight.budget, owner=owner_of(call), history=False)
        lag = TeeSink(sink, bc, _deadline(call))
        try:
            await produce(lag)
        except ClientGone:
            if not _cut_off(call, lag):  # the client left
                lag.detach()
                raise
        except BaseException:
            lag.detach()
            raise
        if call.cache.land is not None:  # an answer to store lands before a slow client has read it
            await call.cache.land()
        await _settle(call, lag)

    async def _carry(self, task: asyncio.Task[None], sink: TeeSink) -> None:
        """The leader's client left while followers still read its stream: keep the relay going
        for them (RelayContext.carried, which a shutdown cancels), detached from that client."""
        sink.detach()
        carried = self.ctx.carried
        carried.add(task)
        task.add_done_callback(carried.discard)
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # this handler's client is gone; the work it started is not
        try:
            await task
        except asyncio.CancelledError as exc:  # cancelled again (a shutdown): the followers' stream ends too
            task.cancel(*exc.args)  # with the shutdown's reason: the relay ends it with an error event
            await asyncio.gather(task, return_exceptions=True)
            raise


async def _shut_down(task: asyncio.Task[None]) -> None:
    """A shutdown cut the flight leader's handler: its relay, in `task`, is cut with the same reason
    and ends the stream as any stream cut mid-answer (relay/core.py), for the leader's client and
    its followers; its error (a 503 before anything was sent) is this handler's."""
    current = asyncio.current_task()
    if current is not None:
        current.uncancel()  # handled: the relay's task writes the ending
    task.cancel(SHUTDOWN_CUT)
    try:
        await asyncio.wait([task])
    except asyncio.CancelledError:  # the runner's cleanup, past the grace: nothing more is written
        task.cancel()
        raise
    task.result()


class _Later(SinkWrapper):
    """A whole answer, written to its client once the relay has returned: a large one waits on a
    slow client (up to CLIENT_READ_S a write), and written inside its attempt that wait held the
    backend's slot and the admission place, which the relay gives back when it returns (review
    helper's finding; streams are decoupled by a TeeSink). The answer is in memory either way."""

    __slots__ = ("_held",)

    def __init__(self, inner: Sink) -> None:
        super().__init__(inner)
        self._held: tuple[int, bytes, str] | None = None

    async def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self._held = (status, body, content_type)

    async def flush(self) -> None:
        """Send the answer the relay gave (if any) to the client."""
        if self._held is not None:
            held, self._held = self._held, None
            await client_write(self._inner.send(*held))


def _cut_off(call: Call, sink: TeeSink) -> bool:
    """The relay stopped (ClientGone): True when it was because the client was cut off (too far
    behind its stream, or past its deadline), not gone: its writer ends its stream with an error
    event (TeeSink.settle), and the call is a cut."""
    if sink.lost is not Finish.CUT:
        return False
    call.out.finish = Finish.CUT
    call.out.error = ("the request's deadline passed while its client read" if call.deadline_passed()
                      else "the client fell too far behind its stream")
    return True


def _deadline(call: Call) -> float:
    """The call's deadline on the loop's clock."""
    return asyncio.get_running_loop().time() + call.remaining_s()


async def _settle(call: Call, sink: TeeSink) -> None:
    """A streamed leader's last step: its client has the rest of its stream (TeeSink.settle),
    and the call says how the client's stream ended when it lost it (a cut after it left stays a cut)."""
    await sink.settle()
    if sink.detached and call.out.finish is Finish.OK:
        call.out.finish = sink.lost or Finish.CLIENT_DISCONNECT


class _Landing:
    """A flight leader's last step (`land`), run once: at the end of its block, or for a whole
    answer before it is written to the client (Caching.land, Attempt.deliver). A leader whose
    client did not read its 4.5 MB answer held every identical request, here and on the other
    replicas, for that client's 60 s write bound: they got 504s past their deadlines (review
    helper's repro)."""

    __slots__ = ("_call", "_cache", "_plan", "_key", "_flight", "_token", "_carried", "landed")

    def __init__(self, call: Call, cache: Cache, plan: CachePlan, key: str, flight: Flight, token: str | None,
                 carried: set[asyncio.Task[None]]) -> None:
        self._call, self._cache, self._plan, self._key, self._flight, self._token = call, cache, plan, key, flight, token
        self._carried = carried  # RelayContext.carried: a failed release's retries (a shutdown cancels them)
        self.landed = False

    async def land(self) -> None:
        """Once: store what the call answered (when it may be stored), release the flight's
        followers and give back the lock. The process's own store never suspends, so nothing
        can stop it part way; a shared store's round trips are shielded (a task each, a few µs:
        misses only)."""
        if self.landed:
            return
        self.landed = True
        call, plan, cache, flight = self._call, self._plan, self._cache, self._flight
        call.cache.land = None
        entry = call.cache.entry if plan.store else None
        if cache.store.shared:
            await asyncio.shield(_land(cache, self._key, entry, plan.ttl_s, flight, self._token, self._carried))
        elif entry is not None:  # inline (a coroutine less a miss): this store holds no lock
            await cache.save(self._key, entry, ttl_s=plan.ttl_s)
            flight.publish(entry)
        flight.finish()


async def _land(cache: Cache, key: str, entry: Entry | None, ttl_s: float, flight: Flight, token: str | None,
                carried: set[asyncio.Task[None]]) -> None:
    """A flight leader's last step: store its complete answer (`entry`, None when there is none or
    it may not be stored), hand it to this process's followers, and only then give back the
    cross-process lock (`token`: ours, when we hold it), so a follower elsewhere that sees the
    lock gone finds the answer."""
    try:
        if entry is not None:
            await cache.save(key, entry, ttl_s=ttl_s)
            flight.publish(entry)
    finally:
        if token is not None and not await cache_flight.release(cache, key, token):
            task = asyncio.get_running_loop().create_task(cache_flight.release_later(cache, key, token))
            carried.add(task)
            task.add_done_callback(carried.discard)
