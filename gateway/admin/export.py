"""The request log's export (GET /admin/requests/export): the log, filtered, as JSON lines, newest
first, streamed a page at a time, bounded in time.

An export holds one of the process's few export slots (api.EXPORTS_AT_ONCE) while it runs, so
every wait in it is bounded, and a viewer reading slowly gives the slot back soon:

- in all, an export takes at most `EXPORT_MAX_S` (store reads and writes alike);
- the client keeps up: the time the export has waited for it (writes waiting for its socket to
  take the bytes) stays within `EXPORT_GRACE_S` plus one second per `EXPORT_MIN_BPS` bytes sent,
  and no one write waits more than `EXPORT_STALL_S` (a client reading ~10 KB/s is cut within
  seconds, not after the whole log);
- each read of the store is bounded by the store's own timeout and by what is left of `EXPORT_MAX_S`.

Cut short, the response ends without the body's end (the last chunk of its chunked encoding), so
a download reads as incomplete, never as the whole log. Where the client still takes bytes (the
store failed, or the time ran out on a store read), a last line says why, written within
`_LAST_LINE_S`; a client that is behind gets its connection reset (what waits for it is dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from typing import Any

import orjson
from aiohttp import web

from ..errors import Unavailable
from ..store.core import StoreError
from ..web.keys import REQUEST_LOG
from .log_store import Cursor, Filter, LogStore, Page

__all__ = ["EXPORT_GRACE_S", "EXPORT_MAX_S", "EXPORT_MIN_BPS", "EXPORT_STALL_S", "export"]

log = logging.getLogger("gateway.admin")

EXPORT_MAX_S = 600.0  # an export's whole time: 10 minutes
EXPORT_MIN_BPS = 64 * 1024  # the client's rate, on average, over the time the export waits for it
EXPORT_GRACE_S = 10.0  # waiting for the client the rate allows on top (a slow start, a hiccup)
EXPORT_STALL_S = 20.0  # one write the client does not take within this ends the export
_PIECE_LINES, _PIECE_BYTES = 1000, 256 * 1024  # a write: up to this many lines or bytes (past the line that passes it)
_PAGE = 1000  # entries a store read asks for
_LAST_LINE_S = 2.0  # the line saying why an export was cut, when the client takes it


class _Cut(Exception):
    """The export ends early; `why` (of error `kind`) goes in its last line (None: the client is
    behind or gone, no line)."""

    def __init__(self, why: str | None, kind: str = "store_unavailable") -> None:
        super().__init__(why or "the client did not keep up, or left")
        self.why, self.kind = why, kind


def _out_of_time() -> _Cut:
    return _Cut(f"the export ran for {EXPORT_MAX_S:g} s, its limit; export less at a time (a tenant, a model, a status)",
                "export_time_limit")


class _Client:
    """The response being written, and what the export has waited for its client so far."""

    def __init__(self, resp: web.StreamResponse, end: float) -> None:
        self.resp, self.end = resp, end
        self.sent = 0  # bytes written
        self.waited = 0.0  # seconds writes waited for the client

    async def write(self, data: bytes, eof: bool = False) -> None:
        """Write `data` (and the body's end); _Cut(None) when the client does not take it in time."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.sent += len(data)
        allowed = EXPORT_GRACE_S + self.sent / EXPORT_MIN_BPS - self.waited
        # A write that need not wait goes on even with nothing left (timeout 0 fires only at a wait).
        limit = max(0.0, min(EXPORT_STALL_S, allowed, self.end - start))
        try:
            async with asyncio.timeout(limit):
                await (self.resp.write_eof(data) if eof else self.resp.write(data))
        except TimeoutError:
            raise _Cut(None) from None
        except ConnectionError:  # the client left
            raise _Cut(None) from None
        finally:
            self.waited += loop.time() - start


async def _read(store: LogStore, f: Filter, at: Cursor | None, end: float) -> Page:
    """One page of the log within what is left of the export's time; _Cut past it."""
    loop = asyncio.get_running_loop()
    if loop.time() >= end:
        raise _out_of_time()
    try:
        async with asyncio.timeout_at(end):
            return await store.page(f, _PAGE, at)
    except TimeoutError:
        raise _out_of_time() from None
    except StoreError as exc:
        raise _Cut(f"the store did not answer mid-export: {exc}") from None


async def export(request: web.Request, f: Filter) -> web.StreamResponse:
    """Stream the entries `f` keeps. A store that fails before the first byte is a 503 (StoreError,
    or Unavailable past the time); after it, the export is cut (see the module's doc)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + EXPORT_MAX_S
    rlog = request.app[REQUEST_LOG]
    await rlog.flush()  # bounded: each batch within request_log.write_timeout_ms
    store = rlog.store
    try:
        async with asyncio.timeout_at(end):
            page = await store.page(f, _PAGE, None)  # a store that does not answer is a 503 while one can be sent
    except TimeoutError:
        raise Unavailable(f"the request log did not answer within {EXPORT_MAX_S:g} s", retry_after_s=5) from None
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-store",
                                       "Content-Disposition": 'attachment; filename="requests.jsonl"'})
    await resp.prepare(request)
    client = _Client(resp, end)
    lines: list[bytes] = []
    size = 0
    try:
        while True:
            for e in page.entries:
                line = orjson.dumps(e)
                lines.append(line)
                size += len(line) + 1
                if len(lines) >= _PIECE_LINES or size >= _PIECE_BYTES:
                    await client.write(b"\n".join(lines) + b"\n")
                    lines, size = [], 0
            if page.next is None:
                break
            # A page that suspends nowhere (a short one in memory) still lets other requests go on
            # between pages: a filter that matches nothing scans the whole log.
            await asyncio.sleep(0)
            page = await _read(store, f, Cursor.parse(page.next), end)
        await client.write(b"\n".join(lines) + b"\n" if lines else b"", eof=True)
    except _Cut as cut:
        await _end_cut(request, resp, lines, cut, client)
    return resp


async def _end_cut(request: web.Request, resp: web.StreamResponse, lines: list[bytes], cut: _Cut, client: _Client) -> None:
    """End a cut export: its last line where the client takes it all within _LAST_LINE_S, then the
    connection closes without the body's end. A client that is behind gets a reset: what waits for
    it is dropped, in this process and in the kernel (close() would keep the socket until a client
    that reads nothing took it; a plain close, megabytes in the kernel's buffers for minutes)."""
    log.warning("request log export cut after %d bytes (%.1f s waiting for the client): %s", client.sent, client.waited, cut)
    transport: Any = request.transport
    if transport is None:
        return
    taken = False
    if cut.why is not None:
        lines.append(orjson.dumps({"error": {"message": cut.why, "type": cut.kind}}))
        try:
            async with asyncio.timeout(_LAST_LINE_S):
                await resp.write(b"\n".join(lines) + b"\n")
                transport.set_write_buffer_limits(high=0)  # the drain below waits until the client took it all
                await request.writer.drain()
            taken = True
        except (TimeoutError, ConnectionError):
            pass
    if taken:
        transport.close()
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
    transport.abort()
