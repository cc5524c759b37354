"""The Responses API (/v1/responses) over a backend that serves only chat completions: the
stateless part of a Responses request as a chat request, and the chat answer (whole or streamed)
back as a Response (pure, no I/O).

    responses_to_chat            a Responses request -> a chat request
    chat_completion_to_response  a chat.completion -> a Response object
    ChatToResponsesStream        chat.completion.chunk events -> the Responses event stream

A request is translated faithfully or not at all (the house rule of messages/translate.py): what a
chat backend has no equivalent for raises Untranslatable naming the field (a 400); a request whose
structure is wrong raises TranslationError. Nothing is dropped unless dropping it cannot change
the answer.

Responses -> chat (responses_to_chat)
  mapped: instructions (the first message, role system); input as a string (one user message) or
    a list of items: messages (role user / assistant / system; developer as system, which is what
    it means to a chat model and the role chat templates know; content a string or parts:
    input_text / output_text -> text, input_image with image_url -> image_url (detail low / high /
    auto kept), input_file with file_data -> a file part, refusal in assistant turns -> a refusal
    part; a lone text part becomes a string), function_call items -> assistant tool_calls (call_id
    the id; calls that follow an assistant message, or each other, join that one assistant
    message), function_call_output items -> `role: tool` messages (tool_call_id = call_id; output
    a string or input_text parts); tools of type function (name, description, parameters, strict:
    a chat function tool; strict only when given); tool_choice auto | none | required | {type:
    function, name}; max_output_tokens (max_tokens); temperature; top_p; text.format json_schema
    (response_format json_schema: name, schema, description, strict) and json_object;
    text.verbosity (chat's verbosity); parallel_tool_calls (with tools); stream (with
    stream_options.include_usage, so the answer's usage reaches the Response); safety_identifier
    or user (user); service_tier, prompt_cache_key, prompt_cache_retention (chat has them).
  dropped: store (the gateway keeps no responses: the Response says store false), metadata (chat
    keeps it only with a stored completion), truncation "disabled", background false, an empty
    include or tools list, top_logprobs 0, stream_options (include_obfuscation is padding),
    text.format text, tool_choice auto / none and parallel_tool_calls without tools (chat refuses
    them; the same answer), item ids and statuses, annotations and logprobs of output_text parts,
    cache breakpoints on parts, an image's detail "original" (chat knows low / high / auto), null
    values.
  Untranslatable: previous_response_id, conversation (state a chat backend cannot hold: send the
    whole conversation as input instead); reasoning (other than null); background true; prompt
    (stored prompt templates); include (any entry: logprobs, encrypted reasoning, tool outputs);
    top_logprobs; max_tool_calls; truncation "auto"; n; built-in and other non-function tools
    (web_search, file_search, code_interpreter, computer_use, mcp, image_generation, custom,
    shell, ...), and function tool fields beyond the four; tool_choice other than the four
    (allowed_tools, hosted tools, mcp, custom); item types other than message, function_call and
    function_call_output (reasoning, item_reference, every built-in tool's call and output, ...);
    images and files given by file_id, files by URL, parts other than those mapped, images or
    files outside user turns (a function_call_output is text only: chat's tool messages are); any
    other top-level field.

Chat -> Responses (chat_completion_to_response, ChatToResponsesStream)
  The Response: id "resp_" + random hex (the gateway stores nothing under it: store is false);
  status completed, or incomplete with incomplete_details.reason max_output_tokens (finish_reason
  length) or content_filter (content_filter), the last output item then incomplete too; output: a
  message item ("msg_...": an output_text part, and a refusal part for chat's refusal) when the
  answer has text, then a function_call item ("fc_...", call_id the chat tool call's id, else a
  new "call_...") per tool call; usage from the chat usage (prompt / completion / total tokens,
  cached_tokens, reasoning_tokens), null when the backend reported none; and the request's own
  settings echoed (instructions, max_output_tokens, temperature, top_p, tools, tool_choice,
  parallel_tool_calls, text, metadata, user, safety_identifier, ...), as OpenAI's Response does.
  A reasoning backend's reasoning text (reasoning_content / reasoning) is not an output item: the
  client did not ask for it (reasoning is refused), and a client that sends the output back as its
  next input would have it refused.

The stream is the event grammar replay.py replays a stored Response in (`event: <type>` and
`data: {...}` with sequence_number 0, 1, ...): response.created, response.in_progress, per output
item output_item.added, (a message:) content_part.added, output_text.delta ... / refusal.delta
..., .done, content_part.done, (a function call:) function_call_arguments.delta ..., .done, then
output_item.done; items one after another (the next opens when the previous is done), finally
response.completed (or response.incomplete) carrying the whole Response, with the usage chunk's
usage. The finish reason and the usage chunk may come in either order: the end waits for [DONE]
(or close()).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..messages.translate import TranslationError, Untranslatable
from ..wire.openai_wire import due_calls, first_message, function_tool, tool_call_delta
from .wire import is_item_reference

__all__ = [
    "DONE",
    "ChatToResponsesStream",
    "StreamOrderError",
    "chat_completion_to_response",
    "responses_to_chat",
]

DONE = "[DONE]"  # the chat stream's last `data:` payload, as fed to ChatToResponsesStream
CHAT_API = "OpenAI chat completions"


class StreamOrderError(ValueError):
    """A chat stream the Responses events cannot express: arguments for a tool call after a later
    output item began (items are streamed one after another, and a done item is never reopened)."""


def _refuse(feature: str) -> Untranslatable:
    return Untranslatable(feature, CHAT_API)


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


# ---- Responses -> chat ----------------------------------------------------------------------

_IMAGE_DETAIL = frozenset({"low", "high", "auto"})


def _part(part: Any, where: str, role: str) -> dict[str, Any]:
    """One Responses content part as a chat content part, for a message of `role`."""
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(part, dict):
        raise TranslationError(f"{where}: a content part object")
    if kind in ("input_text", "output_text", "text"):
        text = part.get("text")
        if not isinstance(text, str):
            raise TranslationError(f"{where}.text: a string")
        return {"type": "text", "text": text}
    if kind == "refusal" and role == "assistant":
        refusal = part.get("refusal")
        if not isinstance(refusal, str):
            raise TranslationError(f"{where}.refusal: a string")
        return {"type": "refusal", "refusal": refusal}
    if kind == "input_image" and role in ("user", "tool"):
        url = part.get("image_url")
        if part.get("file_id") is not None or not isinstance(url, str) or not url:
            raise _refuse(f"images by file_id ({where})")
        image: dict[str, Any] = {"url": url}
        if part.get("detail") in _IMAGE_DETAIL:
            image["detail"] = part["detail"]
        return {"type": "image_url", "image_url": image}
    if kind == "input_file" and role in ("user", "tool"):
        data = part.get("file_data")
        if part.get("file_id") is not None or part.get("file_url") is not None or not isinstance(data, str) or not data:
            raise _refuse(f"files by file_id or URL ({where})")
        file: dict[str, Any] = {"file_data": data}
        if isinstance(part.get("filename"), str):
            file["filename"] = part["filename"]
        return {"type": "file", "file": file}
    if kind in ("input_image", "input_file"):
        raise _refuse(f"{kind} parts in a {role} message ({where})")
    raise _refuse(f"{kind!r} content parts ({where})")


def _content(content: Any, where: str, role: str) -> str | list[dict[str, Any]]:
    """A message's (or a tool output's) content in chat's shape: a string, or parts (a lone text
    part read as a string, as clients write it)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TranslationError(f"{where}: a string or a list of content parts")
    parts = [_part(p, f"{where}[{k}]", role) for k, p in enumerate(content)]
    if len(parts) == 1 and parts[0]["type"] == "text":
        return str(parts[0]["text"])
    return parts


