"""Where each request's time went: the Server-Timing header, per-stage histograms, the JSON access
log and (optionally) an OpenTelemetry span. Called once per API request, after its answer.

The stages (metrics.STAGES) come from four stamps on the Call: its start (`t0`), the request sent
upstream (`sent_at`), the upstream's headers (`headers_at`) and the first content token
(`t0 + ttft_s`); `queue_ms` is the wait for admission or a backend slot.
"""

from __future__ import annotations

import logging
import logging.handlers
import queue
import re
import sys
import time
from typing import TYPE_CHECKING, Any

import orjson

from .call import Call
from .metrics import Metrics
from .policy import Policy, TracingPolicy

if TYPE_CHECKING:
    from .runtime import Runtime

__all__ = ["Observer", "parse_traceparent", "server_timing", "stages"]

access_log = logging.getLogger("gateway.access")

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
    queue_s = call.queue_ms / 1000
    out = {"queue": queue_s}
    if not call.sent_at:  # answered without an upstream call (cache, refusal)
        out["gateway"] = max(0.0, end - call.t0 - queue_s)
        return out
    out["gateway"] = max(0.0, call.sent_at - call.t0 - queue_s)
    if call.headers_at >= call.sent_at:
        out["upstream_headers"] = call.headers_at - call.sent_at
        if call.stream and call.ttft_s is not None:
            first = call.t0 + call.ttft_s
            out["first_token"] = max(0.0, first - call.headers_at)
            out["decode"] = max(0.0, end - first)
        elif not call.stream:
            out["decode"] = max(0.0, end - call.headers_at)
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
    if call.stream and call.ttft_s is not None:
        parts.append(f'ttft;desc="first token";dur={call.ttft_s * 1000:.2f}')
    if call.cache == "hit":
        parts.append('cache;desc="hit"')
    parts.append(f"total;dur={(now - call.t0) * 1000:.2f}")
    return ", ".join(parts)


class Observer:
    """Per-request observation after the answer: stage histograms, access log, tracing."""

    def __init__(self, metrics: Metrics, *, force_access_log: bool = False) -> None:
        self.metrics = metrics
        self.force_access_log = force_access_log
        self._listener: logging.handlers.QueueListener | None = None
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
        if self._listener is not None:
            self._listener.stop()  # writes what is queued
            self._listener = None
        if self._provider is not None:
            self._provider.shutdown()  # exports what is batched
            self._provider = None

    def done(self, call: Call, rt: "Runtime") -> None:
        """Record one finished request (however it ended)."""
        end = time.perf_counter()
        st = stages(call, end)
        hist = self.metrics.stages
        for name, seconds in st.items():
            hist[name].observe(seconds)
        if self.force_access_log or rt.policy.log.access:
            if self._listener is None:
                self._start_access_log()  # turned on by a reload
            access_log.info("%s", _line(call, rt, st, end).decode())
        if self._tracer is not None:
            self._span(call, st, end)

    # ---- access log -----------------------------------------------------------------------------

    def _start_access_log(self) -> None:
        """One JSON line per request on stdout, written by a thread: a slow pipe never stalls
        the event loop (the queue is unbounded; a line is a few hundred bytes)."""
        q: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
        out = logging.StreamHandler(sys.stdout)
        out.setFormatter(logging.Formatter("%(message)s"))
        access_log.handlers[:] = [logging.handlers.QueueHandler(q)]
        access_log.propagate = False
        access_log.setLevel(logging.INFO)
        self._listener = logging.handlers.QueueListener(q, out)
        self._listener.start()

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
        start_ns = end_ns - int((end - call.t0) * 1e9)
        attrs: dict[str, Any] = {
            "gateway.request_id": call.request_id, "gateway.tenant": call.tenant or "", "gen_ai.request.model": call.model,
            "gateway.class": call.cls, "gateway.backend": call.backend or "", "gateway.cache": call.cache,
            "http.response.status_code": call.status, "gateway.stream": call.stream,
        }  # fmt: skip
        for name, seconds in st.items():
            attrs[f"gateway.stage.{name}_ms"] = round(seconds * 1000, 3)
        if call.ttft_s is not None:
            attrs["gateway.ttft_ms"] = round(call.ttft_s * 1000, 3)
        usage = call.usage or {}
        for key in ("prompt_tokens", "completion_tokens"):
            if isinstance(usage.get(key), int):
                attrs[f"gen_ai.usage.{key}"] = usage[key]
        # The caller's span (from its traceparent) as the parent of the gateway's, else a new trace.
        context = None if call.trace_parent is None else self._otel.parent(*call.trace_parent)
        span = self._tracer.start_span(f"{call.endpoint.name} {call.model}", context=context, start_time=start_ns, attributes=attrs)
        if call.status >= 500:
            span.set_status(self._otel.error(call.error or ""))
        span.end(end_time=end_ns)


def _line(call: Call, rt: "Runtime", st: dict[str, float], end: float) -> bytes:
    usage = call.usage or {}
    line: dict[str, Any] = {
        "ts": round(time.time(), 3),
        "request_id": call.request_id,
        "tenant": call.tenant,
        "endpoint": call.endpoint.name,
        "model": call.model,
        "class": call.cls,
        "backend": call.backend,
        "attempts": call.attempts,
        "cache": call.cache,
        "stream": call.stream,
        "status": call.status,
        "finish": call.finish,
        "ttft_ms": None if call.ttft_s is None else round(call.ttft_s * 1000, 2),
        "duration_ms": round((end - call.t0) * 1000, 2),
        **{f"{name}_ms": round(s * 1000, 2) for name, s in st.items()},
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
    }
    if call.error:
        line["error"] = call.error[:300]
    if rt.policy.log.prompts:
        body = call.body
        line["prompt"] = body.get("messages", body.get("prompt", body.get("input")))
    return orjson.dumps(line, default=str)
