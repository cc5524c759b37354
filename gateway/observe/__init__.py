"""Observation: Prometheus metrics, Server-Timing, the access log, OpenTelemetry spans."""