_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_ITEM_NAMES = {
    "reasoning": "reasoning items",
    "item_reference": "item references (stored items)",
    "compaction": "compaction items",
}


def _message(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    chat_role = _ROLES.get(role) if isinstance(role, str) else None
    if chat_role is None:
        raise TranslationError(f"{where}.role: user, assistant, system or developer, not {role!r}")
    return {"role": chat_role, "content": _content(item.get("content"), f"{where}.content", chat_role)}


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
    if not isinstance(call_id, str) or not call_id:
        raise TranslationError(f"{where}.call_id: a string")
    if not isinstance(name, str) or not name:
        raise TranslationError(f"{where}.name: a string")
    if not isinstance(args, str):
        raise TranslationError(f"{where}.arguments: a string (JSON)")
    if item.get("namespace") is not None:
        raise _refuse(f"namespaced function calls ({where}.namespace)")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def _tool_output(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise TranslationError(f"{where}.call_id: a string")
    output = item.get("output")
    if isinstance(output, list):
        for k, p in enumerate(output):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind != "input_text":
                raise _refuse(f"{kind!r} parts in a function_call_output ({where}.output[{k}])")
    content = _content(output if output is not None else "", f"{where}.output", "tool")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _input_messages(items: list[Any]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise TranslationError(f"{where}: an input item object")
        kind = "item_reference" if is_item_reference(item) else item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                # an assistant message (text, or calls) followed by calls: one assistant turn
                last.setdefault("tool_calls", []).append(call)
                if last["content"] == "":
                    last["content"] = None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(_tool_output(item, where))
        else:
            raise _refuse(f"{_ITEM_NAMES.get(str(kind), f'{kind!r} items')} ({where})")
    return messages


_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise TranslationError("tools: a list of tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise TranslationError(f"tools[{i}]: a tool object")
        kind = tool.get("type")
        if kind != "function":
            raise _refuse(f"built-in tool {kind!r} (tools[{i}])")
        for key, value in tool.items():
            if key not in _TOOL_KEYS and value is not None:
                raise _refuse(f"tools[{i}].{key}")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise TranslationError(f"tools[{i}].name: a string")
        out.append(function_tool(name, tool.get("parameters") or {"type": "object", "properties": {}}, tool))
    return out


def _tool_choice(choice: Any, has_tools: bool) -> Any:
    """Chat's tool_choice, or None where it goes (auto / none without tools)."""
    if choice in ("auto", "none", "required"):
        return choice if has_tools or choice == "required" else None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise TranslationError("tool_choice.name: a string")
        return {"type": "function", "function": {"name": name}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise _refuse(f"tool_choice {kind!r}")


def _text_config(text: Any, out: dict[str, Any]) -> None:
    if not isinstance(text, dict):
        raise TranslationError("text: an object")
    for key, value in text.items():
        if value is None:
            continue
        if key == "verbosity":
            out["verbosity"] = value
            continue
        if key != "format":
            raise _refuse(f"text.{key}")
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "text":
            continue
        if kind == "json_object":
            out["response_format"] = {"type": "json_object"}
        elif kind == "json_schema" and isinstance(value, dict):
            schema = {k: v for k, v in value.items() if k in ("name", "schema", "description", "strict") and v is not None}
            out["response_format"] = {"type": "json_schema", "json_schema": schema}
        else:
            raise _refuse(f"text.format {kind!r}")


# Fields a chat backend has no equivalent for, refused whatever their value (but null).
_REFUSED = ("previous_response_id", "conversation", "prompt", "max_tool_calls", "n")
_CARRIED = ("model", "temperature", "top_p", "service_tier", "prompt_cache_key", "prompt_cache_retention")
_DROPPED = frozenset({"store", "metadata", "stream_options"})
_HANDLED = frozenset({"input", "instructions", "max_output_tokens", "tools", "tool_choice", "parallel_tool_calls",
                      "text", "stream", "user", "safety_identifier", *_CARRIED})


def _option(key: str, value: Any) -> None:
    """A top-level field that maps to nothing: dropped where that changes nothing, else refused."""
    if key == "reasoning" and isinstance(value, dict) and all(v is None for v in value.values()):
        return
    if key == "truncation" and value == "disabled":
        return
    if key == "background" and value is False:
        return
    if key == "include" and value == []:
        return
    if key == "top_logprobs" and value == 0:
        return
    if key == "truncation":
        raise _refuse(f"truncation {value!r}")
    raise _refuse(key)


def responses_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses request as an OpenAI chat completions request (see the module's list).

    Raises Untranslatable, TranslationError."""
    for key in _REFUSED:
        if body.get(key) is not None:
            raise _refuse(key)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise TranslationError("instructions: a string")
        if instructions:
            messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        messages.extend(_input_messages(items))
    elif items is not None:
        raise TranslationError("input: a string or a list of input items")
    if items is None or items == []:  # (a stored prompt, which could stand in for it, is refused)
        raise TranslationError("input: a request needs input (a string or a list of input items)")
    out: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for key in _CARRIED[1:]:
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body["tools"]) if body.get("tools") is not None else []
    if tools:  # chat refuses an empty list
        out["tools"] = tools
    if body.get("tool_choice") is not None:
        choice = _tool_choice(body["tool_choice"], bool(tools))
        if choice is not None:
            out["tool_choice"] = choice
    if body.get("parallel_tool_calls") is not None and tools:
        out["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("text") is not None:
        _text_config(body["text"], out)
    if body.get("stream"):
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}
    user = body.get("safety_identifier") or body.get("user")
    if user:
        out["user"] = user
    for key, value in body.items():
        if value is None or key in _HANDLED or key in _DROPPED:
            continue
        _option(key, value)
    return out


# ---- chat -> Responses ----------------------------------------------------------------------


def _usage(chat_usage: Any) -> dict[str, Any] | None:
    """Chat usage as a Response's usage; None when the backend reported none."""
    if not isinstance(chat_usage, dict):
        return None
    prompt = chat_usage.get("prompt_tokens")
    completion = chat_usage.get("completion_tokens")
    prompt = prompt if isinstance(prompt, int) else 0
    completion = completion if isinstance(completion, int) else 0
    total = chat_usage.get("total_tokens")
    pd, cd = chat_usage.get("prompt_tokens_details"), chat_usage.get("completion_tokens_details")
    cached = pd.get("cached_tokens") if isinstance(pd, dict) else None
    reasoning = cd.get("reasoning_tokens") if isinstance(cd, dict) else None
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached if isinstance(cached, int) else 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": reasoning if isinstance(reasoning, int) else 0},
        "total_tokens": total if isinstance(total, int) else prompt + completion,
    }


_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _incomplete(finish: Any) -> bool:
    """Whether a chat finish reason (a backend's: any JSON value) ends the Response incomplete."""
    return isinstance(finish, str) and finish in _INCOMPLETE


# The request's fields a Response echoes (`_response`): each must encode as the request's, or the
# answer could not be written (metadata nested 300 deep, which chat is never sent, made every
# backend's answer unreadable: blamed on each in turn until ejected, or a 500 mid-stream).
ECHOED = ("instructions", "max_output_tokens", "prompt_cache_key", "safety_identifier", "service_tier", "temperature",
          "text", "tool_choice", "tools", "top_p", "user", "metadata")


def _response(request: Mapping[str, Any], *, rid: str, model: str, created: int, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, finish: Any, service_tier: Any = None, started: bool = False) -> dict[str, Any]:
    """A Response object: the answer (or, `started`, the one in progress: no output, no usage),
    and the request's settings echoed as OpenAI does."""
    reason = None if started else _INCOMPLETE.get(str(finish))
    status = "in_progress" if started else "completed" if reason is None else "incomplete"
    text = request.get("text")
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "incomplete_details": {"reason": reason} if reason is not None else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "previous_response_id": None,
        "prompt_cache_key": request.get("prompt_cache_key"),
        "reasoning": {"effort": None, "summary": None},
        "safety_identifier": request.get("safety_identifier"),
        "service_tier": service_tier if isinstance(service_tier, str) else request.get("service_tier"),
        "store": False,
        "temperature": request.get("temperature"),
        "text": text if isinstance(text, dict) else {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": request.get("tools") or [],
        "top_logprobs": 0,
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "user": request.get("user"),
        "metadata": request.get("metadata") or {},
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(parts: list[dict[str, Any]], iid: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"id": iid or _new_id("msg_"), "type": "message", "status": status, "role": "assistant", "content": parts}


def _call_item(call_id: str, name: str, arguments: str, iid: str | None = None, status: str = "completed") -> dict[str, Any]:
    return {"id": iid or _new_id("fc_"), "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def chat_completion_to_response(chat: Mapping[str, Any], request: Mapping[str, Any]) -> dict[str, Any]:
    """A chat.completion (a chat backend's answer) as the Response to the Responses `request`."""
    choice, message, content = first_message(chat)
    parts = [_text_part(content)] if isinstance(content, str) and content else []
    if isinstance(message.get("refusal"), str) and message["refusal"]:
        parts.append({"type": "refusal", "refusal": message["refusal"]})
    output = [_message_item(parts)] if parts else []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(fn, dict):
            continue
        call_id = call.get("id") if isinstance(call.get("id"), str) and call.get("id") else _new_id("call_")
        args = fn.get("arguments")
        output.append(_call_item(str(call_id), str(fn.get("name") or ""), args if isinstance(args, str) else ""))
    finish = choice.get("finish_reason")
    if output and _incomplete(finish):
        output[-1]["status"] = "incomplete"  # the item the limit cut
    created = chat.get("created")
    model = chat.get("model") if isinstance(chat.get("model"), str) and chat.get("model") else request.get("model")
    return _response(request, rid=_new_id("resp_"), model=str(model or ""),
                     created=created if isinstance(created, int) else int(time.time()), output=output,
                     usage=_usage(chat.get("usage")), finish=finish, service_tier=chat.get("service_tier"))


# ---- the stream -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Call:
    """One chat tool call while it streams."""

    id: str | None
    name: str = ""
    held: list[str] = field(default_factory=list)  # argument pieces that came before its name
    args: list[str] = field(default_factory=list)  # the arguments streamed so far
    index: int = -1  # its output_index, once opened
    iid: str = ""  # its item id, once opened
    order: int = 0  # its place among the answer's calls


@dataclass(slots=True)
class _Part:
    kind: str  # "output_text" or "refusal"
    pieces: list[str] = field(default_factory=list)


class ChatToResponsesStream:
    """Chat chunks -> Responses stream events (see the module's note). `model`: the Response's
    model; `request`: the Responses request (its settings are echoed in the Response)."""

    def __init__(self, model: str, request: Mapping[str, Any]) -> None:
        self.model = model
        self.request = request
        self.response_id = _new_id("resp_")
        self.created = int(time.time())
        self.done = False
        self._usage: dict[str, Any] | None = None  # the backend's chat usage, once reported
        self._seq = 0
        self._started = False
        self._output: list[dict[str, Any]] = []  # the items done, in output order
        self._open: str | None = None  # "message" or "call": the open item's kind
        self._open_iid = ""  # the open message's id
        self._parts: list[_Part] = []  # the open message's parts (the last one open)
        self._calls: dict[int, _Call] = {}  # by chat index: the latest call there
        self._all: list[_Call] = []  # every call, in order
        self._named: list[_Call] = []  # calls named but not opened yet (waiting for their first argument piece)
        self._current: _Call | None = None  # the open call
        self._finish: Any = None
        self._cut = False  # the answer was cut (finish length / content_filter): its last item is incomplete
        self._tier: Any = None

    @property
    def usage(self) -> dict[str, Any] | None:
        """The answer's usage in chat terms (the backend's usage chunk), once reported."""
        return self._usage

    def feed(self, chunk: Mapping[str, Any] | str) -> bytes:
        """One chat chunk (a parsed `data:` payload), or DONE: the events it makes.

        Raises StreamOrderError (see the class)."""
        if self.done:
            return b""
        if isinstance(chunk, str):  # DONE
            return self.close()
        out = [self._start(chunk)]
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        if isinstance(chunk.get("service_tier"), str):
            self._tier = chunk["service_tier"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            delta = delta if isinstance(delta, dict) else {}
            for key, kind in (("content", "output_text"), ("refusal", "refusal")):
                text = delta.get(key)
                if isinstance(text, str) and text:
                    out.append(self._text(kind, text))
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    out.append(self._tool(call))
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return b"".join(out)

    def close(self) -> bytes:
        """The end of the stream ([DONE], or the backend's clean end): the open item's end and
        response.completed (or response.incomplete). Idempotent."""
        if self.done:
            return b""
        out = [self._start({})]
        for call in self._all:
            if call.index < 0:  # a call without arguments yet, or whose name never came: sent as it is
                out.append(self._open_call(call))
        self._cut = _incomplete(self._finish)  # the open item (the last) is the one the limit cut
        out.append(self._end_item())
        resp = self._whole()
        self.done = True
        out.append(self._event(f"response.{resp['status']}", response=resp))
        return b"".join(out)

    # -- events

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = orjson.dumps({"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _whole(self, started: bool = False) -> dict[str, Any]:
        return _response(self.request, rid=self.response_id, model=self.model, created=self.created,
                         output=[] if started else list(self._output), usage=None if started else _usage(self._usage),
                         finish=self._finish, service_tier=self._tier, started=started)

    def _start(self, chunk: Mapping[str, Any]) -> bytes:
        if self._started:
            return b""
        self._started = True
        if not self.model and isinstance(chunk.get("model"), str):
            self.model = chunk["model"]
        start = self._whole(started=True)
        return self._event("response.created", response=start) + self._event("response.in_progress", response=start)

    def _end_item(self) -> bytes:
        """The open item's closing events."""
        if self._open == "message":
            out = self._end_part()
            item = _message_item([self._part_whole(p) for p in self._parts], self._open_iid, self._status())
            self._open, self._parts = None, []
            return out + self._item_done(item)
        if self._open == "call" and self._current is not None:
            call, self._current, self._open = self._current, None, None
            args = "".join(call.args)
            out = self._event("response.function_call_arguments.done", item_id=call.iid, output_index=call.index,
                              arguments=args, name=call.name)
            return out + self._item_done(_call_item(str(call.id), call.name, args, call.iid, self._status()))
        return b""

    def _status(self) -> str:
        return "incomplete" if self._cut else "completed"

    def _item_done(self, item: dict[str, Any]) -> bytes:
        self._output.append(item)
        return self._event("response.output_item.done", output_index=len(self._output) - 1, item=item)

    # -- message text

    @staticmethod
    def _part_whole(part: _Part) -> dict[str, Any]:
        text = "".join(part.pieces)
        return _text_part(text) if part.kind == "output_text" else {"type": "refusal", "refusal": text}

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open_iid, "output_index": len(self._output), "content_index": len(self._parts) - 1}

    def _end_part(self) -> bytes:
        if not self._parts:
            return b""
        part = self._parts[-1]
        whole = self._part_whole(part)
        where = self._where()
        if part.kind == "output_text":
            out = self._event("response.output_text.done", **where, text=whole["text"], logprobs=[])
        else:
            out = self._event("response.refusal.done", **where, refusal=whole["refusal"])
        return out + self._event("response.content_part.done", **where, part=whole)

    def _text(self, kind: str, text: str) -> bytes:
        out = self._open_pending()
        if self._open != "message":
            out += self._end_item()
            self._open, self._open_iid, self._parts = "message", _new_id("msg_"), []
            item = {"id": self._open_iid, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            out += self._event("response.output_item.added", output_index=len(self._output), item=item)
        if not self._parts or self._parts[-1].kind != kind:
            out += self._end_part()
            self._parts.append(_Part(kind))
            empty = _text_part("") if kind == "output_text" else {"type": "refusal", "refusal": ""}
            out += self._event("response.content_part.added", **self._where(), part=empty)
        self._parts[-1].pieces.append(text)
        if kind == "output_text":
            return out + self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])
        return out + self._event("response.refusal.delta", **self._where(), delta=text)

    # -- tool calls

    def _open_call(self, call: _Call) -> bytes:
        out = self._end_item()
        call.id = call.id or _new_id("call_")
        call.iid = _new_id("fc_")
        call.index = len(self._output)
        self._open, self._current = "call", call
        item = {"id": call.iid, "type": "function_call", "status": "in_progress", "call_id": call.id,
                "name": call.name, "arguments": ""}
        out += self._event("response.output_item.added", output_index=call.index, item=item)
        held, call.held = "".join(call.held), []
        return out + (self._args(call, held) if held else b"")

    def _open_pending(self, keep: _Call | None = None) -> bytes:
        """Open the named calls still waiting for their first argument piece (as items, in order):
        something after them begins."""
        named, self._named = self._named, []
        return b"".join(self._open_call(c) for c in due_calls(named, keep)) if named else b""

    def _args(self, call: _Call, piece: str) -> bytes:
        call.args.append(piece)
        return self._event("response.function_call_arguments.delta", item_id=call.iid, output_index=call.index, delta=piece)

    def _tool(self, delta: Mapping[str, Any]) -> bytes:
        at, ident, name, args = tool_call_delta(delta)
        call = self._calls.get(at)
        if call is None or (ident is not None and call.id is not None and ident != call.id):
            # a new call; a new id at a used index too (servers that send every call at index 0)
            call = self._calls[at] = _Call(id=ident, order=len(self._all))
            self._all.append(call)
        if call.id is None and ident is not None and call.index < 0:
            call.id = ident
        if isinstance(name, str) and name:
            if not call.name and call.index < 0:
                self._named.append(call)
            call.name += name  # a piece after the item opened reaches the done events and the Response
        if call.index < 0:
            if isinstance(args, str) and args:
                call.held.append(args)
            # Its item opens with its first argument piece, so that a name streamed in pieces is
            # whole in output_item.added too. Calls before it open first.
            if not (call.name and call.held):
                return b""
            return self._open_pending(keep=call) + self._open_call(call)
        if not (isinstance(args, str) and args):
            return b""
        if call is not self._current:
            raise StreamOrderError(f"arguments for tool call {at} after a later output item began")
        return self._args(call, args)
