"""The OpenAI wire subset the gateway reads, and SSE framing.

Bodies are validated for the fields the gateway itself relies on; every other field passes through
to the backend untouched (extra="allow"), so new OpenAI parameters work without a gateway release.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import BadRequest

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "EmbeddingRequest",
    "parse_body",
    "SSEDecoder",
    "sse_event",
    "SSE_DONE",
    "SSE_HEARTBEAT",
]

T = TypeVar("T", bound=BaseModel)

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEARTBEAT = b": keep-alive\n\n"


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    service_tier: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Body):
    messages: list[Message] = Field(min_length=1)


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]


def _field(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parse_body(raw: bytes, model: type[T]) -> tuple[T, dict[str, Any]]:
    """Decode and validate a request body; return the typed view and the raw dict.

    Raises BadRequest naming the offending field.
    """
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(data), data
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


class SSEDecoder:
    """Splits an SSE byte stream into whole events, keeping each event's raw bytes.

    Raw bytes let the relay forward an event exactly as the backend sent it (no re-encoding).
    Accepts LF and CRLF line endings.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self._buf = events.pop()
        return [e + b"\n\n" for e in events if e]

    @property
    def pending(self) -> bytes:
        """Bytes of an event not yet terminated (a stream cut mid-event leaves them here)."""
        return self._buf


def event_data(event: bytes) -> bytes | None:
    """The joined `data:` payload of one raw event, or None for a comment-only event."""
    if event.startswith(b"data: ") and event.count(b"\n") == 2:
        return event[6:-2]  # the common single-line case, without a split
    data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(data) if data else None
