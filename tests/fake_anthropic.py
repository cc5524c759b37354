"""A fake Anthropic Messages API upstream (`kind: anthropic` backends), with latency and fault knobs.

Run it as its own process: `python -m tests.fake_anthropic --port 9201 [--key K] [--words N]
[--fail-status S --fail-count C] [--max-seconds T]` (every Behaviour field has a flag), or
in-process with `await FakeAnthropic("a", words=5).start()`. `url` is its base URL ending in /v1
(a gateway calls `POST {url}/messages`); `root` is the URL without /v1, which is what the official
SDK wants as `base_url` (it adds /v1/... itself). `POST /_control` changes the behaviour at run time
(JSON with any Behaviour field); `GET /_stats` reports what it saw.

Endpoints: POST /v1/messages (JSON, or Anthropic's SSE with `stream: true`), POST
/v1/messages/count_tokens, GET /v1/models, GET /v1/models/{id}, GET /health (no auth). Every error is
Anthropic-shaped: `{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}`,
with a `request-id` header.

Auth (as the API): a key in `x-api-key`, or (`allow_bearer`, the default) `Authorization: Bearer
<key>`, which is what the anthropic SDK 2.x sends; equal to `key` when that is set, any non-empty
key otherwise; else 401 authentication_error. Then an `anthropic-version` header (any value; the
SDK sends 2026-10-21, raw clients 2023-06-01), else 400. `stats.last_auth` says which header
carried the key ("x-api-key" or "bearer"); `stats.auth` counts them.

Validation of POST /v1/messages (400 invalid_request_error, messages in Anthropic's style):
model (a non-empty string); max_tokens (an int >= 1); OpenAI-only fields (stream_options, n, user,
max_completion_tokens, response_format, frequency_penalty, ...) and, with `strict_keys` (default),
any top-level key the API does not know ("x: Extra inputs are not permitted"; every field the SDK
2.14 sends is known); temperature / top_p in 0..1, top_k >= 0; stream a bool; stop_sequences a
list of strings; system a string or a list of non-empty text blocks; metadata only user_id;
messages a non-empty list whose roles alternate user/assistant starting with user (`alternate`;
a `system` role gets the API's own message), a final assistant turn (a prefill) whose text does not
end in whitespace; content a non-empty string or a non-empty list of
known blocks; no empty or whitespace-only text; tool_use blocks ({id, name, input: object}) only in
assistant turns, each answered by a tool_result in the very next user turn; a tool_result only for
a tool_use of the assistant turn just before, and all tool_results before any other block of their
turn; tools shaped {name, description?, input_schema: {type: object, ...}} (a versioned server tool
type such as web_search_20250305 passes; OpenAI's {type: function, function: ...} does not);
tool_choice an object of type auto / any / tool (with a name among the tools) / none, and any/tool
only with tools. count_tokens checks the same, minus max_tokens, which it rejects (as the API
does), as it does stream, stop_sequences and the sampling fields.

The answer (deterministic): text "w0 w1 ... w{N-1}" with N = `words` (`word` changes the stem "w"), cut at max_tokens words
(stop_reason max_tokens), or before the first stop_sequences entry found in it (stop_reason
stop_sequence, stop_sequence set: stop "w3" gives "w0 w1 w2"), else end_turn. A trailing assistant
turn (a prefill) is continued after the words it already has. usage.output_tokens is the number of
words sent (at least 1); input_tokens is about characters / 4 of tools + system + messages (>= 1),
minus what the prompt cache read or wrote (below).

Tool use: with tools in the request and tool_choice not `none`, the answer is tool_use blocks
(stop_reason tool_use) when
  - tool_choice is {"type": "tool", "name": X}: X;
  - else the knob `tool_call` names tools in the request ("get_weather", or "a,b" for parallel
    calls; names not in the request are ignored);
  - else the last user turn's text says `use_tool:NAME` (any number of them);
  - else tool_choice is {"type": "any"}: the first tool;
but not when the last user turn carries tool_result blocks (a round trip's follow-up gets a text
answer) unless tool_choice forces a tool. `disable_parallel_tool_use` keeps only the first call.
Each tool_use block has id toolu_..., the tool's name and input `tool_input` (a dict), or, when that
is None (the default), an input made from the tool's input_schema (each property: its first enum
value, or "x" / 1 / 1.5 / true / [] / {} by type). Without a forced tool_choice a text block
`tool_text` (None: none) comes first, so the first tool_use is index 1. output_tokens: the text's
words plus len(json(input)) / 4 per call. Streamed, a tool's input goes out as input_json_delta
pieces of `json_chunk` characters (split mid-token), the first one "".

Prompt caching (a simple model of the real one): the prompt is a list of segments (each tool, the
system string or each system block, each message's blocks in order; a string content is one
segment); a segment with `cache_control` is a breakpoint, and a top-level `cache_control`
(automatic caching) makes the prompt's last segment one too. A breakpoint's prefix (the segments up
to it, with the model) is cacheable when it holds at least `cache_min_tokens` tokens. The longest
cacheable prefix already in the fake's cache is read (cache_read_input_tokens: its tokens); the
tokens from there to the last cacheable breakpoint are written (cache_creation_input_tokens); every
cacheable prefix is then in the cache. input_tokens is the rest (at least 1). `clear_cache()`
empties it. Tokens are characters / 4 throughout.

Streaming: `event: <type>\\ndata: <json>\\n\\n` for every event: message_start (content [], usage
with input_tokens and the cache counts, output_tokens 1), then, after `ttft_ms`: per block
content_block_start, (ping after the first one), content_block_delta (a text_delta per word, the
first word bare and later ones with a leading space, `itl_ms` apart; or input_json_delta pieces),
content_block_stop; then message_delta (stop_reason, stop_sequence, usage.output_tokens) and
message_stop. The JSON answer comes after ttft_ms + itl_ms per word.

Faults:
  - `fail_status` (0: none; e.g. 529 overloaded_error, 429 rate_limit_error, 500 api_error, 503,
    504 timeout_error) answers the next `fail_count` valid POST /v1/messages (0: all of them, until
    set() changes it; a set() naming fail_status or fail_count starts a new count) with that status, before any byte of a stream; `retry_after_s` adds a
    retry-after header (a real 529 usually has none). With fail_count 0 and a status >= 500, GET
    /v1/models fails alike (the upstream is down everywhere), without using up anything.
  - `cut_after` (None: off) words: a stream stops after that many text deltas (or after the last
    one, if fewer), without message_delta / message_stop, and the connection is closed abruptly (the
    client sees a broken chunked body); `cut_clean` ends it with a clean EOF instead. A JSON request
    gets its connection closed without any answer.
  - `error_event_after` (None: off) words: after that many text deltas (or the last one) a stream
    sends `event: error` with an overloaded_error and ends (streams only).

Stats: requests (POST /v1/messages), by_status (their answers by HTTP status), completed, faults,
active / peak_active, streams, count_tokens, models_requests, last_body, last_headers (of the last
request to any /v1 path), last_path, last_auth and auth (which header carried the key), cache_reads /
cache_writes (requests that read / wrote the cache).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from tests.servers import Served, serve_for

__all__ = ["Behaviour", "FakeAnthropic", "Stats", "ERROR_TYPES", "Invalid", "validate", "segments", "prompt_tokens"]


@dataclass
class Behaviour:
    key: str | None = None  # the API key it accepts; None: any non-empty key
    allow_bearer: bool = True  # accept the key as Authorization: Bearer too (the SDK 2.x sends it so)
    words: int = 8  # words of a text answer: w0 w1 ...
    word: str = "w"  # the words' stem: "v" answers v0 v1 ... (a different answer to the same request)
    ttft_ms: float = 0.0  # before the first content (a stream's message_start goes out at once)
    itl_ms: float = 0.0  # between two deltas of a stream
    model: str | None = None  # the model to answer with; None: echo the request's
    models: tuple[str, ...] = ("claude-fake-1", "claude-fake-2")  # what GET /v1/models lists
    strict_keys: bool = True  # reject unknown top-level keys, as the API does (False: only OpenAI-only ones)
    alternate: bool = True  # roles must alternate user/assistant, starting with user
    tool_call: str | None = None  # tool name(s) to call (comma-separated) when the request has them
    tool_input: dict[str, Any] | None = None  # a tool call's input; None: made from its input_schema
    tool_text: str | None = "Let me use a tool."  # a text block before the tool_use blocks (None: none)
    json_chunk: int = 5  # characters per input_json_delta piece
    cache_min_tokens: int = 0  # the fewest tokens a cached prefix may have
    fail_status: int = 0  # > 0: answer POST /v1/messages with this status
    fail_count: int = 0  # ... for the next this many requests (0: all of them)
    retry_after_s: float | None = None  # a retry-after header on fail_status answers
    cut_after: int | None = None  # a stream stops after this many words, the connection closed
    cut_clean: bool = False  # cut_after ends the stream with a clean EOF rather than an abrupt close
    error_event_after: int | None = None  # a stream sends an error event after this many words


@dataclass
class Stats:
    requests: int = 0  # POST /v1/messages
    by_status: dict[int, int] = field(default_factory=dict)  # POST /v1/messages answers by status
    completed: int = 0  # answered in full (JSON or a stream up to message_stop)
    faults: int = 0  # answered with fail_status, cut or an error event
    active: int = 0
    peak_active: int = 0
    streams: int = 0
    count_tokens: int = 0
    models_requests: int = 0
    cache_reads: int = 0
    cache_writes: int = 0
    last_path: str = ""
    last_body: Any = None
    last_headers: dict[str, str] = field(default_factory=dict)
    last_auth: str | None = None  # "x-api-key" or "bearer"
    auth: dict[str, int] = field(default_factory=dict)


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_FAULT_MESSAGES = {529: "Overloaded", 429: "Number of requests has exceeded your rate limit", 500: "Internal server error"}

# What POST /v1/messages knows at the top level (everything the SDK 2.14 sends, and the sampling fields).
MESSAGES_KEYS = frozenset({
    "model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream", "temperature", "top_p", "top_k",
    "tools", "tool_choice", "thinking", "service_tier", "cache_control", "container", "context_management", "diagnostics",
    "inference_geo", "mcp_servers", "output_config", "output_format", "speed", "user_profile_id", "workspace_id",
})
COUNT_KEYS = frozenset({
    "model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control", "context_management",
    "mcp_servers", "output_config", "output_format", "speed", "user_profile_id", "workspace_id",
})
OPENAI_ONLY = ("stream_options", "n", "user", "max_completion_tokens", "response_format", "frequency_penalty",
               "presence_penalty", "logprobs", "top_logprobs", "logit_bias", "seed", "stop", "functions", "function_call",
               "parallel_tool_calls", "modalities", "reasoning_effort")
BLOCK_TYPES = frozenset({"text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking",
                         "search_result", "server_tool_use", "web_search_tool_result"})
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")
_SERVER_TOOL = re.compile(r"^[a-z_]+_\d{8}$")  # web_search_20250305, bash_20250124, ...
_USE_TOOL = re.compile(r"use_tool:([a-zA-Z0-9_-]+)")


class Invalid(Exception):
    """A request the API would answer 400."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _dumps(v: Any) -> str:
    return orjson.dumps(v, option=orjson.OPT_SORT_KEYS).decode()


