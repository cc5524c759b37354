"""Live stream sharing for single flight: a streamed leader's bytes, teed to its streamed followers.

The leader of a streamed flight answers through a TeeSink, which copies every byte its own client
gets into the flight's Broadcast. A streamed follower reads that Broadcast with `follow()`: what
was already sent first, then each write as it arrives, so its first token comes within a few ms
of the leader's. The bytes are the leader's as they are (no re-encoding), [DONE] included.

Outcomes, from a follower's point of view:
- the leader ended its stream (`end()`): the follower got the same stream, and ends too;
- the leader failed after content reached its client: the follower gets the same error event and
  no [DONE] (nothing is ever retried after a byte reached a client);
- the leader's client went away after content: the stream goes on for the followers (TeeSink
  detaches from that client; the cache stage (stage.py) keeps the relay running) and ends as it would have;
- the leader's key stopped working after content (revoked, rotated away, expired): its client's
  stream ends with the error, and the stream goes on for the followers (`TeeSink.hand_off`);
- the leader failed before any content (all backends failed, a rejected request, a non-streamed
  answer, its client went away before any content, or the flight ended without a stream): the
  follower, which has sent nothing yet, goes upstream itself (`follow()` returns False).

Heartbeats the leader sends while it waits for its first token are not passed on: a follower
commits its headers only with the first content, so that one which goes upstream itself can
still answer with its own status and headers.

Nobody waits on one client, the leader's included: once the leader's client falls behind (its
socket's buffer full), its bytes queue in a tap of its own, written by a task at the client's
pace, and the stream goes on at the backend's for the followers, the stored answer and the
backend's slot. (A leader that read nothing held its streamed followers to its pace and its
non-streamed ones to a 504.) That tap is bounded like a follower's, and ends with an error event
once the client's deadline passes. Over a Broadcast that keeps no history, the same TeeSink
decouples any stream from its client (cache/stage.py): a slow reader holds no backend slot.

Memory: every history and every client's backlog of the process counts in one Budget, per owner
(a tenant); past it, the owner holding the most gives back (Budget.reclaim), never a client that
keeps up.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import orjson

from ..errors import GatewayError, UpstreamError, UpstreamTimeout
from ..pipeline.call import CacheResult, Call, Finish, key_live, revoked
from ..web.drain import cut_by_shutdown, shutdown_error
from ..web.sink import Sink, SinkWrapper
from ..wire.openai_wire import SSE_HEARTBEAT, SSEDecoder, event_data
from .budget import Budget, Holder

__all__ = ["Broadcast", "TeeSink", "follow", "owner_of", "waited_for_leader", "DEFAULT_MAX_BYTES"]

# What one broadcast keeps for late joiners, and what one client may fall behind by (a follower,
# or any stream's own client: cache/stage.py decouples every stream from its client).
DEFAULT_MAX_BYTES = 8 << 20
_SLICE = 64 << 10  # a tap's backlog is written this much at a time


_OPEN, _DONE, _FAILED, _ABANDONED = "open", "done", "failed", "abandoned"


class _Tap:
    """One client's place in a Broadcast (a follower's, or its leader's own once it fell behind):
    the bytes it has not written yet, the history it joined with read in place (the Broadcast's
    own list, from `_at` to `_end`) and what came after in a queue of its own. What it holds beyond
    that history (`counted`) is counted in the process's Budget, under its owner (`_holder`). A
    copy of the history's list per follower was 8 bytes an event each: 200 followers of a
    54,000-event stream held 85 MiB the budget never saw (review helper's repro)."""

    __slots__ = ("_hist", "_at", "_end", "_queue", "size", "counted", "uncounted", "waiter", "overflow", "_budget",
                 "_holder", "_closed")

    def __init__(self, history: list[bytes], size: int, budget: Budget, owner: object) -> None:
        self._at, self._end = 0, len(history)
        # The Broadcast's list (it only grows), held only while part of it is still to be written:
        # one joined before the first byte holding it would keep a released history alive.
        self._hist: list[bytes] | None = history if self._end else None
        self._queue: deque[bytes] = deque()
        self.size = size
        self.counted = 0
        self.uncounted = size  # the history it joined with, pending first: the Broadcast's bytes
        self._budget = budget
        self._holder = budget.holder(owner)
        self._holder.taps.add(self)
        self._closed = False
        self.waiter: asyncio.Future[None] | None = None
        self.overflow = False

    @property
    def pending(self) -> bool:
        """Whether it has bytes left to write."""
        return self._at < self._end or bool(self._queue)

    def add(self, data: bytes) -> None:
        self._queue.append(data)
        n = len(data)
        self.size += n
        self.counted += n
        self._holder.held += n
        self._budget.used += n

    def _give(self, n: int) -> None:
        """`n` bytes it held leave the budget."""
        self.counted -= n
        self._holder.held -= n
        self._budget.used -= n

    def drop(self) -> None:
        """Let go of what it holds (cut off, or gone)."""
        self._hist, self._at, self._end = None, 0, 0
        self._queue.clear()
        self.size = self.uncounted = 0
        if self.counted:
            self._give(self.counted)

    def cut(self) -> None:
        """Too far behind: cut off (its writer ends its client's stream with an error event)."""
        self.overflow = True
        self.drop()
        self.wake()

    def close(self) -> None:
        """It left its Broadcast: nothing of it stays in the budget."""
        self.drop()
        if not self._closed:
            self._closed = True
            self._holder.taps.discard(self)
            self._budget.forget(self._holder)

    def _next(self) -> bytes:
        if self._at < self._end:
            assert self._hist is not None
            piece = self._hist[self._at]
            self._at += 1
            if self._at == self._end:
                self._hist = None  # read through: the history is the Broadcast's alone again
            return piece
        return self._queue.popleft()

    def _peek_len(self) -> int:
        if self._at < self._end:
            assert self._hist is not None
            return len(self._hist[self._at])
        return len(self._queue[0])

    def take(self, limit: int = _SLICE) -> bytes:
        """What is pending, up to `limit` bytes (at least one piece), as one write: a backlog goes
        out a slice at a time, each waiting for the client. Joined whole, a follower's 8 MiB of
        history was a copy of its own, and another in its socket's buffer: 40 followers that read
        nothing held 550 MB over a 64 MiB budget."""
        out, n = list[bytes](), 0
        while self.pending and (not out or n + self._peek_len() <= limit):
            piece = self._next()
            out.append(piece)
            n += len(piece)
        self.size -= n
        freed = max(0, n - self.uncounted)  # what it held beyond the history leaves the budget
        self.uncounted = max(0, self.uncounted - n)
        if freed:
            self._give(freed)
        return out[0] if len(out) == 1 else b"".join(out)

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


class Broadcast:
    """The leader's stream, for followers: a history for late joiners, and one tap per follower.

    Bounded: once the history passes `max_bytes` it is dropped (later requests wait for the stored
    answer, or go upstream themselves); a follower that falls `max_bytes` behind is cut off with
    an error event. All histories and backlogs of the process together are held to the `budget`
    (Budget.reclaim: whoever holds the most gives back; 10 followers that read nothing held 27 MB
    of one 5.8 MB answer, outside any bound but their own 8 MiB each). The leader never waits for
    a follower. `release()` gives the history back when the flight ends.

    `owner`: whom its history and its leader's backlog count for in the budget (the leader's
    tenant; the flight itself when None). `history=False`: a stream nobody joins (a client
    decoupled from its relay, cache/stage.py), which keeps nothing but its client's backlog.
    """

    __slots__ = (
        "state", "started", "include_usage", "max_bytes", "_budget", "_owner", "_holder", "_history",
        "history_bytes", "_taps", "_own", "error",
    )

    def __init__(self, *, include_usage: bool = False, max_bytes: int = DEFAULT_MAX_BYTES, budget: Budget | None = None,
                 owner: str | None = None, history: bool = True) -> None:
        self.state = _OPEN
        self.started = False  # content reached the leader's client
        self.include_usage = include_usage  # the leader asked for a usage chunk
        self.max_bytes = max_bytes
        self._budget = budget if budget is not None else Budget()
        self._owner: object = owner if owner is not None else self
        self._history: list[bytes] | None = [] if history else None
        self._holder = self._budget.holder(self._owner) if history else None  # the history's, until released
        self.history_bytes = 0
        self._taps: set[_Tap] = set()
        self._own: _Tap | None = None  # the leader's client's tap, once it fell behind (not a follower)
        self.error: GatewayError | None = None  # what ends a failed stream (each follower's sink frames it)

    def __len__(self) -> int:
        """Followers attached now."""
        return len(self._taps) - (self._own is not None)

    @property
    def joinable(self) -> bool:
        return self.state in (_OPEN, _DONE) and self._history is not None

    def publish(self, data: bytes) -> None:
        """Bytes the leader's client got."""
        if self.state is not _OPEN or not data:
            return
        self.started = True
        n = len(data)
        budget, holder = self._budget, self._holder
        if self._history is not None and holder is not None:
            self._history.append(data)
            if not self.history_bytes:
                holder.streams.add(self)
            self.history_bytes += n
            holder.held += n
            budget.used += n
            budget.histories += n
            if self.history_bytes > self.max_bytes:
                self.release()
        for tap in self._taps:
            if tap.overflow:
                continue
            tap.add(data)
            if tap.size > self.max_bytes:
                tap.cut()
            else:
                tap.wake()
        if budget.used > budget.limit:
            budget.reclaim(holder)

    def finish(self) -> None:
        """The leader's stream ended (with [DONE], or after an error event it passed through)."""
        if self.state is _OPEN:
            self.state = _DONE if self.started else _ABANDONED
            self._wake_all()

    def fail(self, err: GatewayError) -> None:
        """The leader's stream failed: followers that got content get `err` as an error event;
        the others go upstream themselves."""
        if self.state is _OPEN:
            if self.started:
                self.state, self.error = _FAILED, err
            else:
                self.state = _ABANDONED
            self._wake_all()

    def abandon(self) -> None:
        """The leader answered without a stream (an error status, or a whole body)."""
        self.fail(UpstreamError("the shared stream ended without an answer"))

    def close(self) -> None:
        """The flight is over (however it ended): nobody waits on an open stream after this."""
        self.fail(UpstreamError("the stream this request shared ended early (the request streaming it failed or went away)"))

    def release(self) -> None:
        """Drop the history (nobody joins after this); the taps keep what they have not written."""
        holder = self._holder
        self._history = None
        if holder is not None:
            self._holder = None
            n = self.history_bytes
            holder.held -= n
            holder.streams.discard(self)
            self._budget.used -= n
            self._budget.histories -= n
            self._budget.forget(holder)
            self.history_bytes = 0

    def join(self, owner: str | None = None) -> _Tap | None:
        """A tap that starts with everything sent so far, its backlog counted for `owner` (the
        follower's tenant; this flight when None); None when this stream cannot be shared."""
        if not self.joinable:
            return None
        assert self._history is not None
        tap = _Tap(self._history, self.history_bytes, self._budget, owner if owner is not None else self)
        self._taps.add(tap)
        return tap

    def lag(self) -> _Tap:
        """A tap for the leader's own client, which fell behind: what is published from now on
        queues there, bounded like a follower's (not a follower: `len` does not count it)."""
        tap = self._own = _Tap([], 0, self._budget, self._owner)
        self._taps.add(tap)
        return tap

    def leave(self, tap: _Tap) -> None:
        self._taps.discard(tap)
        if tap is self._own:
            self._own = None
        tap.close()

    def _wake_all(self) -> None:
        for tap in self._taps:
            tap.wake()


class TeeSink(SinkWrapper):
    """The leader's Sink, copying what its client gets into a Broadcast (see the module docstring).

    While its client keeps up, each write goes straight to it. Once the client falls behind, its
    bytes queue in a tap of their own (`Broadcast.lag`) and a task writes them at the client's
    pace (`settle()` waits for it): the relay never waits on this client. When the leader's client
    goes away after content reached followers, the sink detaches from it (`detached`) and the
    stream goes on for the followers alone: one caller leaving must not cut the answers of others
    (cache/stage.py keeps the relay running for them).

    Over a Broadcast that keeps no history (nobody joins it), it decouples any stream from its
    client the same way (cache/stage.py): the relay, the backend's slot and the admission place
    are not held to a slow client's pace. `deadline` (the loop's time): the client's own, past
    which a backlog still unwritten ends with an error event, as a follower's does."""

    __slots__ = ("_bc", "detached", "lost", "_behind", "_writer", "_ended_by", "_deadline")

    def __init__(self, inner: Sink, broadcast: Broadcast, deadline: float | None = None) -> None:
        super().__init__(inner)
        self._bc = broadcast
        self.detached = False
        self.lost: Finish | None = None  # how the leader's client lost its stream, when it did
        self._behind: _Tap | None = None  # the leader's client's backlog, once it fell behind
        self._writer: asyncio.Task[None] | None = None
        self._ended_by: GatewayError | None = None  # what ends the leader's client's stream early (hand_off)
        self._deadline = deadline

    def keeps_followers(self) -> bool:
        """Whether the stream must go on without the leader's client: followers hold part of it."""
        return self._bc.started and len(self._bc) > 0 and self._bc.state is _OPEN

    def detach(self) -> None:
        """The leader's client is gone: from now on only the followers get the stream."""
        self.detached = True
        if self._writer is not None:
            self._writer.cancel()
        if self._behind is not None:  # its backlog leaves the budget now (a writer cancelled before it ran never would)
            self._bc.leave(self._behind)

    async def hand_off(self, err: GatewayError) -> bool:
        """The leader's key stopped working mid-stream: its client's stream ends with `err`, and
        while followers read it the stream goes on for them (a revoked key must not cut the answers
        of the other callers who share its flight)."""
        if not self.keeps_followers():
            return False
        if not self.detached:
            self.lost, self.detached = Finish.CUT, True
            if self._behind is not None:  # its writer ends that client's stream, the rest of its backlog dropped
                self._ended_by = err
                self._behind.wake()
            else:  # in a task of its own: a slow client must not hold the followers' stream
                self._writer = asyncio.get_running_loop().create_task(self._end_with(err))
        return True

    async def _end_with(self, err: GatewayError) -> None:
        try:
            await self._inner.fail(err)
        except ConnectionError:
            self.lost = Finish.CLIENT_DISCONNECT

    async def write(self, data: bytes) -> None:
        bc = self._bc
        content = bc.started or data != SSE_HEARTBEAT
        if content and self._behind is None and not self.detached and self._inner.would_wait(len(data)):
            self._fall_behind()
        if content:
            bc.publish(data)  # followers (and a leader's client that fell behind) first
            if self._behind is not None and self._behind.overflow and not self.detached:
                self.lost, self.detached = Finish.CUT, True  # its writer ends its stream with an error event
        if self.detached:
            if not self.keeps_followers():  # the last follower left too: stop the upstream call
                raise ConnectionResetError("the leader's client and every follower of its stream went away")
            return
        if self._behind is not None:
            return  # queued for the leader's client's writer
        try:
            await self._inner.write(data)
        except ConnectionError:  # reset, or lost while the write waited on a slow reader
            if not self.keeps_followers():
                raise
            self.detach()  # the leader's client left mid-stream; its followers read on

    def _fall_behind(self) -> None:
        """The leader's client stopped keeping up: its bytes queue from now on, and a task writes them."""
        self._behind = tap = self._bc.lag()
        self._writer = asyncio.get_running_loop().create_task(self._catch_up(tap))

    async def _catch_up(self, tap: _Tap) -> None:
        """Write the leader's client its backlog at its own pace, then end its stream as the
        broadcast ended (each write bounded by the sink: web/sink.py CLIENT_READ_S), or with an
        error event once its deadline passed."""
        inner = self._inner
        try:
            try:
                async with asyncio.timeout_at(self._deadline):
                    err = await self._backlog(tap)
            except TimeoutError:
                self.lost, self.detached = Finish.CUT, True
                err = UpstreamTimeout("the request's deadline passed mid-stream")
            if err is None:
                await inner.end()
            else:
                self._bc.leave(tap)  # the rest of its backlog is dropped, not held while the error waits on the client
                await inner.fail(err)
        except ConnectionError:  # the client left: the relay goes on only while followers read (write())
            self.lost, self.detached = Finish.CLIENT_DISCONNECT, True
        finally:
            self._bc.leave(tap)

    async def _backlog(self, tap: _Tap) -> GatewayError | None:
        """Write the backlog as the client takes it, until the stream ended: what ends the
        client's stream (None: the broadcast's end)."""
        bc = self._bc
        while True:
            if self._ended_by is not None:
                return self._ended_by
            if tap.pending:
                await self._inner.write(tap.take())
            elif tap.overflow:
                self.lost, self.detached = Finish.CUT, True
                return UpstreamError("this client fell too far behind its stream")
            elif bc.state is _DONE:
                return None
            elif bc.state is not _OPEN:
                self.lost = Finish.CUT
                return bc.error or UpstreamError("the stream ended early")
            else:
                await tap.wait()

    async def settle(self) -> None:
        """Wait until the leader's client has had the rest of its stream (nothing to wait for
        unless it fell behind). Cancelling the caller stops the writer."""
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)  # stopped (detach) is ended too

    async def drain(self, timeout_s: float) -> None:
        if self.detached or self._behind is not None:
            return
        try:
            await self._inner.drain(timeout_s)
        except ConnectionError:  # the leader's client stopped reading: its followers read on
            if not self.keeps_followers():
                raise
            self.detach()

    async def end(self) -> None:
        followed = self.keeps_followers()
        self._bc.finish()
        if self.detached or self._behind is not None:
            return  # the writer ends the leader's stream once it caught up
        try:
            await self._inner.end()
        except ConnectionError:
            if not followed:
                raise
            self.detach()  # gone at the very end: the answer is whole for the followers (and the cache)

    async def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self._bc.abandon()
        if not self.detached:
            await self._inner.send(status, body, content_type)

    async def fail(self, err: GatewayError) -> None:
        self._bc.fail(err)
        if not self.detached and self._behind is None:
            await self._inner.fail(err)


