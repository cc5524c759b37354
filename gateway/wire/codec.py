"""The endpoint codec: everything the request core needs to know about one API's wire format.

Each API endpoint (chat, completions, embeddings: chat.py; the Responses API:
responses/codec.py) is one `Endpoint`, registered in endpoints.py. The core reads a request
through it (`request`, `classify_view`, `cache_reason`, `stateful_refs`), reads a backend's
answer through it (`whole` for a body, `monitor` for a stream), frames failures through its sink
wrapper (`wrap`), and replays cached answers with it (`replay`). Adding an endpoint means adding
an Endpoint, not editing the core: nothing in the core branches on an endpoint's name.

Endpoints are immutable and shared by every request; they do no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from ..cache.entry import Entry
from ..errors import BadRequest, GatewayError
from ..web.sink import Sink
from .monitor import Monitor, Rewrite
from .openai_wire import RequestBody

__all__ = ["Endpoint", "NotAnAnswer", "Whole", "continue_final_turn", "count_field", "salted", "validate_legs"]


def count_field(v: Any) -> int | None:
    """A validated count or token limit (`n`, `max_tokens`, ...) as the integer it is (a whole
    float passes validation as one); None when absent or not a positive number."""
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and v >= 1 else None


def continue_final_turn(body: Mapping[str, Any], text: str) -> dict[str, Any]:
    """A chat or Messages request that asks for the rest of an answer that began with `text`: the
    text as the trailing assistant turn, appended to the request's own final assistant turn when it
    ends with one (the client's prefill: the answer went on from that; a second assistant turn
    after it was read as a closed turn, and the fake backend's answer came back twice at the seam:
    review helper's repro). Its content may be a string or a list of parts; text goes on the last
    text part."""
    messages = list(body.get("messages") or [])
    last = messages[-1] if messages else None
    if not (isinstance(last, dict) and last.get("role") == "assistant"):
        return {**body, "messages": [*messages, {"role": "assistant", "content": text}]}
    content = last.get("content")
    if isinstance(content, list) and content and isinstance(content[-1], dict) and content[-1].get("type") == "text":
        content = [*content[:-1], {**content[-1], "text": str(content[-1].get("text") or "") + text}]
    elif isinstance(content, list):
        content = [*content, {"type": "text", "text": text}]
    else:
        content = str(content or "") + text
    messages[-1] = {**last, "content": content}
    return {**body, "messages": messages}


def token_ids(value: Any) -> int:
    """The token ids of a prompt or input given as ids: one array of ints, or a list of them."""
    if not isinstance(value, list) or not value:
        return 0
    if isinstance(value[0], int):
        return len(value)
    return sum(len(v) for v in value if isinstance(v, list))


def validate_legs(legs: Iterable[Endpoint], body: Mapping[str, Any]) -> None:
    """Refuse what a translating leg cannot send (`Endpoint.validate`). A body a translation
    cannot read is the caller's error, a 400, whatever the translation raised: never a 500
    (a chat tool call's `id` as a list was a TypeError before authentication's answer)."""
    for leg in legs:
        try:
            leg.validate(body)
        except GatewayError:
            raise
        except Exception as exc:
            raise BadRequest(f"the request cannot be translated for this model's backend: {exc}"[:500]) from None


def salted(body: dict[str, Any], cache_salt: str | None) -> dict[str, Any]:
    """`body` (a chat request a leg made) with vLLM's `cache_salt` when there is one: a launched
    model's prefix cache is then shared only within the tenant, whatever API the caller spoke."""
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


class NotAnAnswer(ValueError):
    """A 200 whose body is not an answer of this endpoint (the attempt fails over)."""


class Whole(NamedTuple):
    """What a whole (non-streamed) answer holds for the relay (a tuple: built once per answer)."""

    usage: dict[str, Any] | None  # in the gateway's terms: prompt/completion/total tokens
    entry: Entry | None = None  # the answer as a cache entry (when captured and cacheable)
    record: dict[str, Any] | None = None  # a response the backend now holds (recorded before release)
    body: bytes | None = None  # what the client gets, when not the backend's bytes (a translation)


class Endpoint:
    """One endpoint's codec. Subclasses set the class attributes and override what differs."""

    name: str  # the policy's name for it (`backends.<b>.endpoints`)
    path: str  # after the base URL, upstream and on the gateway's /v1
    request: type[RequestBody]  # the body's typed view (openai_wire.py): fields the gateway relies on
    streams = True  # the request may ask for a stream
    classifies = True  # a prompt the classifier reads (simple | complex)
    cacheable = True  # answers may be cached
    stateful = False  # answers make the backend hold state later requests build on (responses/affinity.py, pipeline/pinning.py)
    asks_usage = False  # a stream's usage comes only when asked for (stream_options.include_usage)
    generates = True  # answers are generated tokens (a quota reserves for them; embeddings are not)
    client_prefill = False  # a request may end in an assistant turn its answer continues (`ends_in_prefill`)
    # The backend's endpoint (a key of endpoints.ENDPOINTS) an attempt posts to: its own for a
    # native codec, another for a translating leg (see `toward`).
    upstream: str = ""
    kinds: frozenset[str] = frozenset({"openai"})  # backend kinds (BackendPolicy.kind) it speaks natively
    # Request fields its answers repeat back (a Response object echoes `store`, `metadata`, `user`,
    # ...): in the cache key even where cache.core.TRANSPORT_FIELDS leaves them out, so that a
    # hit never hands one caller's values to another.
    echoed: frozenset[str] = frozenset()
    # Response headers that carry the gateway's request id (the one its logs and request log use):
    # the name the API's own SDK reads it from, next to the gateway's x-request-id.
    id_headers: tuple[str, ...] = ("x-request-id",)
    # The fields that bound one answer's tokens on this endpoint, as its API reads them (first
    # set wins). Only these: a field the API ignores (`max_completion_tokens` on /v1/completions,
    # `max_output_tokens` on chat) must not shrink what a quota reserves.
    limit_fields: tuple[str, ...] = ()
    # A translating leg that sends a limit of its own when the request sets none (Anthropic's
    # API requires one): the limit it sends, which its backend is known to accept.
    default_limit: int | None = None
    # What a 404 from a backend on this endpoint most likely means, for the client's error (None:
    # nothing more than the status says).
    missing_hint: str | None = None

    def __init__(self) -> None:
        self.upstream = self.upstream or self.name
        # Per backend kind, the ways to it in order of preference: natively first; endpoints.py
        # adds the translating legs.
        self.legs: dict[str, list[Endpoint]] = {k: [self] for k in self.kinds}

    def toward(self, kind: str, serves: tuple[str, ...]) -> Endpoint | None:
        """How a request to this endpoint goes to a backend of `kind` serving the endpoints
        `serves`: this codec when native, a translating leg (its own `upstream`, `upstream_body`,
        `whole`, `monitor`), or None when it cannot."""
        for leg in self.legs.get(kind, ()):
            if leg.upstream in serves:
                return leg
        return None

    def answer_limit(self, body: Mapping[str, Any]) -> int | None:
        """The most tokens one answer may have, as the request set it (`limit_fields`, as
        validated: a whole float is the integer it is); None when it set none."""
        for key in self.limit_fields:
            v = count_field(body.get(key))
            if v is not None:
                return v
        return None

    def answers(self, body: Mapping[str, Any]) -> int:
        """How many answers the backend generates for the request, each up to `answer_limit`."""
        return 1

    def answers_later(self, body: Mapping[str, Any]) -> bool:
        """Whether the backend goes on generating whatever happens to this request (a Responses
        `background` request: answered `queued`, or streamed to a client that may leave): its
        usage may never come back to the gateway, and what it may generate is charged."""
        return False

    def validate(self, body: Mapping[str, Any]) -> None:
        """A translating leg: refuse (a BadRequest naming the feature) what it cannot translate
        faithfully. Called at intake for every leg a candidate of the request's pool would use."""

    def upstream_body(self, body: Mapping[str, Any], upstream_model: str, cache_salt: str | None = None) -> bytes | None:
        """The body a translating leg sends its backend; None: the client's own (the model mapped).
        `cache_salt` (a launched model's, per tenant): a leg toward a chat backend carries it."""
        return None

    def upstream_request(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The request a continuation builds on, in the backend's format (`prefill` then applies)."""
        return dict(body)

    # Whether a stream through this codec (natively, or as a leg) can be continued on another
    # backend when it breaks (relay/continuation.py: its monitor gives the transcript chat chunks,
    # its own or a translation of its events, and applies the continuation's rewrite to them).
    continues = True
    # Whether a stream through this codec (natively, or as a leg) ends in a cache entry (its
    # monitor's `entry`): a stream that does not is shared live with identical streams, but
    # nothing waits for it to be stored (cache/stage.py).
    stores_streams = True

    def ids(self, request_id: str) -> dict[str, str]:
        """The request id's response headers (`id_headers`), a fresh dict."""
        return dict.fromkeys(self.id_headers, request_id)

    def error_body(self, err: GatewayError) -> bytes:
        """An error answer's body in this endpoint's shape (OpenAI's by default)."""
        return err.to_body()

    def classify_view(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """The body as the classifier reads it (a chat body)."""
        return body

    def unread_prompt(self, body: Mapping[str, Any]) -> int:
        """Prompt tokens the classifier's text cannot show (token ids, a completion's suffix): the
        prompt estimate adds them, and a request with any goes to complex (intake.py)."""
        return 0

    def batch_chars(self, body: Mapping[str, Any]) -> int:
        """The characters of a batch of prompts each answered on its own (a completions prompt
        list of several strings), which the classifier reads joined; 0 for one prompt."""
        return 0

    def cache_reason(self, body: Mapping[str, Any]) -> str | None:
        """Why this request's answer must not come from the cache, beyond the general rules."""
        return None

    def stateful_refs(self, body: Mapping[str, Any]) -> list[tuple[str, str]]:
        """Every (field, id) of state held by a backend that the request builds on (pipeline/pinning.py)."""
        return []

    def missing_code(self, field: str) -> str:
        """The error code for a referenced id that cannot be found."""
        return "not_found"

    def continuable(self, body: Mapping[str, Any]) -> bool:
        """Whether a stream that broke mid-answer could be continued on another backend."""
        return False

    def prefill(self, body: Mapping[str, Any], text: str) -> dict[str, Any]:
        """The body that asks a backend to go on from `text` (a continuation's prefill)."""
        raise NotImplementedError(f"{self.name} answers are not continued")

    def ends_in_prefill(self, body: Mapping[str, Any]) -> bool:
        """Whether the request ends with an assistant turn its answer continues (Anthropic's
        prefill): only a backend that continues one (BackendPolicy.prefill) may answer it."""
        return False

    def prefills(self, body: Mapping[str, Any]) -> bool:
        """Whether a continuation of this request may prefill (else it restarts, skipping the
        delivered text)."""
        return True

    # The backend refuses a prefill that ends in whitespace (Anthropic's API): a continuation's
    # prefill goes without it (continuation.Resume.body).
    prefill_trims = False

    def recognises(self, body: Mapping[str, Any]) -> bool:
        """Whether /v1/route/explain should read `body` as this endpoint's (else as chat)."""
        return False

    def wrap(self, sink: Sink) -> Sink:
        """The sink this endpoint answers through (how a failure is framed once streaming)."""
        return sink

    def monitor(self, *, capture: int, strip_usage: bool, rewrite: Rewrite | None, body: Mapping[str, Any] | None = None,
                transcript: Any = None) -> Monitor:
        """A monitor for one stream (`capture`: keep the answer for the cache, up to this many
        bytes; `strip_usage`: drop the usage chunk the gateway asked for; `rewrite`: a
        continuation's event hook; `body`: the client's request, for a leg that echoes it;
        `transcript`: the answer's continuation.Transcript, where a monitor that reads a stream
        as chat chunks marks what cannot be continued, and a Messages client's stream
        translator is kept across the attempts of one answer)."""
        raise NotImplementedError(f"{self.name} does not stream")

    def whole(self, raw: bytes, capture: int, request: Mapping[str, Any] | None = None) -> Whole:
        """Read a whole 200 answer (`request`: the client's request, for a leg that echoes it); raises
        NotAnAnswer when it is none."""
        raise NotImplementedError

    def held_id(self, entry: Entry) -> str | None:
        """The id a stored answer hands out that a backend must still hold for it to be served
        (a follow-up may build on it): None for an endpoint whose answers leave no state."""
        return None

    def replay(self, entry: Entry, *, stream: bool, include_usage: bool) -> bytes:
        """A cached answer as this endpoint sends it: the body, or the whole event stream."""
        raise NotImplementedError(f"{self.name} answers are not cached")

    def __repr__(self) -> str:
        return f"Endpoint({self.name!r})"
