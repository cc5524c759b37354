"""How many entries each owner holds in a bounded structure, with the owners holding the most at hand.

A full structure that evicts from an owner holding the most is fair: an owner that floods it evicts
its own entries, and an owner holding fewer than bound / N (N: the owners present) loses none. The
request log (admin/log_store.py) and the Responses records (store/fair.py) evict that way.
"""

from __future__ import annotations

import bisect

__all__ = ["Holdings"]


class Holdings:
    """Entries held per owner, the distinct counts kept sorted: a change is O(log owners), and the
    owners holding the most are found in O(1)."""

    __slots__ = ("_held", "_levels", "_at")

    def __init__(self) -> None:
        self._held: dict[str, int] = {}
        self._levels: list[int] = []  # the distinct counts owners hold, ascending
        self._at: dict[int, dict[str, None]] = {}  # the owners holding each count, in arrival order

    def __len__(self) -> int:
        """The owners holding anything."""
        return len(self._held)

    def held(self, owner: str) -> int:
        """What `owner` holds (0 when nothing)."""
        return self._held.get(owner, 0)

    def top(self) -> tuple[int, list[str]]:
        """The most any owner holds and the owners holding it; (0, []) when nobody holds anything."""
        if not self._levels:
            return 0, []
        level = self._levels[-1]
        return level, list(self._at[level])

    def heaviest(self) -> str | None:
        """An owner holding the most (of those, the first to reach that count); None when none."""
        return next(iter(self._at[self._levels[-1]])) if self._levels else None

    def below_top(self) -> int:
        """The second largest count held (0 when every owner holds as many)."""
        return self._levels[-2] if len(self._levels) > 1 else 0

    def move(self, owner: str, by: int) -> int:
        """`owner` holds `by` entries more (or fewer); what it holds now (0: it is forgotten)."""
        held = self._held.get(owner, 0)
        if held + by < 0:
            raise ValueError(f"{owner!r} holds {held} entries, not {-by}")
        if held:
            at = self._at[held]
            del at[owner]
            if not at:
                del self._at[held], self._levels[bisect.bisect_left(self._levels, held)]
        held += by
        if held:
            self._held[owner] = held
            if held not in self._at:
                self._at[held] = {}
                bisect.insort(self._levels, held)
            self._at[held][owner] = None
        else:
            self._held.pop(owner, None)
        return held
