"""The OpenAI wire subset the local backend speaks: request models, response objects, SSE framing, errors."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

__all__ = [
    "ApiError",
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "StreamOptions",
    "chat_choice",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_choice",
    "completion_response",
    "error_body",
    "parse_request",
    "sse",
    "usage",
    "SSE_DONE",
]

SSE_DONE = b"data: [DONE]\n\n"
_MAX_LOGIT_BIAS = 1024  # entries: bounds the work one request adds to each of its steps
# Choices per request (`n`): each is a sequence of the batch, so one request holds at most this many.
_MAX_CHOICES = 8
_MAX_STOP_CHARS = 1000  # characters of one stop sequence (OpenAI documents none; vLLM none)


class ApiError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> bytes:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str, param: str | None = None, code: str | None = None) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as JSON bytes."""
    return orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})


def _whole(value: Any) -> Any:
    """A whole float (100.0) is the integer it spells, as the gateway reads it; anything else goes
    on to strict validation (7.5, "7" and true are 400s)."""
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value


# An integer field: strict, but 100.0 is 100.
Int = Annotated[int, BeforeValidator(_whole)]


class _Request(BaseModel):
    # Unknown OpenAI fields (user, metadata, service_tier...) are accepted and ignored, as vLLM does.
    # Strict types: `"stream": "yes"`, `"n": true` or `"max_tokens": "7"` are 400s, not read one
    # way here and another by a gateway in front (whose rule this follows: a whole float is an integer).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False


class _TextPart(_Request):
    type: Literal["text"]
    text: str


# A list field stops at its first bad element (pydantic's fail_fast): 300,000 bad content parts
# were as many errors per union branch, built on the event loop (2.5 s; health checks failed and
# the gateway restarted the server), to answer with the first.
_FAST = Field(fail_fast=True)
# At most this many messages, and content parts in one message: far more than a prompt of the
# models served here holds (each message costs tokens of its own in the chat template), and a
# bound on what one body makes the validator build (34,000 one-character messages: 230 ms).
MAX_MESSAGES = MAX_PARTS = 4096


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[_TextPart], Field(fail_fast=True, max_length=MAX_PARTS)] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Sampling(_Request):
    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: Int | None = None
    stop: str | Annotated[list[str], _FAST] | None = None
    stream: bool | None = None  # null (OpenAI's schema allows it): not streamed
    stream_options: StreamOptions | None = None
    n: Int = Field(default=1, ge=1, le=_MAX_CHOICES)  # choices: each its own sequence in the batch
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # Token id (as a string, as OpenAI takes it) -> a bias added to its logit; ids checked against
    # the tokenizer by the server (bias_pairs).
    logit_bias: dict[str, float] | None = Field(default=None, max_length=_MAX_LOGIT_BIAS)
    ignore_eos: bool = False  # vLLM's extension: keep generating past the end-of-turn token
    # vLLM's extension: prefix-cache blocks are shared only among requests of the same salt (a
    # gateway sends one per tenant, so a caller cannot time another tenant's cached prompt).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        # Text held back while it may be the start of a stop is matched against each of its
        # prefixes at every token: a stop of 400,000 spaces cost the engine thread 0.3 s a token.
        if any(len(s) > _MAX_STOP_CHARS for s in ([v] if isinstance(v, str) else v or [])):
            raise ValueError(f"a stop sequence is at most {_MAX_STOP_CHARS} characters")
        return v

    def bias_pairs(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias) pairs; a 400 naming the entry that is not a token
        id of this model or whose bias is outside [-100, 100]."""
        pairs: list[tuple[int, float]] = []
        seen: set[int] = set()
        for key, bias in (self.logit_bias or {}).items():
            # isascii: str.isdigit takes '²', which int() refuses; 9 digits: int() of a long string is slow
            if not (key.isascii() and key.isdigit() and len(key) <= 9) or int(key) >= vocab_size:
                raise ApiError(400, f"logit_bias: {key[:40]!r} is not a token id of this model (0 to {vocab_size - 1})",
                               param="logit_bias", code="invalid_value")
            if not -100.0 <= bias <= 100.0:
                raise ApiError(400, f"logit_bias: the bias of token {key} is {bias}; it must be between -100 and 100",
                               param="logit_bias", code="invalid_value")
            token = int(key)
            if token in seen:  # "42" and "042": two biases on one token would add past the bound
                raise ApiError(400, f"logit_bias: token {token} is named twice ({key[:40]!r})", param="logit_bias", code="invalid_value")
            seen.add(token)
            pairs.append((token, bias))
        return tuple(pairs)

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream) and self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)
    max_tokens: Int | None = Field(default=None, ge=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    # Read only to refuse them: a 135M model can neither call tools nor promise JSON output.
    tools: Annotated[list[Any], _FAST] | None = None
    functions: Annotated[list[Any], _FAST] | None = None
    tool_choice: Any = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: Annotated[list[str], _FAST] | None = None
    audio: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):  # `logprobs` is declared first: validated already
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprob_count(self) -> int | None:
        """How many alternatives each token's log probability comes with; None: no log probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def unsupported(self) -> ApiError | None:
        """The 400 for a request this backend cannot honour (rather than answer prose and ignore it)."""
        for param in ("tools", "functions"):
            if getattr(self, param):
                return _unsupported(param, f"{param}: the local model cannot call tools; send this request to a model that can")
        for param in ("tool_choice", "function_call"):
            if getattr(self, param) not in (None, "none"):
                return _unsupported(param, f"{param}: the local model cannot call tools; send this request to a model that can")
        if self.audio is not None or any(m != "text" for m in self.modalities or ()):
            param = "audio" if self.audio is not None else "modalities"
            return _unsupported(param, f"{param}: the local model answers text only; send this request to a model that speaks")
        return self._unsupported_format()

    def _unsupported_format(self) -> ApiError | None:
        """Only plain text is honoured: answering prose to a JSON request would break the caller's parser."""
        if self.response_format is None:
            return None
        kind = self.response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_schema":
            what = "cannot follow a json_schema"
        elif kind == "json_object":
            what = "cannot guarantee JSON output (json_object)"
        else:
            what = f"cannot honour type {kind!r} (only {{\"type\": \"text\"}})"
        return _unsupported("response_format", f"response_format: the local model {what}; send this request to a model that can")


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_parameter")


