"""Sink: where an answer goes. The HTTP implementation writes to an aiohttp response.

Streaming lives here and in the relay, never in middleware (aiohttp's middlewares cannot rewrite
streamed bodies). Once `commit()` sent the 200 and the SSE headers, errors can only travel as an
error event in the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web

from ..errors import GatewayError
from ..wire.openai_wire import sse_event

__all__ = ["Sink", "HttpSink", "SinkWrapper", "CLIENT_READ_S", "client_bounded"]

# How long a client may take none of its answer (its socket's buffer full) before it counts as
# gone: its backend slot and upstream call are not held for a reader that stopped reading.
CLIENT_READ_S = 60.0
# Bytes waiting in the socket's buffer past which a write may wait for the client (under any
# transport's high-water mark, 64 KiB by default): only such writes pay for a timer.
_MAY_WAIT = 16 * 1024

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
    async def drain(self, timeout_s: float) -> None: ...
    def would_wait(self, size: int) -> bool: ...
    def set_header(self, name: str, value: str) -> None: ...

    async def hand_off(self, err: GatewayError) -> bool:
        """This caller may have no more of its stream (its key stopped working): True when others
        share the stream (a flight's followers), this caller's client got `err` and the relay must
        read on for them; False when nobody else reads it (the relay cuts the stream with `err`)."""
        ...


async def client_bounded(aw: Awaitable[None], timeout_s: float) -> None:
    """Await a write (or drain) to a client; one that takes none of it for `timeout_s` is gone
    (ConnectionResetError, as if it had reset the connection)."""
    try:
        async with asyncio.timeout(timeout_s):
            await aw
    except TimeoutError:
        raise ConnectionResetError(f"the client took none of its answer for {timeout_s:g} s") from None


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
        """Write stream bytes; a client that takes none of them for CLIENT_READ_S is gone
        (ConnectionResetError, as if it had reset the connection)."""
        if not self.committed:
            await self.commit()
        resp = self.response
        assert resp is not None
        if self._may_wait(len(data)):
            await client_bounded(resp.write(data), CLIENT_READ_S)
        else:
            await resp.write(data)

    async def end(self) -> None:
        if self.response is not None and self.committed:
            if self._may_wait(0):
                await client_bounded(self.response.write_eof(), CLIENT_READ_S)
            else:
                await self.response.write_eof()

    async def drain(self, timeout_s: float) -> None:
        """Wait until the client has taken what was written (ConnectionResetError after timeout_s)."""
        if self.response is not None and self.committed:
            await client_bounded(self.request.writer.drain(), timeout_s)  # the response's own writer

    def would_wait(self, size: int) -> bool:
        """Whether writing `size` more bytes may wait for the client: so much of its answer waits
        in the socket's buffer that it may have fallen behind."""
        return self._may_wait(size)

    async def hand_off(self, err: GatewayError) -> bool:
        return False  # nobody else reads this client's stream

    def _may_wait(self, size: int) -> bool:
        transport = self.request.transport
        return transport is not None and transport.get_write_buffer_size() + size > _MAY_WAIT

    async def send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        """A whole answer. One that fits the socket's buffer goes out as aiohttp writes a handler's
        response; a larger one is written here, bounded like a stream's bytes: a client that takes
        none of it for CLIENT_READ_S is gone (ConnectionResetError) and its connection closed.
        aiohttp's own write of a response waits on the client with no limit: 24 unread answers of
        16 MB held 856 MB until their clients closed (review helper's repro)."""
        headers = {**self._final_headers(), "Content-Type": content_type}
        if len(body) <= _MAY_WAIT:
            self.response = web.Response(status=status, body=body, headers=headers)
            return
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = len(body)
        await resp.prepare(self.request)
        self.response = resp
        try:
            await client_bounded(resp.write(body), CLIENT_READ_S)
            await client_bounded(resp.write_eof(), CLIENT_READ_S)
        except ConnectionError:
            if self.request.transport is not None:
                self.request.transport.close()  # the rest of the answer is dropped with it
            raise

    async def fail(self, err: GatewayError) -> None:
        """Answer with an OpenAI-shaped error: a status while we can, an error event once streaming."""
        if self.committed:
            # No [DONE] after it: a cut stream must never look like a success.
            await self.write(sse_event(err.to_dict()))
            await self.end()
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

    async def drain(self, timeout_s: float) -> None:
        await self._inner.drain(timeout_s)

    def would_wait(self, size: int) -> bool:
        return self._inner.would_wait(size)

    async def hand_off(self, err: GatewayError) -> bool:
        return await self._inner.hand_off(err)
