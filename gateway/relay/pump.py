"""The streaming pump: one attempt's stream, from the backend's bytes to the client's, for every
wire format (the endpoint's Monitor says what each event is; wire/monitor.py).

Events pass through as the bytes the backend sent (a continuation's are re-encoded, see
continuation.py). Events before the first output are held back and released with it, so a stream
that stalls or fails early costs the client nothing but time: the relay fails over (AttemptFailed).
One timer, moved as the phases change: the first-output deadline, then the stall deadline after
each event (from live data when a stall could be rescued elsewhere), then a short wait for the
end once the answer finished, all within the request's own deadline. The timer is the backend's:
when it runs out while a write waits on a client slow to read, the wait goes on for the client
(bounded: web/sink.py CLIENT_READ_S) and the timer starts again. After the first output a
broken stream raises Cut (the relay continues it elsewhere or ends it with an error event), except
the backend's own failure event where the format passes it on (the Responses API). An event
that is not JSON is dropped (and counted); the answer around it still reaches the client, but is
not stored in the cache: it may lack what that event carried.
"""

from __future__ import annotations

import asyncio
import time

from ..errors import UpstreamError, UpstreamTimeout
from ..pipeline.call import Finish, key_live, revoked
from ..routing.health import Kind
from ..upstream.client import UpstreamHTTPError, UpstreamResponse
from ..wire.monitor import Verdict
from ..web.sink import CLIENT_READ_S
from ..wire.openai_wire import SSEDecoder, SSEEventTooLarge, event_data
from .attempt import MAX_HELD_BYTES, Attempt, AttemptFailed, Cut, client_write
from .continuation import Mismatch

__all__ = ["Pump"]

_CLIENT_WAIT_S = 0.002  # a write that took longer waited on the client
_AFTER_FINISH_S = 2.0  # how long to wait for a usage chunk, [DONE] or the body's end after the answer finished
_NOISE, _DROP, _MALFORMED, _CONTENT, _DONE, _FAILED = (
    Verdict.NOISE, Verdict.DROP, Verdict.MALFORMED, Verdict.CONTENT, Verdict.DONE, Verdict.FAILED,
)


