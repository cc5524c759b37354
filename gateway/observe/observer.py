"""Where each request's time went: the Server-Timing header, per-stage histograms, the JSON access
log and (optionally) an OpenTelemetry span. Called once per API request, after its answer.

The stages (metrics.STAGES) come from four stamps on the Call: its start (`t0`), the request sent
upstream (`sent_at`), the upstream's headers (`headers_at`) and the first content token
(`t0 + ttft_s`); `queue_ms` is the wait for admission, a backend slot or a single flight's leader.
Of hedged attempts, the stamps are the winner's (relay/attempt.py).
"""

from __future__ import annotations

import collections
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

import orjson

from ..admin.request_log import RequestLog
from ..config.policy import Policy, TracingPolicy
from ..pipeline.call import Call, Finish
from .metrics import STAGES, Metrics

if TYPE_CHECKING:
    from ..config.runtime import Runtime

__all__ = ["AccessLog", "Observer", "parse_traceparent", "server_timing", "stages"]

log = logging.getLogger("gateway.pipeline")

# What a log line or a span keeps of a caller-sized value: the model asked for (a client may send
# megabytes of it, each a cheap 404) as the request log keeps it (admin/entry.py), an error
# (which may quote that model) and, with `log.prompts`, the prompt's JSON text.
MODEL_CHARS = 200
ERROR_CHARS = 300
PROMPT_CHARS = 2000

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a W3C `traceparent` header, or None when it is absent
    or invalid: the spec says to ignore a bad one and start a new trace. Versions after 00 are
    read by their first four fields, as the spec asks; `ff` is invalid."""
    m = _TRACEPARENT.fullmatch(value.strip()) if value and len(value) < 512 else None
    if m is None or m.group(1) == "ff" or (m.group(1) == "00" and m.group(5)):
        return None
    trace_id, span_id = int(m.group(2), 16), int(m.group(3), 16)
    if not trace_id or not span_id:  # all zeros: invalid
        return None
    return trace_id, span_id, int(m.group(4), 16)


def stages(call: Call, end: float) -> dict[str, float]:
    """Seconds per stage for a request that ended at `end` (perf_counter); stages it never
    reached are left out."""
    queue_s = call.timing.queue_ms / 1000
    out = {"queue": queue_s}
    if not call.timing.sent_at:  # answered without an upstream call (cache, refusal, a flight's follower)
        ttft_s = call.timing.ttft_s
        if ttft_s is None:
            out["gateway"] = max(0.0, end - call.timing.t0 - queue_s)
        else:  # a follower of a live stream: its wait for the first token is queue, then its leader's decode
            out["gateway"] = max(0.0, ttft_s - queue_s)
            out["decode"] = max(0.0, end - call.timing.t0 - ttft_s)
        return out
    out["gateway"] = max(0.0, call.timing.sent_at - call.timing.t0 - queue_s)
    if call.timing.headers_at >= call.timing.sent_at:
        out["upstream_headers"] = call.timing.headers_at - call.timing.sent_at
        if call.stream and call.timing.ttft_s is not None:
            first = call.timing.t0 + call.timing.ttft_s
            out["first_token"] = max(0.0, first - call.timing.headers_at)
            out["decode"] = max(0.0, end - first)
        elif not call.stream:
            out["decode"] = max(0.0, end - call.timing.headers_at)
    return out


def server_timing(call: Call) -> str:
    """The Server-Timing header for an answer whose headers go out now: the gateway's own work,
    the wait, the upstream's time to headers and to the first token, and the total so far (for
    a stream, whose headers leave with its first token, that is the time to the first byte)."""
    now = time.perf_counter()
    st = stages(call, now)
    parts = [f"gateway;dur={st['gateway'] * 1000:.2f}", f"queue;dur={st['queue'] * 1000:.2f}"]
    if "upstream_headers" in st:
        parts.append(f'upstream;desc="to headers";dur={st["upstream_headers"] * 1000:.2f}')
    if call.stream and call.timing.ttft_s is not None:
        parts.append(f'ttft;desc="first token";dur={call.timing.ttft_s * 1000:.2f}')
    if call.cache.result == "hit":
        parts.append('cache;desc="hit"')
    parts.append(f"total;dur={(now - call.timing.t0) * 1000:.2f}")
    return ", ".join(parts)


class Observer:
    """Per-request observation after the answer: stage histograms, access log, tracing."""

    def __init__(self, metrics: Metrics, *, force_access_log: bool = False) -> None:
        self.metrics = metrics
        self.force_access_log = force_access_log
        self.request_log: RequestLog | None = None  # the admin plane's (admin/request_log.py), while the app runs
        self._access: AccessLog | None = None
        self._tracer: Any = None
        self._provider: Any = None
        self._otel: Any = None  # the otel module, once tracing started

    def start(self, policy: Policy) -> None:
        """Start the access log's writer thread and the tracer the policy asks for."""
        if self.force_access_log or policy.log.access:
            self._start_access_log()
        if policy.tracing is not None:
            self._start_tracing(policy.tracing)

    def close(self) -> None:
        """Write out the access log (for at most AccessLog.CLOSE_WAIT_S) and the batched spans."""
        if self._access is not None:
            self._access.close()  # writes what is queued
            self._access = None
        if self._provider is not None:
            self._provider.shutdown()  # exports what is batched
            self._provider = None

    def count(self, call: Call, rt: "Runtime") -> None:
        """Count one request the pipeline answered (however it ended): requests, durations,
        disconnects, tokens. Labels only from the policy: a client-chosen model string would
        grow the series without bound."""
        m = self.metrics
        backend = call.out.backend or "none"
        model = call.model if call.model in rt.routes else "other"
        m.request_done(model, backend, call.cls, call.cache.result, call.out.status)
        m.duration_of(backend).observe(call.elapsed_s())
        if call.out.finish is Finish.CLIENT_DISCONNECT:
            m.client_disconnects.inc()
        if call.out.affinity is not None:  # counted once, as it ended (a failover may turn a hit into a spill)
            m.prefix_affinity_of(model, call.cls, call.out.affinity.result.value).inc()
        usage = call.out.usage
        if usage and call.out.backend and call.out.backend != "cache":
            tenant = rt.tenants.metric_label("none" if call.tenant is None else call.tenant.name)
            for kind, key in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
                n = usage.get(key)
                if isinstance(n, int) and n > 0:
                    m.tokens_of(tenant, backend, kind).inc(n)
        if call.out.status >= 500:
            log.warning("request %s failed with %s: %s", call.request_id, call.out.status, call.out.error)

    def done(self, call: Call, rt: "Runtime") -> None:
        """Record one finished request (however it ended)."""
        end = time.perf_counter()
        st = stages(call, end)
        hist = self.metrics.stages
        for name, seconds in st.items():
            hist[name].observe(seconds)
        # Refused before authentication: in the metrics and the access log, not in the shared request log
        # (an anonymous caller must not push the tenants' entries out of it).
        if self.request_log is not None and call.tenant is not None and rt.policy.request_log.enabled:
            # What the quota charged (an answer without usage: its estimate's cost), else its usage's.
            spend = call.out.spend_usd
            self.request_log.add(call, rt, end, rt.spend_usd(call) if spend is None else spend)
        if self.force_access_log or rt.policy.log.access:
            access = self._access or self._start_access_log()  # a reload may have turned it on
            access.write(_line(call, rt, st, end))
        if self._tracer is not None:
            self._span(call, st, end)

    # ---- access log -----------------------------------------------------------------------------

    def _start_access_log(self) -> AccessLog:
        drops = self.metrics.access_log_drops
        self._access = AccessLog(sys.stdout, on_drop=lambda reason, n: drops[reason].inc(n))
        return self._access

    # ---- tracing --------------------------------------------------------------------------------

    def _start_tracing(self, tp: TracingPolicy) -> None:
        try:
            from . import otel  # the optional `otel` extra
        except ImportError:
            logging.getLogger("gateway").error(
                "tracing: the policy asks for OpenTelemetry export, but it is not installed: pip install 'llm-routing-gateway[otel]'"
            )
            return
        self._otel = otel
        self._provider = otel.provider(tp)
        self._tracer = self._provider.get_tracer("gateway")

    def _span(self, call: Call, st: dict[str, float], end: float) -> None:
        now_ns = time.time_ns()
        end_ns = now_ns - int((time.perf_counter() - end) * 1e9)
        start_ns = end_ns - int((end - call.timing.t0) * 1e9)
        model = call.model[:MODEL_CHARS]  # the caller's string: a span (and its batch queue) holds what is cut here
        attrs: dict[str, Any] = {
            "gateway.request_id": call.request_id, "gateway.tenant": "" if call.tenant is None else call.tenant.name, "gen_ai.request.model": model,
            "gateway.class": call.cls, "gateway.backend": call.out.backend or "", "gateway.cache": call.cache.result,
            "http.response.status_code": call.out.status, "gateway.stream": call.stream,
        }  # fmt: skip
        for name, seconds in st.items():
            attrs[f"gateway.stage.{name}_ms"] = round(seconds * 1000, 3)
        if call.timing.ttft_s is not None:
            attrs["gateway.ttft_ms"] = round(call.timing.ttft_s * 1000, 3)
        usage = call.out.usage or {}
        for key in ("prompt_tokens", "completion_tokens"):
            if isinstance(usage.get(key), int):
                attrs[f"gen_ai.usage.{key}"] = usage[key]
        # The caller's span (from its traceparent) as the parent of the gateway's, else a new trace.
        context = None if call.asked.trace_parent is None else self._otel.parent(*call.asked.trace_parent)
        span = self._tracer.start_span(f"{call.endpoint.name} {model}", context=context, start_time=start_ns, attributes=attrs)
        if call.out.status >= 500:
            span.set_status(self._otel.error((call.out.error or "")[:ERROR_CHARS]))
        span.end(end_time=end_ns)


