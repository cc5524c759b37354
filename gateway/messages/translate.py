"""Anthropic's Messages API <-> OpenAI chat completions: requests and whole answers (pure, no I/O).

    messages_to_chat            a Messages request -> a chat request   (a Messages client, an OpenAI backend)
    chat_completion_to_message  a chat.completion -> a Message          (that backend's answer, for that client)
    chat_to_messages            a chat request -> a Messages request   (an OpenAI client, an Anthropic backend)
    message_to_chat_completion  a Message -> a chat.completion          (that backend's answer, for that client)

Streams are stream.py's. A request is translated faithfully or not at all: a feature the other API
has no equivalent for raises Untranslatable naming it (a 400, and a BadRequest the relay may also
read as "try a backend that speaks the client's API"); nothing is dropped unless dropping it cannot
change the answer. A request the other API would reject for its structure (a tool call left
unanswered) raises TranslationError, naming the message.

Messages -> chat (messages_to_chat)
  mapped: system (a string, or text blocks: one system message); text blocks; image blocks with a
    base64 or url source (image_url parts, user turns only); tool_use blocks (assistant tool_calls,
    arguments the JSON of input); tool_result blocks (`role: tool` messages before the turn's other
    blocks; content a string or text blocks; is_error as an "Error: " prefix, chat having no flag);
    tools (function tools: input_schema -> parameters, typed "object" where it names no type; strict
    kept); tool_choice auto | any | tool | none (auto | required | the named function | none) and
    disable_parallel_tool_use (parallel_tool_calls false); stop_sequences (stop); max_tokens; temperature; top_p; stream (with
    stream_options.include_usage); metadata.user_id (user); service_tier auto | standard_only (auto |
    default); output_config.format json_schema (response_format json_schema, strict); a final
    assistant turn only where the backend continues one (prefill=True).
  dropped: cache_control (on blocks, tools and top-level), diagnostics, workspace_id,
    user_profile_id, speed "standard", thinking {"type": "disabled"}, an empty tools list and a
    tool_choice auto / none without tools (chat refuses both; the same answer), null values.
  Untranslatable: top_k; thinking (enabled, adaptive) and thinking / redacted_thinking blocks;
    document, search_result, container_upload and server tool blocks (server_tool_use,
    *_tool_result), and any unknown block type; server tools (a tool with a `type` other than
    custom); tool fields beyond name, description, input_schema, strict, cache_control; images
    given by file id, in assistant turns or inside a tool_result; citations on text blocks;
    container, context_management, mcp_servers, inference_geo, speed "fast", output_config.effort
    and any other output_config key; metadata keys other than user_id; a final assistant turn
    (a prefill) for a backend that starts a new turn; any other top-level field.

Chat -> Messages (chat_to_messages)
  mapped: leading system / developer messages (system: a string, or text blocks); user text and
    image_url parts (base64 from a data URL, else a url source; `detail` dropped: a resolution
    hint); PDF file parts given as data (document blocks); assistant content and tool_calls
    (tool_use blocks with the parsed arguments; empty text never sent); tool messages (tool_result
    blocks, one user turn with the next user message, results first); consecutive same-role turns
    merged; tools (input_schema from parameters); tool_choice strings and the named function;
    parallel_tool_calls false (disable_parallel_tool_use); max_completion_tokens or max_tokens,
    else the default; stop (string or list: stop_sequences); temperature up to 1; top_p; top_k (the
    vLLM extension: Anthropic has it; -1 or 0, vLLM's "off", dropped); stream; user or
    safety_identifier (metadata.user_id); response_format json_schema (output_config.format); a
    trailing assistant message only as the gateway's own prefill (prefill=True).
  dropped: stream_options (an Anthropic stream always reports usage), n = 1, service_tier (the
    gateway's priority, not the operator's Anthropic tier), store, metadata, prediction,
    prompt_cache_key, prompt_cache_retention, parallel_tool_calls true, penalties of 0, empty
    logit_bias, logprobs false, modalities ["text"], response_format text, a tool message's name
    (its call's), empty or blank text (Anthropic rejects it; a message left empty is dropped),
    tool_choice auto / none without tools, null values.
  Untranslatable: n > 1; temperature above 1; response_format json_object; seed; non-zero
    frequency / presence penalties; logit_bias; logprobs / top_logprobs; modalities beyond text;
    audio; reasoning_effort; verbosity; web_search_options; functions / function_call and
    function messages (the legacy API); non-function tools; tool_choice allowed_tools; names on
    messages; a system message after the conversation started; audio and file-id parts; files other
    than PDF; an ordinary trailing assistant message (Anthropic would continue it); any other
    top-level field.

Whole answers: stop reasons end_turn | stop_sequence <-> stop, max_tokens <-> length, tool_use <->
tool_calls, refusal <-> content_filter (pause_turn -> stop, model_context_window_exceeded ->
length). A chat answer with tool calls whose finish reason is "stop" (some servers say so) is
tool_use. A matched stop sequence travels as vLLM's choice-level `stop_reason`. Usage: Anthropic's
input_tokens excludes cache reads and writes; chat's prompt_tokens includes both.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from ..errors import BadRequest
from ..wire.openai_wire import first_message, function_tool
from ..wire.tokens import bytes_tokens, text_tokens

__all__ = [
    "BadAnswer",
    "FINISH_REASONS",
    "STOP_REASONS",
    "TranslationError",
    "Untranslatable",
    "anthropic_usage",
    "chat_completion_to_message",
    "chat_to_messages",
    "chat_usage",
    "estimate_tokens",
    "has_prompt_count",
    "message_id",
    "message_to_chat_completion",
    "messages_to_chat",
    "output_estimate",
    "parse_arguments",
    "stop_reason",
    "tool_id",
]

CHAT_API = "OpenAI chat completions"
MESSAGES_API = "Anthropic's Messages API"

# Anthropic stop_reason -> chat finish_reason, and back.
FINISH_REASONS: dict[str, str] = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
    "pause_turn": "stop",
    "model_context_window_exceeded": "length",
}
STOP_REASONS: dict[str, str] = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "function_call": "tool_use",
    "content_filter": "refusal",
}


class TranslationError(BadRequest, ValueError):
    """A request that cannot be sent in the other API's shape as it stands (400)."""


