"""A latency-aware, OpenAI-compatible LLM routing gateway."""

__version__ = "0.1.0"
