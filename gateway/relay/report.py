"""Reporting one attempt's outcome: to its model's latency tracker on the backend, to its model's
health (or the backend's own), and to the metrics and the log, as health.OUTCOMES says. The relay
reports; health decides."""

from __future__ import annotations

import logging

from ..observe.metrics import BackendMetrics, Metrics
from ..pipeline.call import Call
from ..routing.backends import Backend
from ..routing.health import LIVE_DEADLINE, OUTCOMES, Kind

__all__ = ["READ_PROMPT", "cut_short", "report"]

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
# A timeout this much shorter than the backend's first_token_ms was at a deadline from live data.
_AT_LIMIT = 0.98


def report(
    call: Call, backend: Backend, metrics: Metrics, m: BackendMetrics, kind: Kind, seconds: float,
    *, status: int | None = None, sample: bool = True, live: bool = False,
) -> None:
    """Report one attempt's outcome to its model's tracker and health on the backend (the
    backend's own health for a refused connection, and the backend's own tracker and health for a
    call that names no model), as health.OUTCOMES says. `status`: the upstream's HTTP status, for
    a 5xx's label; `sample`: whether the attempt is a latency sample at all (a by-id call is not).
    A timeout at a deadline from live data short of the backend's `first_token_ms` (`cut_short`),
    or a stall cut at one short of its `idle_ms` (`live`), is blamed on health.LIVE_DEADLINE: an
    ejection of such failures waits for a request probe."""
    o = OUTCOMES[kind]
    timeout = kind in (Kind.TIMEOUT, Kind.FIRST_TOKEN_TIMEOUT)
    if o.sample and sample:
        completion = None
        if kind is Kind.OK:  # an answer without usage: None; one that decodes nothing (embeddings): 0
            completion = (call.out.usage or {}).get("completion_tokens", None if call.endpoint.generates else 0)
        backend.tracker_for(call.model).observe_done(
            seconds,
            ok=kind is Kind.OK,
            prompt_tokens=call.prompt_tokens,
            completion_tokens=completion if isinstance(completion, int) else None,
            streamed=call.stream,
            timeout=timeout,
            open_ended=timeout and _open_ended(call),
            tenant=None if call.tenant is None else call.tenant.name,
            asked=o.asked,
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
        if live or (timeout and cut_short(backend, seconds)):
            health.report_failure(LIVE_DEADLINE, asked=True)
        else:
            health.report_failure(None if call.tenant is None else call.tenant.name, asked=o.asked)
        if health.ejections > ejections:
            m.ejections.inc()
            metrics.relay_events.labels("ejection", label).inc()
            target = "" if health is backend.health else f" model {backend.upstream_model(call.model)!r}"
            log.warning("request %s: backend %r%s ejected for %.1f s after %d failures in a row (last: %s)",
                        call.request_id, backend.name, target, health.available_in(), health.consecutive_failures, label)


def cut_short(backend: Backend, seconds: float) -> bool:
    """Whether a timeout after `seconds` came before the backend's configured first-token timeout
    (`first_token_ms`): at a deadline the relay set from live data while another backend could
    take over (2x the live P95, a cold backend's, a whole answer's from its live figures). Such a
    deadline is measured on other requests: a slower but ordinary one (a long prefill, a reasoning
    model's thinking) passes it, and when it was measured on a flood of fast ones (one tenant's
    tiny model, tiny prompts) two tenants' ordinary requests timing out there ejected a healthy
    backend (review helper's repro). So it fails over and teaches the prediction, and counts
    against health as the live deadline's (health.LIVE_DEADLINE): an ejection of such timeouts
    waits for a request probe, which a hung backend fails and a healthy one answers. (A timer
    never fires early: a deadline at the limit takes at least that long.)"""
    return seconds < _AT_LIMIT * backend.timeouts.first_token_ms / 1000


def _open_ended(call: Call) -> bool:
    """A whole answer the request set no length limit on: its deadline passing says how long the
    caller let it run, not how slow the backend's first token is (one 300-token answer without
    max_tokens, cut at the 2 s deadline, raised its backend's predicted TTFT from 7 ms to 1 s and
    moved every tenant's traffic: review helper's repro). Counted, but not learnt from
    (Tracker.observe_done); its health counts it, as a failure a request can cause
    (health.OUTCOMES: asked; `cut_short`: the live deadline's)."""
    return not call.stream and call.endpoint.generates and call.max_output_tokens() is None
