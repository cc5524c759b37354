"""Cache entries: the complete non-streamed JSON answer (chat.completion or text_completion), as bytes.

A non-streamed hit sends those bytes back as they are (no re-encoding; the stored `id` is kept, the
request is correlated by x-request-id); a streamed hit replays them as a valid SSE stream. A
streamed miss is turned into the same JSON by StreamAssembler, so both kinds of request share one
entry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from ..responses.replay import replayable
from ..wire.openai_wire import SSE_DONE

__all__ = ["Entry", "entry_from_response", "is_complete", "StreamAssembler", "replay_json", "replay_sse"]

_FINISHED = frozenset({"stop", "length"})


@dataclass(frozen=True, slots=True)
class Entry:
    """A complete non-streamed answer (chat.completion, text_completion, a Response or a Message JSON), as bytes."""

    body: bytes

    def answer(self) -> dict[str, Any]:
        """The decoded answer (parses on every call: the hit path for JSON never needs it)."""
        obj: dict[str, Any] = orjson.loads(self.body)
        return obj

    def usage(self) -> dict[str, Any] | None:
        """The stored answer's usage block, if it had one."""
        usage = self.answer().get("usage")
        return usage if isinstance(usage, dict) else None


def is_complete(obj: Any) -> bool:
    """One choice, finished with stop/length, no logprobs, in a chat or completions shape (tool
    calls, if any, a list of objects): what replay_json and replay_sse can serve. Also the check
    that a stored entry read back is not corrupt (Cache.lookup)."""
    if not isinstance(obj, dict):
        return False
    if obj.get("object") == "response":
        return replayable(obj)  # a Responses API answer (responses/replay.py)
    if obj.get("type") == "message":  # an Anthropic Message (messages/codec.py replays it)
        return isinstance(obj.get("content"), list) and obj.get("stop_reason") in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    if choice.get("finish_reason") not in _FINISHED or choice.get("logprobs") is not None:
        return False
    message = choice.get("message")
    if isinstance(message, dict):
        # Text a stream can replay: a string, or none. A list of content parts (some servers
        # answer so) came back from a streamed hit as no text at all.
        if not isinstance(message.get("content"), str | None):
            return False
        tools = message.get("tool_calls")
        return not tools or (isinstance(tools, list) and all(isinstance(t, dict) for t in tools))
    return isinstance(choice.get("text"), str)


def entry_from_response(raw: bytes, max_bytes: int) -> Entry | None:
    """An Entry for a non-streamed 200 answer's bytes, or None when it must not be cached
    (over `max_bytes`, unparsable, unfinished, several choices, logprobs). Keeps the bytes as sent."""
    if len(raw) > max_bytes:
        return None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return Entry(raw) if is_complete(obj) else None


class StreamAssembler:
    """Builds the non-streamed answer from a streamed one; fed each event's decoded JSON.

    entry() is None when the stream did not finish with stop/length, carried an error event, more
    than one choice, logprobs or parts that cannot be rebuilt faithfully, or grew past `max_bytes`.
    Tool calls are rebuilt as the openai SDK does (by index; name and arguments concatenated).
    """

    __slots__ = ("_max", "_size", "_head", "_chat", "_role", "_texts", "_tools", "_finish", "_stop", "_usage", "_broken")

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._size = 0
        self._head: dict[str, Any] | None = None
        self._chat: bool | None = None
        self._role = "assistant"
        self._texts: dict[str, list[str]] = {}  # "content", "refusal", "reasoning_content"... or "text"
        self._tools: list[dict[str, Any]] = []
        self._finish: str | None = None
        self._stop: str | int | None = None  # vLLM's choice-level stop_reason: the stop string (or token) matched
        self._usage: dict[str, Any] | None = None
        self._broken = False

    def feed(self, event: Mapping[str, Any]) -> None:
        """Take one stream event (a chunk's JSON object)."""
        if self._broken:
            return
        if "error" in event:
            return self._give_up()
        if self._head is None:
            self._head = {k: event[k] for k in ("id", "created", "model", "system_fingerprint") if k in event}
        usage = event.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0 or choice.get("logprobs") is not None:
                return self._give_up()
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._chat = True
                for k, v in delta.items():
                    if v is None or v == "" or v == [] or v == {}:
                        continue
                    if k == "role" and isinstance(v, str):
                        self._role = v
                    elif k == "tool_calls" and isinstance(v, list):
                        self._add_tools(v)
                    elif isinstance(v, str):
                        self._add_text(k, v)
                    else:
                        return self._give_up()  # function_call, audio...: not rebuilt
            elif isinstance(choice.get("text"), str):
                self._chat = False
                self._add_text("text", choice["text"])
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
            stop = choice.get("stop_reason")
            if isinstance(stop, str | int) and not isinstance(stop, bool):
                self._stop = stop
            if self._broken:
                return
        if self._size > self._max:
            self._give_up()

    def entry(self) -> Entry | None:
        """The assembled answer, or None (see the class docstring)."""
        if self._broken or self._finish not in _FINISHED or self._chat is None:
            return None
        head = self._head or {}
        joined = {k: "".join(parts) for k, parts in self._texts.items()}
        choice: dict[str, Any]
        if self._chat:
            message: dict[str, Any] = {"role": self._role, "content": joined.pop("content", None)}
            message.update(joined)
            if self._tools:
                if any(not t["id"] for t in self._tools):
                    return None
                message["tool_calls"] = self._tools
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self._finish}
        else:
            choice = {"index": 0, "text": joined.get("text", ""), "logprobs": None, "finish_reason": self._finish}
        if self._stop is not None:  # kept as a whole answer has it (a Message's stop_sequence is read from it)
            choice["stop_reason"] = self._stop
        obj = {
            "id": head.get("id", ""),
            "object": "chat.completion" if self._chat else "text_completion",
            "created": head.get("created", 0),
            "model": head.get("model", ""),
            "choices": [choice],
        }
        if "system_fingerprint" in head:
            obj["system_fingerprint"] = head["system_fingerprint"]
        if self._usage is not None:
            obj["usage"] = self._usage
        body = orjson.dumps(obj)
        return Entry(body) if len(body) <= self._max else None

    def _add_text(self, field: str, text: str) -> None:
        self._texts.setdefault(field, []).append(text)
        self._size += len(text)

    def _add_tools(self, deltas: list[Any]) -> None:
        for d in deltas:
            i = d.get("index") if isinstance(d, dict) else None
            if type(i) is not int or not 0 <= i <= len(self._tools) + 16:
                return self._give_up()
            while len(self._tools) <= i:
                self._tools.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            slot = self._tools[i]
            if d.get("id"):
                slot["id"] = d["id"]
            if d.get("type"):
                slot["type"] = d["type"]
            fn = d.get("function")
            if isinstance(fn, dict):
                for part in ("name", "arguments"):
                    if isinstance(fn.get(part), str):
                        slot["function"][part] += fn[part]
                        self._size += len(fn[part])

    def _give_up(self) -> None:
        self._broken = True
        self._texts.clear()
        self._tools.clear()


