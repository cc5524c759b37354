"""A second review of the admin plane: a request log export is bounded in time (a viewer reading
slowly gives its slot back), every write of a cut export is bounded, the admin plane's request
bodies are a body-budget owner no tenant can be, and the in-memory log's cursors never repeat.
Real gateways on loopback, raw sockets for the clients that read slowly or not at all."""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time
from typing import Any

import aiohttp
import orjson
import pytest

import gateway.admin.export as export_mod
from gateway.admin.api import BODY_OWNER
from gateway.admin.log_store import Cursor, Filter, LogStore, MemoryLogStore, Page, scan
from gateway.config.policy import _NAME
from gateway.store.core import StoreError
from gateway.tenants.auth import hash_key
from gateway.web.keys import EXPORTS, REQUEST_LOG
from tests.conftest import simple_policy
from tests.rawhttp import exchange

ADMIN, VIEWER, TENANT = "sk-admin-review2", "sk-viewer-review2", "sk-tenant-review2"
A = {"Authorization": f"Bearer {ADMIN}"}
V = {"Authorization": f"Bearer {VIEWER}"}
T0 = 1_700_000_000_000_000
EXPORT_HEAD = f"GET /admin/requests/export HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {VIEWER}\r\n\r\n".encode()


@pytest.fixture
async def keyed(upstream, gateway):
    up = await upstream("fake")
    policy = simple_policy(up, tenants={"admin": {"key_sha256": [hash_key(TENANT)]}},
                           admin={"key_sha256": [hash_key(ADMIN)], "viewer_key_sha256": [hash_key(VIEWER)]},
                           server={"body_read_budget_bytes": 1000})
    return await gateway(policy)


async def _fill(gw: Any, n: int, pad: int = 200) -> None:
    entry = {"tenant": "admin", "pad": "x" * pad}
    await gw.app[REQUEST_LOG].store.append(
        [(T0 + i, "admin", orjson.dumps({"id": f"r{i}", "time": 1.0 + i, **entry})) for i in range(n)])