class Untranslatable(TranslationError):
    """A feature the backend's API has no faithful equivalent for; `feature` names it."""

    code = "unsupported_feature"

    def __init__(self, feature: str, target: str = "the backend's API") -> None:
        super().__init__(
            f"{feature} has no equivalent in {target}, which this model's backend speaks: "
            "send the request without it, or to a model served over the API you are calling",
            param=feature,
        )
        self.feature = feature


class BadAnswer(ValueError):
    """A backend's answer that cannot be expressed in the client's API (the attempt failed)."""


def message_id(source: str | None = None) -> str:
    """An Anthropic message id (`msg_...`): from a chat completion's id, else a new one."""
    if isinstance(source, str) and source:
        return "msg_" + source.removeprefix("chatcmpl-")
    return "msg_" + uuid.uuid4().hex


def tool_id() -> str:
    """A tool call id, for a backend that sent none."""
    return "toolu_" + uuid.uuid4().hex[:24]


def encoded(value: Any, where: str) -> bytes:
    """`value` as JSON. orjson reads deeper nesting than it writes (its recursion limit): such a
    value is refused naming its place (a 400 for a request, a NotAnAnswer for an answer), not a 500."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise TranslationError(f"{where}: nested too deeply to re-encode ({exc})", param=where) from None


def _json(value: Any, where: str) -> str:
    return encoded(value, where).decode()


def estimate_tokens(body: Mapping[str, Any]) -> int:
    """Input tokens of a Messages body, estimated from its text (system, messages, tools): the
    gateway has no tokenizer for every backend's model (`wire.tokens`). What count_tokens answers,
    and a Message's input_tokens when its chat backend reported none."""
    parts: list[bytes] = []
    for key in ("system", "messages", "tools"):
        value = body.get(key)
        if isinstance(value, str):
            parts.append(value.encode("utf-8", "surrogatepass"))
        elif value is not None:
            parts.append(encoded(value, key))  # a 400 for nesting orjson cannot write back
    return max(1, bytes_tokens(b"".join(parts)))


