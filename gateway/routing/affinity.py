"""Prefix-cache affinity: prefer the backend that most likely holds a prompt's prefix, within a load bound.

Two sources say where a prefix is, neither needing a round trip on the request path:

- **Learned** (`PrefixMap`): every attempt records its prompt's block keys (routing/prefix.py) ->
  the backend it went to. A request whose keys match goes to a backend holding its deepest match:
  a conversation's next turn follows the turn before, and every conversation on a system prompt
  that some backend already prefilled goes there. Kept per process, bounded (`max_entries`: a
  full table drops the expired keys, then the least recently learned of the tenant namespace
  holding the most)
  and forgotten after `prefix_ttl_s` unused.
- **Rendezvous hashing** for a prefix nobody holds yet: each backend's weight is a hash of (first
  block, backend name) and the heaviest wins, so every worker and replica sends a new system
  prompt to the same home with no coordination, and a backend joining or leaving moves only the
  prefixes it wins or held. So that hashing does not pile several system prompts onto one
  backend's cache while another's sits empty, a home already holding more than `max_share` times
  its fair share of the prefixes this process learned recently passes the new one to the next in
  hash order. That count is each process's own: workers or replicas with different histories may
  then home a new prompt differently, which costs one more prefill of it (each keeps sending it
  where it sent it first); `max_share` high (e.g. 100) makes the homes pure hashing.

Affinity never overrides health (only eligible candidates are considered) and is bounded by load:
a holder is taken only while it has at most `max_imbalance` more requests on it (ours in flight, or
what its metrics_url reports running and waiting when that is more) than the least loaded candidate, and a predicted TTFT at most
`max_slowdown` times the best. Otherwise the request *spills* to the latency ranking's pick, and
that backend learns the prefix too: a hot system prompt spreads over as many backends as its load
needs (power of d choices over its holders), never onto one.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

__all__ = ["AffinityResult", "Decision", "Option", "PrefixMap", "choose"]

_MAX_HOLDERS = 4  # backends remembered per block, most recent first


class AffinityResult(StrEnum):
    """The x-gateway-affinity header and the metric's label."""

    HIT = "hit"  # sent to a backend that holds (part of) the prompt's prefix
    MISS = "miss"  # nobody holds it yet: sent to its rendezvous home (or, all loaded, the latency pick)
    SPILL = "spill"  # a holder exists but is unhealthy, loaded past the bound or clearly slower


class Option(NamedTuple):
    """A candidate as affinity sees it (built from the selector's ranking)."""

    name: str
    eligible: bool  # health lets it take traffic now
    skipped: str | None  # why not, when not
    load: float  # requests on it: ours in flight, or running + waiting by its metrics_url when more
    score: float  # the selector's score (predicted TTFT with its load terms), lower is better


@dataclass(frozen=True, slots=True)
class Decision:
    """What affinity did for one request: for the header, the metric, explain and the access log."""

    result: AffinityResult
    backend: str | None  # the backend it put first (None: it kept the ranking's order)
    preferred: str | None  # the holder (or rendezvous home) it wanted
    matched_blocks: int  # leading blocks of the prompt some candidate holds
    blocks: int  # blocks in the prompt
    reason: str
    loads: tuple[tuple[str, float], ...] = ()  # each candidate's load term (Option.load)

    def view(self) -> dict[str, Any]:
        return {
            "result": self.result.value, "backend": self.backend, "preferred": self.preferred,
            "matched_blocks": self.matched_blocks, "blocks": self.blocks, "reason": self.reason,
            "load": dict(self.loads),
        }


class _Entry:
    __slots__ = ("holders", "cls", "end", "at", "owner")

    def __init__(self, cls: str, at: float, owner: str) -> None:
        self.holders: list[str] = []
        self.cls = cls  # the class its last request was answered in (a conversation's stickiness)
        self.end = False  # the last block of some request's prompt: a conversation turn ended here
        self.at = at
        self.owner = owner  # the tenant namespace whose prompts it came from (keys are salted by it)


