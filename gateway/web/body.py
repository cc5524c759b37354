"""Reading a request body: bounded as sent and as inflated, within a deadline.

Every handler that needs a body reads it through `read_body`, after it has authenticated the
caller (the key is in the headers): an unauthenticated caller costs no body bytes. The limit
(`server.max_body_bytes`) holds on the bytes sent and, for a `Content-Encoding: gzip` or `deflate`
body, on the inflated bytes too: inflation is incremental and stops one byte past the limit, so a
small compressed body that inflates to gigabytes costs at most the limit in memory and a few
milliseconds of CPU. Other encodings (`br`, `zstd`, stacked ones) are a 415. The app turns off
aiohttp's own decompression (app.py) so that the bytes arriving here are the ones on the wire.
"""

from __future__ import annotations

import asyncio
import zlib

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from ..errors import BadRequest, GatewayError, PayloadTooLarge, Unavailable

__all__ = ["RequestTimeout", "UnsupportedEncoding", "read_body"]


class UnsupportedEncoding(GatewayError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_content_encoding"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


_GZIP = ("gzip", "x-gzip")


def _encoding(header: str | None) -> str | None:
    """The body's content coding: None for none (or `identity`); UnsupportedEncoding otherwise."""
    name = (header or "").strip().lower()
    if name in ("", "identity"):
        return None
    if name in _GZIP or name == "deflate":
        return name
    raise UnsupportedEncoding(
        f"Content-Encoding {name[:40]!r} is not supported for request bodies: send gzip, deflate or none",
        param="Content-Encoding",
    )


# Concatenated gzip members a body may have (clients send one): each starts a decompressor in a
# Python loop, and 200,000 empty ones in 4 MiB cost the event loop ~15x an ordinary 4 MiB body.
MAX_GZIP_MEMBERS = 64


class Inflater:
    """Inflates a gzip or deflate body fed in pieces, never past `limit` bytes of output.

    Each `feed` asks zlib for at most one byte more than the room left, so the output is bounded
    whatever the ratio; one byte over is a PayloadTooLarge. Concatenated gzip members are one body
    (RFC 1952); `deflate` is the zlib format, or raw deflate as some clients send it."""

    def __init__(self, encoding: str, limit: int) -> None:
        self.encoding = encoding
        self.limit = limit
        self.size = 0  # inflated bytes so far
        self._d: zlib._Decompress | None = None
        self._first = b""  # a deflate body's first byte, until its second comes
        self._members = 0  # gzip members started

    def _start(self, data: bytes) -> zlib._Decompress:
        if self.encoding in _GZIP:
            return zlib.decompressobj(16 + zlib.MAX_WBITS)
        # zlib's header: CM = 8 in the low nibble and the 16-bit header a multiple of 31.
        zlib_header = data[0] & 0x0F == 8 and ((data[0] << 8) | data[1]) % 31 == 0
        return zlib.decompressobj(zlib.MAX_WBITS if zlib_header else -zlib.MAX_WBITS)

    def feed(self, data: bytes) -> list[bytes]:
        """The inflated bytes of `data`; PayloadTooLarge past the limit, BadRequest if malformed."""
        out: list[bytes] = []
        if self._d is None and self.encoding == "deflate":  # the format is told by its first two bytes
            data, self._first = self._first + data, b""
            if len(data) < 2:
                self._first = data
                return out
        while data:
            if self._d is None or self._d.eof:
                if self._d is not None and self.encoding not in _GZIP:
                    raise BadRequest("the request body has data after the end of its deflate stream", param="Content-Encoding",
                                     code="invalid_content_encoding")
                self._members += 1
                if self._members > MAX_GZIP_MEMBERS:
                    raise BadRequest(f"the request body has more than {MAX_GZIP_MEMBERS} gzip members", param="Content-Encoding",
                                     code="invalid_content_encoding")
                self._d = self._start(data)
            try:
                piece = self._d.decompress(data, self.limit - self.size + 1)
            except zlib.error as exc:
                raise BadRequest(f"the request body is not valid {self.encoding}: {exc}", param="Content-Encoding",
                                 code="invalid_content_encoding") from None
            self.size += len(piece)
            if self.size > self.limit:
                raise PayloadTooLarge(f"the request body inflates ({self.encoding}) to more than the limit of {self.limit} bytes")
            out.append(piece)
            data = self._d.unconsumed_tail or (self._d.unused_data if self._d.eof else b"")
        return out

    def end(self) -> None:
        """BadRequest when the compressed stream stopped before its end."""
        if self._first or (self._d is not None and not self._d.eof):
            raise BadRequest(f"the request body's {self.encoding} stream is cut short", param="Content-Encoding",
                             code="invalid_content_encoding")


class BodyBudget:
    """Bytes of request bodies still arriving that this process holds, per owner (a tenant): over
    `limit` in all, an owner holding more than its share (limit / owners reading) is refused, so
    one caller trickling bodies over many connections cannot hold the process's memory, nor lock
    the others out. A body that came whole with its head is not counted (nothing waits on it)."""

    __slots__ = ("limit", "total", "held")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.total = 0
        self.held: dict[str, int] = {}

    def take(self, owner: str, n: int) -> None:
        """Count `n` more bytes for `owner`; Unavailable (503, Retry-After) when over budget and share."""
        mine = self.held.get(owner, 0)
        if self.total + n > self.limit:
            share = self.limit // (len(self.held) + (mine == 0))
            if mine + n > share:
                raise Unavailable(f"the gateway holds {self.total} bytes of request bodies still arriving, its "
                                  f"server.body_read_budget_bytes, and this caller more than its share: retry",
                                  code="overloaded", retry_after_s=1)
        self.held[owner] = mine + n
        self.total += n

    def give(self, owner: str, n: int) -> None:
        """The body is read (or failed): its bytes leave the budget."""
        if not n:
            return
        left = self.held.get(owner, 0) - n
        if left > 0:
            self.held[owner] = left
        else:
            self.held.pop(owner, None)
        self.total -= n


async def read_body(request: web.BaseRequest, limit: int, timeout_s: float, budget: BodyBudget | None = None,
                    owner: str = "") -> bytes:
    """The request's body (inflated when it is gzip or deflate), at most `limit` bytes.

    PayloadTooLarge (413) before reading anything when Content-Length is over the limit, else as
    soon as the bytes read or inflated pass it; UnsupportedEncoding (415) for other encodings;
    BadRequest (400) for malformed compression or framing; RequestTimeout (408) when the body has
    not all arrived within `timeout_s`; Unavailable (503) when `budget` refuses `owner` more while
    it arrives. Read only after authentication."""
    encoding = _encoding(request.headers.get("Content-Encoding"))
    length = request.content_length
    if length is not None and length > limit:
        raise PayloadTooLarge(f"the request body is {length} bytes; the limit is {limit}")
    if encoding is None and request.content.is_eof():
        # The whole body came with the head (the common case): no timer, no iteration.
        try:
            body = request.content.read_nowait()
        except (web.RequestPayloadError, HttpProcessingError) as exc:
            raise BadRequest(f"malformed request body: {str(exc)[:200]}", code="malformed_request") from None
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
        return body
    inflater = Inflater(encoding, limit) if encoding is not None else None
    chunks: list[bytes] = []
    size = held = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"the request body exceeds the limit of {limit} bytes")
                pieces = [chunk] if inflater is None else inflater.feed(chunk)
                if budget is not None:
                    n = sum(map(len, pieces))
                    budget.take(owner, n)
                    held += n
                chunks.extend(pieces)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)") from None
    except (web.RequestPayloadError, HttpProcessingError) as exc:  # framing the HTTP parser refused mid-body
        raise BadRequest(f"malformed request body: {str(exc)[:200]}", code="malformed_request") from None
    finally:
        if budget is not None:
            budget.give(owner, held)
    if inflater is not None:
        inflater.end()
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
