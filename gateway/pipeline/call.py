"""Call: the per-request record that each pipeline stage fills in."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import orjson

from ..admission.gate import Ticket
from ..cache.entry import Entry
from ..classify.classifier import Verdict
from ..errors import BadRequest, Unauthorized
from ..relay.continuation import Transcript
from ..routing.affinity import Decision
from ..tenants.auth import Tenant
from ..wire.codec import Endpoint, salted

if TYPE_CHECKING:
    from ..responses.affinity import Learner

__all__ = ["Asked", "CLIENT_CLOSED", "CacheResult", "Caching", "Call", "Finish", "Outcome", "Timing", "key_live", "revoked"]

# The status logged and counted for a request whose client left before any answer went out
# (nginx's "client closed request"): never sent, since nobody is there to read it.
CLIENT_CLOSED = 499


class Finish(StrEnum):
    """How a request ended, for the access log and the metrics."""

    OK = "ok"  # the client has its whole answer
    ERROR = "error"  # answered with an error (a status, or the backend's own failure event)
    CLIENT_DISCONNECT = "client_disconnect"  # the client left before its answer was whole
    CUT = "cut"  # a stream that broke after content reached the client, ended with an error event


class CacheResult(StrEnum):
    """The cache's part in an answer: the x-gateway-cache header and the metric label."""

    HIT = "hit"
    MISS = "miss"
    BYPASS = "bypass"


@dataclass(slots=True)
class Asked:
    """How the client asked: its headers' options, and the band it may have (parse, then its
    tenant's ceiling, set it)."""

    priority: str | None = None  # the band asked for (x-priority); after intake, held to the tenant's ceiling
    no_cache: bool = False  # cache-control: no-cache
    no_store: bool = False  # cache-control: no-store
    deadline: bool = False  # x-request-timeout-ms was sent (else a band's default may apply)
    trace_parent: tuple[int, int, int] | None = None  # a valid W3C traceparent: (trace id, span id, flags)
    strip_usage: bool = False  # the gateway asked for the stream's usage chunk: the client did not
    betas: tuple[tuple[str, str], ...] = ()  # the client's beta headers (routing/backends.py BETA_HEADERS), lower-case names


@dataclass(slots=True)
class Timing:
    """When each step happened (observe/observer.py turns them into Server-Timing and stage histograms)."""

    t0: float = field(default_factory=time.perf_counter)
    t0_monotonic: float = field(default_factory=time.monotonic)  # the clock `Call.deadline` is on
    queue_ms: float = 0.0  # waited for admission, a backend slot or a single flight's leader
    sent_at: float = 0.0  # perf_counter when the request went upstream (the last attempt; of hedged ones, the winner)
    headers_at: float = 0.0  # perf_counter when that attempt's response headers came
    ttft_s: float | None = None


@dataclass(slots=True)
class Caching:
    """The cache stage's part: what it did, and the answer it keeps for the store."""

    result: CacheResult = CacheResult.BYPASS
    capture: int = 0  # > 0: keep the complete answer (up to this many bytes) in `entry`
    entry: Entry | None = None
    # A flight leader's landing (store `entry`, release the followers and the lock): run before a
    # whole answer is written to its client, so a client that reads slowly holds nobody else.
    land: Callable[[], Awaitable[None]] | None = None
    handed_off: bool = False  # its client lost the stream (a revoked key), which goes on for the flight's followers


@dataclass(slots=True)
class Outcome:
    """How the request ended: who answered, what it used, what the client got."""

    backend: str | None = None
    attempts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    streamed_tokens: int = 0  # content events passed to the client (what a client that leaves is charged)
    read_prompts: int = 0  # attempts after which a backend had read the prompt (relay/report.py READ_PROMPT)
    status: int = 200  # CLIENT_CLOSED (499) when the client left before any answer went out
    error: str | None = None
    finish: Finish | None = None
    affinity: Decision | None = None  # what prefix affinity did (routing/affinity.py), where it applied
    spend_usd: float | None = None  # what its tenant's quota charged (its usage's cost, else its estimate's)


