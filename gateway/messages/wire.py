"""Anthropic's Messages API (`POST /v1/messages`) on the wire: the request fields the gateway reads,
and errors in Anthropic's shape (a continuation's prefill: wire.codec.continue_final_turn).

The request model checks what the gateway and the translation to chat (translate.py) rely on and
lets every other field through (extra="allow"): the official SDK sends new top-level fields
(`cache_control`, `output_config`, `speed`, ...) that a native Anthropic backend takes as they are.
Unknown content block types pass too; translation refuses them by name when the backend speaks chat.

Errors are `{"type": "error", "error": {"type", "message"}}`, with `details.error_code` (the SDK's
`APIStatusError.error_code`) when the gateway's error has a code. The HTTP status stays the
gateway's own; only the error type follows Anthropic's names (`error_type`). One decision:
the gateway's 503 (every backend busy or cooling down) is `overloaded_error`, still sent as 503
rather than Anthropic's 529. The SDK treats both alike (an InternalServerError subclass, retried,
honouring Retry-After), while 503 is understood by every proxy, load balancer and dashboard on
the way and keeps one status per error across the gateway's APIs. A backend's own 529 maps to
`overloaded_error` too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..errors import GatewayError, UpstreamRejected
from ..wire.openai_wire import JsonFloat, JsonInt, RequestBody, parse_body

__all__ = [
    "Block",
    "ERROR_TYPES",
    "MessageParam",
    "MessagesRequest",
    "Metadata",
    "SystemBlock",
    "ToolChoice",
    "ToolParam",
    "error_body",
    "error_event",
    "error_type",
    "gateway_error",
    "parse_messages",
    "sse_event",
]

# Anthropic's error type per HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def _tagged(value: Any) -> str:
    """`str | list[...]` fields: validate one branch only, so an error names the field's real
    problem instead of "Input should be a valid string" for a list. The tags are the names
    openai_wire.parse_body leaves out of an error's field path."""
    return "str" if isinstance(value, str) else "list"


def _bad(message: str) -> PydanticCustomError:
    return PydanticCustomError("messages_wire", message)


# The media types Anthropic takes for a base64 image.
_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


class Block(BaseModel):
    """One content block. The known types are checked for the fields translation reads; any other
    type (document, thinking, server tool blocks, ...) passes as it is."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str

    @model_validator(mode="after")
    def _fields(self) -> Block:
        x = self.model_extra or {}
        t = self.type
        if t == "text" and not isinstance(x.get("text"), str):
            raise _bad("a text block needs 'text', a string")
        if t == "text" and not x["text"]:
            raise _bad("a text block's 'text' is empty (Anthropic refuses empty text blocks)")
        if t == "image":
            src = x.get("source")
            if not isinstance(src, dict) or src.get("type") not in ("base64", "url", "file"):
                raise _bad("an image block needs a 'source' object of type base64, url or file")
            if src["type"] == "base64" and not (isinstance(src.get("data"), str) and isinstance(src.get("media_type"), str)):
                raise _bad("a base64 image source needs 'media_type' and 'data', strings")
            # Anthropic's four; translation pastes it into a data URL, where any other text could reshape the URL.
            if src["type"] == "base64" and src["media_type"] not in _IMAGE_TYPES:
                raise _bad(f"a base64 image source's 'media_type' is one of {', '.join(_IMAGE_TYPES)}, "
                           f"not {src['media_type'][:40]!r}")
            if src["type"] == "url" and not isinstance(src.get("url"), str):
                raise _bad("a url image source needs 'url', a string")
        if t == "tool_use" and not (
            isinstance(x.get("id"), str) and isinstance(x.get("name"), str) and isinstance(x.get("input"), dict)
        ):
            raise _bad("a tool_use block needs 'id' and 'name' (strings) and 'input' (an object)")
        if t == "tool_result":
            content = x.get("content")
            if not isinstance(x.get("tool_use_id"), str):
                raise _bad("a tool_result block needs 'tool_use_id', a string")
            # strict: "no" would read as true (translation's "Error: " prefix), unlike Anthropic's own reading
            if x.get("is_error") is not None and not isinstance(x["is_error"], bool):
                raise _bad("a tool_result's 'is_error' is a boolean (true or false)")
            if content is not None and not isinstance(content, str | list):
                raise _bad("a tool_result's 'content' is a string or a list of content blocks")
            if isinstance(content, list) and not all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in content):
                raise _bad("a tool_result's 'content' blocks are objects with a 'type'")
        return self


Content = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[Block], Tag("list"), Field(fail_fast=True)],
    Discriminator(_tagged),
]


def _blank(text: str) -> bool:
    """Text that is there but only whitespace (`str.strip`'s, as Anthropic's check reads it)."""
    return bool(text) and not text.strip()


# Anthropic's wording (its 400s quoted in public issues: anthropics/claude-code#23440,
# LibreChat-AI/agents#124, which probed the API: a turn of only whitespace text is refused, one
# whitespace block beside real text is not).
_WHITESPACE = "text content blocks must contain non-whitespace text"


class MessageParam(BaseModel):
    """One turn: `user` or `assistant` (a system prompt is the top-level `system`)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    role: Literal["user", "assistant"]
    content: Content

    @model_validator(mode="after")
    def _blocks_fit_role(self) -> MessageParam:
        if isinstance(self.content, list):
            for block in self.content:
                if block.type == "tool_use" and self.role != "assistant":
                    raise _bad("tool_use blocks belong in assistant turns")
                if block.type == "tool_result" and self.role != "user":
                    raise _bad("tool_result blocks belong in user turns")
        return self

    @model_validator(mode="after")
    def _not_only_whitespace(self) -> MessageParam:
        # A string is shorthand for one text block (Anthropic's docs); a turn of text blocks that
        # are all whitespace is refused. Empty text is the Block's own check (and "" content intake's).
        content = self.content
        if isinstance(content, str):
            blank = _blank(content)
        else:  # only text blocks, all blank (beside an image or a tool's block it is not confirmed: passed on)
            blank = bool(content) and all(b.type == "text" and _blank(str((b.model_extra or {}).get("text"))) for b in content)
        if blank:
            raise _bad(_WHITESPACE)
        return self


