"""The running sequences' KV cache: one row per sequence, each with its own length, sized to what runs.

Rows 0..rows-1 are the running batch, kept contiguous so a decode step works on plain slices:
a finished row is replaced by the last one (``remove``). Each decode step writes one K/V column
per row at that row's length and clears one mask entry per row; nothing is concatenated, padded
or rebuilt per step.

The allocation is [allocated rows, kv_heads, capacity, head_dim] per layer: both the rows and the
capacity (positions per row) grow by doubling when a sequence needs them, which copies the cache
once in a while instead of every step, and ``trim`` shrinks them back once the long or many
sequences are gone, so one long answer does not keep its memory for the life of the process.
``fits`` tells the engine whether one more sequence of a given length stays within the byte budget
(``max_bytes``); a request that does not fit waits until running ones finish. A static cache (CUDA
graphs replay fixed addresses) is allocated once at full size and never moves.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache"]

_MIN_CAPACITY = 64


def _pow2_at_least(n: int, floor: int) -> int:
    size = max(1, floor)
    while size < n:
        size *= 2
    return size


class KVCache:
    """K and V for every layer: [allocated rows, kv_heads, capacity, head_dim] each, plus per-row lengths."""

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
        max_bytes: int | None = None,
        static: bool = False,
    ) -> None:
        self.layers, self.slots, self.kv_heads, self.head_dim = layers, slots, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_capacity = max_capacity
        self.base_capacity = min(capacity, max_capacity)
        self.static = static
        self.bytes_per_position = 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        self.max_bytes = max_bytes  # None: no budget beyond slots x max_capacity
        self.capacity = 0
        self.allocated_rows = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # Added to attention scores: 0 where a row holds a token, -inf elsewhere.
        self.bias = torch.zeros((0, 0), dtype=torch.float32, device=device)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # = lengths, as a tensor
        self.lengths: list[int] = []  # one per running row
        self.limits: list[int] = []  # the most positions each running row may reach (its budget)
        self._rows_index = torch.arange(slots, device=device)
        if static:
            self._resize(slots, self.max_capacity)
        else:
            self._resize(1, self.base_capacity)

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def nbytes(self) -> int:
        """Bytes allocated now (K and V of every layer)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def budget_positions(self) -> int:
        """Positions the byte budget holds over all rows (slots x max capacity without a budget)."""
        if self.max_bytes is None:
            return self.slots * self.max_capacity
        return max(1, self.max_bytes // self.bytes_per_position)

    def usage(self) -> float:
        """The share of the cache the running sequences hold, as admission sees it: at their limits,
        rows and capacity rounded up to powers of two (`fits`), against the byte budget; without a
        budget (or static), the positions written against all. Two long-limit sequences that left
        no room for a third read 0.34 from their written positions alone (review helper's repro)."""
        lengths, limits = list(self.lengths), list(self.limits)
        written = min(1.0, sum(lengths) / max(1, self.budget_positions()))
        if self.static or self.max_bytes is None or not limits:
            return written
        return max(written, min(1.0, self._bytes_for(*self._shape_for(len(limits), max(limits))) / self.max_bytes))

    def used_positions(self) -> int:
        """Positions the running sequences hold."""
        return sum(self.lengths)

    def _bytes_for(self, rows: int, capacity: int) -> int:
        return rows * capacity * self.bytes_per_position

    def fits(self, *limits: int) -> bool:
        """Whether more sequences of up to ``limits`` positions fit the slots and the byte budget
        alongside the running ones at their limits (the allocation that could take: rows and capacity
        both rounded up to powers of two)."""
        if self.rows + len(limits) > self.slots or any(limit > self.max_capacity for limit in limits):
            return False
        if self.static or self.max_bytes is None:
            return True
        return self._bytes_for(*self._shape_for(self.rows + len(limits), max([*limits, *self.limits]))) <= self.max_bytes

    def alone_fits(self, limit: int) -> bool:
        """Whether a sequence of up to ``limit`` positions could ever fit (alone in the cache)."""
        if limit > self.max_capacity:
            return False
        return self.static or self.max_bytes is None or self._bytes_for(*self._shape_for(1, limit)) <= self.max_bytes

    def _shape_for(self, rows: int, length: int) -> tuple[int, int]:
        return min(self.slots, _pow2_at_least(rows, 1)), min(self.max_capacity, _pow2_at_least(length, self.base_capacity))

    def reserve(self, length: int, rows: int | None = None) -> None:
        """Make room for ``length`` positions per row (and ``rows`` rows): doubling, copying the running rows."""
        rows = self.rows if rows is None else rows
        if length <= self.capacity and rows <= self.allocated_rows:
            return
        if length > self.max_capacity:
            raise ValueError(f"a sequence of {length} tokens exceeds the cache's {self.max_capacity} positions")
        if rows > self.slots:
            raise RuntimeError(f"all {self.slots} cache rows are in use")
        self._resize(
            max(self.allocated_rows, min(self.slots, _pow2_at_least(rows, 1))),
            max(self.capacity, min(self.max_capacity, _pow2_at_least(length, self.base_capacity))),
        )

    def trim(self) -> None:
        """Shrink to what the running rows need (rows and capacity rounded up to powers of two) once
        that is at most a quarter of either: gives the memory of finished long or many sequences back."""
        if self.static:
            return
        rows = _pow2_at_least(max(1, self.rows), 1)
        capacity = min(self.max_capacity, _pow2_at_least(max([1, *self.lengths]) + 1, self.base_capacity))
        if rows * 4 <= self.allocated_rows or capacity * 4 <= self.capacity:
            self._resize(min(rows * 2, self.allocated_rows), min(capacity * 2, self.capacity))

    def _resize(self, rows: int, capacity: int) -> None:
        """Reallocate at exactly (rows, capacity), zero-filled (unused columns stay finite), keeping the running rows."""
        if rows == self.allocated_rows and capacity == self.capacity:
            return
        live, keep = self.rows, min(max(self.lengths, default=0), capacity)
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        for store in (self.keys, self.values):
            for i in range(self.layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    if live:
                        new[:live, :, :keep] = store[i][:live, :, :keep]
                    store[i] = new
                else:
                    store.append(new)
        bias = torch.full((rows, capacity), float("-inf"), device=self.device)
        if live:
            bias[:live, :keep] = self.bias[:live, :keep]
        self.bias, self.capacity, self.allocated_rows = bias, capacity, rows

    def add_row(self, length: int, limit: int | None = None) -> int:
        """Claim the next row for a sequence whose first ``length`` positions the caller writes and
        which may grow to ``limit`` positions (default: ``length``; what ``fits`` counts it at)."""
        if self.rows >= self.slots:
            raise RuntimeError(f"all {self.slots} cache rows are in use")
        self.reserve(length, self.rows + 1)
        row = self.rows
        self.bias[row].fill_(float("-inf"))
        self.bias[row, :length] = 0.0
        self.positions[row] = length
        self.lengths.append(length)
        self.limits.append(max(length, limit or 0))
        return row

    def remove(self, row: int, *, keep_last: bool = False) -> None:
        """Free ``row``: the last row moves into its place (the caller reorders its own list the same
        way). ``keep_last``: the last row stays last (a prompt still being prefilled, which decode
        steps leave out): the one before it moves into ``row``, and it moves down one."""
        last = self.rows - 1
        if keep_last:
            self._move(last - 1, row)
            self._move(last, last - 1)
        else:
            self._move(last, row)
        self.lengths.pop()
        self.limits.pop()

    def _move(self, src: int, dst: int) -> None:
        if src == dst:
            return
        n = self.lengths[src]
        for store in (self.keys, self.values):
            for t in store:
                t[dst, :, :n] = t[src, :, :n]
        self.bias[dst] = self.bias[src]
        self.positions[dst] = self.positions[src]
        self.lengths[dst] = n
        self.limits[dst] = self.limits[src]

    def read(self, row: int, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Views of ``row``'s K and V at positions start..end-1, per layer ([kv_heads, end - start, head_dim] each)."""
        return [(k[row, :, start:end], v[row, :, start:end]) for k, v in zip(self.keys, self.values, strict=True)]

    def write(self, row: int, start: int, per_layer: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy K and V ([kv_heads, n, head_dim] per layer) into ``row`` from position ``start``."""
        for (k, v), (pk, pv) in zip(zip(self.keys, self.values, strict=True), per_layer, strict=True):
            n = pk.shape[1]
            k[row, :, start : start + n] = pk
            v[row, :, start : start + n] = pv

    def snapshot(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of ``row``'s first ``length`` positions of K and V, per layer (a reusable prefix)."""
        return [(k.clone(), v.clone()) for k, v in self.read(row, 0, length)]

    def restore(self, row: int, prefix: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy a snapshot into the start of ``row``."""
        self.write(row, 0, prefix)

    def clear(self) -> None:
        """Free every row."""
        self.lengths = []
        self.limits = []

    def begin_step(self, b: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Open a decode step over the first ``b`` rows (default: every row): (row index [B], write
        positions [B], attended width). A row after them (a prompt still being prefilled) is left alone.

        The step itself unmasks each row's position, writes K/V there and advances ``positions``
        (tensor ops only, so a CUDA graph can replay them); ``end_step`` updates the lengths.
        """
        b = self.rows if b is None else b
        width = max(self.lengths[:b]) + 1
        self.reserve(width)
        return self._rows_index[:b], self.positions[:b], width

    def end_step(self, b: int | None = None) -> None:
        """The first ``b`` rows (default: every row) gained the token the step wrote."""
        b = self.rows if b is None else b
        for i in range(b):
            n = self.lengths[i] = self.lengths[i] + 1
            if n > self.limits[i]:
                self.limits[i] = n

    def reset(self) -> None:
        """Free every row and forget what any step wrote (after CUDA-graph capture ran steps on nothing)."""
        self.lengths = []
        self.limits = []
        self.positions.zero_()
        self.bias.fill_(float("-inf"))
