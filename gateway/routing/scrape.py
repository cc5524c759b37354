"""The load-signal scraper: GETs each backend's `metrics_url` off the request path.

Every `routing.load_signals.interval_ms` (read from the runtime in force each round, so a reload
changes it, and the backends it adds or drops are followed) each backend that names a
`metrics_url` is scraped: one task per backend per round, and never two at once for the same
backend (one still running from an earlier round, e.g. a server that answers slowly, skips this
round). Each scrape has `timeout_ms` in all and reads at most `MAX_BODY_BYTES`; its result goes
into the backend's `Load` (routing/load.py): a sample on success, or the reason it failed, the
old sample staying until it is stale. A failing scrape degrades routing (it falls back to its own
view), never a request, and never ends the scraper.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import aiohttp
from yarl import URL

from ..config.reload import Live
from .backends import Backend
from .load import Load, LoadSample, parse_load
from .probes import read_capped

__all__ = ["run_scrapes", "scrape_once", "MAX_BODY_BYTES"]

log = logging.getLogger("gateway.scrape")

MAX_BODY_BYTES = 2 << 20  # a vLLM exposition is ~100 KiB; more is not a metrics page we want
# Bodies above this are parsed in a worker thread: a 2 MiB exposition of only load gauges takes
# ~25 ms to parse, too long to hold the event loop (the thread yields it every switch interval).
_PARSE_INLINE_BYTES = 256 << 10
# The classic text format (prometheus_client answers it; OpenMetrics would parse the same).
# identity: the size cap then bounds what is decompressed too.
_HEADERS = {"Accept": "text/plain;version=0.0.4;q=0.9,*/*;q=0.1", "Accept-Encoding": "identity"}


class _Failed(Exception):
    """A scrape failed for `why` (a short reason for /admin and the logs)."""


async def scrape_once(http: aiohttp.ClientSession, backend: Backend, timeout_s: float) -> None:
    """Scrape `backend.metrics_url` once, within `timeout_s` in all, into `backend.state.load`.

    Never raises except CancelledError: a failure (refused connection, timeout, a status other
    than 200, a body over MAX_BODY_BYTES, no load gauges in it) is recorded with
    `Load.failed(reason)` and logged at debug level."""
    load = backend.state.load
    url = backend.metrics_url
    if url is None:
        return
    try:
        sample = await _fetch(http, url, _headers(backend, url), timeout_s)
    except _Failed as exc:
        _record_failure(backend, load, str(exc))
    except TimeoutError:
        _record_failure(backend, load, f"timeout after {timeout_s:g}s")
    except aiohttp.ClientConnectorError as exc:
        _record_failure(backend, load, f"connect: {_os_reason(exc)}")
    except (aiohttp.ClientError, OSError) as exc:
        _record_failure(backend, load, type(exc).__name__)
    except Exception as exc:  # a bug here must not end the scraper, nor hide
        why = f"internal error: {type(exc).__name__}"
        if load.error != why:  # once per run of the same failure, not every interval
            log.warning("load scrape of backend %s failed unexpectedly", backend.name, exc_info=True)
        _record_failure(backend, load, why)
    else:
        if load.error is not None:
            log.debug("load scrape of backend %s works again", backend.name)
        load.update(sample, time.monotonic())


async def _fetch(http: aiohttp.ClientSession, url: str, headers: dict[str, str], timeout_s: float) -> LoadSample:
    """GET `url` and parse it; raises _Failed, TimeoutError or aiohttp/OS errors."""
    async with asyncio.timeout(timeout_s):
        async with http.get(url, headers=headers, max_redirects=3) as resp:  # e.g. vLLM's /metrics -> /metrics/
            if resp.status != 200:
                raise _Failed(f"HTTP {resp.status}")
            if resp.content_length is not None and resp.content_length > MAX_BODY_BYTES:
                resp.close()  # not read: the connection is dropped, not reused
                raise _Failed("body over 2 MiB")
            raw = await read_capped(resp.content, MAX_BODY_BYTES)
            if raw is None:
                resp.close()
                raise _Failed("body over 2 MiB")
    text = raw.decode("utf-8", errors="replace")
    if len(raw) > _PARSE_INLINE_BYTES:
        sample = await asyncio.to_thread(parse_load, text)
    else:
        sample = parse_load(text)
    if sample is None:
        raise _Failed("no load gauges in the exposition")
    return sample


def _headers(backend: Backend, url: str) -> dict[str, str]:
    """The scrape's headers: the backend's key only where the metrics live at the backend's own
    origin (a model server behind an authenticating proxy); never sent to another host."""
    auth = backend.headers.get("Authorization")
    if auth is None:
        return _HEADERS
    m, b = URL(url), URL(backend.base_url)
    if (m.scheme, m.host, m.port) != (b.scheme, b.host, b.port):
        return _HEADERS
    return {**_HEADERS, "Authorization": auth}


def _os_reason(exc: aiohttp.ClientConnectorError) -> str:
    """`Connection refused`, `Name or service not known`, ...: the OS's words where it has some."""
    err = getattr(exc, "os_error", None)
    if isinstance(err, OSError):
        if err.errno:  # asyncio's own strerror reads "Connect call failed ('10.0.0.5', 8000)"
            return os.strerror(err.errno)
        if err.strerror:
            return err.strerror
    return type(exc).__name__


def _record_failure(backend: Backend, load: Load, why: str) -> None:
    log.debug("load scrape of backend %s (%s) failed: %s", backend.name, backend.metrics_url, why)
    load.failed(why)


async def _scrape_guarded(http: aiohttp.ClientSession, backend: Backend, timeout_s: float, inflight: set[Load]) -> None:
    """One scrape task of the loop: frees the backend's in-flight mark however it ends."""
    load = backend.state.load
    try:
        await scrape_once(http, backend, timeout_s)
    except Exception:  # scrape_once records its failures; this is a last guard for the task group
        log.exception("load scrape of backend %s failed", backend.name)
    finally:
        inflight.discard(load)


async def run_scrapes(live: Live) -> None:
    """Scrape every backend with a `metrics_url` every `routing.load_signals.interval_ms`, until
    cancelled (cancelling this cancels the scrapes in flight). The first round runs at once."""
    inflight: set[Load] = set()  # one scrape at a time per backend (its Load outlives reloads)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        async with asyncio.TaskGroup() as tg:
            while True:
                rt = live.runtime  # follows reloads: interval, timeout and the backends themselves
                ls = rt.policy.routing.load_signals
                timeout_s = ls.timeout_ms / 1000
                for backend in rt.backends.values():
                    load = backend.state.load
                    if backend.metrics_url is None or load in inflight:
                        continue
                    inflight.add(load)
                    tg.create_task(_scrape_guarded(http, backend, timeout_s, inflight))
                await asyncio.sleep(ls.interval_ms / 1000)