def parse_arguments(arguments: Any) -> dict[str, Any]:
    """A chat tool call's `arguments` (a JSON string) as Anthropic's `input` object.

    Raises BadAnswer when it is not a JSON object ("" is {})."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    try:
        parsed = orjson.loads(arguments) if isinstance(arguments, str | bytes) else None
    except orjson.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        # Not quoted: the model's output belongs in the request log only for a tenant that logs payloads.
        size = f"{len(arguments)} characters" if isinstance(arguments, str | bytes) else type(arguments).__name__
        raise BadAnswer(f"tool call arguments are not a JSON object ({size})")
    return parsed


# ---- Messages -> chat -----------------------------------------------------------------------


def _refuse(feature: str) -> Untranslatable:
    return Untranslatable(feature, CHAT_API)


def _block_text(block: Mapping[str, Any], where: str) -> str:
    if block.get("citations"):
        raise _refuse(f"citations ({where})")
    text = block.get("text")
    if not isinstance(text, str):
        raise TranslationError(f"{where}: a text block needs 'text', a string")
    return text


def _image_part(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64" and isinstance(src, dict):
        url = f"data:{src.get('media_type')};base64,{src.get('data')}"
    elif kind == "url" and isinstance(src, dict) and isinstance(src.get("url"), str):
        url = src["url"]
    else:
        raise _refuse(f"image source {kind!r} ({where})")
    return {"type": "image_url", "image_url": {"url": url}}


def _unknown_block(kind: Any, where: str) -> Untranslatable:
    names = {"thinking": "thinking blocks", "redacted_thinking": "redacted_thinking blocks",
             "document": "document blocks"}
    return _refuse(f"{names.get(kind, f'{kind!r} blocks')} ({where})")


def _tool_result(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content")
    if content is None or isinstance(content, str):
        texts = [content or ""]
    elif isinstance(content, list):
        texts = []
        for k, item in enumerate(content):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "image":
                raise _refuse(f"images in a tool_result ({where}.content[{k}])")
            if kind != "text" or not isinstance(item, dict):
                raise _unknown_block(kind, f"{where}.content[{k}]")
            texts.append(_block_text(item, f"{where}.content[{k}]"))
    else:
        raise TranslationError(f"{where}.content: a string or a list of content blocks")
    out: Any
    if block.get("is_error") is True:  # a boolean (wire.Block): "no" is no error
        out = "Error: " + "\n".join(texts)
    elif len(texts) == 1:
        out = texts[0]
    else:
        out = [{"type": "text", "text": t} for t in texts]
    return {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": out}


def _assistant_to_chat(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content if isinstance(content, list) else []):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_block_text(block, at))
        elif kind == "tool_use":
            fn = {"name": block.get("name"), "arguments": _json(block.get("input") or {}, f"{at}.input")}
            calls.append({"id": block.get("id"), "type": "function", "function": fn})
        elif kind == "image":
            raise _refuse(f"images in an assistant turn ({at})")
        else:
            raise _unknown_block(kind, at)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user_to_chat(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    results: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content if isinstance(content, list) else []):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            results.append(_tool_result(block, at))
        elif kind == "text":
            parts.append({"type": "text", "text": _block_text(block, at)})
        elif kind == "image":
            parts.append(_image_part(block, at))
        else:
            raise _unknown_block(kind, at)
    if parts or not results:
        single = len(parts) == 1 and parts[0]["type"] == "text"
        results.append({"role": "user", "content": parts[0]["text"] if single else parts if parts else ""})
    return results


def _system_to_chat(system: Any) -> dict[str, Any]:
    if isinstance(system, str):
        return {"role": "system", "content": system}
    texts = [_block_text(b, f"system[{k}]") for k, b in enumerate(system if isinstance(system, list) else [])]
    if len(texts) == 1:
        return {"role": "system", "content": texts[0]}
    return {"role": "system", "content": [{"type": "text", "text": t} for t in texts]}


_TOOL_KEYS = {"name", "description", "input_schema", "type", "cache_control", "strict"}


def _tools_to_chat(tools: Any) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if not isinstance(tool, dict):
            raise TranslationError(f"tools[{i}]: a tool object")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise _refuse(f"server tool {kind!r} (tools[{i}])")
        for key, value in tool.items():
            if key not in _TOOL_KEYS and value is not None:
                raise _refuse(f"tools[{i}].{key}")
        schema = tool.get("input_schema") or {}
        if isinstance(schema, dict) and "type" not in schema:
            schema = {"type": "object", **schema}  # Anthropic's input is an object: so a schema-following backend's must be
        _json(schema, f"tools[{i}].input_schema")  # sent re-encoded: refused now if orjson cannot write it
        out.append(function_tool(tool.get("name"), schema, tool))
    return out


def _tool_choice_to_chat(choice: Mapping[str, Any], out: dict[str, Any]) -> None:
    kind = choice.get("type")
    if not out.get("tools") and kind in ("auto", "none"):
        return  # no tools: the same as no choice (chat refuses a tool_choice without tools)
    if not out.get("tools"):  # as Anthropic: forcing a tool needs one
        raise TranslationError(f"tool_choice: {str(kind)[:20]!r} needs tools")
    if kind == "tool":
        out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind), kind)
    if choice.get("disable_parallel_tool_use") and kind != "none" and out.get("tools"):
        out["parallel_tool_calls"] = False


def _output_config_to_chat(config: Mapping[str, Any], out: dict[str, Any]) -> None:
    for key, value in config.items():
        if value is None:
            continue
        if key != "format":
            raise _refuse(f"output_config.{key}")
        if not isinstance(value, dict) or value.get("type") != "json_schema":
            raise _refuse(f"output_config.format {str(value)[:60]}")
        schema = {"name": "output", "schema": value.get("schema"), "strict": True}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}


_DROPPED_FOR_CHAT = {"cache_control", "diagnostics", "workspace_id", "user_profile_id"}
_HANDLED_FOR_CHAT = {"model", "messages", "system", "max_tokens", "tools", "tool_choice"}


def messages_to_chat(body: Mapping[str, Any], *, prefill: bool = False) -> dict[str, Any]:
    """A Messages request as an OpenAI chat completions request (see the module's list).

    `prefill`: the backend continues a trailing assistant message (BackendPolicy.prefill), so a
    final assistant turn (Anthropic's prefill) means the same there. Raises Untranslatable,
    TranslationError."""
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append(_system_to_chat(body["system"]))
    turns = body.get("messages")
    turns = turns if isinstance(turns, list) else []
    _check_tool_results(turns)
    for i, turn in enumerate(turns):
        where, role = f"messages[{i}]", turn.get("role")
        if turn.get("content") in ("", []) and not (role == "assistant" and i == len(turns) - 1):
            raise TranslationError(f"{where}.content: empty (only a final assistant turn may be)")
        if role == "assistant":
            if i == len(turns) - 1 and not prefill:
                raise _refuse(f"a final assistant turn (a prefill, {where})")
            messages.append(_assistant_to_chat(turn.get("content"), where))
        elif role == "user":
            messages.extend(_user_to_chat(turn.get("content"), where))
        else:
            raise TranslationError(f"{where}.role: 'user' or 'assistant', not {role!r}")
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages, "max_tokens": _count(body.get("max_tokens"))}
    if body.get("tools"):  # chat refuses an empty list
        out["tools"] = _tools_to_chat(body["tools"])
    if body.get("tool_choice") is not None:
        if not isinstance(body["tool_choice"], dict):
            raise TranslationError("tool_choice: an object")
        _tool_choice_to_chat(body["tool_choice"], out)
    for key, value in body.items():
        if value is None or key in _HANDLED_FOR_CHAT or key in _DROPPED_FOR_CHAT:
            continue
        if key == "stream":
            out["stream"] = value
            if value:
                out["stream_options"] = {"include_usage": True}
        elif key in ("temperature", "top_p"):
            out[key] = value
        elif key == "stop_sequences":
            if value:
                out["stop"] = list(value)
        elif key == "metadata":
            if not isinstance(value, dict):
                raise TranslationError("metadata: an object")
            for k, v in value.items():
                if k == "user_id" and v is not None:
                    out["user"] = v
                elif v is not None:
                    raise _refuse(f"metadata.{k}")
        elif key == "thinking" and isinstance(value, dict) and value.get("type") == "disabled":
            continue
        elif key == "service_tier" and value in ("auto", "standard_only"):
            out["service_tier"] = "auto" if value == "auto" else "default"
        elif key == "speed" and value == "standard":
            continue
        elif key == "output_config" and isinstance(value, dict):
            _output_config_to_chat(value, out)
        else:
            raise _refuse(key if key != "speed" else f"speed {value!r}")
    return out


# ---- chat -> Messages -----------------------------------------------------------------------


def _refuse_m(feature: str) -> Untranslatable:
    return Untranslatable(feature, MESSAGES_API)


def _text_block(text: str) -> list[dict[str, Any]]:
    """A text block, or none for empty or blank text (Anthropic rejects those)."""
    return [{"type": "text", "text": text}] if text.strip() else []


def _data_url(url: str) -> tuple[str, str] | None:
    """(media type, base64 data) of a `data:<type>;base64,<data>` URL."""
    if not url.startswith("data:"):
        return None
    head, sep, data = url[5:].partition(",")
    if not sep or not head.endswith(";base64"):
        return None
    return head.removesuffix(";base64"), data


def _part_blocks(part: Any, where: str, role: str) -> list[dict[str, Any]]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part, dict) and isinstance(part.get("text"), str):
        return _text_block(part["text"])
    if kind == "refusal" and role == "assistant" and isinstance(part, dict) and isinstance(part.get("refusal"), str):
        return _text_block(part["refusal"])
    if kind == "image_url" and role == "user" and isinstance(part, dict):
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str):
            raise TranslationError(f"{where}.image_url: needs 'url', a string")
        data = _data_url(url)
        if data is not None:
            return [{"type": "image", "source": {"type": "base64", "media_type": data[0], "data": data[1]}}]
        return [{"type": "image", "source": {"type": "url", "url": url}}]
    if kind == "file" and role == "user" and isinstance(part, dict):
        file = part.get("file")
        file = file if isinstance(file, dict) else {}
        data = _data_url(str(file.get("file_data") or ""))
        if file.get("file_id") is not None or data is None:
            raise _refuse_m(f"files by id or without data ({where})")
        if data[0] != "application/pdf":
            raise _refuse_m(f"{data[0]} files ({where})")
        return [{"type": "document", "source": {"type": "base64", "media_type": data[0], "data": data[1]}}]
    raise _refuse_m(f"{kind!r} content parts in a {role} message ({where})")


def _content_blocks(content: Any, where: str, role: str) -> list[dict[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return _text_block(content)
    if not isinstance(content, list):
        raise TranslationError(f"{where}.content: a string or a list of content parts")
    return [b for k, part in enumerate(content) for b in _part_blocks(part, f"{where}.content[{k}]", role)]


def _assistant_blocks(msg: Mapping[str, Any], where: str) -> list[dict[str, Any]]:
    for key in ("function_call", "audio"):
        if msg.get(key) is not None:
            raise _refuse_m(f"{key} ({where})")
    blocks = _content_blocks(msg.get("content"), where, "assistant")
    if isinstance(msg.get("refusal"), str) and not blocks:
        blocks = _text_block(msg["refusal"])
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise TranslationError(f"{where}.tool_calls: expected an array")
    for k, call in enumerate(calls):
        at = f"{where}.tool_calls[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise _refuse_m(f"non-function tool calls ({at})")
        if not isinstance(call.get("id"), str):
            raise TranslationError(f"{at}.id: expected a string")
        try:
            args = parse_arguments(fn.get("arguments"))
        except BadAnswer:
            raise TranslationError(f"{at}.function.arguments: not a JSON object") from None
        blocks.append({"type": "tool_use", "id": call.get("id"), "name": fn.get("name"), "input": args})
    return blocks


def _tool_message(msg: Mapping[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(msg.get("tool_call_id"), str):
        raise TranslationError(f"{where}.tool_call_id: expected a string")
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id")}
    content = msg.get("content")
    if isinstance(content, str):
        if content:
            block["content"] = content
    else:
        texts = _content_blocks(content, where, "tool")
        if texts:
            block["content"] = texts
    return block


def _merge(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    """Consecutive messages of one role are one turn (extended in place: a copy and a sort per
    message made 12,000 messages in a row take 9 s on the event loop)."""
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": blocks})


def _tool_results_first(turns: list[dict[str, Any]]) -> None:
    """In a user turn, tool results come first (Anthropic's order), the rest as they came."""
    for turn in turns:
        content = turn["content"]
        if turn["role"] == "user" and len(content) > 1:
            turn["content"] = [b for b in content if b.get("type") == "tool_result"] + [b for b in content if b.get("type") != "tool_result"]


def _blocks_of(turn: Any, kind: str, field: str) -> set[str]:
    content = turn.get("content") if isinstance(turn, dict) else None
    blocks = content if isinstance(content, list) else []
    return {str(b.get(field)) for b in blocks if isinstance(b, dict) and b.get("type") == kind}


def _check_tool_results(turns: list[Any]) -> None:
    """Anthropic's rule, which it checks and an OpenAI backend may not: each tool_use is answered
    by a tool_result in the very next (user) turn, and a tool_result answers a tool_use of the
    turn just before it; tool_use ids are unique (a chat backend would take two calls of one id,
    and the tool_result answering one of them answers both), and each has one tool_result (two
    would be two `role: tool` messages for one call)."""
    seen: set[str] = set()
    for i, turn in enumerate(turns):
        content = turn.get("content") if isinstance(turn, dict) else None
        answered: set[str] = set()
        for j, block in enumerate(content if isinstance(content, list) else []):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_use":
                ident = str(block.get("id"))
                if ident in seen:
                    where = f"messages[{i}].content[{j}].id"
                    raise TranslationError(f"{where}: tool_use id {ident[:100]!r} is used twice (tool_use ids are unique)",
                                           param=where)
                seen.add(ident)
            elif kind == "tool_result":
                ident = str(block.get("tool_use_id"))
                if ident in answered:  # Anthropic's 400, in its words
                    where = f"messages[{i}].content[{j}]"
                    raise TranslationError(f"{where}: each tool_use must have a single result; found multiple tool_result "
                                           f"blocks with id {ident[:100]!r}", param=where)
                answered.add(ident)
    pending: set[str] = set()
    for i, turn in enumerate(turns):
        results = _blocks_of(turn, "tool_result", "tool_use_id")
        if pending - results:
            raise TranslationError(f"messages[{i}]: tool_use ids were found without tool_result blocks immediately "
                                   f"after: {', '.join(sorted(pending - results))}")
        if results - pending:
            raise TranslationError(f"messages[{i}]: tool_result block(s) for ids that the turn before did not use: "
                                   f"{', '.join(sorted(results - pending))}")
        role = turn.get("role") if isinstance(turn, dict) else None
        pending = _blocks_of(turn, "tool_use", "id") if role == "assistant" else set()


def _check_tool_pairs(turns: list[dict[str, Any]], prefill: bool) -> None:
    """Anthropic's rule: each tool_use is answered by a tool_result in the very next (user) turn."""
    pending: set[str] = set()
    for turn in turns:
        blocks = turn["content"]
        results = {b.get("tool_use_id") for b in blocks if b.get("type") == "tool_result"}
        stray = sorted(str(r) for r in results - pending)
        if stray:
            raise TranslationError(f"the tool message for tool call {stray[0]!r} does not follow the assistant message that made it")
        if pending - results:
            raise TranslationError(f"tool call {sorted(pending - results)[0]!r} has no tool message answering it")
        pending = {b["id"] for b in blocks if b.get("type") == "tool_use"} if turn["role"] == "assistant" else set()
    if turns and turns[-1]["role"] == "assistant" and (pending or not prefill):
        raise _refuse_m("a trailing assistant message (Anthropic would continue it as a prefill)")


def _chat_turns(messages: Any, prefill: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(system blocks, turns) of a chat body's messages."""
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    started = False
    for i, msg in enumerate(messages if isinstance(messages, list) else []):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise TranslationError(f"{where}: a message object")
        role = msg.get("role")
        if msg.get("name") is not None and role != "tool":  # a tool message's name repeats its call's
            raise _refuse_m(f"names on messages ({where}.name)")
        if role in ("system", "developer"):
            if started:
                raise _refuse_m(f"a {role} message after the conversation started ({where})")
            system.extend(_content_blocks(msg.get("content"), where, role))
            continue
        started = True
        if role == "user":
            blocks = _content_blocks(msg.get("content"), where, "user")
        elif role == "assistant":
            blocks = _assistant_blocks(msg, where)
        elif role == "tool":
            role, blocks = "user", [_tool_message(msg, where)]
        elif role == "function":
            raise _refuse_m(f"function messages (the legacy functions API, {where})")
        else:
            raise TranslationError(f"{where}.role: unknown role {role!r}")
        if blocks:
            _merge(turns, role, blocks)
    if not turns:
        raise _refuse_m("a conversation without a user or assistant message")
    _tool_results_first(turns)
    _check_tool_pairs(turns, prefill)
    for turn in turns:  # a lone text block reads as a string, as clients write it
        content = turn["content"]
        if len(content) == 1 and content[0]["type"] == "text":
            turn["content"] = content[0]["text"]
    return system, turns


def _tools_to_messages(tools: Any) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise _refuse_m(f"{tool.get('type') if isinstance(tool, dict) else None!r} tools (tools[{i}])")
        t: dict[str, Any] = {"name": fn.get("name"), "input_schema": fn.get("parameters") or {"type": "object", "properties": {}}}
        if fn.get("description") is not None:
            t["description"] = fn["description"]
        if fn.get("strict"):
            t["strict"] = True
        out.append(t)
    return out


def _tool_choice_to_messages(choice: Any, has_tools: bool) -> dict[str, Any] | None:
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        if not has_tools and choice != "required":
            return None
        kind = {"auto": "auto", "none": "none", "required": "any"}[choice]
        out: dict[str, Any] = {"type": kind}
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        out = {"type": "tool", "name": choice["function"].get("name")}
    else:
        raise _refuse_m(f"tool_choice {str(choice)[:60]}")
    if not has_tools:
        raise TranslationError(f"tool_choice {str(choice)[:60]} needs tools")
    return out


_DROPPED_FOR_MESSAGES = {"stream_options", "service_tier", "store", "metadata", "prediction", "prompt_cache_key",
                         "prompt_cache_retention"}
_HANDLED = {"model", "messages", "max_tokens", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
            "user", "safety_identifier"}


def _option_to_messages(key: str, value: Any, out: dict[str, Any]) -> None:
    """One top-level chat option into `out` (a Messages body), dropped, or refused."""
    if key == "stream":
        out["stream"] = value
    elif key == "temperature":
        if not isinstance(value, int | float) or value > 1:
            raise _refuse_m("temperature above 1")
        out["temperature"] = value
    elif key == "top_p":
        out["top_p"] = value
    elif key == "top_k":
        if isinstance(value, int) and value > 0:
            out["top_k"] = value
    elif key == "n":
        if value != 1:
            raise _refuse_m("n > 1")
    elif key == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise TranslationError("stop: a string or a list of strings")
        if stops:
            out["stop_sequences"] = stops
    elif key == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_schema" and isinstance(value.get("json_schema"), dict):
            out["output_config"] = {"format": {"type": "json_schema", "schema": value["json_schema"].get("schema")}}
        elif kind != "text":
            raise _refuse_m(f"response_format {kind}")
    elif key in ("frequency_penalty", "presence_penalty") and value == 0:
        pass
    elif key in ("logit_bias",) and not value:
        pass
    elif key in ("logprobs",) and value is False:
        pass
    elif key == "top_logprobs" and value == 0:
        pass
    elif key == "modalities" and value == ["text"]:
        pass
    else:
        raise _refuse_m(key)


def _count(value: Any) -> Any:
    """A token count as an integer: validation let a whole float (100.0) through as the integer it
    is, and a backend of the other API need not accept one."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def chat_to_messages(body: Mapping[str, Any], default_max_tokens: int, *, prefill: bool = False) -> dict[str, Any]:
    """A chat completions request as a Messages request for an Anthropic backend (see the
    module's list). `default_max_tokens`: Anthropic requires max_tokens; used when the body has
    none. `prefill`: a trailing assistant message is the gateway's own prefill (a continuation),
    which Anthropic continues; a client's own trailing assistant message is refused.

    Raises Untranslatable, TranslationError."""
    system, turns = _chat_turns(body.get("messages"), prefill)
    out: dict[str, Any] = {"model": body.get("model")}
    if system:
        out["system"] = system[0]["text"] if len(system) == 1 else system
    out["messages"] = turns
    limit = body.get("max_completion_tokens")
    out["max_tokens"] = _count(limit if limit is not None else body.get("max_tokens") or default_max_tokens)
    tools = _tools_to_messages(body["tools"]) if body.get("tools") else []
    if tools:
        out["tools"] = tools
    choice = _tool_choice_to_messages(body["tool_choice"], bool(tools)) if body.get("tool_choice") is not None else None
    if body.get("parallel_tool_calls") is False and tools and (choice is None or choice["type"] != "none"):
        choice = {**(choice or {"type": "auto"}), "disable_parallel_tool_use": True}
    if choice is not None:
        out["tool_choice"] = choice
    user = body.get("safety_identifier") or body.get("user")
    if user:
        out["metadata"] = {"user_id": user}
    for key, value in body.items():
        if value is None or key in _HANDLED or key in _DROPPED_FOR_MESSAGES:
            continue
        _option_to_messages(key, value, out)
    return out


# ---- whole answers --------------------------------------------------------------------------


def _reported(value: Any) -> int:
    """A token count a backend reported: a non-negative int, anything else 0 (a backend's "10" or
    10.5 must not break the translation, nor the quota's arithmetic)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def chat_usage(usage: Any) -> dict[str, Any]:
    """Anthropic usage as chat usage: prompt_tokens counts cache reads and writes too."""
    u = usage if isinstance(usage, dict) else {}
    fresh, read, written = (_reported(u.get(k)) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
    out = _reported(u.get("output_tokens"))
    prompt = fresh + read + written
    return {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out,
            "prompt_tokens_details": {"cached_tokens": read}}


def has_prompt_count(usage: Any) -> bool:
    """Whether a chat usage counts the prompt (else a Message's input_tokens is the estimate)."""
    return isinstance(usage, dict) and _reported(usage.get("prompt_tokens")) > 0


def anthropic_usage(usage: Any, input_tokens_estimate: int, output_tokens_estimate: int = 0) -> dict[str, Any]:
    """Chat usage as Anthropic usage: input_tokens without the cached part, never 0 (the
    estimate when the backend reported no prompt); output_tokens the estimate when the backend
    reported no completion count (none at all, or not an integer)."""
    u = usage if isinstance(usage, dict) else {}
    prompt = _reported(u.get("prompt_tokens"))
    details = u.get("prompt_tokens_details")
    cached = _reported(details.get("cached_tokens")) if isinstance(details, dict) else 0
    if not prompt:
        fresh, cached = max(1, input_tokens_estimate), 0
    else:
        cached = min(cached, prompt)
        fresh = max(1, prompt - cached)
    completion = u.get("completion_tokens")
    counted = isinstance(completion, int) and not isinstance(completion, bool)
    output = _reported(completion) if counted else max(0, output_tokens_estimate)
    return {"input_tokens": fresh, "output_tokens": output, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def output_estimate(blocks: list[dict[str, Any]]) -> int:
    """A Message's output tokens estimated from its content (text, and tool inputs as JSON), for
    an answer whose backend counted none."""
    text = "".join(str(b.get("text") or "") for b in blocks if b.get("type") == "text")
    inputs = b"".join(encoded(b.get("input") or {}, "content[].input") for b in blocks if b.get("type") == "tool_use")
    return text_tokens(text) + bytes_tokens(inputs)


def stop_reason(finish_reason: Any, *, has_tool_calls: bool = False, matched: Any = None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat finish reason. `matched`: vLLM's choice-level
    `stop_reason`, the stop string that ended the answer (an int is a stop token, not a sequence)."""
    if has_tool_calls and finish_reason in (None, "stop"):
        return "tool_use", None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(str(finish_reason), "end_turn"), None


def message_to_chat_completion(msg: Mapping[str, Any], model: str, *, created: int | None = None) -> dict[str, Any]:
    """An Anthropic message (an Anthropic backend's answer) as a chat.completion."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in msg.get("content") or []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text") or ""))
        elif kind == "tool_use":
            fn = {"name": block.get("name"), "arguments": _json(block.get("input") or {}, "content[].input")}
            calls.append({"id": block.get("id"), "type": "function", "function": fn})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None,
                               "refusal": None}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                              "finish_reason": FINISH_REASONS.get(str(msg.get("stop_reason")), "stop")}
    if isinstance(msg.get("stop_sequence"), str):
        choice["stop_reason"] = msg["stop_sequence"]
    ident = str(msg.get("id") or "")
    return {
        "id": "chatcmpl-" + (ident.removeprefix("msg_") or uuid.uuid4().hex),
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [choice],
        "usage": chat_usage(msg.get("usage")),
    }


def chat_completion_to_message(resp: Mapping[str, Any], model: str, input_tokens_estimate: int, *,
                               cut_input: bool = True, estimate_output: bool = False) -> dict[str, Any]:
    """A chat.completion (an OpenAI backend's answer) as an Anthropic message. Usage the backend
    did not report is estimated: input_tokens as `input_tokens_estimate`, output_tokens (with
    `estimate_output`; else 0) from the content.

    Raises BadAnswer when a tool call's arguments are not a JSON object (Anthropic's input is one),
    except in an answer cut by its limit (`length`, with `cut_input`): there the arguments stop
    anywhere, as Anthropic's own do, and the input is `{}` beside stop_reason max_tokens (it was
    a 502 counted against the backend: callers asking for tools with a small max_tokens could
    eject it)."""
    choice, message, content = first_message(resp)
    finish = choice.get("finish_reason")
    if not content and isinstance(message.get("refusal"), str):
        content, finish = message["refusal"], "content_filter"
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if isinstance(content, str) and content else []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            continue
        try:
            args = parse_arguments(fn.get("arguments"))
        except BadAnswer:
            if not (cut_input and finish == "length"):
                raise
            args = {}
        blocks.append({"type": "tool_use", "id": call.get("id") or tool_id(), "name": fn.get("name"), "input": args})
    reason, sequence = stop_reason(finish, has_tool_calls=any(b["type"] == "tool_use" for b in blocks),
                                   matched=choice.get("stop_reason"))
    return {
        "id": message_id(resp.get("id") if isinstance(resp.get("id"), str) else None),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": anthropic_usage(resp.get("usage"), input_tokens_estimate, output_estimate(blocks) if estimate_output else 0),
    }
