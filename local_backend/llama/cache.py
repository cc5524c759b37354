"""A preallocated KV cache: one row per running sequence, each with its own length.

Rows 0..rows-1 are the running batch, kept contiguous so a decode step works on plain slices:
a finished row is replaced by the last one (``remove``). Each decode step writes one K/V
column per row at that row's length and clears one mask entry per row; nothing is concatenated,
padded or rebuilt per step. Capacity (positions per row) grows by doubling when a sequence needs
more, which copies the cache once in a while instead of every step.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]


class KVCache:
    """K and V for every layer: [slots, kv_heads, capacity, head_dim] each, plus per-row lengths."""

    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        capacity: int = 256,
        max_capacity: int = 8192,
    ) -> None:
        self.layers, self.slots, self.kv_heads, self.head_dim = layers, slots, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_capacity = max_capacity
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # Added to attention scores: 0 where a row holds a token, -inf elsewhere.
        self.bias = torch.zeros((slots, 0), dtype=torch.float32, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # = lengths, as a tensor
        self.lengths: list[int] = []  # one per running row
        self._rows_index = torch.arange(slots, device=device)
        self.reserve(min(capacity, max_capacity))

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def reserve(self, length: int) -> None:
        """Make room for ``length`` positions per row (doubling; zero-filled so unused columns are finite)."""
        if length <= self.capacity:
            return
        if length > self.max_capacity:
            raise ValueError(f"a sequence of {length} tokens exceeds the cache's {self.max_capacity} positions")
        new = self.capacity or 1
        while new < length:
            new *= 2
        new = min(new, self.max_capacity)
        shape = (self.slots, self.kv_heads, new, self.head_dim)
        for store in (self.keys, self.values):
            for i in range(self.layers):
                grown = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    grown[:, :, : self.capacity] = store[i]
                    store[i] = grown
                else:
                    store.append(grown)
        bias = torch.full((self.slots, new), float("-inf"), device=self.device)
        bias[:, : self.capacity] = self.bias
        self.bias, self.capacity = bias, new

    def add_row(self, length: int) -> int:
        """Claim the next row for a sequence whose first ``length`` positions the caller writes."""
        if self.rows >= self.slots:
            raise RuntimeError(f"all {self.slots} cache rows are in use")
        self.reserve(length)
        row = self.rows
        self.bias[row].fill_(float("-inf"))
        self.bias[row, :length] = 0.0
        self.positions[row] = length
        self.lengths.append(length)
        return row

    def remove(self, row: int) -> None:
        """Free ``row``: the last row moves into its place (the caller reorders its own list the same way)."""
        last = self.rows - 1
        if row != last:
            n = self.lengths[last]
            for store in (self.keys, self.values):
                for t in store:
                    t[row, :, :n] = t[last, :, :n]
            self.bias[row] = self.bias[last]
            self.positions[row] = self.positions[last]
            self.lengths[row] = n
        self.lengths.pop()

    def snapshot(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of ``row``'s first ``length`` positions of K and V, per layer (a reusable prefix)."""
        return [(k[row, :, :length].clone(), v[row, :, :length].clone()) for k, v in zip(self.keys, self.values, strict=True)]

    def restore(self, row: int, prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy a snapshot into the start of ``row``."""
        for (k, v), (pk, pv) in zip(zip(self.keys, self.values, strict=True), prefix, strict=True):
            k[row, :, : pk.shape[1]] = pk
            v[row, :, : pv.shape[1]] = pv

    def clear(self) -> None:
        """Free every row."""
        self.lengths = []

    def begin_step(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Open a decode step over every row: (row index [B], write positions [B], attended width).

        The step itself unmasks each row's position, writes K/V there and advances ``positions``
        (tensor ops only, so a CUDA graph can replay them); ``end_step`` updates the lengths.
        """
        width = max(self.lengths) + 1
        self.reserve(width)
        b = self.rows
        return self._rows_index[:b], self.positions[:b], width

    def end_step(self) -> None:
        """Every row gained the token the step wrote."""
        self.lengths = [n + 1 for n in self.lengths]

    def reset(self) -> None:
        """Free every row and forget what any step wrote (after CUDA-graph capture ran steps on nothing)."""
        self.lengths = []
        self.positions.zero_()
        self.bias.fill_(float("-inf"))