class Pump:
    """Relays one attempt's 200 stream (`resp`) to the client. `run()` returns the outcome kind
    once the stream ended; raises AttemptFailed before the first output, Cut after it."""

    __slots__ = ("att", "resp", "mon", "timer", "idle_s", "idle_live", "first", "saw_done", "failed", "broke", "held",
                 "held_bytes", "last", "client_ttft", "decoder", "writing", "malformed", "skipping", "unnoted")

    def __init__(self, att: Attempt, resp: UpstreamResponse) -> None:
        call = att.call
        self.att, self.resp = att, resp
        rewrite = att.resume.rewrite if att.resume is not None else None
        self.mon = att.leg.monitor(capture=call.cache.capture, strip_usage=call.asked.strip_usage, rewrite=rewrite, body=call.body,
                                   transcript=call.transcript)
        self.timer = asyncio.timeout_at(att.first_deadline)
        self.idle_s = _idle_s(att)
        # Shorter than the backend's idle_ms: a deadline from live data (health.LIVE_DEADLINE's cut).
        self.idle_live = self.idle_s < att.backend.timeouts.idle_ms / 1000
        self.first = self.saw_done = self.failed = False  # first: the first output reached the client
        self.broke: Cut | None = None  # the backend's failure event mid-stream (the relay ends the stream)
        self.held: list[bytes] = []  # events before the first output, released with it
        self.held_bytes = 0
        self.last = 0.0  # when the last output came (perf_counter)
        self.client_ttft = att.resume is None  # a continuation's first token is the backend's TTFT, not the client's
        self.decoder = SSEDecoder()
        self.writing = False  # a write to the client is under way
        self.malformed = False  # an event was dropped as malformed: the answer may lack part of it
        # A continuation's backend generates output the client already has (a restart regenerates
        # it, a prefill's thinking is dropped): alive, so the stall deadline applies, not the first
        # token's (which cut every long restart and every thinking model's continuation, and
        # blamed the backend continuing it; review helper's repro).
        self.skipping = False
        # The held events' parts of the answer, noted in the transcript only once they reach the
        # client: an attempt that failed before its first output (or lost a hedge) gave the
        # continued stream its id, model and created (review helper's repro).
        self.unnoted: list[dict[str, object]] = []

    async def run(self) -> Kind:
        att = self.att
        cut: Cut | None = None
        try:
            while not await self._timed_read():
                # The bytes were written; only the wait for the client was cut short.
                t = time.perf_counter()
                await client_write(att.sink.drain(CLIENT_READ_S))
                self._waited(time.perf_counter() - t)
                if self._over():
                    break
                self.timer = asyncio.timeout_at(self._next_deadline(asyncio.get_running_loop()))
        except Mismatch as exc:
            if not self.first:
                raise AttemptFailed(UpstreamError(f"backend {att.backend.name!r}: {exc}"), Kind.MISMATCH) from None
            raise  # cannot happen: text is only sent once the prefix matched
        except TimeoutError:
            cut = self._timed_out()
        except SSEEventTooLarge as exc:
            if not self.first:
                raise AttemptFailed(UpstreamError(f"backend {att.backend.name!r}: {exc}"), Kind.TOO_LARGE) from None
            cut = Cut(UpstreamError(f"backend {att.backend.name!r}: {exc}"), Kind.TOO_LARGE)
        except UpstreamHTTPError as exc:
            if not self.first:
                detail = f"{type(exc).__name__}: {exc}"
                raise att.failed(f"{exc.summary} before the {self.mon.first}", Kind.DISCONNECT, detail) from None
            if not self.mon.finished:
                cut = self._cut(f"backend {att.backend.name!r} lost its connection mid-stream")
        else:
            cut = self.broke or self._ended()
        finally:
            if self.mon.usage is not None:
                att.call.out.usage = self.mon.usage
        if cut is not None:
            # Nothing is written about it here: the relay continues the answer elsewhere, or ends the
            # stream with an error event (never [DONE]: a cut stream must not look like a success).
            raise cut
        return await self._end()

    async def _timed_read(self) -> bool:
        """Read the stream under the timer: True once it ended (or the timer ran out on the
        backend: TimeoutError); False when the timer ran out while a write waited on the client,
        which says nothing about the backend."""
        try:
            async with self.timer:
                await self._read()
            return True
        except TimeoutError:
            if not self.writing or self.att.call.deadline_passed():
                raise
            self.writing = False
            return False

    async def _read(self) -> None:
        resp, att = self.resp, self.att
        decoder = self.decoder
        loop = asyncio.get_running_loop()
        while True:
            chunk = await resp.readany()
            if not chunk:
                return
            if not key_live(att.call):  # revoked meanwhile: nothing more of it goes out to this caller
                if not self.first:
                    raise revoked()
                err = revoked()
                if not await att.sink.hand_off(err):
                    self.broke = Cut(err, Kind.KEY_REVOKED)
                    return
                att.call.cache.handed_off = True  # the rest is its flight's followers': read on for them
                att.call.out.error = f"{err.message} (its stream went on for the requests sharing it)"
            out = await self._events(decoder.feed(chunk))
            if out:
                self.writing = True
                t = time.perf_counter()
                await client_write(att.sink.write(b"".join(out)))
                self._waited(time.perf_counter() - t)
                self.writing = False
            if self._over():
                return
            if self.first or self.skipping:
                self.timer.reschedule(self._next_deadline(loop))

    def _waited(self, seconds: float) -> None:
        """A write (or drain) took `seconds`: past a moment, the client was slow to read, and that
        time is neither an inter-token gap nor part of the backend's duration (a client that stopped
        reading for 3 s fed a 2.95 s gap of a backend that sent every token at once; a few such set
        everyone's P99, and the stall and whole-answer deadlines from it)."""
        if seconds > _CLIENT_WAIT_S:
            self.att.client_wait_s += seconds
            if self.last:
                self.last += seconds

    def _over(self) -> bool:
        return self.saw_done or self.failed or self.broke is not None

    def _next_deadline(self, loop: asyncio.AbstractEventLoop) -> float:
        """The timer's next deadline: the first output's, then the stall's, then the end's."""
        att = self.att
        if not self.first and not self.skipping:
            return att.first_deadline
        wait = _AFTER_FINISH_S if self.mon.finished else self.idle_s
        return min(loop.time() + wait, att.call_deadline)

    async def _events(self, events: list[bytes]) -> list[bytes]:
        """The bytes to write now for one read's events (held ones included once released)."""
        att, mon = self.att, self.mon
        out: list[bytes] = []
        for ev in events:
            data = event_data(ev)
            v = _NOISE if data is None else mon.feed(data)  # a comment: keep-alives mean nothing before the first output
            if v is _NOISE:
                if self.first:
                    out.append(ev)
                continue
            if v is _MALFORMED:
                att.m.malformed.inc()
                self.malformed = True
                continue
            if mon.timed:  # the backend's output, even where a continuation skips it: its timing
                self.last = att.observe_content(self.last, client=self.client_ttft)
                self.skipping = not self.first
            if v is _DROP:
                continue
            if v is _DONE:
                self.saw_done = True
                break
            if v is _FAILED:
                if not self.first:
                    raise AttemptFailed(UpstreamError(f"error event before the {mon.first}: {mon.failure}"), Kind.ERROR_EVENT)
                if mon.relays_failure:
                    out.append(ev)  # the backend's own failure event is the end of the client's stream
                    self.failed = True
                else:  # what came before it in this read is written, then the relay ends the stream
                    why = f"backend {att.backend.name!r} sent an error event mid-stream: {mon.failure}"
                    self.broke = Cut(UpstreamError(why), Kind.ERROR_EVENT_MID_STREAM)
                break
            if mon.record is not None and att.call.affinity is not None:
                # Before anything reaches the client: a follow-up can never outrun its record.
                await att.call.affinity.learn(mon.record, att.backend.name)
            sent = len(ev)  # the backend's bytes: what MAX_HELD_BYTES bounds
            if mon.out is not None:
                ev = mon.out  # a translation's (its start events repeat the request: not the backend's bytes)
            if v is _CONTENT:
                att.call.out.streamed_tokens += 1
                if not self.first:
                    att.claim()
            transcript = att.call.transcript
            if transcript is not None and mon.event is not None:
                if self.first:
                    transcript.note(mon.event, att.backend.name)
                else:
                    self.unnoted.append(mon.event)
            if self.first:
                out.append(ev)
                continue
            self.held.append(ev)
            self.held_bytes += sent
            if v is _CONTENT or mon.finished:
                if v is not _CONTENT:
                    att.claim()  # an answer without output: its end is its first byte
                self.first = att.progress.first_sent = True
                out, self.held = [*out, *self.held], []
                if transcript is not None:
                    for event in self.unnoted:
                        transcript.note(event, att.backend.name)
                    self.unnoted = []
            elif self.held_bytes > MAX_HELD_BYTES:
                raise AttemptFailed(
                    UpstreamError(f"backend {att.backend.name!r} sent over {MAX_HELD_BYTES} bytes before its {mon.first}"),
                    Kind.TOO_LARGE,
                )
        return out

    def _timed_out(self) -> Cut | None:
        att = self.att
        if att.call.deadline_passed():
            if not self.first:
                raise att.caller_deadline() from None
            return Cut(UpstreamTimeout(f"the request's deadline of {att.call.timeout_ms()} ms passed mid-stream"),
                       Kind.CALLER_DEADLINE)
        if not self.first:
            if self.skipping:
                raise AttemptFailed(UpstreamTimeout(
                    f"backend {att.backend.name!r} stalled for more than {int(self.idle_s * 1000)} ms before its {self.mon.first}"
                    " (regenerating what the client already has)"), Kind.FIRST_TOKEN_TIMEOUT) from None
            waited = att.first_deadline - asyncio.get_running_loop().time() + (time.perf_counter() - att.started)
            raise AttemptFailed(UpstreamTimeout(f"no {self.mon.first} within {int(waited * 1000)} ms"),
                                Kind.FIRST_TOKEN_TIMEOUT) from None
        if self.mon.finished:
            return None
        return Cut(UpstreamError(f"backend {att.backend.name!r} stalled for more than {int(self.idle_s * 1000)} ms mid-stream"),
                   Kind.CUT_MID_STREAM, live=self.idle_live)

    def _ended(self) -> Cut | None:
        """The body ended (or the stream's end marker came)."""
        if self.failed or self.saw_done or self.mon.finished:
            return None
        if not self.first:
            raise AttemptFailed(UpstreamError(f"the stream ended before the {self.mon.first}"), Kind.CUT)
        return self._cut(self.mon.unfinished.format(backend=self.att.backend.name))

    def _cut(self, why: str) -> Cut:
        return Cut(UpstreamError(why), Kind.CUT_MID_STREAM)

    async def _end(self) -> Kind:
        """A stream that ended as it should (or with the backend's own failure event, passed on)."""
        att, mon, call = self.att, self.mon, self.att.call
        if self.failed:
            call.out.finish = Finish.ERROR
            await client_write(att.sink.end())
            return Kind.ERROR_EVENT_MID_STREAM
        if mon.ending and not self.saw_done:
            att.m.error("missing_done")  # completed by the gateway
        # Before the last write: a client that leaves at [DONE] still has it stored. Not an answer
        # with an event dropped as malformed: what that event carried is missing from it.
        call.cache.entry = None if self.malformed else mon.entry()
        call.out.finish = Finish.OK
        # The figures the quota charges an answer without usage (tenants/quota.py `_used`).
        tail = mon.estimated_usage(call.prompt_tokens, call.out.streamed_tokens) + mon.ending
        if tail:
            await client_write(att.sink.write(tail))
        await client_write(att.sink.end())
        return Kind.OK


def _idle_s(att: Attempt) -> float:
    """How long the stream may stall mid-answer: the backend's idle timeout, or, while a stall
    could be rescued on another backend, a deadline from its model's live inter-token latency."""
    idle_s = att.backend.timeouts.idle_ms / 1000
    live = att.live
    if live is not None and att.call.transcript is not None:
        idle_s = att.tracker.idle_deadline_s(
            idle_s, live.idle_floor_ms / 1000, live.cold_idle_ms / 1000, mult=live.idle_p99_multiplier
        )
    return idle_s