def validate(body: Any, *, count: bool = False, strict_keys: bool = True, alternate: bool = True) -> None:
    """Raise Invalid with Anthropic's kind of message when the API would refuse this body."""
    if not isinstance(body, dict):
        raise Invalid("body: Input should be a valid dictionary")
    for k in OPENAI_ONLY:
        if k in body:
            raise Invalid(f"{k}: Extra inputs are not permitted")
    if count and "max_tokens" in body:
        raise Invalid("max_tokens: Extra inputs are not permitted")
    known = COUNT_KEYS if count else MESSAGES_KEYS
    if count:
        for k in ("stream", "stop_sequences", "temperature", "top_p", "top_k", "metadata"):
            if k in body:
                raise Invalid(f"{k}: Extra inputs are not permitted")
    if strict_keys:
        for k in sorted(set(body) - known):
            raise Invalid(f"{k}: Extra inputs are not permitted")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise Invalid("model: Field required" if "model" not in body else "model: Input should be a non-empty string")
    if not count:
        mt = body.get("max_tokens")
        if mt is None:
            raise Invalid("max_tokens: Field required")
        if not _is_int(mt) or mt < 1:
            raise Invalid("max_tokens: Input should be a valid integer greater than or equal to 1")
        if "stream" in body and not isinstance(body["stream"], bool):
            raise Invalid("stream: Input should be a valid boolean")
        for k in ("temperature", "top_p"):
            v = body.get(k)
            if v is not None and (not _is_num(v) or not 0 <= v <= 1):
                raise Invalid(f"{k}: Input should be less than or equal to 1" if _is_num(v) and v > 1
                              else f"{k}: Input should be a number between 0 and 1")
        tk = body.get("top_k")
        if tk is not None and (not _is_int(tk) or tk < 0):
            raise Invalid("top_k: Input should be a valid integer greater than or equal to 0")
        ss = body.get("stop_sequences")
        if ss is not None and not (isinstance(ss, list) and all(isinstance(s, str) and s.strip() for s in ss)):
            raise Invalid("stop_sequences: Input should be a list of non-whitespace strings")
        md = body.get("metadata")
        if md is not None and not (isinstance(md, dict) and set(md) <= {"user_id"}):
            raise Invalid("metadata: Extra inputs are not permitted (only user_id)")
    system = body.get("system")
    if system is not None:
        if isinstance(system, list):
            for j, x in enumerate(system):
                if not (isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str)):
                    raise Invalid(f"system.{j}: Input should be a text block")
                if not x["text"].strip():
                    raise Invalid(f"system.{j}.text: text content blocks must contain non-whitespace text")
        elif not isinstance(system, str):
            raise Invalid("system: Input should be a valid string or a list of text blocks")
    names = _validate_tools(body.get("tools"))
    _validate_tool_choice(body.get("tool_choice"), names)
    _validate_messages(body.get("messages"), alternate)


