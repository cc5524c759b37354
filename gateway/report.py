"""Reporting one attempt's outcome: to the backend's latency tracker, to its model's health (or
the backend's own), and to the metrics and the log, as health.OUTCOMES says. The relay reports;
health decides."""

from __future__ import annotations

import logging

from .backends import Backend
from .call import Call
from .health import outcome
from .metrics import BackendMetrics, Metrics

__all__ = ["report"]

log = logging.getLogger("gateway.relay")

# Outcomes that are not the backend's errors: not in gateway_upstream_errors_total.
_NOT_UPSTREAM_ERRORS = frozenset({"rejected", "context_length", "caller_deadline", "client_disconnect", "lost", "mismatch"})
# Outcomes about the backend as a whole, not one of its models.
_WHOLE_BACKEND = frozenset({"connect"})


def report(call: Call, backend: Backend, metrics: Metrics, m: BackendMetrics, kind: str, seconds: float) -> None:
    """Report one attempt's outcome to the backend's tracker and its model's health (or the
    backend's own, for a refused connection), as health.OUTCOMES says."""
    o = outcome(kind)
    if o.sample:
        completion = (call.usage or {}).get("completion_tokens") if kind == "ok" else None
        backend.tracker.observe_done(
            seconds,
            ok=kind == "ok",
            prompt_tokens=call.prompt_tokens,
            completion_tokens=completion if isinstance(completion, int) else None,
            streamed=call.stream,
            timeout=kind in ("timeout", "first_token_timeout"),
        )
    health = backend.health_for(call.model)
    if kind == "ok":
        health.report_success()
        backend.health.report_success()  # the backend as a whole answers, too
        return
    if kind not in _NOT_UPSTREAM_ERRORS:
        m.error(kind)
    if kind in ("http_429", "http_503"):
        metrics.relay_events.labels("cooldown", kind).inc()
    if o.health:
        if kind in _WHOLE_BACKEND:
            health = backend.health
        ejections = health.ejections
        health.report_failure()
        if health.ejections > ejections:
            m.ejections.inc()
            metrics.relay_events.labels("ejection", kind).inc()
            target = "" if health is backend.health else f" model {backend.upstream_model(call.model)!r}"
            log.warning("request %s: backend %r%s ejected for %.1f s after %d failures in a row (last: %s)",
                        call.request_id, backend.name, target, health.available_in(), health.consecutive_failures, kind)


