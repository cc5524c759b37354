"""Every Prometheus metric, declared in one place, on the app's own registry (no globals)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from ..admission.gate import BANDS
from ..classify.classifier import Stage
from .hot import Folder, Hot

if TYPE_CHECKING:
    from ..admission.gate import Admission
    from ..config.runtime import Runtime

__all__ = ["Metrics", "BackendMetrics", "STAGES", "refresh_gauges"]

# Where a request's time went, in order, without overlap (gateway_stage_seconds{stage}):
# gateway: its own work (parse, auth, classify, cache lookup, routing) and failed attempts;
# queue: waiting for admission, a backend slot or a single flight's leader; upstream_headers:
# request sent -> response headers; first_token: headers -> first content token (prefill);
# decode: first token -> end (a non-streamed answer: reading its body).
STAGES = ("gateway", "queue", "upstream_headers", "first_token", "decode")

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 1.5, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)
_SHED_REASONS = ("queue_full", "deadline", "expired", "standing_queue")
_QUOTA_LIMITS = ("rpm", "tpm", "concurrency", "tokens_per_day", "spend_per_day_usd")
_ENCODER_BUCKETS = (0.001, 0.002, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.03, 0.05, 0.1)
_QUEUE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """The gateway's metrics. With `gateway serve --workers N`, values live in
    PROMETHEUS_MULTIPROC_DIR and /metrics aggregates every worker."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        # The children every request updates add into plain numbers, folded in at each collection
        # (the folder is collected first): hot.py.
        self.hot = hot = Hot()
        r.register(Folder(hot))
        # Declared by family, in this order (the order /metrics lists them in).
        self._request_metrics(r)
        self._admission_metrics(r)
        self._relay_metrics(r)
        self._backend_metrics(r)
        self._cache_and_quota_metrics(r)
        self._stage_and_affinity_metrics(r)
        # Bound once: labels() is slow on the hot path, and these label sets are fixed.
        self.stages = {s: hot.histogram(self.stage.labels(s)) for s in STAGES}
        self.lookup = {res: hot.counter(self.cache_lookups.labels(res)) for res in ("hit", "miss", "bypass")}
        self.per_class = {c: hot.counter(self.classified.labels(c)) for c in ("simple", "complex")}  # never "none"
        self.per_stage = {s: hot.counter(self.classifier_decisions.labels(s.value)) for s in Stage}
        self.access_log_drops = {r: self.access_log_dropped.labels(r) for r in ("queue_full", "write")}  # at 0 from the start
        self.backend_names: frozenset[str] | None = None  # the runtime's, at the last refresh_gauges (None: all)
        self._requests: dict[tuple[str, str, str, str, int], Any] = {}
        self._backends: dict[str, BackendMetrics] = {}
        self._durations: dict[str, Any] = {}
        self._affinity: dict[tuple[str, str], Any] = {}
        self._prefix: dict[tuple[str, str, str], Any] = {}
        self._tokens: dict[tuple[str, str, str], Any] = {}
        self._spend: dict[str, Any] = {}

    def _request_metrics(self, r: CollectorRegistry) -> None:
        """Answered requests, and how long they and their streams took."""
        self.requests = Counter(
            "gateway_requests", "Requests answered", ["model", "backend", "class", "cache", "code"], registry=r
        )
        self.duration = Histogram(
            "gateway_request_duration_seconds", "Request duration, start to last byte", ["backend"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.ttft = Histogram(
            "gateway_ttft_seconds", "Time to the first content token of a stream", ["backend"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.inter_token = Histogram(
            "gateway_inter_token_seconds", "Gaps between content chunks of a stream", ["backend"],
            buckets=_ITL_BUCKETS, registry=r,
        )

    def _admission_metrics(self, r: CollectorRegistry) -> None:
        """Queues, sheds and the admitted requests (admission/gate.py)."""
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds", "Time spent queued (admission, a backend slot), per priority band", ["priority"],
            buckets=_QUEUE_BUCKETS, registry=r,
        )
        self.shed = Counter(
            "gateway_shed", "Requests refused or dropped by admission: queue_full, deadline (predicted), expired (in a queue)",
            ["reason", "priority"], registry=r,
        )
        self.queue_depth = Gauge(
            "gateway_queue_depth", "Requests waiting (admission and backend queues), per priority band", ["priority"],
            registry=r, multiprocess_mode="livesum",
        )
        self.admission_inflight = Gauge(
            "gateway_admission_inflight", "Requests admitted and relaying", registry=r, multiprocess_mode="livesum",
        )

    def _relay_metrics(self, r: CollectorRegistry) -> None:
        """What happened while relaying: backend failures and what the relay did about them,
        dropped chunks, clients that left, tokens used."""
        self.upstream_errors = Counter(
            "gateway_upstream_errors", "Backend failures by kind", ["backend", "kind"], registry=r
        )
        self.failovers = Counter(
            "gateway_failovers", "Requests moved to another backend before the first byte", ["backend"], registry=r
        )
        self.relay_events = Counter(
            "gateway_relay_events",
            "What the relay did about a failing backend: failover, retry, cooldown, ejection, continuation, "
            "context_fallback; reason: the outcome that caused it (or the continuation's mode and result)",
            ["event", "reason"], registry=r,
        )
        self.malformed_chunks = Counter(
            "gateway_stream_malformed_chunks", "Stream events dropped as malformed", ["backend"], registry=r
        )
        self.client_disconnects = Counter(
            "gateway_client_disconnects", "Requests whose client went away before the end", registry=r
        )
        self.tokens = Counter(
            "gateway_tokens", "Tokens reported by backends", ["tenant", "backend", "kind"], registry=r
        )

    def _backend_metrics(self, r: CollectorRegistry) -> None:
        """Backends' live state and health, and the routing decisions around them (reloads, classes, hedges)."""
        self.inflight = Gauge(
            "gateway_backend_inflight", "Requests in flight per backend", ["backend"], registry=r,
            multiprocess_mode="livesum",
        )
        self.healthy = Gauge(
            "gateway_backend_healthy", "1 when the backend takes traffic", ["backend"], registry=r,
            multiprocess_mode="livemax",
        )
        self.policy_reloads = Counter(
            "gateway_policy_reloads", "Policy reload attempts", ["result"], registry=r
        )
        self.classified = Counter(
            "gateway_classified", "Requests per class from the classifier", ["class"], registry=r
        )
        self.classifier_decisions = Counter(
            "gateway_classifier_decisions", "Classified requests by the cascade stage that decided: rule, lexical, "
            "encoder, deadline (the encoder too late or too busy: complex)", ["stage"], registry=r,
        )
        self.classifier_encoder_seconds = Histogram(
            "gateway_classifier_encoder_seconds", "What an uncertain request waited for the classifier's encoder "
            "(queue and scoring; a deadline ends it)", buckets=_ENCODER_BUCKETS, registry=r,
        )
        self.hedges = Counter(
            "gateway_hedges", "Hedged requests: started, won (the hedge answered first), lost, budget_exhausted, no_candidate",
            ["result"], registry=r,
        )
        self.ejections = Counter(
            "gateway_backend_ejections", "Times a backend was ejected by passive health checks", ["backend"], registry=r
        )
        self.probes = Counter("gateway_probes", "Active health probes", ["backend", "result"], registry=r)
        self.health_verifications = Counter(
            "gateway_health_verifications", "Request probes that decided a run of failures one tenant's requests alone met "
            "(or timeouts at live deadlines): "
            "cleared (answered: not ejected) or confirmed (failed too: ejected)", ["backend", "result"], registry=r)
        self.ttft_p95 = Gauge(
            "gateway_backend_ttft_p95_seconds", "Live TTFT P95 per backend (60 s window)", ["backend"], registry=r,
            multiprocess_mode="livemax",
        )

    def _cache_and_quota_metrics(self, r: CollectorRegistry) -> None:
        """The response cache's decisions and failures; tenant limits and spend."""
        self.cache_lookups = Counter(
            "gateway_cache_lookups", "Cache decisions per request: hit, miss, bypass", ["result"], registry=r
        )
        self.cache_errors = Counter(
            "gateway_cache_errors", "Cache store failures (the request went upstream)", ["op"], registry=r
        )
        self.quota_rejections = Counter(
            "gateway_quota_rejections", "Requests refused by a tenant limit", ["tenant", "limit"], registry=r
        )
        self.spend = Counter("gateway_spend_usd", "Spend from the backends' prices, USD", ["tenant"], registry=r)
        self.quota_degraded = Counter(
            "gateway_quota_degraded", "Quota operations answered by this replica's own counters (shared store failing)",
            registry=r,
        )
        self.request_log_dropped = Counter(
            "gateway_request_log_dropped", "Request log entries dropped: queue_full (the writer is behind), store (a write failed), "
            "encode (an entry the writer could not make: a bug, logged)",
            ["reason"], registry=r,
        )
        self.access_log_dropped = Counter(
            "gateway_access_log_dropped", "Access log lines dropped: queue_full (stdout slow or stalled), write (stdout failed)",
            ["reason"], registry=r,
        )

    def _stage_and_affinity_metrics(self, r: CollectorRegistry) -> None:
        """Where each request's time went (STAGES), and the Responses API's affinity records."""
        self.stage = Histogram(
            "gateway_stage_seconds", "Where each request's time went: " + ", ".join(STAGES), ["stage"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.affinity = Counter(
            "gateway_responses_affinity",
            "Responses API id -> (backend, owner) records: learn (ok, error, conflict), lookup (hit, miss, error), forget",
            ["op", "result"], registry=r,
        )
        self.prefix_affinity = Counter(
            "gateway_prefix_affinity",
            "Prefix-affinity decisions per pool (model, class): hit (sent where its prefix is cached), "
            "miss (cached nowhere yet: its home), spill (its holder was unhealthy, loaded or slower)",
            ["model", "class", "result"], registry=r,
        )

    def prefix_affinity_of(self, model: str, cls: str, result: str) -> Any:
        """The prefix-affinity counter child of (model, class, hit | miss | spill), bound once."""
        key = (model, cls, result)
        child = self._prefix.get(key)
        if child is None:
            child = self._prefix[key] = self.hot.counter(self.prefix_affinity.labels(model, cls, result))
        return child

    def affinity_event(self, op: str, result: str) -> None:
        """Count one operation on the Responses affinity map (children bound once: labels() is slow)."""
        child = self._affinity.get((op, result))
        if child is None:
            child = self._affinity[(op, result)] = self.hot.counter(self.affinity.labels(op, result))
        child.inc()

    def zero_series(self, tenants: list[str]) -> None:
        """Create the refusal series at 0 (sheds; quota rejections per tenant label): a rate over
        a series that does not exist yet is "no data" on a dashboard, not 0."""
        for reason in _SHED_REASONS:
            for band in BANDS:
                self.shed.labels(reason, band)
        for tenant in tenants:
            for limit in _QUOTA_LIMITS:
                self.quota_rejections.labels(tenant, limit)

    def request_done(self, model: str, backend: str, cls: str, cache: str, code: int) -> None:
        """Count one answered request (label children are cached: labels() is slow on the hot path)."""
        key = (model, backend, cls, cache, code)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.hot.counter(self.requests.labels(model, backend, cls, cache, str(code)))
        child.inc()

    def tokens_of(self, tenant: str, backend: str, kind: str) -> Any:
        """The token counter child of (tenant, backend, prompt | completion), bound once."""
        key = (tenant, backend, kind)
        child = self._tokens.get(key)
        if child is None:
            child = self._tokens[key] = self.hot.counter(self.tokens.labels(tenant, backend, kind))
        return child

    def spend_of(self, tenant: str) -> Any:
        """The spend counter child of a tenant's metric label, bound once."""
        child = self._spend.get(tenant)
        if child is None:
            child = self._spend[tenant] = self.hot.counter(self.spend.labels(tenant))
        return child

    def duration_of(self, backend: str) -> Any:
        """The request-duration child of a backend, or of the pseudo backends `cache` and `none`
        (which get no per-backend failover, ejection or error series)."""
        child = self._durations.get(backend)
        if child is None:
            child = self._durations[backend] = self.hot.histogram(self.duration.labels(backend))
        return child

    def for_backend(self, name: str) -> "BackendMetrics":
        """The per-backend children, looked up once per backend."""
        bm = self._backends.get(name)
        if bm is None:
            bm = self._backends[name] = BackendMetrics(self, name)
        return bm

    def exposition(self) -> bytes:
        """The text /metrics serves; all workers' values when running multi-process. The live
        gauges of a backend that a reload removed are left out (`backend_names`)."""
        source: Any = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            source = CollectorRegistry()
            multiprocess.MultiProcessCollector(source)
        return generate_latest(_InForce(source, self.backend_names))


# Gauges of a backend's live state: a backend no longer in the policy has none. Filtered out at
# exposition rather than removed: prometheus_client cannot remove a series from the multiprocess
# mmap files, and a backend added back must keep counting on the same child.
_BACKEND_GAUGES = ("gateway_backend_inflight", "gateway_backend_healthy", "gateway_backend_ttft_p95_seconds")


class _InForce:
    """A collector view of `source` without the backend gauges of backends not in `names`."""

    def __init__(self, source: Any, names: frozenset[str] | None) -> None:
        self._source, self._names = source, names

    def collect(self) -> Any:
        names = self._names
        for family in self._source.collect():
            if names is not None and family.name in _BACKEND_GAUGES:
                family.samples = [s for s in family.samples if s.labels.get("backend") in names]
            yield family


def refresh_gauges(m: Metrics, rt: "Runtime", admission: "Admission") -> None:
    """Set the gauges that mirror live state (queues, in flight, health, live TTFT P95), for the
    backends of `rt` (the runtime in force: those of backends it no longer has leave /metrics).
    Called on every scrape, and every second in each worker of `--workers N` (a scrape reaches
    one worker, but /metrics shows all of them)."""
    m.backend_names = frozenset(rt.backends)
    depth = dict(admission.gate.queue.sizes)
    for b in rt.backends.values():
        for band, n in b.slots.queue.sizes.items():
            depth[band] += n
    for band, n in depth.items():
        m.queue_depth.labels(band).set(n)
    m.admission_inflight.set(admission.gate.used)
    for b in rt.backends.values():
        m.healthy.labels(b.name).set(1 if b.takes_traffic() else 0)
        p95 = b.tracker.ttft_p95_s(min_samples=1)
        if p95 is not None:
            m.ttft_p95.labels(b.name).set(p95)


class BackendMetrics:
    """Label children of one backend, bound once."""

    __slots__ = ("duration", "ttft", "inter_token", "inflight", "failovers", "malformed", "ejections", "_errors", "_m", "name")

    def __init__(self, m: Metrics, name: str) -> None:
        self._m = m
        self.name = name
        self.duration = m.duration_of(name)
        self.ttft = m.hot.histogram(m.ttft.labels(name))
        self.inter_token = m.hot.histogram(m.inter_token.labels(name))
        self.inflight = m.hot.gauge(m.inflight.labels(name))  # mirrors the backend's slot count, per process
        self.failovers = m.failovers.labels(name)
        self.malformed = m.malformed_chunks.labels(name)
        self.ejections = m.ejections.labels(name)
        self._errors: dict[str, Any] = {}

    def error(self, kind: str) -> None:
        child = self._errors.get(kind)
        if child is None:
            child = self._errors[kind] = self._m.upstream_errors.labels(self.name, kind)
        child.inc()
