"""The prefix cache: K/V of recently seen prompt prefixes (system prompts, earlier turns), in blocks.

A prompt is cut into blocks of ``block_tokens`` tokens; block i is keyed by a chained hash of
every token up to its end, so a block is only reused when everything before it matches too (and
its tokens and parent are compared on a hit, so a hash collision can only miss). A request reuses
the longest run of leading blocks held here: their K/V are copied into its cache row and prefill
computes only the rest. After prefill every full block of the prompt is stored; in the kernel modes
(where a token's K/V are the same bits whichever pass computed them) the answer's blocks are stored
too when the sequence ends, so a conversation's next turn reuses its earlier turns.

The pool is allocated once, ``max_bytes`` in all (``torch.empty``: pages are touched as blocks
fill, so memory grows with use up to the bound), and evicted least recently used first, deepest
blocks before their parents (a chain's blocks are touched leaf first, so its root stays more
recent than its leaves). Blocks may be pinned (the chat template's opening), never evicted.
A request's ``cache_salt`` (vLLM's) keeps its blocks to requests of the same salt, the pinned
opening excepted: every request shares that.

Tokens stay bit-identical to a cold run: in the kernel modes any split of a prompt computes the
same bits; the torch modes prefill in chunks that end on block boundaries (engine.py), so a warm
run repeats the cold run's chunks exactly.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache import KVCache

__all__ = ["PrefixCache", "PrefixStats"]


@dataclass(eq=False)
class _Block:
    index: int  # its place in the pool
    parent: int | None  # the key of the block before it (None for a prompt's first block)
    tokens: tuple[int, ...]
    pinned: bool = False


@dataclass(frozen=True)
class PrefixStats:
    """Counters and occupancy (vLLM counts queries and hits in tokens; so do we)."""

    queries_tokens: int
    hits_tokens: int
    stored_blocks: int
    evicted_blocks: int
    blocks: int
    capacity_blocks: int
    block_tokens: int
    block_bytes: int


class PrefixCache:
    """Blocks of K/V keyed by their prefix; used by the engine thread, read by /metrics."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 block_tokens: int = 16, max_bytes: int = 256 << 20) -> None:
        if block_tokens < 1:
            raise ValueError(f"prefix blocks need at least one token, not {block_tokens}")
        self.block_tokens = block_tokens
        self.block_bytes = 2 * layers * kv_heads * block_tokens * head_dim * torch.tensor([], dtype=dtype).element_size()
        self.capacity = max(0, max_bytes // self.block_bytes)
        shape = (self.capacity, layers, kv_heads, block_tokens, head_dim)
        self._keys = torch.empty(shape, dtype=dtype, device=device)
        self._values = torch.empty(shape, dtype=dtype, device=device)
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))
        self._lock = threading.Lock()  # the counters and the dict's size, for /metrics
        self._queries = self._hits = self._stored = self._evicted = 0

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def _chain(self, ids: Sequence[int], blocks: int, salt: str = "") -> list[tuple[int, int | None, tuple[int, ...]]]:
        """(key, parent key, tokens) of the first ``blocks`` full blocks of ``ids``.

        With a ``salt``, the chain follows the unsalted one only over leading *pinned* blocks (the chat
        template's opening: public text, pinned at start-up, the same for every caller, so sharing it
        tells no one anything), then hangs its next block from the salt: only requests of the same salt
        share the rest, and no unsalted request reaches a salted block. (Before, every salted chain
        began at the salt, so no tenant reused the pinned opening.)"""
        out: list[tuple[int, int | None, tuple[int, ...]]] = []
        parent: int | None = None
        public = True  # still on the unsalted chain
        b = self.block_tokens
        for i in range(blocks):
            tokens = tuple(ids[i * b : (i + 1) * b])
            key = hash((parent, tokens))
            if salt and public:
                block = self._blocks.get(key)
                if block is None or not block.pinned or block.parent != parent or block.tokens != tokens:
                    public = False
                    parent = hash(("salt", salt, parent))
                    key = hash((parent, tokens))
            out.append((key, parent, tokens))
            parent = key
        return out

    def match(self, ids: Sequence[int], limit: int, salt: str = "") -> list[int]:
        """Pool indices of the longest run of ``ids``' leading blocks held here, covering at most ``limit``
        tokens; counts the query and the hit (tokens) and marks the blocks used."""
        if not self.enabled:
            return []
        found: list[int] = []
        keys: list[int] = []
        for key, parent, tokens in self._chain(ids, max(0, min(limit, len(ids))) // self.block_tokens, salt):
            block = self._blocks.get(key)
            if block is None or block.parent != parent or block.tokens != tokens:
                break
            found.append(block.index)
            keys.append(key)
        for key in reversed(keys):  # leaf first: the root ends up the most recent
            self._blocks.move_to_end(key)
        with self._lock:
            self._queries += len(ids)
            self._hits += len(found) * self.block_tokens
        return found

    def load(self, indices: list[int], cache: KVCache, row: int) -> int:
        """Copy the blocks ``indices`` (a chain from the first) into ``row``; returns the tokens loaded."""
        if not indices:
            return 0
        n, b = len(indices), self.block_tokens
        at = torch.tensor(indices, dtype=torch.long, device=self._keys.device)
        for layer, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
            for pool, dst in ((self._keys, k), (self._values, v)):
                blocks = pool[at, layer]  # [n, kv_heads, b, head_dim]
                dst[row, :, : n * b] = blocks.transpose(0, 1).reshape(blocks.shape[1], n * b, blocks.shape[3])
        return n * b

    def store(self, ids: Sequence[int], upto: int, cache: KVCache, row: int, *, pinned: bool = False, salt: str = "") -> int:
        """Keep the full blocks of ``ids[:upto]`` not held yet, copied from ``row`` (which holds their K/V);
        evicts least recently used blocks for room. Returns the blocks stored."""
        if not self.enabled:
            return 0
        chain = self._chain(ids, max(0, min(upto, len(ids))) // self.block_tokens, salt)
        mine = {key for key, _, _ in chain}
        missing: list[tuple[int, int, int | None, tuple[int, ...]]] = []  # (position, key, parent, tokens)
        for i, (key, parent, tokens) in enumerate(chain):
            block = self._blocks.get(key)
            if block is None:
                missing.append((i, key, parent, tokens))
            elif block.parent != parent or block.tokens != tokens:
                chain = chain[:i]  # a colliding key holds another prefix: stop here, keep it
                missing = [m for m in missing if m[0] < i]
                break
            elif pinned:
                block.pinned = True
        slots = self._take(len(missing), mine)
        missing = missing[: len(slots)]  # short of room: the leading ones, so the chain stays reachable
        if missing:
            b = self.block_tokens
            # runs of consecutive blocks: one strided copy per layer for each (usually one run per prompt)
            runs: list[tuple[int, int, int]] = []  # (first block, blocks, first of `slots`)
            for j, (i, _, _, _) in enumerate(missing):
                if runs and runs[-1][0] + runs[-1][1] == i:
                    runs[-1] = (runs[-1][0], runs[-1][1] + 1, runs[-1][2])
                else:
                    runs.append((i, 1, j))
            for first, count, j in runs:
                at = torch.tensor(slots[j : j + count], dtype=torch.long, device=self._keys.device)
                for layer, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
                    for pool, src in ((self._keys, k), (self._values, v)):
                        part = src[row, :, first * b : (first + count) * b]  # [kv_heads, count * b, head_dim]
                        pool[at, layer] = part.reshape(part.shape[0], count, b, part.shape[2]).transpose(0, 1)
            for index, (_, key, parent, tokens) in zip(slots, missing, strict=True):
                self._blocks[key] = _Block(index, parent, tokens, pinned)
        for key, _, _ in reversed(chain):  # leaf first, as in match
            if key in self._blocks:
                self._blocks.move_to_end(key)
        with self._lock:
            self._stored += len(missing)
        return len(missing)

    def _take(self, n: int, protected: set[int]) -> list[int]:
        """Up to ``n`` free pool slots, evicting the least recently used unpinned blocks outside ``protected``."""
        taken: list[int] = []
        while len(taken) < n and self._free:
            taken.append(self._free.pop())
        if len(taken) < n:
            victims = [key for key, block in self._blocks.items() if not block.pinned and key not in protected][: n - len(taken)]
            for key in victims:
                taken.append(self._blocks.pop(key).index)
            with self._lock:
                self._evicted += len(victims)
        return taken

    def clear(self) -> None:
        """Forget every unpinned block."""
        for key in [k for k, block in self._blocks.items() if not block.pinned]:
            self._free.append(self._blocks.pop(key).index)

    def stats(self) -> PrefixStats:
        """A consistent reading of the counters (any thread)."""
        with self._lock:
            return PrefixStats(self._queries, self._hits, self._stored, self._evicted, len(self._blocks), self.capacity,
                               self.block_tokens, self.block_bytes)
