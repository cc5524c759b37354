"""Where each request's time went: the Server-Timing header, per-stage histograms, the JSON access
log and (optionally) an OpenTelemetry span. Called once per API request, after its answer.

The stages (metrics.STAGES) come from four stamps on the Call: its start (`t0`), the request sent
upstream (`sent_at`), the upstream's headers (`headers_at`) and the first content token
(`t0 + ttft_s`); `queue_ms` is the wait for admission or a backend slot.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import re
import sys
import threading
import time
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
    if not call.timing.sent_at:  # answered without an upstream call (cache, refusal)
        out["gateway"] = max(0.0, end - call.timing.t0 - queue_s)
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
            self.request_log.add(call, rt, end, rt.spend_usd(call))
        if self.force_access_log or rt.policy.log.access:
            access = self._access or self._start_access_log()  # a reload may have turned it on
            access.write(_line(call, rt, st, end))
        if self._tracer is not None:
            self._span(call, st, end)

    # ---- access log -----------------------------------------------------------------------------

    def _start_access_log(self) -> AccessLog:
        self._access = AccessLog(sys.stdout)
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
        attrs: dict[str, Any] = {
            "gateway.request_id": call.request_id, "gateway.tenant": "" if call.tenant is None else call.tenant.name, "gen_ai.request.model": call.model,
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
        span = self._tracer.start_span(f"{call.endpoint.name} {call.model}", context=context, start_time=start_ns, attributes=attrs)
        if call.out.status >= 500:
            span.set_status(self._otel.error(call.out.error or ""))
        span.end(end_time=end_ns)


class AccessLog:
    """One JSON line per request on `out`, written by a thread in batches: a slow pipe never
    stalls the event loop, and a request costs a queue put, not a logging record and a thread
    wake-up (the queue is unbounded; a line is a few hundred bytes)."""

    _EVERY_S = 0.05  # how often the writer wakes up to write what came

    def __init__(self, out: TextIO) -> None:
        self._out = out
        self._q: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gateway-access-log", daemon=True)
        self._thread.start()

    def write(self, line: bytes) -> None:
        self._q.put(line)

    def close(self) -> None:
        """Write what is queued and stop the writer."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._EVERY_S):
            self._flush()
        self._flush()

    def _flush(self) -> None:
        lines: list[bytes] = []
        with contextlib.suppress(queue.Empty):
            while True:
                lines.append(self._q.get_nowait())
        if lines:
            lines.append(b"")
            try:
                self._out.write(b"\n".join(lines).decode())
                self._out.flush()
            except (OSError, ValueError):  # stdout closed or gone: the lines are dropped, not the gateway
                pass


_STAGE_KEYS = {name: f"{name}_ms" for name in STAGES}  # the access log's field per stage (stages() names only these)


def _line(call: Call, rt: "Runtime", st: dict[str, float], end: float) -> bytes:
    usage = call.out.usage or {}
    line: dict[str, Any] = {
        "ts": round(time.time(), 3),
        "request_id": call.request_id,
        "tenant": None if call.tenant is None else call.tenant.name,
        "endpoint": call.endpoint.name,
        "model": call.model,
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
        line["error"] = call.out.error[:300]
    if rt.policy.log.prompts:
        body = call.body
        line["prompt"] = body.get("messages", body.get("prompt", body.get("input")))
    return orjson.dumps(line, default=str)