@dataclass(slots=True)
class Call:
    """One request from parse to metrics. Each stage keeps its own part: intake the verdict and
    the ticket, the cache stage `cache`, the relay the transcript and `out`."""

    request_id: str
    endpoint: Endpoint  # the API endpoint's codec (wire/endpoints.py)
    raw: bytes  # the client's body, forwarded as is when no field needs rewriting
    api_key: str | None
    deadline: float  # time.monotonic() by which the client must have an answer
    asked: Asked = field(default_factory=Asked)
    timing: Timing = field(default_factory=Timing)
    # Filled in by intake:
    body: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    stream: bool = False
    tenant: Tenant | None = None  # who is calling (its name, and the virtual key it used)
    verdict: Verdict | None = None  # the classifier's, on a route that classifies
    prompt_tokens: int = 0  # an estimate, the same number for routing and the trackers
    prefix: tuple[bytes, ...] | None = None  # the prompt's block keys (routing/prefix.py), where a route learns them
    ticket: Ticket | None = None  # its place in admission and backend queues (band, tenant, tokens)
    # Filled in by the later stages:
    cache: Caching = field(default_factory=Caching)
    transcript: Transcript | None = None  # what a stream delivered, when it could be continued elsewhere
    affinity: Learner | None = None  # a stateful endpoint: records which backend holds each id it answers
    out: Outcome = field(default_factory=Outcome)
    _bodies: dict[str, bytes] = field(default_factory=dict)

    @property
    def cls(self) -> str:
        """simple | complex once classified; "none" on a route that does not classify."""
        v = self.verdict
        return v.cls if v is not None and v.features else "none"

    @property
    def score(self) -> float | None:
        v = self.verdict
        return v.score if v is not None and v.features else None

    @property
    def reasons(self) -> list[str]:
        v = self.verdict
        return v.logged() if v is not None and v.features else []

    def ask_usage(self) -> None:
        """A stream: have the backend send its usage chunk (a quota settles with it, the cache
        stores it), dropped for a client that did not ask (`asked.strip_usage`)."""
        if not self.stream or not self.endpoint.asks_usage:
            return  # a format whose streams always end with their usage (a Responses stream's response.completed)
        opts = self.body.get("stream_options")
        if isinstance(opts, dict) and opts.get("include_usage") is True:
            return
        self.body = {**self.body, "stream_options": {**(opts if isinstance(opts, dict) else {}), "include_usage": True}}
        self.raw = orjson.dumps(self.body)
        self.asked.strip_usage = True

    def max_output_tokens(self) -> int | None:
        """One answer's token limit as the request set it, in the field its endpoint honours
        (Endpoint.answer_limit), else None."""
        return self.endpoint.answer_limit(self.body)

    def limit_answer(self, tokens: int) -> None:
        """Have the backend generate at most `tokens` per answer: the endpoint's limit field the
        request set (each one it set), else the first it honours, written into the body."""
        fields = self.endpoint.limit_fields
        present = [f for f in fields if self.body.get(f) is not None] or list(fields[:1])
        if present:
            self.body = {**self.body, **dict.fromkeys(present, tokens)}
            self.raw = orjson.dumps(self.body)

    def answers(self) -> int:
        """How many answers the backend generates for it (`n`, `best_of`, a list of prompts)."""
        return self.endpoint.answers(self.body)

    def body_for(self, upstream_model: str, cache_salt: str | None = None) -> bytes:
        """The body to send a backend that knows the model as `upstream_model` (with vLLM's
        `cache_salt` when given: its prefix cache is then shared only with the same salt).

        Always encoded from what the gateway read, never the bytes as sent: of a key sent twice
        the gateway reads the last, and a backend that read the first would get what nothing
        checked (a model the tenant may not use, another tenant's previous_response_id, more
        max_tokens than the quota reserved). About 0.4 us for a small body, 6 us for 100 KB."""
        key = upstream_model if cache_salt is None else f"{upstream_model}\0{cache_salt}"
        out = self._bodies.get(key)
        if out is None:
            body = self.body if upstream_model == self.model and cache_salt is None else salted({**self.body, "model": upstream_model}, cache_salt)
            try:
                out = self._bodies[key] = orjson.dumps(body)
            except orjson.JSONEncodeError:  # orjson reads deeper nesting (1024) than it writes (~255)
                raise BadRequest("the request body is nested too deeply to be re-encoded for the backend") from None
        return out

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def timeout_ms(self) -> int:
        """The deadline the request was given, in ms (for messages)."""
        return max(1, round((self.deadline - self.timing.t0_monotonic) * 1000))

    def deadline_passed(self) -> bool:
        """True once the request's own deadline is (about) reached: a timeout then is the caller's."""
        return self.remaining_s() <= 0.002

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.timing.t0


def key_live(call: Call) -> bool:
    """Whether the caller's key still works (a key from the policy always does, for this request),
    or the answer goes on for the followers of its flight alone (TeeSink.hand_off)."""
    tenant = call.tenant
    return tenant is None or tenant.live is None or call.cache.handed_off or tenant.live()


def revoked() -> Unauthorized:
    """What a request gets once its key stopped working while it was under way."""
    return Unauthorized("the API key was revoked, rotated away or expired while this request was under way")