def _validate_tools(tools: Any) -> list[str]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise Invalid("tools: Input should be a valid list")
    names: list[str] = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise Invalid(f"tools.{i}: Input should be a valid dictionary")
        kind = t.get("type")
        if kind is None or kind == "custom":
            for k in sorted(set(t) - {"name", "description", "input_schema", "type", "cache_control", "strict",
                                       "input_examples", "defer_loading", "allowed_callers", "eager_input_streaming"}):
                raise Invalid(f"tools.{i}.custom.{k}: Extra inputs are not permitted")
            if not isinstance(t.get("name"), str) or not _TOOL_NAME.match(t["name"]):
                raise Invalid(f"tools.{i}.custom.name: String should match pattern '^[a-zA-Z0-9_-]{{1,128}}$'")
            if "description" in t and not isinstance(t["description"], str):
                raise Invalid(f"tools.{i}.custom.description: Input should be a valid string")
            schema = t.get("input_schema")
            if not isinstance(schema, dict):
                raise Invalid(f"tools.{i}.custom.input_schema: Field required")
            if schema.get("type") != "object":
                raise Invalid(f"tools.{i}.custom.input_schema.type: Input should be 'object'")
        elif isinstance(kind, str) and _SERVER_TOOL.match(kind):
            if not isinstance(t.get("name"), str):
                raise Invalid(f"tools.{i}.{kind}.name: Field required")
        else:
            raise Invalid(f"tools.{i}: Input tag '{kind}' found using 'type' does not match any of the expected tags "
                          "(a custom tool is {name, description?, input_schema})")
        if t["name"] in names:
            raise Invalid(f"tools: Tool names must be unique ({t['name']})")
        names.append(t["name"])
    return names


