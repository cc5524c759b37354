"""Response cache: the canonical key, what may be cached, entries, replay, and single flight.

An entry is the complete non-streamed JSON answer (chat.completion or text_completion), stored as
bytes. A non-streamed hit sends those bytes back as they are (no re-encoding; the stored `id` is
kept, the request is correlated by x-request-id); a streamed hit replays them as a valid SSE
stream. A streamed miss is turned into the same JSON by StreamAssembler, so both kinds of request
share one entry. The key is versioned (CACHE_FORMAT): changing the entry format means bumping it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from .store import Store, StoreError
from .wire import SSE_DONE

__all__ = [
    "CACHE_FORMAT",
    "TRANSPORT_FIELDS",
    "cache_key",
    "cacheable_request",
    "cache_control",
    "Entry",
    "entry_from_response",
    "StreamAssembler",
    "replay_json",
    "replay_sse",
    "Cache",
    "Flight",
    "SingleFlight",
]

CACHE_FORMAT = "v1"
_KEY_PREFIX = f"gwc:{CACHE_FORMAT}:"

# Body fields that change how an answer travels or is accounted, never what it says: not in the key.
# Everything else is in it, unknown vendor fields included (a needless miss beats a wrong answer).
TRANSPORT_FIELDS = frozenset({
    "model",  # the body's spelling is replaced by the public model passed to cache_key
    "stream",  # streamed and non-streamed requests share one entry
    "stream_options",  # include_usage only adds a usage chunk, which replay_sse emits on demand
    "user",  # abuse-monitoring id, no effect on the answer
    "safety_identifier",  # OpenAI's successor of `user`
    "metadata",  # tags for the caller's own dashboards
    "service_tier",  # priority / latency class, not content
    "store",  # whether OpenAI keeps the completion for distillation
    "prompt_cache_key",  # a routing hint for the provider's prompt cache
})
# 0 and 0.0 mean the same sampling: key them alike.
_FLOAT_FIELDS = ("temperature", "top_p", "frequency_penalty", "presence_penalty")
_FINISHED = frozenset({"stop", "length"})
_WARN_EVERY_S = 60.0


def cache_key(namespace: str, endpoint: str, model: str, body: Mapping[str, Any]) -> str:
    """`gwc:v1:<sha256 hex>` of the canonical JSON (sorted keys) of everything that changes the answer.

    `namespace` isolates tenants (the tenant name, or a namespace the policy shares between tenants);
    `endpoint` is "chat" or "completions"; `model` is the public model the client asked for.
    """
    fields = {k: v for k, v in body.items() if k not in TRANSPORT_FIELDS}
    for name in _FLOAT_FIELDS:
        v = fields.get(name)
        if type(v) is int:
            fields[name] = float(v)
    canonical = orjson.dumps([CACHE_FORMAT, namespace, endpoint, model, fields], option=orjson.OPT_SORT_KEYS)
    return _KEY_PREFIX + hashlib.sha256(canonical).hexdigest()


def cacheable_request(body: Mapping[str, Any], *, require_deterministic: bool = True) -> str | None:
    """None when the request may be answered from (and stored in) the cache, else the reason why not.

    One choice only; no logprobs (a streamed replay could not carry them). With
    `require_deterministic`, also temperature 0 or a seed (the policy may drop this per model/tenant).
    """
    n = body.get("n")
    if n is not None and n != 1:
        return "n > 1"
    logprobs = body.get("logprobs")
    if logprobs is not None and logprobs is not False:
        return "logprobs requested"
    if require_deterministic and body.get("seed") is None:
        t = body.get("temperature")
        if t is None:
            return "no temperature 0 or seed (default temperature is 1)"
        if t != 0:
            return "temperature > 0 without seed"
    return None


def cache_control(header: str | None) -> tuple[bool, bool]:
    """(no_cache, no_store) from a request's Cache-Control header: skip the lookup / skip the store."""
    if not header:
        return False, False
    tokens = {part.split("=", 1)[0].strip().lower() for part in header.split(",")}
    return "no-cache" in tokens, "no-store" in tokens


@dataclass(frozen=True, slots=True)
class Entry:
    """A complete non-streamed answer (chat.completion or text_completion JSON), as bytes."""

    body: bytes

    def answer(self) -> dict[str, Any]:
        """The decoded answer (parses on every call: the hit path for JSON never needs it)."""
        obj: dict[str, Any] = orjson.loads(self.body)
        return obj

    def usage(self) -> dict[str, Any] | None:
        """The stored answer's usage block, if it had one."""
        usage = self.answer().get("usage")
        return usage if isinstance(usage, dict) else None


def _complete(obj: Any) -> bool:
    """One choice, finished with stop/length, no logprobs, in a chat or completions shape."""
    if not isinstance(obj, dict):
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    if choice.get("finish_reason") not in _FINISHED or choice.get("logprobs") is not None:
        return False
    return isinstance(choice.get("message"), dict) or isinstance(choice.get("text"), str)


