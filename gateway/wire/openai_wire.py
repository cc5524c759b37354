"""The OpenAI wire subset the gateway reads, and SSE framing.

Bodies are validated for the fields the gateway itself relies on; every other field passes through
to the backend untouched (extra="allow"), so new OpenAI parameters work without a gateway release.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Protocol, TypeVar

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from ..errors import BadRequest, PayloadTooLarge

__all__ = [
    "first_message",
    "function_tool",
    "tool_call_delta",
    "due_calls",
    "json_object",
    "ChatRequest",
    "RequestBody",
    "CompletionRequest",
    "JsonFloat",
    "JsonInt",
    "EmbeddingRequest",
    "parse_body",
    "bounded_containers",
    "bounded_items",
    "MAX_CONTAINERS",
    "validate_body",
    "SSEDecoder",
    "SSEEventTooLarge",
    "sse_event",
    "SSE_DONE",
    "SSE_HEARTBEAT",
]

T = TypeVar("T", bound=BaseModel)

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEARTBEAT = b": keep-alive\n\n"


def _json_number(value: Any) -> Any:
    """Numbers must be JSON numbers: "5" or true would reach the backend as they are, while the
    gateway (quotas, the classifier) would have read 5 or 1. A whole float (100.0) is an integer."""
    if isinstance(value, str | bool):
        raise ValueError(f"must be a JSON number, not {type(value).__name__} {value!r:.40}")
    return value


JsonInt = Annotated[int, BeforeValidator(_json_number)]
JsonFloat = Annotated[float, BeforeValidator(_json_number)]


class RequestBody(BaseModel):
    """What every request body has: a model. Other fields pass through to the backend."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model: str = Field(min_length=1)


class _Body(RequestBody):
    # strict: "yes", "1" or 1 are not booleans; the backend would read them differently than we do.
    stream: bool = Field(False, strict=True)
    stream_options: dict[str, Any] | None = None
    max_tokens: JsonInt | None = Field(None, ge=1)
    max_completion_tokens: JsonInt | None = Field(None, ge=1)
    temperature: JsonFloat | None = Field(None, ge=0, le=2)
    top_p: JsonFloat | None = Field(None, ge=0, le=1)
    n: JsonInt | None = Field(None, ge=1, le=128)
    # OpenAI's tiers; an unknown one is a 400, like an unknown `x-priority`.
    service_tier: Literal["auto", "default", "flex", "priority", "scale"] | None = None

    @field_validator("service_tier")
    @classmethod
    def _scale_is_default(cls, v: str | None) -> str | None:
        """`scale` (reserved capacity upstream) gets the default priority here."""
        return "default" if v == "scale" else v


# A list field stops at its first bad element (pydantic's fail_fast): a body of 400,000 bad
# content parts was 400,001 errors, validated and listed on the event loop (1.4 s, every
# request waiting), to answer with the first.
_FAST = Field(fail_fast=True)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | Annotated[list[dict[str, Any]], _FAST] | None = None


class ChatRequest(_Body):
    messages: list[Message] = Field(min_length=1, fail_fast=True)


class CompletionRequest(_Body):
    prompt: str | Annotated[list[str], _FAST] | Annotated[list[int], _FAST] | Annotated[list[Annotated[list[int], _FAST]], _FAST]
    best_of: JsonInt | None = Field(None, ge=1, le=128)  # candidates generated per prompt (a quota reserves them all)


class EmbeddingRequest(RequestBody):
    input: str | Annotated[list[str], _FAST] | Annotated[list[int], _FAST] | Annotated[list[Annotated[list[int], _FAST]], _FAST]