def _validate_tool_choice(tc: Any, names: list[str]) -> None:
    if tc is None:
        return
    if not isinstance(tc, dict):
        raise Invalid("tool_choice: Input should be a valid dictionary or object to extract fields from")
    kind = tc.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise Invalid(f"tool_choice: Input tag '{kind}' found using 'type' does not match any of the expected tags: "
                      "'auto', 'any', 'tool', 'none'")
    if "disable_parallel_tool_use" in tc and not isinstance(tc["disable_parallel_tool_use"], bool):
        raise Invalid("tool_choice.disable_parallel_tool_use: Input should be a valid boolean")
    if kind in ("any", "tool") and not names:
        raise Invalid("tool_choice: tool_choice may only be specified while providing tools")
    if kind == "tool":
        if not isinstance(tc.get("name"), str):
            raise Invalid("tool_choice.tool.name: Field required")
        if tc["name"] not in names:
            raise Invalid(f"tool_choice.tool.name: Tool '{tc['name']}' not found in tools")


def _validate_messages(msgs: Any, alternate: bool) -> None:
    if msgs is None:
        raise Invalid("messages: Field required")
    if not isinstance(msgs, list) or not msgs:
        raise Invalid("messages: at least one message is required")
    pending: set[str] = set()  # the tool_use ids of the turn before, which this turn must answer
    prev_role: str | None = None
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise Invalid(f"messages.{i}: Input should be a valid dictionary")
        role = m.get("role")
        if role == "system":
            raise Invalid(f'messages.{i}.role: Unexpected role "system". The Messages API accepts a top-level `system` '
                          'parameter, not "system" as an input message role.')
        if role not in ("user", "assistant"):
            raise Invalid(f"messages.{i}.role: Input should be 'user' or 'assistant'")
        for k in sorted(set(m) - {"role", "content"}):
            raise Invalid(f"messages.{i}.{k}: Extra inputs are not permitted")
        if alternate:
            if i == 0 and role != "user":
                raise Invalid("messages: first message must use the \"user\" role")
            if role == prev_role:
                raise Invalid(f"messages: roles must alternate between \"user\" and \"assistant\", but found multiple "
                              f"\"{role}\" roles in a row (messages.{i})")
        c = m.get("content")
        if isinstance(c, str):
            if not c.strip() and not (role == "assistant" and i == len(msgs) - 1 and c == ""):
                raise Invalid(f"messages.{i}.content: text content blocks must contain non-whitespace text"
                              if c else f"messages.{i}.content: messages must have non-empty content")
            blocks: list[Any] = [{"type": "text", "text": c}] if c else []
        elif isinstance(c, list):
            if not c:
                raise Invalid(f"messages.{i}.content: messages must have non-empty content")
            blocks = c
        else:
            raise Invalid(f"messages.{i}.content: Input should be a valid string or a list of content blocks")
        results: set[str] = set()
        seen_other = False
        uses: set[str] = set()
        for j, x in enumerate(blocks):
            where = f"messages.{i}.content.{j}"
            t = x.get("type") if isinstance(x, dict) else None
            if t not in BLOCK_TYPES:
                raise Invalid(f"{where}.type: Input tag '{t}' found using 'type' does not match any of the expected tags")
            if t == "text":
                if not isinstance(x.get("text"), str):
                    raise Invalid(f"{where}.text: Field required")
                if not x["text"].strip():
                    raise Invalid(f"{where}.text: text content blocks must contain non-whitespace text")
            elif t == "image":
                src = x.get("source")
                if not (isinstance(src, dict) and src.get("type") in ("base64", "url", "file")):
                    raise Invalid(f"{where}.source: Field required (base64, url or file)")
            elif t == "tool_use":
                if role != "assistant":
                    raise Invalid(f"{where}: tool_use blocks can only be in assistant messages")
                if not isinstance(x.get("id"), str) or not isinstance(x.get("name"), str) or not isinstance(x.get("input"), dict):
                    raise Invalid(f"{where}: a tool_use block is {{id, name, input: object}}")
                if x["id"] in uses:
                    raise Invalid(f"{where}: `tool_use` ids must be unique: {x['id']}")
                uses.add(x["id"])
            elif t == "tool_result":
                tid = x.get("tool_use_id")
                if role != "user" or tid not in pending:
                    raise Invalid(f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: {tid}. Each "
                                  "`tool_result` block must have a corresponding `tool_use` block in the previous message.")
                if seen_other:
                    raise Invalid(f"messages.{i}: `tool_result` blocks must come first in the content, before any other block")
                if tid in results:
                    raise Invalid(f"{where}: duplicate `tool_result` for tool_use_id {tid}")
                results.add(tid)
                rc = x.get("content")
                if rc is not None and not isinstance(rc, (str, list)):
                    raise Invalid(f"{where}.content: Input should be a valid string or a list of blocks")
                if isinstance(rc, list):
                    for k, y in enumerate(rc):
                        if isinstance(y, dict) and y.get("type") == "text" and not str(y.get("text") or "").strip():
                            raise Invalid(f"{where}.content.{k}.text: text content blocks must contain non-whitespace text")
            if t != "tool_result":
                seen_other = True
        if pending - results:
            raise Invalid(f"messages.{i}: `tool_use` ids were found without `tool_result` blocks immediately after: "
                          f"{', '.join(sorted(pending - results))}. Each `tool_use` block must have a corresponding "
                          "`tool_result` block in the next message.")
        pending = uses if role == "assistant" else set()
        prev_role = role
    if pending:
        raise Invalid(f"messages: `tool_use` ids were found without `tool_result` blocks immediately after: "
                      f"{', '.join(sorted(pending))}. Each `tool_use` block must have a corresponding `tool_result` "
                      "block in the next message.")
    last = msgs[-1].get("content")
    final = last if isinstance(last, str) else (last[-1].get("text") if isinstance(last[-1], dict) else None)
    if prev_role == "assistant" and isinstance(final, str) and final and final != final.rstrip():
        raise Invalid("messages: final assistant content cannot end with trailing whitespace")