def replay_json(entry: Entry) -> bytes:
    """The body of a non-streamed hit: the stored bytes, as the backend (or the assembler) wrote them."""
    return entry.body


def replay_sse(entry: Entry, *, include_usage: bool, chunk_chars: int = 64) -> list[bytes]:
    """The events of a streamed hit, ending with `data: [DONE]`.

    Chat: a role chunk, chunks of at most `chunk_chars` characters for each text field (other text
    fields such as reasoning_content first, then content), one chunk with every tool call, a finish
    chunk, and a usage chunk (empty choices) when `include_usage` and the entry has usage.
    Completions: text chunks, then a finish chunk with empty text.
    """
    obj = orjson.loads(entry.body)
    choice = obj["choices"][0]
    chat = isinstance(choice.get("message"), dict)
    head: dict[str, Any] = {
        "id": obj.get("id", ""),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": obj.get("created", 0),
        "model": obj.get("model", ""),
    }
    if "system_fingerprint" in obj:
        head["system_fingerprint"] = obj["system_fingerprint"]
    # Every chunk is prefix + one small JSON value + suffix: only the varying part is encoded per chunk.
    prefix = b"data: " + orjson.dumps(head)[:-1] + (b',"choices":[{"index":0,"delta":' if chat else b',"choices":[{"index":0,"text":')
    open_suffix = b',"logprobs":null,"finish_reason":null}]}\n\n'
    finish = orjson.dumps(choice.get("finish_reason"))
    if choice.get("stop_reason") is not None:  # vLLM's matched stop string (or token), on its finish chunk
        finish += b',"stop_reason":' + orjson.dumps(choice["stop_reason"])
    out: list[bytes] = []
    if chat:
        message = choice["message"]
        out.append(prefix + orjson.dumps({"role": message.get("role") or "assistant", "content": ""}) + open_suffix)
        texts = [k for k, v in message.items() if isinstance(v, str) and k not in ("role", "content")]
        for field in [*texts, "content"]:
            for piece in _pieces(message.get(field), chunk_chars):
                out.append(prefix + orjson.dumps({field: piece}) + open_suffix)
        for k, v in message.items():
            if k == "tool_calls" and v:
                calls = [{"index": i, **tc} for i, tc in enumerate(v)]
                out.append(prefix + orjson.dumps({"tool_calls": calls}) + open_suffix)
            elif k not in ("role", "content") and not isinstance(v, str) and v:
                out.append(prefix + orjson.dumps({k: v}) + open_suffix)  # e.g. a legacy function_call
        out.append(prefix + b'{},"logprobs":null,"finish_reason":' + finish + b"}]}\n\n")
    else:
        for piece in _pieces(choice.get("text"), chunk_chars):
            out.append(prefix + orjson.dumps(piece) + open_suffix)
        out.append(prefix + b'"","logprobs":null,"finish_reason":' + finish + b"}]}\n\n")
    usage = obj.get("usage")
    if include_usage and isinstance(usage, dict):
        out.append(b"data: " + orjson.dumps({**head, "choices": [], "usage": usage}) + b"\n\n")
    out.append(SSE_DONE)
    return out


def _pieces(text: Any, n: int) -> list[str]:
    if not isinstance(text, str) or not text:
        return []
    return [text[i : i + n] for i in range(0, len(text), max(1, n))]


