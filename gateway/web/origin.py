"""Whether a request comes from this machine's programs or from a web page that a browser on it
opened: loopback trust is meant for the first.

A gateway on a loopback address with no keys (loopback open mode, `make run`) lets every caller
in, admin plane included, and /metrics is open on loopback. A browser on the same machine can
reach it too, on behalf of any site it visits: a cross-site form or `fetch` (a "simple" request
needs no CORS approval to be sent), or a page whose host name the attacker re-points at 127.0.0.1
(DNS rebinding), which then reads the answers as its own. Both carry marks a local program does
not send: an `Origin` of another site, or a `Host` that names no loopback address. Such a request
is refused where loopback trust would let it in (`foreign`); a caller with a key is unaffected.
"""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import urlsplit

from aiohttp import hdrs

from ..tenants.auth import is_loopback

__all__ = ["foreign", "host_name"]


def host_name(host: str) -> str:
    """The name in a `Host` header, without its port (`[::1]:8080` -> `::1`)."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") > 1:  # an IPv6 address without brackets (not valid in a Host header; read whole)
        return host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isascii() and port.isdigit() else host


def foreign(headers: Mapping[str, str]) -> str | None:
    """Why a request's headers show it came from a web page of another site, or None. A request
    with neither header (a program: curl, an SDK, HTTP/1.0) is this machine's."""
    host = headers.get(hdrs.HOST)
    if host is not None and not _local(host_name(host.strip())):
        return f"its Host header ({host[:100]!r}) names no loopback address"
    origin = headers.get(hdrs.ORIGIN)
    if origin is not None:
        try:
            name = urlsplit(origin.strip()).hostname
        except ValueError:
            name = None
        if name is None or not _local(name):
            return f"it comes from a web page of another site (Origin {origin[:100]!r})"
    return None


_USUAL = frozenset({"127.0.0.1", "localhost", "::1"})  # on every request in open mode: no address parsing


def _local(name: str) -> bool:
    if name in _USUAL:
        return True
    name = name.rstrip(".")  # a fully qualified `localhost.` is still this machine
    return bool(name) and is_loopback(name)  # `localhost` or a loopback address (never another name)
