"""Answers that need another backend after one already spoke: a prompt too long for the first
backend's context window (its larger-context fallbacks), and a stream that broke after content
reached the client (continued elsewhere, continuation.py, or ended with an error event)."""

from __future__ import annotations

import logging

from ..errors import UpstreamRejected
from ..pipeline.call import Finish, Outcome
from ..routing.health import Kind
from .attempt import client_write
from .base import RelayBase
from .continuation import Resume, Transcript

__all__ = ["Rescue"]

log = logging.getLogger("gateway.relay")

# Mid-stream failures another backend may rescue (a caller's deadline is not one of them).
_RESCUABLE = frozenset({Kind.CUT_MID_STREAM, Kind.ERROR_EVENT_MID_STREAM, Kind.TOO_LARGE})


class Rescue(RelayBase):
    __slots__ = ()

    async def context_fallback(self, rejected: UpstreamRejected) -> None:
        """The prompt did not fit: try the route's larger-context backends, never the same
        (backend, upstream model) twice; pass the rejection back when none answers."""
        call, route = self.call, self.route
        by_name = {b.name: b for b in (*route.simple.backends, *route.complex.backends, *route.context_fallbacks)}
        too_small = {(rejected.backend, by_name[rejected.backend].upstream_model(call.model))} if rejected.backend in by_name else set()
        for fb in route.context_fallbacks:
            model = fb.upstream_model(call.model)
            if (fb.name, model) in too_small or call.remaining_s() <= 0:
                continue
            self.ctx.metrics.relay_events.labels("context_fallback", Kind.CONTEXT_LENGTH).inc()
            log.info("request %s: backend %r said context length exceeded; trying %r (model %r)",
                     call.request_id, rejected.backend, fb.name, model)
            self.sink.set_header("x-gateway-fallback", Kind.CONTEXT_LENGTH)
            self.tries.count += 1
            self.tries.last_kind, self.tries.last_label = Kind.CONTEXT_LENGTH, Kind.CONTEXT_LENGTH.label()
            try:
                wait_s = min(call.remaining_s(), fb.timeouts.first_token_ms / 1000)
                # One ticket for every fallback's wait: each gate queues a copy of its own (Gate.acquire).
                answered = await self.attempt(fb, live=None, wait_s=wait_s, queue=call.ticket)
            except UpstreamRejected as again:
                if not again.context_length:
                    raise
                too_small.add((fb.name, model))
                continue
            if answered or self.progress.owner is not None:
                return
        raise rejected

    async def rescue(self) -> None:
        """A stream broke after content reached the client: continue it on the next candidates
        (prefill where the backend takes one, else restart and skip the delivered text), or end
        it with an error event naming the original failure."""
        call, original = self.call, self.progress.cut
        assert original is not None
        transcript = call.transcript
        notes: list[str] = []
        if transcript is not None and transcript.continuable and original.kind in _RESCUABLE:
            call.cache.capture, call.cache.entry = 0, None  # an answer spliced from two backends is not cached
            if await self._continue(transcript, notes):
                return
        call.out.finish = Finish.CUT
        err = original.err
        if notes:
            err = type(err)(f"{err.message}; the answer could not be continued ({'; '.join(notes)})")
        call.out.error = err.message  # the request log's word on why its stream was cut
        log.warning("request %s: stream ended with an error after content was sent: %s", call.request_id, err.message)
        await client_write(self.sink.fail(err))

    async def _continue(self, transcript: Transcript, notes: list[str]) -> bool:
        """Continue the answer on the other candidates, best first; True once one finished it."""
        call, pool, progress, events = self.call, self.pool, self.progress, self.ctx.metrics.relay_events
        original = cut = progress.cut
        assert original is not None and cut is not None
        broken = {call.out.backend}
        ranked = [r for r in pool.selector.rank(pool.candidates, call.prompt_tokens) if r.skipped is None]
        candidates = [pool.backends[r.index] for r in ranked if pool.backends[r.index].name not in broken]
        rescues = 0
        for n, backend in enumerate(candidates):
            if rescues >= self.route.server.max_attempts or call.remaining_s() <= 0 or cut.kind not in _RESCUABLE:
                break
            for mode in ("prefill", "restart") if backend.prefill and call.endpoint.prefills(call.body) else ("restart",):
                rescues += 1
                progress.cut, progress.owner, progress.rivals = None, None, None
                log.warning("request %s: %s; continuing the answer on %r (%s, %d characters delivered)",
                            call.request_id, cut.err.message, backend.name, mode, len(transcript.text))
                resume = Resume(transcript, mode, backend.name, original.err.message)
                try:
                    answered = await self.attempt(backend, live=None if n == len(candidates) - 1 else self.route.routing,
                                                  resume=resume)
                except UpstreamRejected as rejected:
                    # A 4xx to a continuation: most likely the prefill itself; restart instead.
                    notes.append(f"{backend.name} ({mode}): HTTP {rejected.status}")
                    events.labels("continuation", f"{mode}_rejected").inc()
                    continue
                if progress.cut is not None:  # the continuation broke too: go on from there
                    cut = progress.cut
                    broken.add(backend.name)
                    notes.append(f"{backend.name} ({mode}): {cut.err.message}")
                    events.labels("continuation", f"{mode}_cut").inc()
                    break
                if answered:
                    _charge_earlier(call.out, resume.earlier)
                    events.labels("continuation", mode).inc()
                    log.info("request %s: answer continued on %r (%s); backends %s",
                             call.request_id, backend.name, mode, ", ".join(transcript.backends))
                    return True
                why = self.tries.failures[-1][1].message if self.tries.failures else "no slot"
                notes.append(f"{backend.name} ({mode}): {why}")
                events.labels("continuation", f"{mode}_failed").inc()
                break
        return False


def _charge_earlier(out: Outcome, tokens: int) -> None:
    """A continued answer: add to what its quota charges the output the earlier legs generated
    that the answering leg's usage does not count (continuation.Resume.earlier), after the client
    had its own usage (the whole answer's tokens, as an unbroken stream's): to the usage's
    completion and total, or without a usage to the content events counted in its place. A
    usage figure that is not a whole number from 0 is left as it came (the quota believes none
    of such a report)."""
    if tokens <= 0:
        return
    usage = out.usage
    if usage is None:
        out.streamed_tokens += tokens
        return
    more = {key: n + tokens for key in ("completion_tokens", "total_tokens")
            if type(n := usage.get(key)) is int and n >= 0}
    if more:
        out.usage = {**usage, **more}  # a copy: the dict may be the event the client was sent
