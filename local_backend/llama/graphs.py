"""Decode steps replayed as CUDA graphs: for a 135M model a GPU step is bound by kernel launches.

One graph per batch size 1..slots, captured once over a cache allocated at full capacity (so no
tensor moves and every shape is fixed: attention always spans the whole capacity, masked). The
graphs share one memory pool; capture runs real steps on empty rows, so the cache is reset after.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .cache import KVCache
    from .model import LeanLlama

__all__ = ["CudaGraphs"]


class CudaGraphs:
    """Captured decode steps for every batch size of ``cache``."""

    def __init__(self, model: LeanLlama, cache: KVCache) -> None:
        if cache.capacity != cache.max_capacity:
            raise ValueError("CUDA graphs need a cache allocated at full capacity (it must never move)")
        self._graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        pool = None
        for b in range(cache.slots, 0, -1):  # largest first, so smaller ones fit in its pool
            tokens = torch.zeros(b, dtype=torch.long, device=cache.device)
            rows, pos = cache._rows_index[:b], cache.positions[:b]

            def step(tokens: torch.Tensor = tokens, rows: torch.Tensor = rows, pos: torch.Tensor = pos) -> torch.Tensor:
                return model.decode_tensors(tokens, cache, rows, pos, cache.capacity)

            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()  # warm-up outside capture (allocator, kernel selection)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = step()
            pool = graph.pool()
            self._graphs[b] = (graph, tokens, logits)
            cache.reset()

    def replay(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run one decode step for ``tokens`` [B] over the cache's B rows; the logits are valid until the next step."""
        graph, static_tokens, logits = self._graphs[int(tokens.shape[0])]
        static_tokens.copy_(tokens)
        graph.replay()
        cache.end_step(int(tokens.shape[0]))
        return logits