def _trails_whitespace(turn: MessageParam) -> bool:
    """Whether a final assistant turn (a prefill) ends in whitespace, which Anthropic refuses
    ("final assistant content cannot end with trailing whitespace"; its prefill guide says so too):
    its string, or its last block's text."""
    content = turn.content
    if isinstance(content, str):
        text: Any = content
    elif content and content[-1].type == "text":
        text = (content[-1].model_extra or {}).get("text")
    else:
        return False
    return isinstance(text, str) and text != text.rstrip()


class SystemBlock(BaseModel):
    """A block of the system prompt: text only (cache_control and the like pass through)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _not_empty(cls, text: str) -> str:
        if not text:  # Anthropic: "system: text content blocks must be non-empty"
            raise _bad("a text block's 'text' is empty (Anthropic refuses empty text blocks)")
        return text


class ToolParam(BaseModel):
    """A tool: a custom one is `{name, description?, input_schema}`; a server tool (`type`
    "web_search_20250305", "bash_20250124", ...) has its own fields."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str = Field(min_length=1)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, schema: dict[str, Any] | None, info: ValidationInfo) -> dict[str, Any] | None:
        # Anthropic's rule: a tool's input is an object. Forwarded to a chat backend, {"type": "string"}
        # had a schema-following backend answer arguments no Message can hold: a 502 charged to that
        # backend, which three such requests ejected. (Without a `type`, translation says "object".)
        if schema is not None and info.data.get("type") in (None, "custom") and schema.get("type", "object") != "object":
            raise _bad(f"a custom tool's input_schema has type 'object' (a tool's input is an object), "
                       f"not {str(schema['type'])[:40]!r}")
        return schema

    @model_validator(mode="after")
    def _custom_has_schema(self) -> ToolParam:
        if self.type in (None, "custom") and self.input_schema is None:
            raise _bad("a custom tool needs 'input_schema', a JSON schema object")
        return self


