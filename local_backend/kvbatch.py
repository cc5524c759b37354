"""The running batch's KV cache: rows of different lengths, left-padded to a common length.

A new sequence is prefilled alone (exact, no padding) and then spliced in as a new row; a
finished one is dropped, and columns that became padding in every row are trimmed so the
cache does not keep growing with the longest sequence that ever ran.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

__all__ = ["BatchCache"]


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """Pad dim -2 (the sequence axis of a [batch, heads, seq, dim] tensor) with ``n`` zero columns."""
    if n == 0:
        return t
    pad = t.new_zeros((*t.shape[:-2], n, t.shape[-1]))
    return torch.cat([pad, t], dim=-2)


class BatchCache:
    """A DynamicCache plus a [batch, seq] mask of which positions hold real tokens."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # int64 [batch, seq], 1 = real token

    @property
    def rows(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    def add(self, cache: DynamicCache, length: int) -> None:
        """Append a single-row cache of ``length`` real tokens (no padding) as the last row."""
        new_mask = torch.ones((1, length), dtype=torch.long, device=cache.layers[0].keys.device)
        if self.cache is None or self.mask is None:
            self.cache, self.mask = cache, new_mask
            return
        width = self.mask.shape[1]
        grow_batch, grow_new = max(0, length - width), max(0, width - length)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, grow_batch), _left_pad(theirs.keys, grow_new)], dim=0)
            mine.values = torch.cat([_left_pad(mine.values, grow_batch), _left_pad(theirs.values, grow_new)], dim=0)
        old = torch.nn.functional.pad(self.mask, (grow_batch, 0))
        self.mask = torch.cat([old, torch.nn.functional.pad(new_mask, (grow_new, 0))], dim=0)

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mask [batch, seq + 1] and position ids [batch, 1] for one decode step."""
        assert self.mask is not None
        positions = self.mask.sum(dim=1, keepdim=True)
        return torch.nn.functional.pad(self.mask, (0, 1), value=1), positions

    def advance(self) -> None:
        """Record that every row gained one real token (the model already appended its K/V)."""
        assert self.mask is not None
        self.mask = torch.nn.functional.pad(self.mask, (0, 1), value=1)

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order) and trim columns that are padding everywhere."""
        if self.cache is None or self.mask is None:
            return
        if not rows:
            self.cache = self.mask = None
            return
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(dim=0).long().argmax().item())  # first column that is real somewhere
        self.mask = mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:, :]
            layer.values = layer.values.index_select(0, index)[:, :, start:, :]