# -- the prompt: tokens and the prompt cache ------------------------------------------------------


def _strip_cc(x: Any) -> Any:
    return {k: v for k, v in x.items() if k != "cache_control"} if isinstance(x, dict) else x


def segments(body: dict[str, Any]) -> list[tuple[str, bool]]:
    """The prompt as (text, has cache_control) segments: tools, system, then each message's blocks."""
    out: list[tuple[str, bool]] = []
    for t in body.get("tools") or []:
        out.append(("tool:" + _dumps(_strip_cc(t)), isinstance(t, dict) and "cache_control" in t))
    system = body.get("system")
    if isinstance(system, str) and system:
        out.append(("system:" + system, False))
    elif isinstance(system, list):
        for x in system:
            out.append(("system:" + str(x.get("text", "")), "cache_control" in x))
    for m in body.get("messages") or []:
        role = m.get("role", "")
        c = m.get("content")
        if isinstance(c, str):
            out.append((f"{role}:{c}", False))
            continue
        for x in c or []:
            text = x["text"] if x.get("type") == "text" and isinstance(x.get("text"), str) else _dumps(_strip_cc(x))
            out.append((f"{role}:{text}", "cache_control" in x))
    if body.get("cache_control") and out:
        out[-1] = (out[-1][0], True)
    return out