class PrefixMap:
    """Learned block key -> the backends that were sent it; one per process, kept across reloads."""

    def __init__(self, max_entries: int = 100_000, ttl_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.ttl_s, self.clock = max_entries, ttl_s, clock
        self._entries: dict[bytes, _Entry] = {}
        # Each namespace's keys, least recently learned first: a full table drops the oldest of the
        # namespace that holds the most (one table for everyone: 40 requests of 128 one-word
        # messages emptied a 5,000-entry table of another tenant's conversation; review helper's repro).
        self._owned: dict[str, OrderedDict[bytes, None]] = {}
        self._roots: dict[str, OrderedDict[bytes, float]] = {}  # backend -> first block -> last sent

    def configure(self, max_entries: int, ttl_s: float) -> None:
        """The policy's bounds (a reload may change them; entries are kept)."""
        self.max_entries, self.ttl_s = max_entries, ttl_s

    def __len__(self) -> int:
        return len(self._entries)

    def learn(self, keys: Sequence[bytes], backend: str, cls: str, owner: str = "") -> None:
        """`backend` was sent a prompt with these keys (its cache holds them now); `owner`: the
        tenant namespace the keys were salted with."""
        if not keys:
            return
        now = self.clock()
        entries = self._entries
        owned = self._owned.get(owner)
        if owned is None:
            owned = self._owned[owner] = OrderedDict()
        for k in keys:
            e = entries.get(k)
            if e is None:
                e = entries[k] = _Entry(cls, now, owner)
                owned[k] = None
            else:
                if e.owner == owner:
                    owned.move_to_end(k)
                e.at, e.cls = now, cls
            h = e.holders
            if not h or h[0] != backend:
                if backend in h:
                    h.remove(backend)
                h.insert(0, backend)
                del h[_MAX_HOLDERS:]
        entries[keys[-1]].end = True
        if len(entries) > self.max_entries:
            self._evict()
        roots = self._roots.get(backend)
        if roots is None:
            roots = self._roots[backend] = OrderedDict()
        roots[keys[0]] = now
        roots.move_to_end(keys[0])
        # Bounded like the entries: trimmed only by age (in `footprint`), 200,000 distinct first
        # blocks under max_entries 100 held 200,000 roots (~36 MB; request rate x the TTL).
        while len(roots) > self.max_entries:
            roots.popitem(last=False)

    def _evict(self) -> None:
        """Down to max_entries: the keys past their TTL first (any namespace's), then the oldest
        of the namespace that holds the most (an idle tenant's dead blocks must not outlast an
        active one's fresh ones)."""
        entries, owned = self._entries, self._owned
        horizon = self.clock() - self.ttl_s
        for name, keys in list(owned.items()):
            while keys and len(entries) > self.max_entries:
                k = next(iter(keys))
                if entries[k].at >= horizon:
                    break
                keys.popitem(last=False)
                del entries[k]
            if not keys:
                del owned[name]
        while len(entries) > self.max_entries:
            name, keys = max(owned.items(), key=lambda kv: len(kv[1]))
            while keys and len(entries) > self.max_entries:
                k, _ = keys.popitem(last=False)
                del entries[k]
            if not keys:
                del owned[name]

    def match(self, keys: Sequence[bytes], start: int | None = None) -> tuple[int, _Entry | None]:
        """The deepest learned block of `keys` at or below index `start` (default: the last), as
        (blocks matched, its entry); (0, None) when none is."""
        entries, horizon = self._entries, self.clock() - self.ttl_s
        for i in range(len(keys) - 1 if start is None else start, -1, -1):
            e = entries.get(keys[i])
            if e is not None and e.at >= horizon:
                return i + 1, e
        return 0, None

    def footprint(self, backend: str) -> int:
        """How many distinct first blocks `backend` was sent within the TTL."""
        roots = self._roots.get(backend)
        if not roots:
            return 0
        horizon = self.clock() - self.ttl_s
        while roots and next(iter(roots.values())) < horizon:
            roots.popitem(last=False)
        return len(roots)

    def previous_class(self, keys: Sequence[bytes]) -> str | None:
        """The class an earlier turn of this conversation was answered in: the deepest learned
        block that ended an earlier request's prompt, short of this prompt's own end (None: none)."""
        if len(keys) < 2:
            return None
        n, e = self.match(keys, len(keys) - 2)
        while e is not None and not e.end and n > 1:
            n, e = self.match(keys, n - 2)
        if e is None or not e.end:
            return None  # only blocks shared with other conversations (a system prompt): no turn of this one
        return e.cls


def _hrw(root: bytes, name: str) -> int:
    return int.from_bytes(hashlib.blake2b(root + name.encode(), digest_size=8).digest(), "big")


def choose(
    options: Sequence[Option], keys: Sequence[bytes], prefixes: PrefixMap, *,
    max_imbalance: float, max_slowdown: float, max_share: float,
) -> Decision:
    """Which candidate should take this prompt first (`options` in the ranking's order, the
    ranking's pick first), with the load terms it weighed."""
    result, backend, preferred, matched, reason = _choose(options, keys, prefixes, max_imbalance, max_slowdown, max_share)
    return Decision(result, backend, preferred, matched, len(keys), reason, tuple([(o.name, o.load) for o in options]))


def _choose(
    options: Sequence[Option], keys: Sequence[bytes], prefixes: PrefixMap,
    max_imbalance: float, max_slowdown: float, max_share: float,
) -> tuple[AffinityResult, str | None, str | None, int, str]:
    eligible = [o for o in options if o.eligible]
    n_blocks = len(keys)
    if not eligible:
        return (AffinityResult.SPILL, None, None, 0, "no candidate is available")
    min_load = min(o.load for o in eligible)
    best = min(o.score for o in eligible)
    limit_load = min_load + max_imbalance
    limit_score = best * max_slowdown if best > 0 else math.inf
    fallback = eligible[0].name  # the latency ranking's pick

    def why_not(o: Option) -> str | None:
        if not o.eligible:
            return o.skipped or "not available"
        if o.load > limit_load:
            return f"{o.load:g} in flight or queued vs {min_load:g} on the least loaded"
        if o.score > limit_score:
            return f"predicted {o.score * 1000:.0f} ms vs {best * 1000:.0f} ms best"
        return None

    by_name = {o.name: o for o in options}
    spilled: tuple[str, str, int] | None = None  # (holder, why not, blocks it holds)
    n, e = prefixes.match(keys)
    while e is not None:
        ok = []
        for h in e.holders:
            o = by_name.get(h)
            if o is None:
                continue  # no longer a candidate here (left the pool)
            why = why_not(o)
            if why is None:
                ok.append(o)
            elif spilled is None:
                spilled = (h, why, n)
        if ok:
            # Several holders: the least loaded (a hot prefix spreads), then the fastest.
            pick = min(ok, key=lambda o: (o.load, o.score))
            deeper = f"; the deeper holder {spilled[0]} spilled: {spilled[1]}" if spilled else ""
            return (AffinityResult.HIT, pick.name, pick.name, n, f"holds {n} of {n_blocks} prefix blocks{deeper}")
        n, e = prefixes.match(keys, n - 2) if n > 1 else (0, None)
    if spilled is not None:
        holder, why, held = spilled
        return (AffinityResult.SPILL, fallback, holder, held, f"{holder} holds {held} of {n_blocks} prefix blocks but {why}: the latency pick instead")
    if not keys:
        return (AffinityResult.MISS, None, None, 0, "no prompt to match")
    # Nobody holds it: its rendezvous home, passing over a home already over its share of prefixes.
    root = keys[0]
    ranked = sorted(eligible, key=lambda o: _hrw(root, o.name), reverse=True)
    prints = {o.name: prefixes.footprint(o.name) for o in eligible}
    share_cap = math.ceil(max_share * (sum(prints.values()) + 1) / len(eligible))
    first_ok = None
    for o in ranked:
        if why_not(o) is not None:
            continue
        first_ok = first_ok or o
        if prints[o.name] < share_cap:
            note = "" if o is ranked[0] else f" ({ranked[0].name}, the first in hash order, is loaded or holds its share)"
            return (AffinityResult.MISS, o.name, o.name, 0, f"a new prefix: its rendezvous home{note}")
    if first_ok is not None:
        return (AffinityResult.MISS, first_ok.name, first_ok.name, 0, "a new prefix: its rendezvous home (every candidate holds its share)")
    return (AffinityResult.MISS, fallback, None, 0, "a new prefix, every candidate loaded: the latency pick")
