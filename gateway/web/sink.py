"""Sink: where an answer goes. The HTTP implementation writes to an aiohttp response.

Streaming lives here and in the relay, never in middleware (aiohttp's middlewares cannot rewrite
streamed bodies). Once `commit()` sent the 200 and the SSE headers, errors can only travel as an
error event in the stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from ..errors import GatewayError
from ..wire.openai_wire import sse_event

__all__ = ["Sink", "HttpSink", "SinkWrapper"]

_SSE_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # ask nginx-style proxies not to buffer the stream
}


class Sink(Protocol):
    committed: bool

    async def commit(self) -> None: ...
    async def write(self, data: bytes) -> None: ...
    async def end(self) -> None: ...
    async def send(self, status: int, body: bytes, content_type: str = "application/json") -> None: ...
    async def fail(self, err: GatewayError) -> None: ...
    def set_header(self, name: str, value: str) -> None: ...


class HttpSink:
    """Writes one request's answer; `response` is what the handler returns."""

    __slots__ = ("request", "headers", "response", "committed", "timing")

    def __init__(
        self, request: web.Request, headers: dict[str, str], timing: Callable[[], str] | None = None
    ) -> None:
        self.request = request
        self.headers = headers
        self.response: web.StreamResponse | None = None
        self.committed = False
        self.timing = timing  # the Server-Timing header's value, computed as the headers leave

    def _final_headers(self) -> dict[str, str]:
        if self.timing is not None:
            self.headers["Server-Timing"] = self.timing()
        return self.headers

    def set_header(self, name: str, value: str) -> None:
        if self.committed:
            return  # too late for headers: the stream is already going
        self.headers[name] = value

    async def commit(self) -> None:
        """Send the 200 and SSE headers (idempotent)."""
        if self.committed:
            return
        resp = web.StreamResponse(status=200, headers={**_SSE_HEADERS, **self._final_headers()})
        await resp.prepare(self.request)
        self.response = resp
        self.committed = True

    async def write(self, data: bytes) -> None:
        if not self.committed:
            await self.commit()
        await self.response.write(data)  # type: ignore[union-attr]

    async def end(self) -> None:
        if self.response is not None and self.committed:
            await self.response.write_eof()

    async def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.response = web.Response(
            status=status, body=body, headers={**self._final_headers(), "Content-Type": content_type}
        )

    async def fail(self, err: GatewayError) -> None:
        """Answer with an OpenAI-shaped error: a status while we can, an error event once streaming."""
        if self.committed:
            # No [DONE] after it: a cut stream must never look like a success.
            await self.response.write(sse_event(err.to_dict()))  # type: ignore[union-attr]
            await self.response.write_eof()  # type: ignore[union-attr]
            return
        self.response = web.Response(
            status=err.status,
            body=err.to_body(),
            headers={**self._final_headers(), **err.headers(), "Content-Type": "application/json"},
        )


class SinkWrapper:
    """A Sink that passes everything to `inner`; subclasses override what they add to it."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Sink) -> None:
        self._inner = inner

    @property
    def committed(self) -> bool:
        return self._inner.committed

    @committed.setter
    def committed(self, value: bool) -> None:
        self._inner.committed = value

    def set_header(self, name: str, value: str) -> None:
        self._inner.set_header(name, value)

    async def commit(self) -> None:
        await self._inner.commit()

    async def write(self, data: bytes) -> None:
        await self._inner.write(data)

    async def end(self) -> None:
        await self._inner.end()

    async def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        await self._inner.send(status, body, content_type)

    async def fail(self, err: GatewayError) -> None:
        await self._inner.fail(err)