async def _slow_export(port: int, bps: int, give_up_s: float) -> tuple[bytes, float]:
    """An export read ~`bps` bytes a second through a small receive buffer: what came, and when the
    server ended it (or `give_up_s`)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, EXPORT_HEAD)
    got, t0 = bytearray(), time.monotonic()
    try:
        while time.monotonic() - t0 < give_up_s:
            try:
                data = await asyncio.wait_for(loop.sock_recv(sock, 1024), give_up_s)
            except ConnectionError:
                break
            if not data:
                break
            got += data
            await asyncio.sleep(min(1024 / bps, max(0.0, give_up_s - (time.monotonic() - t0))))
    finally:
        sock.close()
    return bytes(got), time.monotonic() - t0


async def _both_slots_free(gw: Any, within_s: float) -> None:
    exporting = gw.app[EXPORTS]
    async with asyncio.timeout(within_s):
        await exporting.acquire()
        await exporting.acquire()
    exporting.release()
    exporting.release()


async def _full_export(url: str) -> list[bytes]:
    async with aiohttp.ClientSession() as http, http.get(url + "/admin/requests/export", headers=V) as r:
        assert r.status == 200, await r.text()
        return (await r.read()).splitlines()


# ---- 1. a viewer reading slowly ---------------------------------------------------------------------


async def test_a_slow_reader_is_cut_and_its_slot_serves_the_next_exports(keyed, monkeypatch):
    """Two viewers reading ~10 KB/s held both export slots for as long as they liked (a third
    viewer got 429s). Now the client must keep up (here 1 MiB/s, after 0.5 s): both are cut
    within seconds, their downloads incomplete, and the next two exports run whole."""
    monkeypatch.setattr(export_mod, "EXPORT_GRACE_S", 0.5)
    monkeypatch.setattr(export_mod, "EXPORT_MIN_BPS", 1 << 20)
    n = 30_000  # ~7 MB: more than the sockets' buffers hold
    await _fill(keyed, n)
    slow = [asyncio.ensure_future(_slow_export(keyed.port, 10_000, 30.0)) for _ in range(2)]
    await asyncio.sleep(0.2)
    async with aiohttp.ClientSession() as http, http.get(keyed.url + "/admin/requests/export", headers=V) as r:
        assert r.status == 429  # both slots held meanwhile
    for got, seconds in await asyncio.gather(*slow):
        assert got.startswith(b"HTTP/1.1 200 "), got[:100]
        assert seconds < 10, seconds  # the server ended it, not the reader's patience
        assert not got.endswith(b"\r\n0\r\n\r\n") and len(got) < n * 200  # incomplete
    await _both_slots_free(keyed, 2.0)
    second, third = await asyncio.gather(_full_export(keyed.url), _full_export(keyed.url))
    assert len(second) == len(third) == n and orjson.loads(second[0])["id"] == f"r{n - 1}"


async def test_a_write_the_client_does_not_take_within_the_stall_limit_ends_the_export(keyed, monkeypatch):
    """A client that read fast has earned patience by the rate rule; one that then stops reading
    still frees the slot after EXPORT_STALL_S."""
    monkeypatch.setattr(export_mod, "EXPORT_GRACE_S", 100.0)
    monkeypatch.setattr(export_mod, "EXPORT_STALL_S", 1.0)
    await _fill(keyed, 30_000)
    t0 = time.monotonic()
    reader = asyncio.ensure_future(_slow_export(keyed.port, 1, 4.0))  # one read, then none for 4 s
    await asyncio.sleep(0.2)
    await _both_slots_free(keyed, 3.0)
    assert time.monotonic() - t0 < 3
    got, _ = await reader
    assert got.startswith(b"HTTP/1.1 200 ")


class _SlowStore:
    """The gateway's log store, each page `delay_s` late; failing with `error` from its second page
    on while `error` is set."""

    def __init__(self, inner: LogStore, delay_s: float = 0.0, error: str | None = None) -> None:
        self.inner, self.delay_s, self.error, self.size = inner, delay_s, error, inner.size

    async def append(self, batch: list[tuple[int, str, bytes]]) -> None:
        await self.inner.append(batch)

    async def page(self, f: Filter, limit: int, at: Cursor | None) -> Page:
        await asyncio.sleep(self.delay_s)
        if at is not None and self.error is not None:
            raise StoreError(self.error)
        return await self.inner.page(f, limit, at)

    async def close(self) -> None:
        await self.inner.close()


async def test_an_export_ends_at_its_time_limit_with_a_last_line_saying_so(keyed, monkeypatch):
    monkeypatch.setattr(export_mod, "EXPORT_MAX_S", 1.0)
    await _fill(keyed, 10_000)
    rlog = keyed.app[REQUEST_LOG]
    rlog.store = _SlowStore(rlog.store, delay_s=0.3)
    lines: list[bytes] = []
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http, http.get(keyed.url + "/admin/requests/export", headers=V) as r:
        assert r.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):  # the download reads as incomplete
            async for line in r.content:
                lines.append(line)
    assert time.monotonic() - t0 < 3
    last = orjson.loads(lines[-1])
    assert last["error"]["type"] == "export_time_limit" and "1 s, its limit" in last["error"]["message"]
    assert 1000 <= len(lines) - 1 < 10_000
    await _both_slots_free(keyed, 1.0)


# ---- 2. the store fails mid-export --------------------------------------------------------------------


async def test_the_store_failing_mid_export_is_a_last_line_then_the_end(keyed):
    await _fill(keyed, 2500, pad=10)
    rlog = keyed.app[REQUEST_LOG]
    rlog.store = _SlowStore(rlog.store, error="the log's store is gone")
    async with aiohttp.ClientSession() as http, http.get(keyed.url + "/admin/requests/export", headers=V) as r:
        assert r.status == 200
        lines: list[bytes] = []
        with pytest.raises(aiohttp.ClientPayloadError):
            async for line in r.content:
                lines.append(line)
    last = orjson.loads(lines[-1])
    assert last["error"]["type"] == "store_unavailable" and "the log's store is gone" in last["error"]["message"]
    assert len(lines) == 1001


async def test_the_last_line_after_a_store_error_is_bounded_when_the_client_reads_nothing(keyed, monkeypatch, caplog):
    """The line saying the store failed was written with no time limit: a client that read nothing
    (its buffers full) held the slot for good. Here the line itself is larger than every buffer
    (a store error of 4 MB): both exports end within _LAST_LINE_S, aborted, and free their slots."""
    monkeypatch.setattr(export_mod, "_LAST_LINE_S", 0.5)
    await _fill(keyed, 1500, pad=10)  # the first page (1,000 entries, ~60 KB) goes without a wait
    rlog = keyed.app[REQUEST_LOG]
    store = rlog.store
    rlog.store = _SlowStore(store, error="gone " + "x" * (4 << 20))
    socks = []
    caplog.set_level(logging.WARNING, "gateway.admin")
    t0 = time.monotonic()
    for _ in range(2):
        s = socket.create_connection(("127.0.0.1", keyed.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(EXPORT_HEAD)
        socks.append(s)  # never read
    try:
        await asyncio.sleep(0.2)
        await _both_slots_free(keyed, 3.0)
        assert time.monotonic() - t0 < 3
    finally:
        for s in socks:
            s.close()
    cuts = [r.getMessage() for r in caplog.records if "export cut" in r.getMessage()]
    assert len(cuts) == 2 and all("the store did not answer mid-export" in c for c in cuts)
    rlog.store = store
    second, third = await asyncio.gather(_full_export(keyed.url), _full_export(keyed.url))
    assert len(second) == len(third) == 1500


# ---- 3. the admin plane's body budget -------------------------------------------------------------------


def test_the_admin_planes_body_owner_is_no_tenants_name():
    assert re.match(_NAME, "admin") and not re.match(_NAME, BODY_OWNER)


async def test_a_tenant_named_admin_and_the_admin_plane_hold_separate_shares_of_the_body_budget(keyed):
    """server.body_read_budget_bytes 1,000: the tenant `admin` holds 900 bytes of a body still
    arriving. The admin plane's body of 300 bytes, arriving in two pieces, passes the budget: as
    the owner "admin" it was counted as that tenant's (901 + 299 over a share of all 1,000: 503);
    as an owner of its own, its share is 500."""
    body = orjson.dumps({"tenant": "admin", "name": "budget"}).ljust(300)

    def run() -> Any:
        held = socket.create_connection(("127.0.0.1", keyed.port))
        try:
            held.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {TENANT}\r\nContent-Length: 2000\r\n\r\n".encode() + b"x" * 900)
            time.sleep(0.3)  # the gateway holds the 900 bytes for the tenant
            head = ("POST /admin/keys HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"Authorization: Bearer {ADMIN}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
            return exchange(keyed.port, head, pieces=[body[:1], body[1:]], pause_s=0.3)
        finally:
            held.close()

    answer = await asyncio.to_thread(run)
    assert answer.status == 201, answer.raw[:400]
    assert orjson.loads(answer.body)["tenant"] == "admin"


# ---- 4. the in-memory log's cursors ---------------------------------------------------------------------


async def _walk(store: LogStore, f: Filter, limit: int, at: Cursor | None = None) -> tuple[list[str], list[str]]:
    ids: list[str] = []
    cursors: list[str] = []
    for _ in range(10_000):
        page = await store.page(f, limit, at)
        ids += [e["id"] for e in page.entries]
        if page.next is None:
            return ids, cursors
        assert page.next not in cursors, f"cursor {page.next} repeated"
        cursors.append(page.next)
        at = Cursor.parse(page.next)
    raise AssertionError("the cursor never ended")


async def test_more_entries_in_one_microsecond_than_a_page_scans_are_read_once_each(log_store):
    """20,500 entries that ended in one microsecond: in memory, the 21st page of 1,000 skipped its
    first 20,000 one by one, counted them against the page's scan of 20,000, read none and gave
    back its own cursor: the walk (and an export) went on for ever. Redis skips in the server."""
    store = log_store(100_000)
    n = 20_500
    await store.append([(T0, "acme", orjson.dumps({"id": f"r{i}", "tenant": "acme", "model": "m"})) for i in range(n)])
    ids, cursors = await _walk(store, Filter(), 1000)
    assert sorted(ids) == sorted(f"r{i}" for i in range(n)) and len(cursors) == 20
    ids, _ = await _walk(store, Filter(model="none"), 1000)  # a filter that keeps nothing: pages of 20,000 read past
    assert ids == []
    assert len([e async for e in scan(store, Filter(tenant="acme"))]) == n


async def test_in_memory_equal_scores_come_in_the_order_they_came_and_a_late_one_goes_after_the_cursor():
    """Equal scores were in an order of their bytes across parts but of their arrival within one,
    which a merge of parts changed (a page's edge then skipped or repeated one). Now the order
    they came, everywhere: an entry that comes later at the edge's score is after the cursor."""
    store = MemoryLogStore(100_000)
    for batch in range(40):  # small batches of one tenant: merged into parts as they come
        await store.append([(T0 + (i % 3), "acme", orjson.dumps({"id": f"b{batch}-{i}", "tenant": "acme"})) for i in range(7)])
    first = await store.page(Filter(), 50, None)
    assert [e["id"] for e in first.entries[:3]] == ["b0-2", "b0-5", "b1-2"]  # the newest score, in the order they came
    await store.append([(T0 + 2, "acme", orjson.dumps({"id": "late", "tenant": "acme"}))])  # at the edge's score
    rest, cursors = await _walk(store, Filter(), 7, Cursor.parse(first.next or ""))
    shown = [e["id"] for e in first.entries] + rest
    assert len(shown) == len(set(shown)) == 281 and "late" in rest
    assert cursors == sorted(cursors, key=lambda c: (-int(c.split(":")[0]), int(c.split(":")[1])))


def test_the_export_limits_are_the_ones_the_docs_give():
    assert (export_mod.EXPORT_MAX_S, export_mod.EXPORT_MIN_BPS, export_mod.EXPORT_GRACE_S, export_mod.EXPORT_STALL_S) == (
        600.0, 64 * 1024, 10.0, 20.0)

