"""Reporting one attempt's outcome: to the backend's latency tracker, to its model's health (or
the backend's own), and to the metrics and the log, as health.OUTCOMES says. The relay reports;
health decides."""

from __future__ import annotations

import logging

from ..observe.metrics import BackendMetrics, Metrics
from ..pipeline.call import Call
from ..routing.backends import Backend
from ..routing.health import OUTCOMES, Kind

__all__ = ["READ_PROMPT", "report"]

log = logging.getLogger("gateway.relay")

# Outcomes that are not the backend's errors: not in gateway_upstream_errors_total.
_NOT_UPSTREAM_ERRORS = frozenset({Kind.REJECTED, Kind.CONTEXT_LENGTH, Kind.CALLER_DEADLINE, Kind.CLIENT_DISCONNECT,
                                  Kind.LOST, Kind.MISMATCH, Kind.KEY_REVOKED})
# Outcomes after which the backend had read the prompt (answered, or failed or was cut once at
# work on it): each such attempt costs the tenant its prompt (quota.py _tokens_used). A prompt
# whose prefill outlasts every backend's first-token deadline was read by three backends and
# charged once (review helper's repro). Refusals (429, 503, 4xx), refused connections and 5xx
# answers (most come before any work) are not counted.
READ_PROMPT = frozenset({Kind.OK, Kind.TIMEOUT, Kind.FIRST_TOKEN_TIMEOUT, Kind.MALFORMED, Kind.TOO_LARGE, Kind.ERROR_EVENT,
                         Kind.CUT, Kind.DISCONNECT, Kind.CUT_MID_STREAM, Kind.ERROR_EVENT_MID_STREAM, Kind.MISMATCH})
# Outcomes about the backend as a whole, not one of its models.
_WHOLE_BACKEND = frozenset({Kind.CONNECT})


def report(
    call: Call, backend: Backend, metrics: Metrics, m: BackendMetrics, kind: Kind, seconds: float,
    *, status: int | None = None, sample: bool = True,
) -> None:
    """Report one attempt's outcome to the backend's tracker and its model's health (or the
    backend's own, for a refused connection, or for a call that names no model), as
    health.OUTCOMES says. `status`: the upstream's HTTP status, for a 5xx's label; `sample`:
    whether the attempt is a latency sample at all (a by-id call is not)."""
    o = OUTCOMES[kind]
    if o.sample and sample:
        timeout = kind in (Kind.TIMEOUT, Kind.FIRST_TOKEN_TIMEOUT)
        completion = None
        if kind is Kind.OK:  # an answer without usage: None; one that decodes nothing (embeddings): 0
            completion = (call.out.usage or {}).get("completion_tokens", None if call.endpoint.generates else 0)
        backend.tracker.observe_done(
            seconds,
            ok=kind is Kind.OK,
            prompt_tokens=call.prompt_tokens,
            completion_tokens=completion if isinstance(completion, int) else None,
            streamed=call.stream,
            timeout=timeout,
            open_ended=timeout and _open_ended(call),
            tenant=None if call.tenant is None else call.tenant.name,
        )
    health = backend.health_for(call.model) if call.model else backend.health
    if kind is Kind.OK:
        health.report_success()
        backend.health.report_success()  # the backend as a whole answers, too
        return
    label = kind.label(status)
    if kind not in _NOT_UPSTREAM_ERRORS:
        m.error(label)
    if kind in (Kind.HTTP_429, Kind.HTTP_503):
        metrics.relay_events.labels("cooldown", label).inc()
    if o.health:
        if kind in _WHOLE_BACKEND:
            health = backend.health
        ejections = health.ejections
        health.report_failure(None if call.tenant is None else call.tenant.name, asked=o.asked)
        if health.ejections > ejections:
            m.ejections.inc()
            metrics.relay_events.labels("ejection", label).inc()
            target = "" if health is backend.health else f" model {backend.upstream_model(call.model)!r}"
            log.warning("request %s: backend %r%s ejected for %.1f s after %d failures in a row (last: %s)",
                        call.request_id, backend.name, target, health.available_in(), health.consecutive_failures, label)


def _open_ended(call: Call) -> bool:
    """A whole answer the request set no length limit on: its deadline passing says how long the
    caller let it run, not how slow the backend's first token is (one 300-token answer without
    max_tokens, cut at the 2 s deadline, raised its backend's predicted TTFT from 7 ms to 1 s and
    moved every tenant's traffic: review helper's repro). Counted, but not learnt from
    (LatencyTracker.observe_done); its health counts it, as a failure a request can cause
    (health.OUTCOMES: asked)."""
    return not call.stream and call.endpoint.generates and call.max_output_tokens() is None
