"""Sans-io stream monitors: what each event of a backend's stream means to the relay.

The pump (relay/pump.py) reads a backend's stream, splits it into SSE events and feeds each event's
`data` to the endpoint's Monitor, which parses it and answers with a Verdict; the pump acts on the
verdict (holds the event back, releases it, claims the client, times it, stops). A Monitor keeps
what the relay needs afterwards (the usage, a failure's words, the complete answer for the cache).
Monitors do no I/O and read no clock: their tests feed them scripted events (tests/test_monitors.py).

One Monitor per wire format: chat and completions (chat_monitor.py), the Responses API
(responses/monitor.py).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto
from typing import Any, Protocol

from ..cache.entry import Entry

__all__ = ["Monitor", "Rewrite", "Verdict"]

# A continuation's hook on each event (continuation.Resume.rewrite): the event the client gets
# instead, or None to drop it.
Rewrite = Callable[[dict[str, Any]], "dict[str, Any] | None"]


class Verdict(Enum):
    """What one stream event is, to the pump."""

    NOISE = auto()  # not part of the answer (a stray [DONE]): passed on once streaming, dropped before
    DROP = auto()  # nothing for the client (rewritten away, a usage chunk it did not ask for, no type)
    MALFORMED = auto()  # not a JSON object: dropped, and counted
    HELD = auto()  # part of the answer without output (a role, `response.created`): held until the first output
    CONTENT = auto()  # output: the first claims the client (its TTFT), later ones are inter-token gaps
    DONE = auto()  # the stream's own end marker ([DONE]): nothing more to read
    FAILED = auto()  # the backend reports a failure (`failure` has its words)


class Monitor(Protocol):
    """One stream's monitor. After each `feed`, `timed`, `out`, `event` and `record` describe that
    event; `finished`, `usage` and `failure` describe the stream so far."""

    @property
    def first(self) -> str:
        """How messages name the first output ("first token", "first output")."""

    @property
    def unfinished(self) -> str:
        """Why a stream that ended without its answer finished is cut (`{backend}`: its name)."""

    @property
    def relays_failure(self) -> bool:
        """A failure event reaches the client as the backend sent it, and ends the stream (else
        the relay writes its own error event, after any rescue)."""

    @property
    def ending(self) -> bytes:
        """What a whole stream ends with on the client's side that the pump writes (chat: [DONE])."""

    @property
    def finished(self) -> bool:
        """The answer is complete (a finish reason, response.completed): only usage or an end may follow."""

    @property
    def failure(self) -> str | None:
        """The backend's words, after FAILED."""

    @property
    def usage(self) -> dict[str, Any] | None:
        """The last usage the stream carried (prompt/completion/total tokens)."""

    @property
    def timed(self) -> bool:
        """The event carried the backend's output (a latency sample), even if the client gets none of it."""

    @property
    def out(self) -> bytes | None:
        """The event as the client gets it when rewritten (a continuation); None: as the backend sent it."""

    @property
    def event(self) -> dict[str, Any] | None:
        """The event as the client gets it, decoded (for the transcript)."""

    @property
    def record(self) -> dict[str, Any] | None:
        """A response the backend now holds: recorded before anything of it is released."""

    def feed(self, data: bytes) -> Verdict:
        """Take one event's `data` (the SSE data lines, joined)."""

    def estimated_usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """What a finished stream carries before `ending` when its client asked for usage and
        the backend sent none (it ignores the option, or the stream was cut after its finish):
        the usage event with the gateway's estimate (the figures its quota charged). b"" where
        the format's finish event carries the usage itself."""

    def entry(self) -> Entry | None:
        """The complete answer as a cache entry, when it was captured and may be cached."""
