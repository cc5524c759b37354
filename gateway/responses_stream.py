"""One attempt's answer on /v1/responses: a whole Response, or a Responses event stream.

The same rules as chat (attempt.py): events pass through as the bytes the backend sent; events
before the first output delta (`response.created`, `response.in_progress`, `...added`) are held
back and released with it, so a backend that fails before it (an HTTP error, `response.failed`,
an `error` event, a cut or a stall) is failed over without the client seeing anything; TTFT is
the first output delta (`response.output_text.delta`, or any other `*.delta`). After it, a
stream that does not end with `response.completed` / `response.incomplete` (or the backend's own
`response.failed` / `error`) ends with an `error` event and no `response.completed`.

Every answer's ids are recorded (Call.affinity) before the client can see any of it: a whole
body before it is sent, a stream's at its `response.created` event (held back until then). When
the record cannot be written (affinity.RecordFailed, OwnerConflict) the answer is not released:
the request fails with that error, and the backend is not blamed (no failover, no health report).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from .attempt import MAX_HELD_BYTES, AttemptFailed, Progress, RelayContext, caller_deadline, claim, client_write
from .attempt import failed, observe_content, parse_event
from .backends import Backend
from .cache_entry import Entry
from .call import CacheResult, Call, Finish
from .errors import GatewayError, UpstreamError, UpstreamTimeout
from .responses import TERMINAL_FAILED, TERMINAL_OK, usage_of
from .responses_replay import replayable
from .sink import Sink
from .upstream_http import UpstreamHTTPError, UpstreamResponse
from .wire import SSEDecoder, SSEEventTooLarge, event_data

__all__ = ["Monitor", "answer"]

_AFTER_END_S = 2.0  # how long to wait for the backend to close its body after the terminal event

# What a stream event means to the relay (Monitor.feed).
CONTENT, HELD, END, FAILED, SKIP = "content", "held", "end", "failed", "skip"


@dataclass(slots=True)
class Monitor:
    """Reads a Responses event stream without I/O: fed each event's decoded JSON, says what it is
    (CONTENT: an output delta; END: the response finished; FAILED: the backend reported a failure;
    HELD: anything else) and keeps what the relay needs afterwards."""

    created: dict[str, Any] | None = None  # the `response` of response.created
    final: dict[str, Any] | None = None  # the `response` of response.completed / .incomplete
    failure: str | None = None  # the message of a response.failed / error event
    deltas: int = 0

    def feed(self, event: Mapping[str, Any]) -> str:
        kind = event.get("type")
        if not isinstance(kind, str):
            return self._failed(event) if event.get("error") else SKIP
        if kind in TERMINAL_FAILED or event.get("error"):
            return self._failed(event)
        if kind in TERMINAL_OK:
            resp = event.get("response")
            self.final = resp if isinstance(resp, dict) else {}
            return END
        if kind.endswith(".delta") or kind == "response.image_gen_call.partial_image":
            self.deltas += 1
            return CONTENT
        if kind == "response.created":
            resp = event.get("response")
            if isinstance(resp, dict):
                self.created = resp
        return HELD

    def _failed(self, event: Mapping[str, Any]) -> str:
        msg: Any = event.get("message")
        err = event.get("error")
        resp = event.get("response")
        if isinstance(resp, dict) and isinstance(resp.get("error"), dict):
            err = resp["error"]
        if isinstance(err, dict):
            msg = err.get("message") or msg
        elif isinstance(err, str):
            msg = err
        self.failure = str(msg or event.get("type") or "error")
        return FAILED


async def answer(
    call: Call,
    backend: Backend,
    resp: UpstreamResponse,
    raw: bytes,
    ctx: RelayContext,
    sink: Sink,
    progress: Progress,
    started: float,
    first_deadline: float,
    call_deadline: float,
) -> str:
    """The client's answer from a 200 (`raw`: a whole body already read, when not streaming).
    Returns the outcome kind (health.OUTCOMES); raises AttemptFailed to fail over."""
    if not call.stream:
        return await _deliver(call, backend, raw, sink, progress)
    return await _stream(call, backend, resp, ctx, sink, progress, started, first_deadline, call_deadline)


async def _deliver(call: Call, backend: Backend, raw: bytes, sink: Sink, progress: Progress) -> str:
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str) or "output" not in obj:
        raise AttemptFailed(UpstreamError("the backend answered 200 with a body that is not a Response"), "malformed")
    claim(progress, backend, call, sink)
    if call.affinity is not None:
        await call.affinity.learn(obj, backend.name)
    if call.capture and len(raw) <= call.capture and replayable(obj):
        call.entry = Entry(raw)
    call.usage = usage_of(obj)
    call.finish = Finish.OK
    await client_write(sink.send(200, raw))
    return "ok"


async def _stream(
    call: Call,
    backend: Backend,
    resp: UpstreamResponse,
    ctx: RelayContext,
    sink: Sink,
    progress: Progress,
    started: float,
    first_deadline: float,
    call_deadline: float,
) -> str:
    loop = asyncio.get_running_loop()
    m = ctx.metrics.for_backend(backend.name)
    idle_s = backend.timeouts.idle_ms / 1000
    decoder = SSEDecoder()
    mon = Monitor()
    held: list[bytes] = []
    held_bytes = 0
    first = ended = failed = False
    last_delta = 0.0
    timer = asyncio.timeout_at(first_deadline)
    cut: str | None = None
    kind = "ok"
    try:
        async with timer:
            while True:
                chunk = await resp.readany()
                if not chunk:
                    break
                out: list[bytes] = []
                for ev in decoder.feed(chunk):
                    data = event_data(ev)
                    if data is None or data == b"[DONE]":  # comments; a [DONE] some servers add
                        if first:
                            out.append(ev)
                        continue
                    obj = parse_event(data, m)
                    if obj is None:
                        continue
                    had = mon.created
                    what = mon.feed(obj)
                    if what == SKIP:
                        continue
                    if what == FAILED:
                        if not first:
                            raise AttemptFailed(UpstreamError(f"the backend failed before the first output: {mon.failure}"), "error_event")
                        out.append(ev)
                        failed = True
                        break
                    if mon.created is not had and call.affinity is not None:
                        # Before anything reaches the client: a follow-up can never outrun its record.
                        await call.affinity.learn(mon.created, backend.name)
                    if what == CONTENT:
                        call.streamed_tokens += 1
                        if not last_delta:
                            claim(progress, backend, call, sink)
                        last_delta = observe_content(call, backend, m, started, last_delta)
                    elif what == END:
                        ended = True
                        call.usage = usage_of(mon.final or {})
                    if first:
                        out.append(ev)
                        continue
                    held.append(ev)
                    held_bytes += len(ev)
                    if what in (CONTENT, END):
                        if what == END and not last_delta:
                            claim(progress, backend, call, sink)  # an answer without output: its end is its first byte
                        first = progress.first_sent = True
                        out, held = held, []
                    elif held_bytes > MAX_HELD_BYTES:
                        raise AttemptFailed(
                            UpstreamError(f"backend {backend.name!r} sent over {MAX_HELD_BYTES} bytes before its first output"),
                            "too_large",
                        )
                if out:
                    await client_write(sink.write(b"".join(out)))
                if failed:
                    break
                if first:
                    timer.reschedule(min(loop.time() + (_AFTER_END_S if ended else idle_s), call_deadline))
    except TimeoutError:
        if call.deadline_passed():
            if not first:
                raise caller_deadline(call, backend) from None
            cut, kind = f"the request's deadline of {call.timeout_ms()} ms passed mid-stream", "caller_deadline"
        elif not first:
            waited = int((first_deadline - loop.time() + time.perf_counter() - started) * 1000)
            raise AttemptFailed(UpstreamTimeout(f"no first output within {waited} ms"), "first_token_timeout") from None
        elif not ended:
            cut, kind = f"the stream stalled for more than {backend.timeouts.idle_ms} ms", "cut_mid_stream"
    except SSEEventTooLarge as exc:
        if not first:
            raise AttemptFailed(UpstreamError(f"backend {backend.name!r}: {exc}"), "too_large") from None
        cut, kind = f"backend {backend.name!r}: {exc}", "too_large"
    except UpstreamHTTPError as exc:
        if not first:
            detail = f"{type(exc).__name__}: {exc}"
            raise failed(call, backend, f"{exc.summary} before the first output", "disconnect", detail) from None
        if not ended:
            cut, kind = "the backend's connection was lost mid-stream", "cut_mid_stream"
    else:
        if failed:
            call.finish = Finish.ERROR
            await client_write(sink.end())
            return "error_event_mid_stream"
        if not ended:
            if not first:
                raise AttemptFailed(UpstreamError("the stream ended before the first output"), "cut")
            cut, kind = "the backend's stream ended before response.completed", "cut_mid_stream"
    if cut is not None:
        # Never presented as a success: an `error` event, and no response.completed (ResponsesSink).
        call.finish = Finish.CUT
        err: GatewayError = UpstreamTimeout(cut) if kind == "caller_deadline" else UpstreamError(cut)
        await client_write(sink.fail(err))
        return kind
    final = mon.final
    if call.capture and final is not None and replayable(final):
        body = orjson.dumps(final)
        if len(body) <= call.capture:
            call.entry = Entry(body)
    call.finish = Finish.OK
    await client_write(sink.end())
    return "ok"

