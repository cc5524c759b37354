"""The bytes a process's live streams hold, per owner, and who gives some back past the limit.

Every Broadcast of a process (broadcast.py) counts here what it keeps for late joiners (its
history) and what its clients have not been written yet (their taps' backlogs), under the owner of
the stream (a tenant; one flight where no tenant is known). Past the limit, the owner holding the
most gives back, never a client that keeps up.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["DEFAULT_BUDGET_BYTES", "Budget", "Holder", "Kept", "Tap"]

# What all the broadcasts of a process keep for late joiners and slow clients together.
DEFAULT_BUDGET_BYTES = 64 << 20


class Tap(Protocol):
    """A client's place in a stream (broadcast._Tap): what it holds beyond its history, and its cut."""

    counted: int

    def cut(self) -> None: ...


class Kept(Protocol):
    """A stream keeping a history for late joiners (broadcast.Broadcast)."""

    history_bytes: int

    def release(self) -> None: ...


class Holder:
    """What one owner holds in the Budget: a tenant (its streams' histories, its clients'
    backlogs), or one flight where no tenant is known. Counted as it changes (O(1) a write)."""

    __slots__ = ("key", "held", "taps", "streams", "users")

    def __init__(self, key: object) -> None:
        self.key = key
        self.held = 0
        self.taps: set[Tap] = set()  # its clients' taps (each with what it holds beyond its history: `counted`)
        self.streams: set[Kept] = set()  # its broadcasts keeping a history
        self.users = 0  # the taps and broadcasts counted here: forgotten when none is left


class Budget:
    """Bytes held by every Broadcast that shares it (one per process: SingleFlight.budget): the
    histories kept for late joiners, and what clients have not been written yet beyond the history
    they joined with, the followers' and each stream's own client's (cache/stage.py), per owner.

    Past `limit`, `reclaim` takes bytes back from whoever holds the most, never from a client that
    keeps up: one tenant's clients that read nothing held the budget, and every other tenant's
    shared stream was cut mid-answer ("fell too far behind") though it was not (review helper's
    repro)."""

    __slots__ = ("limit", "used", "histories", "_holders")

    def __init__(self, limit: int = DEFAULT_BUDGET_BYTES) -> None:
        self.limit = limit
        self.used = 0
        self.histories = 0  # of `used`, the histories'
        self._holders: dict[object, Holder] = {}

    def holder(self, key: object) -> Holder:
        """`key`'s record, counting one more user (give it back with `forget`)."""
        h = self._holders.get(key)
        if h is None:
            h = self._holders[key] = Holder(key)
        h.users += 1
        return h

    def forget(self, h: Holder) -> None:
        h.users -= 1
        if h.users <= 0 and self._holders.get(h.key) is h:
            del self._holders[h.key]

    def reclaim(self, first: Holder | None = None) -> None:
        """Over the limit: give bytes back until under it (run only then, by a publish).

        The owner holding the most gives (`first`, the publishing one, on a tie): of what it
        holds, the largest goes, its tap furthest behind (cut off with an error event) or its
        largest history (dropped: later requests wait for the stored answer), the tap on a tie.
        So the client cut off is always the one furthest behind of the tenant holding the most,
        never another tenant's nor one of its own that is less behind: a client that keeps up
        holds a write or two, and its tenant holds less than any tenant whose clients read nothing.
        A max over the owners and over one owner's taps, only while over the limit: a publish
        under it counts its bytes and nothing else."""
        while self.used > self.limit:
            if not self._give_back(first):
                return

    def _give_back(self, first: Holder | None) -> bool:
        h = max(self._holders.values(), key=lambda h: (h.held, h is first), default=None)
        if h is None or h.held <= 0:
            return False
        tap = max(h.taps, key=_backlog, default=None)
        stream = max(h.streams, key=_history_size, default=None)
        if tap is not None and tap.counted and (stream is None or tap.counted >= stream.history_bytes):
            tap.cut()
        elif stream is not None:
            stream.release()
        else:
            return False
        return True


def _backlog(tap: Tap) -> int:
    return tap.counted


def _history_size(stream: Kept) -> int:
    return stream.history_bytes