class CompletionRequest(_Sampling):
    prompt: str | Annotated[list[str], _FAST] | Annotated[list[int], _FAST] = Field(min_length=1)
    max_tokens: Int | None = Field(default=16, ge=1)  # OpenAI's default for /v1/completions
    echo: Literal[False] = False
    logprobs: Int | None = Field(default=None, ge=0, le=5)  # OpenAI's legacy form: the alternatives per token
    # Read only to refuse them: the engine cannot fill in a middle (suffix) or rank several answers.
    suffix: str | None = None
    best_of: Int | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str] | list[int]) -> str | list[str] | list[int]:
        if isinstance(v, list) and v and isinstance(v[0], str) and len(v) != 1:
            raise ValueError("exactly one prompt per request")
        return v

    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprob_count(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> ApiError | None:
        """The 400 for a completion this backend cannot honour."""
        if self.suffix:
            return _unsupported("suffix", "suffix: the local model cannot insert text before a suffix")
        if self.best_of not in (None, 1):
            return _unsupported("best_of", "best_of: the local model generates one answer per request (best_of: 1)")
        return None


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none"})
_R = TypeVar("_R", bound=_Request)


def _param(loc: tuple[int | str, ...]) -> str:
    """pydantic's error location as an OpenAI-style parameter path: messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or any(c in part for c in "[(,"):
            continue  # a union-branch label (str, list[int], function-after[...]), not a field
        else:
            out += f".{part}" if out else str(part)
    return out


def parse_request(model: type[_R], body: bytes) -> _R:
    """Parse and validate a JSON body, raising ApiError(400) that names the offending field."""
    try:
        data: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(tuple(first["loc"])) or None
        raise ApiError(400, f"{param or 'body'}: {first['msg']}", param=param, code="invalid_value") from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event: ``data: {json}\\n\\n``."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_choice(index: int, text: str, finish: str, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish, "logprobs": logprobs}


def chat_response(rid: str, created: int, model: str, choices: list[dict[str, Any]], use: dict[str, int]) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": use,
        "system_fingerprint": None,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, str],
    finish: str | None,
    *,
    with_usage_field: bool,
    index: int = 0,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}],
        "system_fingerprint": None,
    }
    if with_usage_field:
        chunk["usage"] = None  # as OpenAI does: null on every chunk but the last
    return chunk


def completion_choice(index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "finish_reason": finish, "logprobs": logprobs}


def completion_response(rid: str, created: int, model: str, choices: list[dict[str, Any]], use: dict[str, int] | None) -> dict[str, Any]:
    """A ``text_completion`` object: the whole answer, or one stream chunk (``use`` None)."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "system_fingerprint": None,
        "usage": use,
    }


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None, index: int = 0) -> dict[str, Any]:
    return completion_response(rid, created, model, [completion_choice(index, text, finish)], None)