# Writes of at most PIPE_BUF bytes to a pipe are atomic (POSIX; 4096 on Linux): with
# `--workers N` on one stdout pipe, a batch of whole lines never interleaves with another worker's.
_PIPE_BUF = 4096


class AccessLog:
    """One JSON line per request on `out`, written by a thread in batches: a slow pipe never
    stalls the event loop, and a request costs a deque append, not a logging record and a thread
    wake-up.

    Bounded: at most `max_queued` lines wait (each cut to a few hundred bytes by `_line`); past
    that, while stdout is slow or stalled, lines are dropped and counted (`on_drop("queue_full",
    n)`; `"write"`: stdout failed). A real file descriptor is written with os.write in chunks of
    whole lines of at most _PIPE_BUF bytes (a longer line goes alone), bypassing sys.stdout's
    buffer, which would cut lines at its 8 KiB boundaries."""

    _EVERY_S = 0.05  # how often the writer wakes up to write what came
    MAX_QUEUED = 8192  # lines: a few MiB, and 160k requests/s between two wake-ups
    CLOSE_WAIT_S = 2.0  # what close() waits for a stalled stdout: within the supervisor's 5 s after the drain

    def __init__(self, out: TextIO, on_drop: Callable[[str, int], None] | None = None, max_queued: int = MAX_QUEUED) -> None:
        self._out = out
        self._fd = _fileno(out)
        self._on_drop = on_drop
        self._max = max_queued
        # deque: append and popleft are atomic under the GIL, len() is O(1) (SimpleQueue has no bound)
        self._q: collections.deque[bytes] = collections.deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-access-log", daemon=True)
        self._thread.start()

    def write(self, line: bytes) -> None:
        """Queue one line (without its newline); dropped and counted when `max_queued` wait."""
        if len(self._q) < self._max:
            self._q.append(line)
        elif self._on_drop is not None:
            self._on_drop("queue_full", 1)

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Write what is queued and stop the writer, waiting at most `wait_s`: a stdout that
        nobody reads must not hold the shutdown (the daemon thread dies with the process)."""
        self._stop.set()
        self._thread.join(wait_s)
        if self._thread.is_alive():
            logging.getLogger("gateway").warning(
                "access log: stdout did not take its last lines within %.1f s; %d not written", wait_s, len(self._q)
            )

    def _run(self) -> None:
        while not self._stop.wait(self._EVERY_S):
            self._flush()
        self._flush()

    def _flush(self) -> None:
        q = self._q
        while q:
            batch = [q.popleft()]
            size = len(batch[0]) + 1
            while q and size + len(q[0]) + 1 <= _PIPE_BUF:
                line = q.popleft()
                batch.append(line)
                size += len(line) + 1
            batch.append(b"")
            self._emit(b"\n".join(batch), len(batch) - 1)

    def _emit(self, data: bytes, lines: int) -> None:
        try:
            if self._fd is None:  # a stream without a descriptor (a test's capture)
                self._out.write(data.decode())
                self._out.flush()
                return
            view = memoryview(data)
            while view:  # one write unless a line is longer than _PIPE_BUF
                view = view[os.write(self._fd, view):]
        except (OSError, ValueError):  # stdout closed or gone: the lines are dropped, not the gateway
            if self._on_drop is not None:
                self._on_drop("write", lines)


def _fileno(out: TextIO) -> int | None:
    """The descriptor under `out` (its buffer flushed first), or None when it has none."""
    try:
        fd = out.fileno()
        out.flush()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None
    return fd


_STAGE_KEYS = {name: f"{name}_ms" for name in STAGES}  # the access log's field per stage (stages() names only these)


def _line(call: Call, rt: "Runtime", st: dict[str, float], end: float) -> bytes:
    usage = call.out.usage or {}
    line: dict[str, Any] = {
        "ts": round(time.time(), 3),
        "request_id": call.request_id,
        "tenant": None if call.tenant is None else call.tenant.name,
        "endpoint": call.endpoint.name,
        "model": call.model[:MODEL_CHARS],  # the caller's string: a line stays a few hundred bytes
        "class": call.cls,
        "class_stage": None if call.cls == "none" or call.verdict is None else call.verdict.stage,  # what decided it
        "backend": call.out.backend,
        "attempts": call.out.attempts,
        "cache": call.cache.result,
        "stream": call.stream,
        "status": call.out.status,
        "finish": call.out.finish,
        "ttft_ms": None if call.timing.ttft_s is None else round(call.timing.ttft_s * 1000, 2),
        "duration_ms": round((end - call.timing.t0) * 1000, 2),
    }
    for name, s in st.items():
        line[_STAGE_KEYS[name]] = round(s * 1000, 2)
    line["prompt_tokens"] = usage.get("prompt_tokens")
    line["completion_tokens"] = usage.get("completion_tokens")
    if call.out.affinity is not None:
        line["affinity"] = call.out.affinity.view()
    if call.out.error:
        line["error"] = call.out.error[:ERROR_CHARS]
    if rt.policy.log.prompts:
        body = call.body
        return _with_prompt(line, body.get("messages", body.get("prompt", body.get("input"))))
    return orjson.dumps(line, default=str)


_LINE_BYTES = _PIPE_BUF - 1  # a line and its newline in one atomic write


def _with_prompt(line: dict[str, Any], prompt: Any) -> bytes:
    """The line with the prompt as sent, or with its JSON text cut (and `prompt_truncated`) to
    PROMPT_CHARS characters and to what keeps the line within one atomic write: escaped control
    characters take 6 bytes each and other scripts up to 4, so 2,000 characters can be 12 KB."""
    text = prompt if isinstance(prompt, str) else orjson.dumps(prompt, default=str).decode()
    if len(text) <= PROMPT_CHARS:
        line["prompt"] = prompt
        out = orjson.dumps(line, default=str)
        if len(out) <= _LINE_BYTES:
            return out
    line["prompt"], line["prompt_truncated"] = "", True
    room = _LINE_BYTES - len(orjson.dumps(line, default=str))
    n = min(len(text), PROMPT_CHARS, max(room, 0))
    while n > 0:
        size = len(orjson.dumps(text[:n])) - 2  # without its quotes
        if size <= room:
            break
        n = min(n - 1, n * room // size)
    line["prompt"] = text[:n]
    return orjson.dumps(line, default=str)
