"""Engine counters, written by the engine thread and read by /metrics, in Prometheus text format."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .llama.prefix import PrefixStats

__all__ = ["EngineStats", "render_load"]

_TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_RATE_WINDOW_S = 10.0


class EngineStats:
    """Thread-safe counters and gauges for one engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.queue_depth = 0
        self.batch_size = 0
        self.requests: dict[str, int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.steps = 0
        self._ttft_counts = [0] * (len(_TTFT_BUCKETS_S) + 1)
        self._ttft_sum = 0.0
        self._recent: deque[tuple[float, int]] = deque()

    def set_load(self, queue_depth: int, batch_size: int) -> None:
        with self._lock:
            self.queue_depth, self.batch_size = queue_depth, batch_size

    def observe_ttft(self, seconds: float, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self._ttft_sum += seconds
            idx = next((i for i, b in enumerate(_TTFT_BUCKETS_S) if seconds <= b), len(_TTFT_BUCKETS_S))
            self._ttft_counts[idx] += 1

    def observe_tokens(self, n: int, *, decode_step: bool) -> None:
        """Count ``n`` generated tokens, from one decode step or one prefill."""
        now = time.monotonic()
        with self._lock:
            self.steps += decode_step
            self.completion_tokens += n
            self._recent.append((now, n))
            while self._recent and now - self._recent[0][0] > _RATE_WINDOW_S:
                self._recent.popleft()

    def observe_finish(self, reason: str) -> None:
        with self._lock:
            self.requests[reason] = self.requests.get(reason, 0) + 1

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last few seconds."""
        now = time.monotonic()
        with self._lock:
            total = sum(n for t, n in self._recent if now - t <= _RATE_WINDOW_S)
        return total / _RATE_WINDOW_S

    def render(self, model: str, passes: dict[tuple[str, int], int] | None = None) -> str:
        """Prometheus text exposition of every counter; ``passes``: forward passes per (kind, thread count)."""
        label = f'model="{model}"'
        rate = self.tokens_per_second()
        with self._lock:
            lines = [
                "# TYPE local_backend_queue_depth gauge",
                f"local_backend_queue_depth{{{label}}} {self.queue_depth}",
                "# TYPE local_backend_batch_size gauge",
                f"local_backend_batch_size{{{label}}} {self.batch_size}",
                "# TYPE local_backend_tokens_per_second gauge",
                f"local_backend_tokens_per_second{{{label}}} {rate:.3f}",
                "# TYPE local_backend_prompt_tokens_total counter",
                f"local_backend_prompt_tokens_total{{{label}}} {self.prompt_tokens}",
                "# TYPE local_backend_completion_tokens_total counter",
                f"local_backend_completion_tokens_total{{{label}}} {self.completion_tokens}",
                "# TYPE local_backend_decode_steps_total counter",
                f"local_backend_decode_steps_total{{{label}}} {self.steps}",
                "# TYPE local_backend_requests_total counter",
            ]
            lines += [
                f'local_backend_requests_total{{{label},finish_reason="{r}"}} {n}'
                for r, n in sorted(self.requests.items())
            ]
            lines.append("# TYPE local_backend_ttft_seconds histogram")
            cumulative = 0
            for bound, count in zip((*_TTFT_BUCKETS_S, float("inf")), self._ttft_counts, strict=True):
                cumulative += count
                le = "+Inf" if bound == float("inf") else repr(bound)
                lines.append(f'local_backend_ttft_seconds_bucket{{{label},le="{le}"}} {cumulative}')
            lines.append(f"local_backend_ttft_seconds_sum{{{label}}} {self._ttft_sum:.6f}")
            lines.append(f"local_backend_ttft_seconds_count{{{label}}} {cumulative}")
        if passes:
            lines.append("# TYPE local_backend_forward_passes_total counter")
            lines += [
                f'local_backend_forward_passes_total{{{label},pass="{kind}",threads="{n}"}} {count}'
                for (kind, n), count in sorted(passes.items())
            ]
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_load(model: str, load: Mapping[str, float], prefix: PrefixStats | None, info: Mapping[str, str]) -> str:
    """vLLM's load and cache series (so a router that reads vLLM's /metrics reads ours alike), the prefix
    cache's own counters, and ``local_backend_info`` naming the compute path (mode, kernel build, device).

    vLLM names: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``
    (the KV positions running sequences hold over the cache's budget, 0..1), ``vllm:prefix_cache_queries_total``
    and ``vllm:prefix_cache_hits_total`` (prompt tokens looked up, and found, as vLLM's V1 engine counts them).
    """
    label = f'model_name="{_escape(model)}"'
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{label}}} {float(load['batch_size'])}",
        "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{label}}} {float(load['queue_depth'])}",
        "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{label}}} {float(load['kv_cache_usage']):.6f}",
        "# TYPE local_backend_kv_cache_bytes gauge",
        f"local_backend_kv_cache_bytes{{{label}}} {int(load['kv_cache_bytes'])}",
    ]
    if prefix is not None:
        lines += [
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{label}}} {float(prefix.queries_tokens)}",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{label}}} {float(prefix.hits_tokens)}",
            "# TYPE local_backend_prefix_cache_blocks gauge",
            f"local_backend_prefix_cache_blocks{{{label}}} {prefix.blocks}",
            "# TYPE local_backend_prefix_cache_capacity_blocks gauge",
            f"local_backend_prefix_cache_capacity_blocks{{{label},block_tokens=\"{prefix.block_tokens}\"}} {prefix.capacity_blocks}",
            "# TYPE local_backend_prefix_cache_stored_blocks_total counter",
            f"local_backend_prefix_cache_stored_blocks_total{{{label}}} {prefix.stored_blocks}",
            "# TYPE local_backend_prefix_cache_evicted_blocks_total counter",
            f"local_backend_prefix_cache_evicted_blocks_total{{{label}}} {prefix.evicted_blocks}",
        ]
    if info:
        pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(info.items()))
        lines += ["# TYPE local_backend_info gauge", f"local_backend_info{{{label},{pairs}}} 1"]
    return "\n".join(lines) + "\n"