class _DropUsage:
    """Drops the usage-only chunk (empty choices) from a stream, for a follower that did not ask
    for usage while its leader did (a client indexing choices[0] would break on it)."""

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = SSEDecoder()

    def __call__(self, data: bytes) -> bytes:
        if b'"usage"' not in data and not self._decoder.pending:
            return data
        out = []
        for ev in self._decoder.feed(data):
            payload = event_data(ev)
            if payload is not None and b'"usage"' in payload and payload != b"[DONE]":
                try:
                    obj = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    obj = None
                if isinstance(obj, dict) and obj.get("choices") == [] and isinstance(obj.get("usage"), dict):
                    continue
            out.append(ev)
        return b"".join(out)


def owner_of(call: Call) -> str | None:
    """Whom a call's bytes count for in the Budget: its tenant."""
    return call.tenant.name if call.tenant is not None else None


def wants_usage(call: Call) -> bool:
    """Whether the client's stream carries a usage chunk: one it asked for itself (a quota's
    request for one, which the client does not see, sets `strip_usage`)."""
    opts = call.body.get("stream_options") if call.stream else None
    return isinstance(opts, dict) and bool(opts.get("include_usage")) and not call.asked.strip_usage


async def follow(bc: Broadcast, call: Call, sink: Sink) -> bool:
    """Answer a streamed follower from its leader's live stream, within the follower's deadline.

    True when the follower was answered (its stream ended as the leader's did, or was cut with an
    error event after content reached it, its key revoked meanwhile included; `call.out.finish`
    says which, "client_disconnect" included); False when nothing was sent and the follower must
    go upstream itself.
    """
    tap = bc.join(owner_of(call))
    if tap is None:
        return False
    drop = _DropUsage() if bc.include_usage and not wants_usage(call) else None
    sent = False
    joined = time.perf_counter()
    try:
        try:
            async with asyncio.timeout(max(0.0, call.remaining_s())):
                while True:
                    if not key_live(call):  # this follower's key stopped working: no more of it goes out
                        if not sent:
                            return False  # its own relay refuses it (a 401), sending nothing
                        await _cut(call, sink, revoked())
                        return True
                    if tap.pending and (sent or bc.state is not _FAILED):
                        data = tap.take()
                        if drop is not None:
                            data = drop(data)
                        if not data:
                            continue
                        if not sent:
                            sent = True
                            # A hit like any (docs/api.md): backend `cache` in the header, the logs
                            # and the metrics. Its wait for the leader's first token is queue time,
                            # the rest of the stream its leader's decode (observer.stages).
                            call.cache.result, call.out.backend = CacheResult.HIT, "cache"
                            waited_for_leader(call, sink, joined)
                            call.timing.ttft_s = time.perf_counter() - call.timing.t0
                            sink.set_header("x-gateway-cache", CacheResult.HIT)
                            sink.set_header("x-gateway-backend", "cache")
                        await sink.write(data)
                        continue
                    if tap.overflow:
                        if not sent:
                            return False
                        await _cut(call, sink, UpstreamError("this client fell too far behind the stream it shared"))
                        return True
                    if bc.state is _DONE:
                        call.out.finish = Finish.OK
                        await sink.end()
                        return True
                    if bc.state is not _OPEN:  # failed or abandoned
                        if not sent:
                            return False
                        # The sink frames it: an SSE error event for chat, an `error` event on /v1/responses.
                        await _cut(call, sink, bc.error or UpstreamError("the stream this request shared ended early"))
                        return True
                    await tap.wait()
        except TimeoutError:
            if not sent:
                return False  # the caller's own relay answers for the deadline (a 504)
            await _cut(call, sink, UpstreamTimeout("the request's deadline passed mid-stream"))
            return True
    except ConnectionError:  # reset, or lost while a write waited on a slow reader
        call.out.finish = Finish.CLIENT_DISCONNECT
        return True
    except asyncio.CancelledError as exc:
        if not cut_by_shutdown(exc):
            raise  # the client left
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # handled: the shutdown's error ending is written here
        if not sent:
            raise shutdown_error() from None  # a 503 (an error event once its heartbeat began the stream)
        await _cut(call, sink, shutdown_error())
        return True
    finally:
        bc.leave(tap)
        if not sent:  # it waited for a stream that never came (then goes upstream itself): queue time too
            waited_for_leader(call, sink, joined)


def waited_for_leader(call: Call, sink: Sink, since: float) -> None:
    """A single flight's follower waited for its leader since `since` (perf_counter): queue time
    (the `queue` stage, x-gateway-queue-ms), as a wait for admission is, not the gateway's own work."""
    timing = call.timing
    timing.queue_ms += (time.perf_counter() - since) * 1000
    sink.set_header("x-gateway-queue-ms", f"{timing.queue_ms:.1f}")


async def _cut(call: Call, sink: Sink, err: GatewayError) -> None:
    """End a follower's stream after content reached it: its endpoint's error event, and the
    request log's word on why (as a relay's cut stream has: relay/rescue.py)."""
    call.out.finish, call.out.error = Finish.CUT, err.message
    await sink.fail(err)