def _field(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; BadRequest when it is not valid JSON or not an object."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


def parse_body(raw: bytes, model: type[T], max_items: int | None = None) -> tuple[T, dict[str, Any]]:
    """Decode and validate a request body; return the typed view and the raw dict.

    Raises BadRequest naming the offending field, or the items past `max_items` (bounded_items)
    before anything is validated.
    """
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    data = json_object(raw)
    if "stream" in data and data["stream"] is None:
        del data["stream"]  # OpenAI's schema allows null (clients that write out None send it): not streamed
    # Each item, object or array takes two bytes at least: a smaller body cannot hold too many.
    if len(raw) > 2 * MAX_CONTAINERS:
        bounded_containers(raw, data)
    if max_items is not None and len(raw) > 2 * max_items:
        bounded_items(data, max_items)
    return validate_body(data, model), data


# JSON objects and arrays one body may hold. Each costs ~60-100 bytes decoded, and a body is held
# for its whole upstream call: 4 MiB of `{}` in a field the gateway passes on was ~100 MB, five
# such requests in flight half a gigabyte. A body of messages at server.max_items holds far fewer.
MAX_CONTAINERS = 200_000


def bounded_containers(raw: bytes, data: Any) -> None:
    """Raise PayloadTooLarge when the decoded body holds more than MAX_CONTAINERS objects and
    arrays. Counted in the body's bytes first (a bound: braces in strings count too), and walked
    only when that count is past it."""
    if raw.count(b"{") + raw.count(b"[") <= MAX_CONTAINERS:
        return
    n, stack = 0, [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        else:
            continue
        n += 1
        if n > MAX_CONTAINERS:
            raise PayloadTooLarge(f"the request body holds more than {MAX_CONTAINERS:,} JSON objects and arrays")


# A body's lists of items: chat and Messages API, Responses and embeddings, completions, all
_LISTS = ("messages", "input", "prompt", "tools")


def bounded_items(body: dict[str, Any], limit: int) -> None:
    """Raise BadRequest when `body` holds more than `limit` items: its messages (or Responses
    input items, or prompts and inputs of a list), their content parts and its tools, together
    (server.max_items); token ids are one item an array. Counted before validation, whose cost
    (and the classifier's) grows with them."""
    n = 0
    for key in _LISTS:
        items = body.get(key)
        if not isinstance(items, list):
            continue
        n += 1 if items and isinstance(items[0], int) else len(items)
        if n <= limit:
            for item in items:
                content = item.get("content") if isinstance(item, dict) else None
                if isinstance(content, list):
                    n += len(content)
                    if n > limit:
                        break
        if n > limit:
            raise BadRequest(f"invalid field '{key}': the request holds more than {limit:,} messages, input items, "
                             "prompts, content parts and tools together (the gateway's server.max_items)", param=key)


def validate_body(data: dict[str, Any], model: type[T]) -> T:
    """An already decoded body's typed view; BadRequest naming the offending field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        # Drop pydantic's union-branch names ("str", "list[...]") from the location.
        loc = tuple(p for p in err["loc"] if isinstance(p, int) or ("[" not in p and p not in ("str", "int", "list")))
        field = _field(loc)
        msg = "is required" if err["type"] == "missing" else err["msg"]
        raise BadRequest(f"invalid field '{field}': {msg}", param=field or None) from None


def sse_event(payload: dict[str, Any]) -> bytes:
    """Frame one JSON payload as an SSE data event."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class SSEEventTooLarge(ValueError):
    """One SSE event grew past SSEDecoder's `max_event_bytes` (without its blank-line terminator,
    or with it: either way the decoder refuses to hold or hand out an event that big).

    The stream can't be trusted past this point: close the upstream response."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"an SSE event exceeds {limit} bytes")
        self.limit = limit


class SSEDecoder:
    """Splits an SSE byte stream into whole events, keeping each event's raw bytes.

    Raw bytes let the relay forward an event exactly as the backend sent it (no re-encoding).
    Accepts LF and CRLF line endings. One event may hold at most `max_event_bytes` (default 1 MiB);
    feed() raises SSEEventTooLarge past that. An event that spans many reads is kept as the reads
    that came and joined once, when its end arrives: one dribbled in tiny reads costs linear time.
    """

    __slots__ = ("_buf", "_more", "_size", "max_event_bytes")

    def __init__(self, max_event_bytes: int = 1 << 20) -> None:
        self.max_event_bytes = max_event_bytes
        self._buf = b""  # the unterminated event, CRLF-normalised
        self._more: list[bytes] | None = None  # once an event spans 3+ reads: the later ones, raw
        self._size = 0  # len(_buf) + the bytes in _more, while _more is set

    def feed(self, chunk: bytes) -> list[bytes]:
        held = self._buf
        if self._more is not None:  # a long event: look for its end in the new bytes only
            if b"\n\n" not in chunk and b"\n\r\n" not in chunk and not self._ends_at_junction(chunk):
                return self._hold(chunk)
            buf = b"".join([held, *self._more, chunk])
            self._more = None
        elif held:
            buf = held + chunk
        else:
            buf = chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._buf = rest = events.pop()
        if len(buf) > self.max_event_bytes:
            self._check(rest, events)
        if not events:
            if held:  # the second read without an end: keep further reads aside instead of copying
                self._more = []
                self._size = len(rest)
            return []
        return [e + b"\n\n" for e in events if e]

    def _check(self, rest: bytes, events: list[bytes]) -> None:
        cap = self.max_event_bytes
        if len(rest) > cap or any(len(e) > cap for e in events):
            raise SSEEventTooLarge(cap)

    def _ends_at_junction(self, chunk: bytes) -> bool:
        """Whether a terminator starts in the held bytes and ends in `chunk`."""
        if chunk[:1] != b"\n" and chunk[:2] != b"\r\n":
            return False
        edge = b"".join([self._buf[-2:], *self._more[-2:]])[-2:] + chunk[:2]  # type: ignore[index]
        return b"\n\n" in edge or b"\n\r\n" in edge

    def _hold(self, chunk: bytes) -> list[bytes]:
        if chunk:
            self._more.append(chunk)  # type: ignore[union-attr]
            self._size += len(chunk)
            if self._size > self.max_event_bytes:
                raise SSEEventTooLarge(self.max_event_bytes)
        return []

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated (a stream cut mid-event leaves them here)."""
        buf = self._buf if self._more is None else b"".join([self._buf, *self._more])
        return buf.replace(b"\r\n", b"\n") if b"\r" in buf else buf


def event_data(event: bytes) -> bytes | None:
    """The joined `data:` payload of one raw event, or None for a comment-only event."""
    if event.startswith(b"data: ") and event.count(b"\n") == 2:
        return event[6:-2]  # the common single-line case, without a split
    data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(data) if data else None


def function_tool(name: Any, parameters: Any, spec: Mapping[str, Any]) -> dict[str, Any]:
    """A chat function tool: `name`, `parameters`, and `spec`'s description and strict when set
    (the translations from the Messages and Responses APIs build it alike)."""
    fn: dict[str, Any] = {"name": name, "parameters": parameters}
    if spec.get("description") is not None:
        fn["description"] = spec["description"]
    if spec.get("strict") is not None:
        fn["strict"] = spec["strict"]
    return {"type": "function", "function": fn}


class _Waiting(Protocol):
    """A translated stream's tool call: its place among the answer's calls, its output index once opened."""

    @property
    def order(self) -> int: ...
    @property
    def index(self) -> int: ...


W = TypeVar("W", bound=_Waiting)


def due_calls(named: list[W], keep: W | None) -> list[W]:
    """The named tool calls still waiting to open, in the order they came, all but `keep` (which
    its caller opens next). Only the named ones are kept to look at: a scan of every call on each
    text piece was quadratic (2,000 calls then 100,000 pieces: ~3 s)."""
    return [c for c in sorted(named, key=lambda c: c.order) if c.index < 0 and c is not keep]


def tool_call_delta(delta: Mapping[str, Any]) -> tuple[int, str | None, Any, Any]:
    """A chat stream's tool call delta as (index, id, name piece, arguments piece); the id only
    when one is given (servers repeat it, or send it once)."""
    at = delta.get("index", 0)
    fn = delta.get("function")
    fn = fn if isinstance(fn, dict) else {}
    ident = delta.get("id")
    return (at if isinstance(at, int) else 0), (ident if isinstance(ident, str) and ident else None), fn.get("name"), fn.get("arguments")


def first_message(chat: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """A chat.completion's first choice, its message ({} where absent or malformed) and the
    message's content, content parts joined into one text."""
    choices = chat.get("choices")
    choice: dict[str, Any] = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message: dict[str, Any] = choice["message"] if isinstance(choice.get("message"), dict) else {}
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return choice, message, content
