"""A scripted upstream pool and a recording sink: the pipeline and the relay without sockets.

`ScriptedPool` stands in for upstream_http.UpstreamPool (the one method the relay calls, `post`):
each backend host gets a queue of scripted answers (a status, headers, body chunks and pauses, or
an exception to raise instead of answering) and every request it was sent is recorded.
`RecordingSink` is a gateway.sink.Sink that keeps what a client would have received.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from gateway.errors import GatewayError
from gateway.upstream.client import UpstreamDisconnected, UpstreamTooLarge
from gateway.wire.openai_wire import sse_event

__all__ = ["Answer", "Posted", "RecordingSink", "ScriptedPool", "ScriptedResponse", "chat_answer", "chat_chunk"]

# A body item: bytes handed out by one read, seconds to wait before the next, or an exception the
# read raises (a connection lost mid-body).
Item = bytes | float | BaseException


@dataclass
class Answer:
    """One scripted upstream answer: its head comes after `delay_s`; `raises` instead of a head."""

    status: int = 200
    body: list[Item] = field(default_factory=list)
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    raises: BaseException | None = None


@dataclass
class Posted:
    """One request the pool was sent."""

    url: str
    body: bytes
    headers: dict[str, str]
    connect_timeout_s: float

    @property
    def json(self) -> Any:
        return orjson.loads(self.body)


class ScriptedResponse:
    """What UpstreamResponse offers the relay: status, headers, readany, read, release, close."""

    def __init__(self, answer: Answer) -> None:
        self.status = answer.status
        self.headers = CIMultiDictProxy(CIMultiDict(answer.headers))
        self._items = list(answer.body)
        self.released = self.closed = False
        self.complete = False  # as an upstream response still reading its body: the relay's timer applies

    async def readany(self) -> bytes:
        while self._items and not self.closed:
            item = self._items.pop(0)
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, (int, float)):
                await asyncio.sleep(item)
                continue
            return item
        if self.closed:
            raise UpstreamDisconnected("the response was closed")
        return b""

    async def read(self, max_bytes: int | None = None) -> bytes:
        out = b""
        while chunk := await self.readany():
            out += chunk
            if max_bytes is not None and len(out) > max_bytes:
                raise UpstreamTooLarge(f"response body exceeds {max_bytes} bytes", max_bytes)
        return out

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


class ScriptedPool:
    """`post` answers from each host's script, in order; a post with nothing scripted fails the test."""

    def __init__(self, script: Mapping[str, list[Answer]] | None = None) -> None:
        self.script: dict[str, list[Answer]] = {host: list(answers) for host, answers in (script or {}).items()}
        self.posts: list[Posted] = []
        self.responses: list[ScriptedResponse] = []

    def add(self, host: str, *answers: Answer) -> None:
        self.script.setdefault(host, []).extend(answers)

    def to(self, host: str) -> list[Posted]:
        """The requests sent to one host."""
        return [p for p in self.posts if URL(p.url).host == host]

    async def post(
        self, url: URL | str, body: bytes, headers: Mapping[str, str], *, connect_timeout_s: float, method: str = "POST"
    ) -> ScriptedResponse:
        assert method == "POST", method
        self.posts.append(Posted(str(url), body, dict(headers), connect_timeout_s))
        host = URL(str(url)).host or ""
        queue = self.script.get(host)
        if not queue:
            raise AssertionError(f"no answer scripted for {url}")
        answer = queue.pop(0)
        if answer.delay_s:
            await asyncio.sleep(answer.delay_s)
        if answer.raises is not None:
            raise answer.raises
        resp = ScriptedResponse(answer)
        self.responses.append(resp)
        return resp

    async def close(self) -> None:
        pass


class RecordingSink:
    """A Sink (gateway.sink) that keeps what the client gets: like HttpSink, headers set after the
    stream's commit are lost, and a failure once committed is an error event without [DONE]."""

    def __init__(self) -> None:
        self.committed = False
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []  # a stream's writes
        self.body: bytes | None = None  # a whole answer (send, or fail before the commit)
        self.content_type: str | None = None
        self.ended = False
        self.error: GatewayError | None = None

    def set_header(self, name: str, value: str) -> None:
        if not self.committed:
            self.headers[name] = value

    async def commit(self) -> None:
        if not self.committed:
            self.committed, self.status = True, 200

    async def write(self, data: bytes) -> None:
        await self.commit()
        self.chunks.append(data)

    def would_wait(self, size: int) -> bool:
        return False

    async def hand_off(self, err: Any) -> bool:
        return False  # nobody shares this stream

    async def end(self) -> None:
        self.ended = True

    async def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.status, self.body, self.content_type = status, body, content_type

    async def fail(self, err: GatewayError) -> None:
        self.error = err
        if self.committed:
            self.chunks.append(sse_event(err.to_dict()))
            self.ended = True
            return
        self.status, self.body, self.content_type = err.status, err.to_body(), "application/json"
        self.headers.update(err.headers())

    @property
    def streamed(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def json(self) -> Any:
        assert self.body is not None, "no whole answer was sent"
        return orjson.loads(self.body)


def chat_answer(content: str = "Hello", *, model: str = "m", usage: tuple[int, int] = (3, 2)) -> bytes:
    """A whole chat completion, as a backend answers it."""
    p, c = usage
    return orjson.dumps({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c},
    })  # fmt: skip


def chat_chunk(content: str | None = None, finish: str | None = None, *, role: bool = False) -> bytes:
    """One streamed chat event (`data: {chunk}`)."""
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    if content is not None:
        delta["content"] = content
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
    return b"data: " + orjson.dumps(chunk) + b"\n\n"
