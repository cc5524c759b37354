"""Backends and their live state (latency, health, probes), and the pure ranking of candidates."""