class ToolChoice(BaseModel):
    """`{"type": "auto" | "any" | "tool" | "none"}`; `tool` names one (`name`)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = Field(None, strict=True)

    @model_validator(mode="after")
    def _tool_has_name(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise _bad('tool_choice {"type": "tool"} needs the tool\'s \'name\'')
        return self


class Metadata(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    user_id: str | None = None


System = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[SystemBlock], Tag("list"), Field(fail_fast=True)],
    Discriminator(_tagged),
]


class MessagesRequest(RequestBody):
    """POST /v1/messages: the fields the gateway relies on; every other field is kept as sent."""

    max_tokens: JsonInt = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1, fail_fast=True)  # the first bad one, not every one
    system: System | None = None
    # strict: "yes" or 1 is not a boolean (the backend would read it differently than we do).
    stream: bool = Field(False, strict=True)
    tools: Annotated[list[ToolParam], Field(fail_fast=True)] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: Annotated[list[str], Field(fail_fast=True)] | None = None
    temperature: JsonFloat | None = Field(None, ge=0, le=1)  # Anthropic's range, not OpenAI's 0..2
    top_p: JsonFloat | None = Field(None, ge=0, le=1)
    top_k: JsonInt | None = Field(None, ge=0)
    metadata: Metadata | None = None

    @field_validator("messages")
    @classmethod
    def _prefill_ends_in_text(cls, turns: list[MessageParam]) -> list[MessageParam]:
        if turns and turns[-1].role == "assistant" and _trails_whitespace(turns[-1]):
            raise _bad("final assistant content cannot end with trailing whitespace (Anthropic refuses such a prefill)")
        return turns

    @field_validator("system")
    @classmethod
    def _system_not_only_whitespace(cls, system: str | list[SystemBlock] | None) -> str | list[SystemBlock] | None:
        if isinstance(system, list) and system and all(_blank(b.text) for b in system):
            raise _bad(_WHITESPACE)
        return system

    @field_validator("stop_sequences")
    @classmethod
    def _stops_have_text(cls, stops: list[str] | None) -> list[str] | None:
        # Anthropic's 400s: "each stop sequence must be non-empty", "... must contain non-whitespace".
        for i, stop in enumerate(stops or ()):
            if not stop.strip():
                what = "be non-empty" if not stop else "contain non-whitespace"
                raise _bad(f"each stop sequence must {what} (stop_sequences[{i}] is {stop[:20]!r})")
        return stops


def parse_messages(raw: bytes) -> tuple[MessagesRequest, dict[str, Any]]:
    """Decode and validate a Messages request body: (the typed view, the raw dict).

    Raises BadRequest naming the field ("invalid field 'messages[0].content[1]': a tool_use
    block needs ..."); gateway_error() turns it into Anthropic's shape."""
    return parse_body(raw, MessagesRequest)


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status: ERROR_TYPES, else invalid_request_error for any
    other 4xx and api_error for the rest."""
    known = ERROR_TYPES.get(status)
    if known is not None:
        return known
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def _error(err_type: str, message: str, code: str | None, request_id: str | None) -> dict[str, Any]:
    error: dict[str, Any] = {"type": err_type, "message": message}
    if code:
        error["details"] = {"error_code": code}
    out: dict[str, Any] = {"type": "error", "error": error}
    if request_id:
        out["request_id"] = request_id
    return out


def error_body(err_type: str, message: str, *, code: str | None = None, request_id: str | None = None) -> bytes:
    """An error response body: `{"type": "error", "error": {"type", "message"}}`."""
    return orjson.dumps(_error(err_type, message, code, request_id))


def sse_event(payload: dict[str, Any]) -> bytes:
    """One Anthropic stream event: `event: <type>` (the SDK reads a stream by this line) and its data."""
    return b"event: " + str(payload["type"]).encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def error_event(err_type: str, message: str, *, code: str | None = None) -> bytes:
    """An `error` event, for a failure once a stream has begun."""
    return sse_event(_error(err_type, message, code, None))


def _rejection(err: UpstreamRejected) -> tuple[str, str]:
    """(type, message) of a backend's own 4xx: an Anthropic backend's error keeps its type, an
    OpenAI backend's its message."""
    try:
        parsed = orjson.loads(err.raw_body)
    except orjson.JSONDecodeError:
        parsed = None
    inner = parsed.get("error") if isinstance(parsed, dict) else None
    if isinstance(inner, dict) and isinstance(inner.get("message"), str):
        if parsed.get("type") == "error" and isinstance(inner.get("type"), str):
            return inner["type"], inner["message"]
        return error_type(err.status), inner["message"]
    text = err.raw_body[:500].decode("utf-8", "replace")
    return error_type(err.status), f"{err.message}: {text}" if text else err.message


def gateway_error(err: GatewayError) -> tuple[int, bytes]:
    """A gateway error as a Messages API client sees it: (HTTP status, body). The status is the
    gateway's own (see the module's note on 503); headers (Retry-After) come from err.headers()."""
    if isinstance(err, UpstreamRejected):
        err_type, message = _rejection(err)
    else:
        err_type, message = error_type(err.status), err.message
    return err.status, error_body(err_type, message, code=err.code)
