"""The request log: its stores (memory, and a redis-server of the test's own) page by page, filtered
and bounded; its writer bounded under a slow store; and end to end through a gateway with the
official openai SDK: what is kept, what is not (prompts), the cursor, the export, the overview."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aredis

from gateway.admin.entry import decode, encode, row_of, take
from gateway.admin.log_store import Cursor, Filter, LogStore, MemoryLogStore, RedisLogStore, scan
from gateway.admin.request_log import RequestLog
from gateway.config.policy import RequestLogPolicy
from gateway.pipeline.call import CacheResult, Call, Finish, Outcome, Timing
from gateway.tenants.auth import Tenant
from gateway.wire.endpoints import ENDPOINTS
from tests.procs import redis_server

TENANTS = ("acme", "beta", "gamma")


def _entry(i: int) -> tuple[int, str, bytes]:
    tenant = TENANTS[i % 3]
    e = {"id": f"r{i}", "time": 1_700_000_000 + i / 1000, "tenant": tenant, "model": "m" if i % 2 else "n",
         "status": 200 if i % 5 else 429}
    return int(e["time"] * 1e6), tenant, orjson.dumps(e)  # type: ignore[operator]


def _row(i: int) -> tuple[Any, ...]:
    """A finished request as the request path queues it (gateway/admin/entry.py's `take`)."""
    out = Outcome(backend="up", attempts=["up"], usage={"prompt_tokens": 1, "completion_tokens": 2}, finish=Finish.OK)
    timing = Timing()
    tenant = Tenant(TENANTS[i % 3], "default", None)
    return take(_finished(f"r{i}", tenant, out, timing), None, timing.t0 + 0.001, 0.0)  # type: ignore[arg-type]


def _finished(rid: str, tenant: Tenant, out: Outcome, timing: Timing) -> Call:
    call = Call(rid, ENDPOINTS["chat"], b"{}", None, time.monotonic() + 30, timing=timing, model="m", tenant=tenant, out=out)
    call.cache.result = CacheResult.BYPASS
    return call


def test_a_finished_request_waits_for_the_writer_without_the_long_strings_its_caller_chose():
    """A model name of a megabyte, and the error quoting it: the queue holds 200 and 300
    characters of them, and nothing of the Call (a caller could otherwise make every refused
    request keep its megabytes until the writer's next flush)."""
    out = Outcome(status=404, error="model_not_found: " + "m" * 1_000_000, finish=Finish.ERROR)
    call = _finished("r1", Tenant("acme", "default", None), out, Timing())
    call.model = "m" * 1_000_000
    taken = take(call, None, time.perf_counter(), 0.0)  # type: ignore[arg-type]
    assert all(not isinstance(part, (str, bytes)) or len(part) <= 300 for part in taken)
    assert not any(part is call or part is out or part is call.body for part in taken)
    row = decode(encode(row_of(taken))[2])
    assert len(row["model"]) == 200 and len(row["error"]) == 300 and row["status"] == 404


async def _all(store: LogStore, f: Filter, limit: int, at: Cursor | None = None) -> tuple[list[str], int]:
    """Every entry's id through the cursor (from `at`), and how many pages it took."""
    ids: list[str] = []
    pages = 0
    while True:
        page = await store.page(f, limit, at)
        pages += 1
        assert len(page.entries) <= limit
        ids += [e["id"] for e in page.entries]
        if page.next is None:
            return ids, pages
        at = Cursor.parse(page.next)


async def test_pages_newest_first_through_the_cursor_with_filters(log_store):
    store = log_store(10_000)
    await store.append([_entry(i) for i in range(2500)])
    ids, pages = await _all(store, Filter(), 300)
    assert ids == [f"r{i}" for i in reversed(range(2500))] and pages in (9, 10)
    ids, _ = await _all(store, Filter(tenant="beta"), 100)
    assert ids == [f"r{i}" for i in reversed(range(2500)) if i % 3 == 1]
    ids, _ = await _all(store, Filter(tenant="acme", model="m", status=429), 7)
    assert ids == [f"r{i}" for i in reversed(range(2500)) if i % 3 == 0 and i % 2 and i % 5 == 0]
    assert (await store.page(Filter(tenant="nobody"), 10, None)).entries == []
    assert [e["id"] async for e in scan(store, Filter(model="n"), chunk=333)] == [f"r{i}" for i in reversed(range(2500)) if i % 2 == 0]


async def test_entries_that_ended_in_the_same_microsecond_are_neither_skipped_nor_repeated_at_a_pages_edge(log_store):
    """Replicas and workers under load end requests in the same microsecond: a page that ended
    inside such a group went on strictly below its score, and the rest of the group was never
    shown (nor exported). Groups of up to 7 equal scores, pages of 1 to 9, filters too; the
    cursor goes on across an append as well."""
    store = log_store(10_000)
    rows = []
    for i in range(600):
        tenant = TENANTS[i % 3]
        e = {"id": f"r{i}", "time": 1_700_000_000 + i // 7 / 1000, "tenant": tenant, "model": "m" if i % 2 else "n", "status": 200}
        rows.append((1_700_000_000_000_000 + (i // 7) * 1000, tenant, orjson.dumps(e)))
    await store.append(rows[:300])
    await store.append(rows[300:])
    everyone = sorted(f"r{i}" for i in range(600))
    for limit in (1, 2, 3, 7, 9):
        ids, _ = await _all(store, Filter(), limit)
        assert sorted(ids) == everyone and len(ids) == 600
    ids, _ = await _all(store, Filter(tenant="beta", model="m"), 2)
    assert sorted(ids) == sorted(f"r{i}" for i in range(600) if i % 3 == 1 and i % 2)
    assert sorted([e["id"] async for e in scan(store, Filter(), chunk=4)]) == everyone
    page = await store.page(Filter(), 3, None)
    await store.append([(rows[-1][0] + 1000, "acme", orjson.dumps({"id": "new", "tenant": "acme"}))])
    rest, _ = await _all(store, Filter(), 5, Cursor.parse(page.next or ""))
    assert sorted([e["id"] for e in page.entries] + rest) == everyone


async def test_a_memory_page_pauses_for_other_requests_and_reads_on_through_evictions_meanwhile():
    """A filtered page pauses every 1,000 entries it reads (a viewer's exports held the event loop
    a 20,000-entry page at a time); appends that evict and compact meanwhile do not disturb it."""
    store = MemoryLogStore(100_000, max_bytes=400_000)
    await store.append([_entry(i) for i in range(3000)])
    page = asyncio.ensure_future(store.page(Filter(model="m", status=429), 10_000, None))
    pauses = 0
    n = 3000
    while not page.done():
        pauses += 1
        await store.append([_entry(i) for i in range(n, n + 1500)])  # past max_bytes: the oldest shed, parts compacted
        n += 1500
        await asyncio.sleep(0)
    ids = [e["id"] for e in page.result().entries]
    assert pauses >= 2 and ids and all(e["model"] == "m" and e["status"] == 429 for e in page.result().entries)
    assert ids == sorted(ids, key=lambda r: -int(r[1:])) and len(set(ids)) == len(ids)


def test_a_cursor_reads_back_as_written_and_an_earlier_versions_bare_score_means_older_than_it():
    assert Cursor.parse(str(Cursor(1_700_000_000_000_000, 3))) == Cursor(1_700_000_000_000_000, 3)
    assert Cursor.parse("1700000000000000") == Cursor(1_699_999_999_999_999, 0)
    for bad in ("", "x", "1:", ":1", "1:2:3", "-1", "1:-2", "\u00b2", "1" * 20 + ":0", "1:" + "9" * 10):
        with pytest.raises(ValueError):
            Cursor.parse(bad)


async def test_the_log_keeps_its_newest_entries_and_a_late_one_lands_in_order(log_store):
    store = log_store(1000)
    for start in range(0, 5000, 500):
        await store.append([_entry(i) for i in range(start, start + 500)])
    ids, _ = await _all(store, Filter(), 1000)
    assert ids == [f"r{i}" for i in reversed(range(4000, 5000))]
    ids, _ = await _all(store, Filter(tenant="gamma"), 1000)  # a tenant's index loses what the log lost
    assert ids == [f"r{i}" for i in reversed(range(4000, 5000)) if i % 3 == 2]
    late = _entry(4500)
    await store.append([(late[0] + 1, "acme", orjson.dumps({"id": "late", "time": 0, "tenant": "acme"}))])
    # Replicas (on Redis) or workers (on the supervisor's memory log) write late: both keep time order.
    first = [e["id"] for e in (await store.page(Filter(), 501, None)).entries]
    assert first[498:501] == ["r4501", "late", "r4500"]
    ids, _ = await _all(store, Filter(), 7)  # the cursor walks the merged order too
    assert ids[:501] == first and len(ids) == len(set(ids)) == 1000


async def test_the_writer_is_bounded_while_the_store_is_slow_and_resumes_after():
    async with redis_server() as url:
        store = RedisLogStore(url, 100_000, prefix="slow:")
        dropped: list[tuple[str, int]] = []
        rlog = RequestLog(store, RequestLogPolicy(queue=500, flush_ms=20, write_timeout_ms=100),
                          on_drop=lambda reason, n: dropped.append((reason, n)))
        rlog.start()
        admin = aredis.Redis.from_url(url)
        try:
            await admin.execute_command("CLIENT", "PAUSE", "2000", "ALL")  # Redis answers no other client for 2 s
            t0 = time.perf_counter()
            queued = [rlog.put(_row(i)) for i in range(5000)]  # while it sleeps: 500 wait, the rest are dropped
            # Not a speed: a put that waited on the store would take the pause's 2 s (5,000 puts
            # took 0.8 s on a loaded 2-core CI machine).
            assert time.perf_counter() - t0 < 1.5 and 0 < sum(queued) <= 500
            await asyncio.sleep(2.3)
            assert sum(n for r, n in dropped if r == "store") >= 1  # a batch the sleeping store did not take in 100 ms
            assert sum(n for r, n in dropped if r == "queue_full") >= 4500
            assert rlog.put(_row(9999))
            await asyncio.sleep(0.2)
            assert (await store.page(Filter(), 1, None)).entries[0]["id"] == "r9999"  # writing again
        finally:
            await admin.aclose()
            await rlog.close()


async def test_a_flush_writes_what_was_queued_and_leaves_the_rest_for_the_next_one():
    """A store with a round trip: requests keep coming while a batch is written. A flush writes
    what was queued when it began, in batches of at most 1,000, and returns; it does not chase
    the tail with a stream of small writes (~150 a second at 5,000 req/s)."""
    appended: list[int] = []

    class SlowStore(MemoryLogStore):
        async def append(self, batch: list[tuple[int, str, bytes]]) -> None:
            appended.append(len(batch))
            await asyncio.sleep(0.01)  # meanwhile, more requests end
            rlog.put(_row(100_000 + len(appended)))
            await super().append(batch)

    rlog = RequestLog(SlowStore(100_000), RequestLogPolicy(flush_ms=10_000), on_drop=lambda reason, n: None)
    for i in range(2500):
        rlog.put(_row(i))
    await rlog.flush()
    assert appended == [1000, 1000, 500]  # three writes, then it returned with 3 new rows queued
    await rlog.flush()
    assert appended[3:] == [3]


async def test_an_entry_the_writer_cannot_make_is_dropped_and_counted_and_the_writer_goes_on(caplog):
    """A bug in making one row (here: an entry whose endpoint is missing) costs that entry, counted
    and logged, not the writer task: the entries around it are written, and so are later ones."""
    dropped: list[tuple[str, int]] = []
    store = MemoryLogStore(100)
    rlog = RequestLog(store, RequestLogPolicy(flush_ms=20), on_drop=lambda reason, n: dropped.append((reason, n)))
    rlog.start()
    try:
        rlog.put(_row(1))
        broken = list(_row(2))
        broken[3] = None  # the endpoint
        rlog.put(tuple(broken))
        rlog.put(_row(3))
        await asyncio.sleep(0.1)
        rlog.put(_row(4))
        await asyncio.sleep(0.1)
        ids = [e["id"] for e in (await store.page(Filter(), 10, None)).entries]
        assert ids == ["r4", "r3", "r1"] and dropped == [("encode", 1)]
        assert "cannot make an entry of request 'r2'" in caplog.text
    finally:
        await rlog.close()


# ---- end to end -----------------------------------------------------------------------------------

KEY, PAYLOAD_KEY, ADMIN = "sk-acme-key-1", "sk-beta-key-1", "sk-admin-key-1"
A = {"Authorization": f"Bearer {ADMIN}"}


def _sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def _policy(up_url: str, **extra: Any) -> dict[str, Any]:
    return {
        "backends": {"up": {"url": up_url, "models": ["m"], "price": {"input_per_mtok": 1.0, "output_per_mtok": 2.0}}},
        "tenants": {"acme": {"key_sha256": [_sha(KEY)]}, "beta": {"key_sha256": [_sha(PAYLOAD_KEY)], "log_payloads": True}},
        "admin": {"key_sha256": [_sha(ADMIN)]},
        "cache": {"enabled": False},
        "reload": {"watch": False},
        **extra,
    }


async def _get(url: str, headers: dict[str, str] = A) -> Any:
    async with aiohttp.ClientSession() as http:
        async with http.get(url, headers=headers) as r:
            assert r.status == 200, await r.text()
            return await r.json(content_type=None) if r.content_type == "application/json" else await r.text()


async def test_each_request_is_logged_with_its_route_and_no_prompt_unless_the_tenant_asks(upstream, gateway):
    up = await upstream("up", tokens=5, ttft_ms=20)
    gw = await gateway(_policy(up.url))
    acme, beta = gw.client(KEY), gw.client(PAYLOAD_KEY)
    secret_prompt = "the launch code is 0451"
    await acme.chat.completions.create(model="m", messages=[{"role": "user", "content": secret_prompt}],
                                       extra_headers={"x-request-id": "req-plain"})
    stream = await acme.chat.completions.create(model="m", messages=[{"role": "user", "content": secret_prompt}], stream=True,
                                                extra_headers={"x-request-id": "req-stream"})
    async for _ in stream:
        pass
    await beta.chat.completions.create(model="m", messages=[{"role": "user", "content": "log me"}], extra_headers={"x-request-id": "req-beta"})
    async with aiohttp.ClientSession() as http:  # refused before authentication: not in the shared log
        for _ in range(20):
            async with http.post(gw.url + "/v1/chat/completions", json={"model": "m"}, headers={"Authorization": "Bearer nope"}) as r:
                assert r.status == 401
    log = await _get(gw.url + "/admin/requests?limit=50")
    by_id = {e["id"]: e for e in log["data"]}
    assert list(by_id) == ["req-beta", "req-stream", "req-plain"] and log["next"] is None
    plain, streamed, beta_row = by_id["req-plain"], by_id["req-stream"], by_id["req-beta"]
    assert plain["tenant"] == "acme" and plain["key_id"] is None and plain["backend"] == "up" and plain["status"] == 200
    assert plain["attempts"] == ["up"] and plain["completion_tokens"] == 5 and plain["cost_usd"] > 0
    assert plain["finish"] == "ok" and plain["cache"] == "bypass" and isinstance(plain["duration_ms"], float)
    assert streamed["stream"] is True and streamed["ttft_ms"] >= 15
    assert secret_prompt not in json.dumps(log["data"][1:]) and "prompt" not in plain and "answer" not in plain
    assert beta_row["prompt"] == [{"role": "user", "content": "log me"}] and beta_row["answer"].startswith("w0")
    assert [e["id"] for e in (await _get(gw.url + "/admin/requests?tenant=acme"))["data"]] == ["req-stream", "req-plain"]
    page = await _get(gw.url + "/admin/requests?limit=2")
    assert [e["id"] for e in page["data"]] == ["req-beta", "req-stream"] and page["next"]
    rest = await _get(gw.url + f"/admin/requests?limit=2&before={page['next']}")
    assert [e["id"] for e in rest["data"]] == ["req-plain"] and rest["next"] is None
    lines = (await _get(gw.url + "/admin/requests/export?tenant=acme")).splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["req-stream", "req-plain"]
    ov = await _get(gw.url + "/admin/overview")
    assert ov["requests"] == 3 and ov["errors"] == 0 and ov["backends"]["up"]["requests"] == 3 and ov["unrouted"] == 0
    assert ov["backends"]["up"]["ttft_ms_p50"] >= 15 and ov["backends"]["up"]["latency_ms_p95"] >= 15


async def test_the_classifiers_top_terms_of_a_prompt_are_shown_to_its_caller_and_never_logged(upstream, gateway):
    """The route's `reasons` in the log held "top terms: +word ...", words of the prompt, which
    every viewer read for tenants whose `log_payloads` is off (review helper's repro). The terms
    are the caller's to see through /v1/route/explain; the log keeps them only with its payloads."""
    up = await upstream("up", tokens=2)
    policy = _policy(up.url)
    policy["models"] = {"auto": {"simple": ["up"], "complex": ["up"]}}
    gw = await gateway(policy)
    words = ["zorblaxquartz", "acmemergerproject"]
    prompts = [f"{w} {w} is my {w}: tell me a story about {w}" for w in words]
    prompts += [f"Prove rigorously, step by step, the theorem about {w} and {w}" for w in words]
    for who in (KEY, PAYLOAD_KEY):
        for p in prompts:
            await gw.client(who).chat.completions.create(model="auto", messages=[{"role": "user", "content": p}])
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain", headers={"Authorization": f"Bearer {KEY}"},
                             json={"model": "auto", "messages": [{"role": "user", "content": prompts[0]}]}) as r:
            explained = await r.json()
    assert any(r.startswith("top terms: ") and words[0] in r for r in explained["reasons"]), explained["reasons"]
    rows = (await _get(gw.url + "/admin/requests?limit=50"))["data"]
    acme = [e for e in rows if e["tenant"] == "acme"]
    assert len(acme) == 4 and all(e["reasons"] for e in acme)  # the features' reasons stay
    assert not any(w in json.dumps(acme) for w in words), [e["reasons"] for e in acme]
    beta = [e for e in rows if e["tenant"] == "beta"]
    assert len(beta) == 4 and all(words[0] in json.dumps(e) or words[1] in json.dumps(e) for e in beta)  # its payloads


async def test_bad_query_values_are_400s_and_the_log_can_be_turned_off(upstream, gateway):
    up = await upstream("up", tokens=2)
    gw = await gateway(_policy(up.url, request_log={"enabled": False}))
    async with aiohttp.ClientSession() as http:
        for q in ("limit=0", "limit=1001", "limit=x", "before=-1", "status=abc", "status=2000"):
            async with http.get(gw.url + "/admin/requests?" + q, headers=A) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == q.split("=")[0], q
        async with http.get(gw.url + "/admin/requests", headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 401  # a tenant's key is not an admin key
    await gw.client(KEY).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert (await _get(gw.url + "/admin/requests"))["data"] == []


async def test_payloads_are_cut_to_their_bound_and_the_memory_log_to_its_bytes(upstream, gateway):
    up = await upstream("up", tokens=3)
    gw = await gateway(_policy(up.url, request_log={"max_payload_chars": 100}))
    long = "x" * 5000
    await gw.client(PAYLOAD_KEY).chat.completions.create(model="m", messages=[{"role": "user", "content": long}])
    e = (await _get(gw.url + "/admin/requests"))["data"][0]
    assert e["prompt_truncated"] is True and len(e["prompt"]) == 100 and e["answer"] == "w0 w1 w2 "

    store = MemoryLogStore(1_000_000, max_bytes=50_000)
    for start in range(0, 3000, 100):
        await store.append([_entry(i) for i in range(start, start + 100)])
    kept = [e["id"] async for e in scan(store, Filter())]
    assert 300 < len(kept) < 3000 and kept[0] == "r2999"  # the newest, as many as 50 kB hold
    assert sum(len(orjson.dumps(e)) for e in [json.loads(orjson.dumps(x)) async for x in scan(store, Filter())]) <= 50_000


async def test_a_page_that_filters_reads_a_bounded_number_of_entries_and_says_where_to_go_on(log_store):
    store = log_store(100_000)
    await store.append([_entry(i) for i in range(25_000)])
    store_filter = Filter(model="m", status=201)  # matches nothing: the whole log would be read
    page = await store.page(store_filter, 10, None)
    assert page.entries == [] and page.next is not None and Cursor.parse(page.next).score > _entry(0)[0]
    rest = await store.page(store_filter, 10, Cursor.parse(page.next))
    assert rest.entries == [] and rest.next is None
    hit = await store.page(Filter(model="n", status=429), 3, Cursor.parse(page.next))  # the cursor goes on where the scan stopped
    assert [e["id"] for e in hit.entries] == [f"r{i}" for i in reversed(range(5000)) if i % 2 == 0 and i % 5 == 0][:3]


class _FailingAfter:
    """The gateway's log store, failing (as Redis would: StoreError) from its `n`th page on."""

    def __init__(self, inner: LogStore, n: int) -> None:
        self.inner, self.n, self.size = inner, n, inner.size

    async def append(self, batch: list[tuple[int, str, bytes]]) -> None:
        await self.inner.append(batch)

    async def page(self, f: Filter, limit: int, at: Cursor | None) -> Any:
        from gateway.store.core import StoreError

        self.n -= 1
        if self.n < 0:
            raise StoreError("the log's store is gone")
        return await self.inner.page(f, limit, at)

    async def close(self) -> None:
        await self.inner.close()


async def test_an_export_the_store_fails_is_a_503_before_it_starts_and_reads_as_incomplete_after(gateway):
    from gateway.web.keys import REQUEST_LOG

    gw = await gateway(_policy("http://127.0.0.1:9/v1"))
    rlog = gw.app[REQUEST_LOG]
    store = rlog.store
    await store.append([(1_700_000_000_000_000 + i, "acme", orjson.dumps({"id": f"r{i}", "tenant": "acme", "time": 1.0 + i}))
                        for i in range(2500)])
    url = gw.url + "/admin/requests/export"
    async with aiohttp.ClientSession() as http:
        rlog.store = _FailingAfter(store, 0)
        async with http.get(url, headers=A) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] is not None, await r.text()
        rlog.store = _FailingAfter(store, 2)  # two pages of 1,000, then the store fails
        async with http.get(url, headers=A) as r:
            assert r.status == 200
            # Before: the guard answered a second response on the started stream.
            with pytest.raises(aiohttp.ClientPayloadError):  # the download reads as incomplete
                await r.read()
    rlog.store = store


async def test_an_export_that_matches_nothing_lets_other_requests_run_between_pages():
    # The memory store's page never suspends: a filter matching nothing scanned the whole log
    # (pages of up to 20,000 entries read past) with every other request waiting.
    store = MemoryLogStore(100_000)
    await store.append([(1_700_000_000_000_000 + i, "acme", orjson.dumps({"id": f"r{i}", "tenant": "acme", "model": "m"}))
                        for i in range(60_000)])
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    assert [e async for e in scan(store, Filter(model="nope"))] == []
    t.cancel()
    assert ticks - before >= 2  # at least once between the pages (60,000 entries: 3 pages read past)


async def test_viewers_polling_the_overview_at_once_share_one_reading_of_the_log():
    """Each /admin/overview read and summed up to 10,000 entries on the event loop; 8 viewers
    polling it held /healthz ~0.5 s (review helper's repro). Callers at once share one reading, a
    fresh one (under FRESH_S) is answered again, and the figures are summed a page at a time."""
    from gateway.admin.overview import FRESH_S, Overviews

    now = time.time()
    store = MemoryLogStore(100_000, 1 << 30)
    rows = [{"id": f"r{i}", "time": now - 100 + i * 0.001, "tenant": "acme", "backend": "up" if i % 4 else "cache",
             "status": 200 if i % 10 else 503, "cache": "hit" if i % 4 == 0 else "miss", "ttft_ms": float(i % 100),
             "duration_ms": float(i % 1000)} for i in range(12_000)]
    await store.append([(int(e["time"] * 1e6), "acme", orjson.dumps(e)) for e in rows])
    pages = 0
    page_of = store.page

    async def counted(*args: Any) -> Any:
        nonlocal pages
        pages += 1
        return await page_of(*args)

    store.page = counted  # type: ignore[method-assign]
    log = RequestLog(store, RequestLogPolicy(), on_drop=lambda reason, n: None)
    clock = [0.0]
    ov = Overviews(clock=lambda: clock[0])
    got = await asyncio.gather(*(ov.get(log) for _ in range(8)))
    assert pages == 10 and all(g is got[0] for g in got)  # one reading: 10 pages of 1,000 (sampled)
    first = got[0]
    assert first["requests"] == 10_000 and first["sampled"] and first["cache_hits"] == 2_500
    assert first["backends"]["up"]["requests"] == 7_500 and first["errors"] == 1_000 and first["cache_hit_ratio"] == 0.25
    clock[0] += FRESH_S / 2
    assert await ov.get(log) is first and pages == 10
    clock[0] += FRESH_S
    assert (await ov.get(log))["requests"] == 10_000 and pages == 20  # read again once stale