def entry_from_response(raw: bytes, max_bytes: int) -> Entry | None:
    """An Entry for a non-streamed 200 answer's bytes, or None when it must not be cached
    (over `max_bytes`, unparsable, unfinished, several choices, logprobs). Keeps the bytes as sent."""
    if len(raw) > max_bytes:
        return None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return Entry(raw) if _complete(obj) else None


class StreamAssembler:
    """Builds the non-streamed answer from a streamed one; fed each event's decoded JSON.

    entry() is None when the stream did not finish with stop/length, carried an error event, more
    than one choice, logprobs or parts that cannot be rebuilt faithfully, or grew past `max_bytes`.
    Tool calls are rebuilt as the openai SDK does (by index; name and arguments concatenated).
    """

    __slots__ = ("_max", "_size", "_head", "_chat", "_role", "_texts", "_tools", "_finish", "_usage", "_broken")

    def __init__(self, max_bytes: int) -> None:
        self._max = max_bytes
        self._size = 0
        self._head: dict[str, Any] | None = None
        self._chat: bool | None = None
        self._role = "assistant"
        self._texts: dict[str, list[str]] = {}  # "content", "refusal", "reasoning_content"... or "text"
        self._tools: list[dict[str, Any]] = []
        self._finish: str | None = None
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


class Cache:
    """A Store under the policy's knobs, failing open: a store error is a miss (lookup) or a no-op
    (save), reported to `on_error(op)` every time and logged at most once a minute."""

    __slots__ = ("store", "ttl_s", "max_entry_bytes", "_on_error", "_log", "_clock", "_last_warn", "_suppressed", "_failing")

    def __init__(
        self,
        store: Store,
        *,
        ttl_s: float,
        max_entry_bytes: int,
        on_error: Callable[[str], None] | None = None,
        log: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.max_entry_bytes = max_entry_bytes
        self._on_error = on_error
        self._log = log or logging.getLogger("gateway.cache")
        self._clock = clock
        self._last_warn: float | None = None
        self._suppressed = 0
        self._failing = False

    async def lookup(self, key: str) -> Entry | None:
        """The entry under `key`, or None on a miss or when the store fails."""
        try:
            raw = await self.store.get(key)
        except StoreError as exc:
            self._failed("get", exc)
            return None
        if self._failing:
            self._recovered()
        return None if raw is None else Entry(raw)

    async def save(self, key: str, entry: Entry, *, ttl_s: float | None = None) -> bool:
        """Store `entry` for `ttl_s` (default: the cache's); False when too big or the store failed."""
        if len(entry.body) > self.max_entry_bytes:
            return False
        try:
            await self.store.set(key, entry.body, self.ttl_s if ttl_s is None else ttl_s)
        except StoreError as exc:
            self._failed("set", exc)
            return False
        if self._failing:
            self._recovered()
        return True

    def _failed(self, op: str, exc: StoreError) -> None:
        self._failing = True
        if self._on_error is not None:
            self._on_error(op)
        now = self._clock()
        if self._last_warn is not None and now - self._last_warn < _WARN_EVERY_S:
            self._suppressed += 1
            return
        more = f" ({self._suppressed} more failures since the last warning)" if self._suppressed else ""
        self._log.warning("cache store failed, answering from upstream: %s%s", exc, more)
        self._last_warn, self._suppressed = now, 0

    def _recovered(self) -> None:
        self._failing = False
        self._log.info("cache store answers again")


class Flight:
    """One caller's place in a SingleFlight: the leader calls upstream and publishes what it
    stored; a follower reads `entry` (None: the leader failed, stored nothing, or took too long)."""

    __slots__ = ("leader", "entry", "_done")

    def __init__(self, leader: bool, entry: Entry | None = None) -> None:
        self.leader = leader
        self.entry = entry
        self._done = asyncio.Event()

    def publish(self, entry: Entry) -> None:
        """Hand `entry` to the followers (call it inside the `hold` block, leader only)."""
        self.entry = entry


class SingleFlight:
    """Per process: concurrent identical misses make one upstream call.

        async with flight.hold(key, wait_s=call.remaining_s()) as f:
            entry = None if f.leader else (f.entry or await cache.lookup(key))
            if entry is None:
                ...call upstream; on a cacheable answer: await cache.save(key, e); f.publish(e)

    Followers wait until the leader's block exits (at most `wait_s`), then proceed on their own if
    nothing was published. Cancelling a leader or a follower leaves nothing behind.
    """

    __slots__ = ("_flights",)

    def __init__(self) -> None:
        self._flights: dict[str, Flight] = {}

    def __len__(self) -> int:
        return len(self._flights)

    @contextlib.asynccontextmanager
    async def hold(self, key: str, *, wait_s: float) -> AsyncIterator[Flight]:
        """Lead the flight for `key`, or follow the one in progress (see the class docstring)."""
        current = self._flights.get(key)
        if current is None:
            flight = self._flights[key] = Flight(leader=True)
            try:
                yield flight
            finally:
                if self._flights.get(key) is flight:
                    del self._flights[key]
                flight._done.set()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, wait_s)):
                await current._done.wait()
        yield Flight(leader=False, entry=current.entry)
