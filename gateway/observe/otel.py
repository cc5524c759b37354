"""OpenTelemetry export (the optional `otel` extra): imported only when the policy asks for
tracing (observe.Observer), so a gateway without it never loads the SDK."""

from __future__ import annotations

from typing import Any

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, Status, StatusCode, TraceFlags, set_span_in_context

from ..config.policy import TracingPolicy

__all__ = ["error", "parent", "provider"]

# The longest string attribute a span keeps (the SDK cuts longer ones). The gateway cuts the
# caller's strings itself (observer.MODEL_CHARS); this bounds any other, so the batch queue's
# 2048 spans stay a few MiB whatever the callers send.
MAX_ATTRIBUTE_CHARS = 512


def provider(tp: TracingPolicy) -> TracerProvider:
    """A tracer provider exporting over OTLP/HTTP, sampling as the policy says."""
    out = TracerProvider(
        # A caller's traceparent decides for its own trace (its sampled flag); sample_ratio for the rest.
        resource=Resource.create({"service.name": tp.service_name}),
        sampler=ParentBased(TraceIdRatioBased(tp.sample_ratio)),
        span_limits=SpanLimits(max_attribute_length=MAX_ATTRIBUTE_CHARS),
    )
    out.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=tp.otlp_endpoint)))
    return out


def parent(trace_id: int, span_id: int, flags: int) -> Any:
    """The caller's span (from its traceparent) as the context of the gateway's."""
    return set_span_in_context(NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 1))))


def error(message: str) -> Status:
    return Status(StatusCode.ERROR, message)