def prompt_tokens(body: dict[str, Any]) -> int:
    return max(1, sum(len(s) for s, _ in segments(body)) // 4)


def _schema_input(schema: Any) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    out: dict[str, Any] = {}
    for name, p in (props or {}).items():
        p = p if isinstance(p, dict) else {}
        if isinstance(p.get("enum"), list) and p["enum"]:
            out[name] = p["enum"][0]
            continue
        out[name] = {"string": "x", "integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}.get(
            str(p.get("type")), "x")
    return out


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return " ".join(x.get("text", "") for x in content or [] if isinstance(x, dict) and x.get("type") == "text")


class FakeAnthropic(Served):
    """One fake Anthropic upstream. `url` is its base URL (…/v1) once started; `root` the SDK's base_url."""

    def __init__(self, name: str = "anthropic", *, host: str = "127.0.0.1", port: int = 0,
                 behaviour: Behaviour | None = None, **changes: Any) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.behaviour = dataclasses.replace(behaviour or Behaviour(), **self._normalise(changes))
        self.stats = Stats()
        self._fails_since_set = 0
        self._seq = 0
        self._tag = re.sub(r"[^a-zA-Z0-9]", "", name)[:12] or "fake"
        self._cache: set[str] = set()  # the keys of the prefixes the prompt cache holds
        self._runner: web.AppRunner | None = None
        self.app = web.Application(middlewares=[self._errors], client_max_size=32 << 20)
        self.app.add_routes([
            web.post("/v1/messages", self._messages),
            web.post("/v1/messages/count_tokens", self._count_tokens),
            web.get("/v1/models", self._models),
            web.get("/v1/models/{model_id}", self._model),
            web.get("/health", self._health),
            web.post("/_control", self._control),
            web.get("/_stats", self._stats),
        ])


    @property
    def root(self) -> str:
        return f"http://{self.host}:{self.port}"


    async def __aenter__(self) -> "FakeAnthropic":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @staticmethod
    def _normalise(changes: dict[str, Any]) -> dict[str, Any]:
        if isinstance(changes.get("models"), (list, str)):
            m = changes["models"]
            changes["models"] = tuple(x for x in m.split(",") if x) if isinstance(m, str) else tuple(m)
        if isinstance(changes.get("tool_call"), (list, tuple)):
            changes["tool_call"] = ",".join(changes["tool_call"])
        return changes

    def set(self, **changes: Any) -> None:
        self.behaviour = dataclasses.replace(self.behaviour, **self._normalise(changes))
        if "fail_status" in changes or "fail_count" in changes:
            self._fails_since_set = 0  # a new fault budget; other changes leave the one in force alone

    def clear_cache(self) -> None:
        self._cache.clear()

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _id(self, prefix: str) -> str:
        return f"{prefix}_01{self._tag}{self._next():016d}"

    def _error(self, status: int, message: str, kind: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
        rid = self._id("req")
        body = {"type": "error", "error": {"type": kind or ERROR_TYPES.get(status, "api_error"), "message": message}, "request_id": rid}
        return web.Response(status=status, body=orjson.dumps(body), content_type="application/json",
                            headers={"request-id": rid, **(headers or {})})

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Anthropic-shaped 404 / 405 for paths and methods it does not serve."""
        try:
            resp: web.StreamResponse = await handler(request)
            return resp
        except web.HTTPNotFound:
            return self._error(404, f"Not found: {request.path}")
        except web.HTTPMethodNotAllowed:
            return self._error(405, f"Method {request.method} not allowed for {request.path}")

    def _auth(self, request: web.Request) -> web.Response | None:
        """401 / 400 as the API answers a request without a good key or without anthropic-version."""
        b = self.behaviour
        h = request.headers
        key, how = h.get("x-api-key"), "x-api-key"
        if not key and b.allow_bearer:
            authz = h.get("authorization", "")
            if authz[:7].lower() == "bearer ":
                key, how = authz[7:].strip(), "bearer"
        if not key:
            return self._error(401, "x-api-key header is required")
        if b.key is not None and key != b.key:
            return self._error(401, "invalid x-api-key")
        self.stats.last_auth = how
        self.stats.auth[how] = self.stats.auth.get(how, 0) + 1
        if not h.get("anthropic-version"):
            return self._error(400, "anthropic-version: header is required")
        return None

    async def _receive(self, request: web.Request) -> tuple[Any, web.Response | None]:
        raw = await request.read()
        self.stats.last_path = request.path
        self.stats.last_headers = dict(request.headers)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = None
            self.stats.last_body = raw.decode("utf-8", "replace")
            bad = self._auth(request)
            return None, bad or self._error(400, "There was an error parsing the body as JSON")
        self.stats.last_body = body
        return body, self._auth(request)

    # -- handlers -----------------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _control(self, request: web.Request) -> web.Response:
        self.set(**await request.json())
        return web.json_response(dataclasses.asdict(self.behaviour))

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(self.stats))

    def _down(self) -> web.Response | None:
        b = self.behaviour
        if b.fail_status >= 500 and b.fail_count == 0:
            return self._error(b.fail_status, _FAULT_MESSAGES.get(b.fail_status, f"fake upstream {self.name} is down"))
        return None

    def _model_obj(self, m: str) -> dict[str, Any]:
        return {"type": "model", "id": m, "display_name": m.replace("-", " ").title(), "created_at": "2025-01-01T00:00:00Z"}

    async def _models(self, request: web.Request) -> web.Response:
        self.stats.models_requests += 1
        self.stats.last_path = request.path
        self.stats.last_headers = dict(request.headers)
        bad = self._auth(request) or self._down()
        if bad is not None:
            return bad
        ids = list(self.behaviour.models)
        data = [self._model_obj(m) for m in ids]
        return web.json_response({"data": data, "has_more": False, "first_id": ids[0] if ids else None,
                                  "last_id": ids[-1] if ids else None}, headers={"request-id": self._id("req")})

    async def _model(self, request: web.Request) -> web.Response:
        self.stats.models_requests += 1
        bad = self._auth(request) or self._down()
        if bad is not None:
            return bad
        mid = request.match_info["model_id"]
        if mid not in self.behaviour.models:
            return self._error(404, f"model: {mid}")
        return web.json_response(self._model_obj(mid))

    async def _count_tokens(self, request: web.Request) -> web.Response:
        self.stats.count_tokens += 1
        body, bad = await self._receive(request)
        if bad is not None:
            return bad
        b = self.behaviour
        try:
            validate(body, count=True, strict_keys=b.strict_keys, alternate=b.alternate)
        except Invalid as e:
            return self._error(400, str(e))
        return web.json_response({"input_tokens": prompt_tokens(body)}, headers={"request-id": self._id("req")})

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        st = self.stats
        st.requests += 1
        st.active += 1
        st.peak_active = max(st.peak_active, st.active)
        status = 0  # 0: the connection was closed without an answer
        try:
            resp = await self._answer(request)
            status = resp.status
            return resp
        finally:
            st.active -= 1
            st.by_status[status] = st.by_status.get(status, 0) + 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body, bad = await self._receive(request)
        if bad is not None:
            return bad
        b = self.behaviour
        try:
            validate(body, strict_keys=b.strict_keys, alternate=b.alternate)
        except Invalid as e:
            return self._error(400, str(e))
        if b.fail_status and (b.fail_count == 0 or self._fails_since_set < b.fail_count):
            self._fails_since_set += 1
            self.stats.faults += 1
            headers = {"retry-after": f"{b.retry_after_s:g}"} if b.retry_after_s is not None else {}
            return self._error(b.fail_status, _FAULT_MESSAGES.get(b.fail_status, f"fake upstream {self.name} says {b.fail_status}"),
                               headers=headers)
        blocks, stop, seq, out_tokens = self._content(body, b)
        usage = self._usage(body, b)
        model = b.model or body["model"]
        rid = self._id("req")
        msg = {"id": self._id("msg"), "type": "message", "role": "assistant", "model": model, "content": blocks,
               "stop_reason": stop, "stop_sequence": seq, "usage": {**usage, "output_tokens": out_tokens}}
        if body.get("stream"):
            return await self._stream(request, msg, b, rid)
        if b.cut_after is not None:
            self.stats.faults += 1
            if request.transport is not None:
                request.transport.close()
            await asyncio.sleep(3600)  # the handler is cancelled: the connection is gone
        words = sum(len(x["text"].split()) for x in blocks if x["type"] == "text")
        delay = b.ttft_ms + b.itl_ms * max(0, words - 1)
        if delay:
            await asyncio.sleep(delay / 1000)
        self.stats.completed += 1
        return web.Response(body=orjson.dumps(msg), content_type="application/json", headers={"request-id": rid})

    def _tools_to_call(self, body: dict[str, Any], b: Behaviour) -> tuple[list[str], bool]:
        """(the tools to call, whether tool_choice forced it)."""
        tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and isinstance(t.get("name"), str)]
        names = [t["name"] for t in tools]
        tc = body.get("tool_choice") or {}
        kind = tc.get("type", "auto")
        if not names or kind == "none":
            return [], False
        calls: list[str] = []
        forced = kind in ("tool", "any")
        if kind == "tool":
            calls = [tc["name"]]
        else:
            last_user = next((m for m in reversed(body["messages"]) if m.get("role") == "user"), None)
            content = last_user.get("content") if last_user else None
            followup = isinstance(content, list) and any(isinstance(x, dict) and x.get("type") == "tool_result" for x in content)
            if not followup or forced:
                if b.tool_call:
                    calls = [n for n in b.tool_call.split(",") if n in names]
                if not calls and not followup:
                    calls = [n for n in _USE_TOOL.findall(_text_of(content)) if n in names]
            if not calls and kind == "any":
                calls = [names[0]]
        if tc.get("disable_parallel_tool_use"):
            calls = calls[:1]
        return calls, forced

    def _content(self, body: dict[str, Any], b: Behaviour) -> tuple[list[dict[str, Any]], str, str | None, int]:
        """(content blocks, stop_reason, stop_sequence, output_tokens)."""
        calls, forced = self._tools_to_call(body, b)
        if calls:
            schemas = {t["name"]: t.get("input_schema") for t in body["tools"] if isinstance(t, dict) and "name" in t}
            blocks: list[dict[str, Any]] = []
            out = 0
            if b.tool_text and not forced:
                blocks.append({"type": "text", "text": b.tool_text})
                out += len(b.tool_text.split())
            for name in calls:
                inp = dict(b.tool_input) if b.tool_input is not None else _schema_input(schemas.get(name))
                blocks.append({"type": "tool_use", "id": self._id("toolu"), "name": name, "input": inp})
                out += max(1, len(_dumps(inp)) // 4)
            return blocks, "tool_use", None, out
        start = 0
        last = body["messages"][-1]
        if last.get("role") == "assistant":
            start = len(_text_of(last.get("content")).split())
        n = min(b.words, start + body["max_tokens"])
        text = " ".join(f"{b.word}{i}" for i in range(start, n))
        stop, seq = ("max_tokens" if b.words > n else "end_turn"), None
        hits = [(text.find(s), s) for s in body.get("stop_sequences") or [] if s in text]
        if hits:
            at, seq = min(hits)
            text, stop = text[:at].rstrip(" "), "stop_sequence"
        if start and text:
            text = " " + text  # continues the prefill's last word
        if not text.strip():
            return [], stop, seq, 1  # as the API does when the answer is empty (e.g. a stop sequence at once)
        return [{"type": "text", "text": text}], stop, seq, max(1, len(text.split()))

    def _usage(self, body: dict[str, Any], b: Behaviour) -> dict[str, Any]:
        segs = segments(body)
        total = max(1, sum(len(s) for s, _ in segs) // 4)
        h = hashlib.blake2b(str(body["model"]).encode(), digest_size=16)
        chars = 0
        bps: list[tuple[str, int]] = []  # (prefix key, its tokens) per cacheable breakpoint
        for text, cc in segs:
            h.update(orjson.dumps(text))
            chars += len(text)
            if cc and chars // 4 >= max(1, b.cache_min_tokens):
                bps.append((h.copy().hexdigest(), chars // 4))
        read = max((tok for key, tok in bps if key in self._cache), default=0)
        created = bps[-1][1] - read if bps else 0
        for key, _ in bps:
            self._cache.add(key)
        if read:
            self.stats.cache_reads += 1
        if created:
            self.stats.cache_writes += 1
        return {"input_tokens": max(1, total - read - created), "cache_creation_input_tokens": created,
                "cache_read_input_tokens": read, "service_tier": "standard"}

    async def _stream(self, request: web.Request, msg: dict[str, Any], b: Behaviour, rid: str) -> web.StreamResponse:
        self.stats.streams += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                                           "request-id": rid})
        await resp.prepare(request)

        async def ev(data: dict[str, Any]) -> None:
            await resp.write(b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")

        start = {**msg, "content": [], "stop_reason": None, "stop_sequence": None, "usage": {**msg["usage"], "output_tokens": 1}}
        await ev({"type": "message_start", "message": start})
        if b.ttft_ms:
            await asyncio.sleep(b.ttft_ms / 1000)
        fault_at = b.cut_after if b.cut_after is not None else b.error_event_after
        sent = 0  # text deltas so far
        first = True

        async def fault_now() -> bool:
            """Strike the cut or the error event when its word count is reached."""
            if fault_at is None or sent < fault_at:
                return False
            self.stats.faults += 1
            if b.cut_after is not None:
                if b.cut_clean:
                    await resp.write_eof()
                elif request.transport is not None:
                    request.transport.close()
                return True
            await ev({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
            await resp.write_eof()
            return True

        if await fault_now():
            return resp
        for i, blk in enumerate(msg["content"]):
            head = {"type": "text", "text": ""} if blk["type"] == "text" else {**blk, "input": {}}
            await ev({"type": "content_block_start", "index": i, "content_block": head})
            if i == 0:
                await ev({"type": "ping"})
            if blk["type"] == "text":
                for p in re.findall(r"\s*\S+", blk["text"]) or [blk["text"]]:
                    if not first and b.itl_ms:
                        await asyncio.sleep(b.itl_ms / 1000)
                    first = False
                    await ev({"type": "content_block_delta", "index": i,
                              "delta": {"type": "text_delta", "text": p}})
                    sent += 1
                    if await fault_now():
                        return resp
            else:
                js = _dumps(blk["input"]) if blk["input"] else "{}"
                step = max(1, b.json_chunk)
                for p in ["", *(js[k:k + step] for k in range(0, len(js), step))]:
                    if not first and b.itl_ms:
                        await asyncio.sleep(b.itl_ms / 1000)
                    first = False
                    await ev({"type": "content_block_delta", "index": i, "delta": {"type": "input_json_delta", "partial_json": p}})
            await ev({"type": "content_block_stop", "index": i})
        if fault_at is not None:
            sent = max(sent, fault_at)  # fewer words than the fault's count: it strikes now
            await fault_now()
            return resp
        await ev({"type": "message_delta", "delta": {"stop_reason": msg["stop_reason"], "stop_sequence": msg["stop_sequence"]},
                  "usage": {"output_tokens": msg["usage"]["output_tokens"]}})
        await ev({"type": "message_stop"})
        await resp.write_eof()
        self.stats.completed += 1
        return resp


_HELP = {
    "key": "the API key it accepts (default: any non-empty key)",
    "allow_bearer": "accept the key as Authorization: Bearer too",
    "words": "words of a text answer (w0 w1 ...)",
    "word": "the words' stem (v: v0 v1 ...)",
    "ttft_ms": "milliseconds before the first content",
    "itl_ms": "milliseconds between two deltas of a stream",
    "model": "the model to answer with (default: echo the request's)",
    "models": "comma-separated models GET /v1/models lists",
    "strict_keys": "reject unknown top-level keys, as the API does",
    "alternate": "roles must alternate user/assistant, starting with user",
    "tool_call": "comma-separated tool names to call when the request offers them",
    "tool_input": "a tool call's input, as JSON (default: made from the tool's input_schema)",
    "tool_text": "a text block before tool_use blocks ('' for none)",
    "json_chunk": "characters per input_json_delta piece",
    "cache_min_tokens": "the fewest tokens a cached prefix may have",
    "fail_status": "answer POST /v1/messages with this status (0: none; 529, 429, 500, ...)",
    "fail_count": "fail_status applies to the next this many requests (0: all)",
    "retry_after_s": "a retry-after header on fail_status answers",
    "cut_after": "streams stop after this many words, the connection closed",
    "cut_clean": "cut_after ends the stream with a clean EOF",
    "error_event_after": "streams send an overloaded error event after this many words",
}


def _flag_type(f: dataclasses.Field[Any]) -> Any:
    t = str(f.type)
    if t.startswith("bool"):
        return lambda v: v.lower() in ("1", "true", "yes", "on")
    if f.name == "models":
        return lambda v: tuple(x for x in v.split(",") if x)
    if f.name == "tool_input":
        return orjson.loads
    if f.name == "tool_text":
        return lambda v: v or None
    if t.startswith("int"):
        return int
    if t.startswith("float"):
        return float
    return str


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fake_anthropic",
        description="A fake Anthropic Messages API upstream with latency and fault knobs.",
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=9201, help="port to listen on (0: any free one; default: %(default)s)")
    parser.add_argument("--name", default="anthropic", help="its name in ids and logs (default: %(default)s)")
    parser.add_argument("--max-seconds", type=float, default=600.0, help="exit by itself after this long (default: %(default)s)")
    for f in dataclasses.fields(Behaviour):
        parser.add_argument("--" + f.name.replace("_", "-"), type=_flag_type(f), default=f.default,
                            help=f"{_HELP[f.name]} (default: %(default)s)")
    args = parser.parse_args()
    behaviour = Behaviour(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Behaviour)})

    serve_for(FakeAnthropic(args.name, host=args.host, port=args.port, behaviour=behaviour).start, args.max_seconds,
              lambda fake: f"fake anthropic {args.name} on {fake.url} (exits by itself after {args.max_seconds:g} s)")


if __name__ == "__main__":
    main()
