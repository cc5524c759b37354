"""Every Prometheus metric, declared in one place, on the app's own registry (no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import multiprocess
import os

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 1.5, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2.5)
_QUEUE_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class Metrics:
    """The gateway's metrics. With `gateway serve --workers N`, values live in
    PROMETHEUS_MULTIPROC_DIR and /metrics aggregates every worker."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
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
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds", "Time spent waiting for a backend slot", buckets=_QUEUE_BUCKETS, registry=r
        )
        self.upstream_errors = Counter(
            "gateway_upstream_errors", "Backend failures by kind", ["backend", "kind"], registry=r
        )
        self.failovers = Counter(
            "gateway_failovers", "Requests moved to another backend before the first byte", ["backend"], registry=r
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

    def exposition(self) -> bytes:
        """The text /metrics serves; all workers' values when running multi-process."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)
