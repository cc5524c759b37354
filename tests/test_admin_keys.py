"""Virtual keys across replicas: two `gateway serve` processes (one with two workers) on a
redis-server of the test's own, the fake upstream on the test's loop, the official openai SDK and
raw HTTP as clients. Create on one replica, use on the other, revoke and rotate within 2 s
everywhere, expiry, a narrowed model list, roles, and a store outage."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import yaml

from gateway.admin import key_ops
from gateway.admin.key_ops import Add, Revoke, Rotate
from gateway.admin.key_store import MemoryKeyStore
from gateway.admin.keys import KeyBook
from gateway.config.policy import VirtualKeysPolicy
from gateway.errors import BadRequest, Conflict, NotFound
from tests.procs import redis_process, redis_server, serve

TENANT_KEY = "sk-" + secrets.token_urlsafe(24)
ADMIN = "sk-adm-" + secrets.token_urlsafe(24)
VIEWER = "sk-view-" + secrets.token_urlsafe(24)
A = {"Authorization": f"Bearer {ADMIN}"}
V = {"Authorization": f"Bearer {VIEWER}"}


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _policy(up_url: str, redis_url: str | None) -> dict[str, Any]:
    p: dict[str, Any] = {
        "reload": {"watch": False, "channel": "test-keys-" + secrets.token_hex(4)},
        "cache": {"enabled": False},
        "backends": {"up": {"url": up_url, "models": ["m", "n"]}},
        "tenants": {"acme": {"key_sha256": [_sha(TENANT_KEY)]}, "beta": {}},  # beta: virtual keys only
        "admin": {"key_sha256": [_sha(ADMIN)], "viewer_key_sha256": [_sha(VIEWER)], "keys": {"poll_ms": 200}},
    }
    if redis_url is not None:
        p["store"] = {"url": redis_url, "timeout_ms": 500}
    return p


async def _call(method: str, url: str, headers: dict[str, str] | None = None, js: Any = None) -> tuple[int, Any]:
    """One request on a connection of its own (SO_REUSEPORT spreads them over the workers)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        async with http.request(method, url, headers=headers or {}, json=js) as r:
            raw = await r.read()
            try:
                return r.status, await r.json(content_type=None) if raw else None
            except ValueError:
                return r.status, raw.decode(errors="replace")


async def _chat(base: str, key: str, model: str = "m") -> int:
    status, _ = await _call("POST", f"{base}/v1/chat/completions", {"Authorization": f"Bearer {key}"},
                            {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    return status


async def _until(check: Any, timeout_s: float) -> float:
    """Seconds until `await check()` is true (AssertionError past `timeout_s`)."""
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def test_a_key_made_on_one_replica_works_on_every_worker_of_the_other_and_dies_everywhere(upstream, tmp_path):
    up = await upstream("up", tokens=2)
    async with redis_server() as redis_url:
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(_policy(up.url, redis_url)))
        async with serve(path, tmp_path) as g1, serve(path, tmp_path, "--workers", "2") as g2:
            st, made = await _call("POST", f"{g1.url}/admin/keys", A, {"tenant": "beta", "name": "ci-bot"})
            assert st == 201 and made["key"].startswith("sk-gw-") and made["tenant"] == "beta"
            assert set(made) >= {"id", "key", "tenant", "name", "created_at", "expires_at"}
            key = made["key"]
            # at once on the other replica (a key it does not know yet is looked up), every worker
            assert [await _chat(g2.url, key) for _ in range(6)] == [200] * 6
            sdk = openai.AsyncOpenAI(base_url=g1.url + "/v1", api_key=key, max_retries=0)
            answer = await sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert answer.choices[0].message.content
            await sdk.close()

            # last_used_at is written every 5 s (api.md): within that, plus a poll, on any worker
            deadline = asyncio.get_running_loop().time() + 6.0
            while True:
                st, listed = await _call("GET", f"{g2.url}/admin/keys?tenant=beta", V)
                assert st == 200 and [k["id"] for k in listed["data"]] == [made["id"]]
                row = listed["data"][0]
                if row["last_used_at"] is not None or asyncio.get_running_loop().time() > deadline:
                    break
                await asyncio.sleep(0.25)
            assert row["revoked"] is False and row["last_used_at"] is not None and row["name"] == "ci-bot"
            text = str(listed)
            assert key not in text and _sha(key) not in text  # never the secret, nor its digest

            assert (await _call("DELETE", f"{g1.url}/admin/keys/{made['id']}", V))[0] == 403  # a viewer reads only
            assert (await _call("DELETE", f"{g1.url}/admin/keys/{made['id']}", A))[0] == 204

            async def refused() -> bool:
                return [await _chat(g.url, key) for g in (g1, g2, g2, g2)] == [401] * 4

            assert await _until(refused, 2.0) <= 2.0
            st, listed = await _call("GET", f"{g1.url}/admin/keys", A)
            assert [k["revoked"] for k in listed["data"] if k["id"] == made["id"]] == [True]
            assert (await _call("DELETE", f"{g1.url}/admin/keys/{made['id']}", A))[0] == 204  # twice is fine
            assert (await _call("DELETE", f"{g1.url}/admin/keys/key_nope", A))[0] == 404
            # the policy's own keys keep working beside virtual ones
            assert await _chat(g2.url, TENANT_KEY) == 200


async def test_rotation_with_and_without_grace_expiry_and_a_narrowed_model_list(upstream, tmp_path):
    up = await upstream("up", tokens=2)
    async with redis_server() as redis_url:
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(_policy(up.url, redis_url)))
        async with serve(path, tmp_path) as g1, serve(path, tmp_path) as g2:
            st, k = await _call("POST", f"{g1.url}/admin/keys", A, {"tenant": "acme", "name": "narrow", "models": ["m"]})
            assert st == 201 and k["models"] == ["m"]
            assert await _chat(g2.url, k["key"], "m") == 200
            assert await _chat(g2.url, k["key"], "n") == 403  # the key narrows the tenant's models
            st, models = await _call("GET", f"{g2.url}/v1/models", {"Authorization": f"Bearer {k['key']}"})
            assert st == 200 and [m["id"] for m in models["data"]] == ["m"]
            # a key cannot widen what its tenant may use, nor name a model nobody serves
            st, err = await _call("POST", f"{g1.url}/admin/keys", A, {"tenant": "acme", "name": "x", "models": ["zzz"]})
            assert st == 400 and err["error"]["param"] == "models"

            # rotation with a grace: both secrets work, then only the new one
            st, r1 = await _call("POST", f"{g1.url}/admin/keys/{k['id']}/rotate", A, {"grace_s": 1.5})
            assert st == 201 and r1["id"] == k["id"] and r1["key"] != k["key"]
            assert await _chat(g2.url, r1["key"]) == 200 and await _chat(g2.url, k["key"]) == 200

            async def old_refused() -> bool:
                return await _chat(g2.url, k["key"]) == 401 and await _chat(g1.url, k["key"]) == 401

            assert await _until(old_refused, 4.0) <= 1.5 + 1.0  # the grace ends (plus a poll), not later
            assert await _chat(g1.url, r1["key"]) == 200
            # rotation without a grace: the old secret stops within 2 s everywhere
            st, r2 = await _call("POST", f"{g2.url}/admin/keys/{k['id']}/rotate", A, {"grace_s": 0})
            assert st == 201

            async def swapped() -> bool:
                return [await _chat(g.url, r2["key"]) for g in (g1, g2)] == [200, 200] and \
                    [await _chat(g.url, r1["key"]) for g in (g1, g2)] == [401, 401]

            assert await _until(swapped, 2.0) <= 2.0
            assert (await _call("POST", f"{g1.url}/admin/keys/{k['id']}/rotate", A, {"grace_s": -1}))[0] == 400

            # expiry
            st, e = await _call("POST", f"{g1.url}/admin/keys", A, {"tenant": "acme", "name": "short", "expires_in_s": 1})
            assert st == 201 and e["expires_at"] - e["created_at"] == pytest.approx(1, abs=0.01)
            assert await _chat(g2.url, e["key"]) == 200
            await asyncio.sleep(1.1)
            assert await _chat(g2.url, e["key"]) == 401 and await _chat(g1.url, e["key"]) == 401


async def test_roles_and_bad_input_on_the_key_endpoints(upstream, tmp_path):
    up = await upstream("up", tokens=2)
    async with serve(_policy(up.url, None), tmp_path) as g:
        assert await _call("GET", f"{g.url}/admin/whoami", A) == (200, {"role": "admin"})
        assert await _call("GET", f"{g.url}/admin/whoami", V) == (200, {"role": "viewer"})
        for h in (None, {"Authorization": f"Bearer {TENANT_KEY}"}, {"Authorization": "Bearer sk-gw-made-up"}):
            assert (await _call("GET", f"{g.url}/admin/keys", h))[0] == 401
            assert (await _call("POST", f"{g.url}/admin/keys", h, {"tenant": "acme", "name": "x"}))[0] == 401
        st, err = await _call("POST", f"{g.url}/admin/keys", V, {"tenant": "acme", "name": "x"})
        assert st == 403 and err["error"]["type"] == "permission_error"
        assert (await _call("POST", f"{g.url}/admin/reload", V))[0] == 403
        for body, param in (({"tenant": "nope", "name": "x"}, "tenant"), ({"tenant": "acme"}, "name"),
                            ({"tenant": "acme", "name": "x", "expires_in_s": 0}, "expires_in_s"),
                            ({"tenant": "acme", "name": "x", "admin": True}, "admin"), ({"tenant": "acme", "name": ""}, "name")):
            st, err = await _call("POST", f"{g.url}/admin/keys", A, body)
            assert st == 400 and err["error"]["param"] == param, (body, err)
        # a body bomb is refused unread past the admin plane's bound
        st, _ = await _call("POST", f"{g.url}/admin/keys", A, {"tenant": "acme", "name": "x" * 200_000})
        assert st == 413
        assert (await _call("POST", f"{g.url}/admin/keys/key_nope/rotate", A, {}))[0] == 404
        # a made-up sk-gw- key is a 401 like any other, and the endpoint stays quick
        t0 = time.monotonic()
        assert [await _chat(g.url, "sk-gw-" + secrets.token_urlsafe(8)) for _ in range(20)] == [401] * 20
        assert time.monotonic() - t0 < 5


async def test_in_memory_keys_with_one_process_and_shared_by_the_workers_through_their_supervisor(upstream, tmp_path):
    up = await upstream("up", tokens=2)
    async with serve(_policy(up.url, None), tmp_path) as g:
        st, k = await _call("POST", f"{g.url}/admin/keys", A, {"tenant": "acme", "name": "local"})
        assert st == 201 and await _chat(g.url, k["key"]) == 200
    # --workers N without Redis: the keys and the log live in the supervisor (admin/relayed.py)
    async with serve(_policy(up.url, None), tmp_path, "--workers", "3") as g:
        st, made = await _call("POST", f"{g.url}/admin/keys", A, {"tenant": "beta", "name": "w"})
        assert st == 201
        key = made["key"]
        assert [await _chat(g.url, key) for _ in range(12)] == [200] * 12  # connections spread over the workers

        async def logged() -> bool:  # every worker's requests in one log
            st, page = await _call("GET", f"{g.url}/admin/requests?tenant=beta&limit=100", V)
            return st == 200 and page["scope"] == "shared" and len(page["data"]) >= 12

        await _until(logged, 3.0)
        st, page = await _call("GET", f"{g.url}/admin/requests?tenant=beta&limit=100", V)
        assert {e["key_id"] for e in page["data"]} == {made["id"]}
        times = [e["time"] for e in page["data"]]
        assert times == sorted(times, reverse=True)  # newest first across the workers' batches

        # a worker that restarts finds every key in the supervisor
        workers = [int(c) for c in Path(f"/proc/{g.proc.pid}/task/{g.proc.pid}/children").read_text().split()]
        os.kill(workers[0], signal.SIGKILL)
        await asyncio.sleep(0.5)
        assert [await _chat(g.url, key) for _ in range(9)] == [200] * 9

        st, rotated = await _call("POST", f"{g.url}/admin/keys/{made['id']}/rotate", A, {"grace_s": 0})
        assert st == 201

        async def switched() -> bool:
            return [await _chat(g.url, key) for _ in range(6)] == [401] * 6 and \
                [await _chat(g.url, rotated["key"]) for _ in range(6)] == [200] * 6

        assert await _until(switched, 2.0) <= 2.0
        assert (await _call("DELETE", f"{g.url}/admin/keys/{made['id']}", A))[0] == 204

        async def refused() -> bool:
            return [await _chat(g.url, rotated["key"]) for _ in range(6)] == [401] * 6

        assert await _until(refused, 2.0) <= 2.0
        st, listed = await _call("GET", f"{g.url}/admin/keys?tenant=beta", V)
        assert st == 200 and [(k["id"], k["revoked"]) for k in listed["data"]] == [(made["id"], True)]
        # refused there as here: a revoked key cannot be rotated, an unknown one is a 404
        assert (await _call("POST", f"{g.url}/admin/keys/{made['id']}/rotate", A, {}))[0] == 409
        assert (await _call("DELETE", f"{g.url}/admin/keys/key_nope", A))[0] == 404


async def test_a_store_outage_keeps_known_keys_working(upstream, tmp_path: Path):
    up = await upstream("up", tokens=2)
    async with redis_process() as (redis_url, redis_proc):
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(_policy(up.url, redis_url)))
        async with serve(path, tmp_path) as g1, serve(path, tmp_path) as g2:
            st, k = await _call("POST", f"{g1.url}/admin/keys", A, {"tenant": "acme", "name": "survivor"})
            assert st == 201 and await _chat(g2.url, k["key"]) == 200
            redis_proc.kill()
            await redis_proc.wait()
            await asyncio.sleep(0.5)  # a few polls fail
            assert [await _chat(g.url, k["key"]) for g in (g1, g2)] == [200, 200]
            assert await _chat(g2.url, "sk-gw-" + secrets.token_urlsafe(8)) == 401
            st, err = await _call("POST", f"{g1.url}/admin/keys", A, {"tenant": "acme", "name": "new"})
            assert st == 503 and "store" in err["error"]["message"]


async def test_the_book_is_bounded_and_forgets_keys_that_ended_long_ago():
    now = [1_000_000.0]
    book = KeyBook(MemoryKeyStore(), VirtualKeysPolicy(max_keys=3, keep_revoked_s=100), clock=lambda: now[0])
    a = await book.create("acme", "a", None, None)
    b = await book.create("acme", "b", 10, None)  # expires at +10 s
    await book.create("acme", "c", None, None)
    with pytest.raises(Conflict):
        await book.create("acme", "d", None, None)
    await book.revoke(a["id"])
    now[0] += 50  # a revoked 50 s ago, b expired 40 s ago: both still listed, still counted
    with pytest.raises(Conflict):
        await book.create("acme", "d", None, None)
    now[0] += 100
    await book.create("acme", "d", None, None)  # both forgotten now: room again
    assert sorted(k["name"] for k in (await book.page(None)).data) == ["c", "d"]
    assert b["id"] not in {k["id"] for k in (await book.page("acme")).data}


async def test_a_rotation_ends_every_secret_but_the_one_it_replaces_and_now_ends_them_all():
    """A secret leaked during an earlier rotation's grace kept working after a rotation with
    grace_s 0 (documented as "the old one stops now"), and graced rotations piled up live
    secrets (21 after 20), none of it listed (review helper's repro). A rotation keeps only the
    secret it replaces (for its grace); grace_s 0 ends them all; the listing says until when a
    previous secret works."""
    now = [1_000_000.0]
    book = KeyBook(MemoryKeyStore(), VirtualKeysPolicy(), clock=lambda: now[0])
    s0 = await book.create("acme", "a", None, None)
    secrets_ = [s0["key"]] + [(await book.rotate(s0["id"], 3600))["key"] for _ in range(20)]
    await book.refresh()
    live = [k for k in secrets_ if book.lookup(_sha(k)) is not None]
    assert live == secrets_[-2:]  # the newest, and the one it replaced (in its grace)
    listed = next(k for k in (await book.page(None)).data if k["id"] == s0["id"])
    assert listed["rotated_at"] == now[0] and listed["previous_secret_until"] is not None
    fresh = (await book.rotate(s0["id"], 0))["key"]
    await book.refresh()
    assert [k for k in [*secrets_, fresh] if book.lookup(_sha(k)) is not None] == [fresh]
    assert next(k for k in (await book.page(None)).data if k["id"] == s0["id"])["previous_secret_until"] is None


async def test_an_expired_key_is_not_rotated_into_a_secret_that_never_works():
    """Rotating an expired key answered 201 with a fresh secret that got 401 (the expiry stays):
    a 409, as for a revoked key (review helper's repro)."""
    now = [1_000_000.0]
    book = KeyBook(MemoryKeyStore(), VirtualKeysPolicy(), clock=lambda: now[0])
    k = await book.create("acme", "short", 0.5, None)
    assert (await book.rotate(k["id"], 0))["key"]  # live: rotated
    now[0] += 1.0
    with pytest.raises(Conflict, match="expired"):
        await book.rotate(k["id"], 0)


async def test_a_store_that_comes_back_empty_never_gives_a_replica_the_version_it_loaded_before():
    """Redis restarted without persistence (as the shipped compose and Kubernetes Redis run): the
    version counted from 1 again, the first change made it the number a replica had loaded, and
    that replica never reloaded: it kept a key the store no longer held (no admin could revoke
    it: a 404) and refused the new one (review helper's repro). An emptied store counts from a
    random number."""
    import redis.asyncio as aioredis

    from gateway.admin.key_store import RedisKeyStore

    async with redis_server() as url:
        a = KeyBook(RedisKeyStore(url, prefix="t:"), VirtualKeysPolicy())
        b = KeyBook(RedisKeyStore(url, prefix="t:"), VirtualKeysPolicy())
        try:
            old = await a.create("acme", "old", None, None)
            await b.catch_up()
            assert b.lookup(_sha(old["key"])) is not None
            r = aioredis.from_url(url)
            await r.flushall()  # back empty
            await r.aclose()
            new = await a.create("acme", "new", None, None)
            await b._check()  # the poll's step
            assert b.lookup(_sha(old["key"])) is None and b.lookup(_sha(new["key"])) is not None
        finally:
            await a.close()
            await b.close()


async def test_a_listing_reads_the_store_only_when_the_keys_changed():
    """A listing read every record from the store and built the answer without a pause: three
    viewers listing 10,000 keys in a loop held every request up to 387 ms (review helper's
    repro). It reads the version, and the records only when they changed (from another process
    too), and pauses every 1,000 keys."""
    reads = [0]

    class Counting(MemoryKeyStore):
        async def records(self) -> tuple[int, dict[str, dict[str, Any]]]:
            reads[0] += 1
            return await super().records()

    store = Counting()
    book, other = KeyBook(store, VirtualKeysPolicy()), KeyBook(store, VirtualKeysPolicy())
    for i in range(300):
        await other.create("acme", f"k{i}", None, None)  # each reloads `other`: a read each
    first = (await book.page(None, 1000)).data  # this process had loaded nothing: one read
    assert len(first) == 300 and reads[0] == 300 + 1
    assert (await book.page("acme", 1000)).data == first and reads[0] == 301  # nothing changed: no read
    await other.revoke(first[0]["id"])
    assert ((await book.page(None)).data)[0]["revoked"] is True and reads[0] == 303  # other's reload, then this one's


async def test_a_revoked_key_stops_its_streams_and_its_requests_under_way(upstream, gateway):
    """A stream opened before its key was revoked ran to its end (8 s and 81 chunks more in the
    review helper's repro; up to the 600 s deadline), and a request under way was answered. Each
    read of a stream and each upstream attempt asks whether the key still works: the stream ends
    with an error (never [DONE]); a whole answer that arrives after the revoke is a 401."""
    up = await upstream("up", tokens=200, itl_ms=20)
    slow = await upstream("slow", tokens=2, ttft_ms=600)
    policy = _policy(up.url, None)
    policy["backends"]["slow"] = {"url": slow.url, "models": ["s"]}
    gw = await gateway(policy)
    st, k = await _call("POST", f"{gw.url}/admin/keys", A, {"tenant": "acme", "name": "leaky"})
    assert st == 201
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=k["key"], max_retries=0)
    chunks = 0
    with pytest.raises(openai.APIError) as exc:
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for _ in stream:
            chunks += 1
            if chunks == 5:
                assert (await _call("DELETE", f"{gw.url}/admin/keys/{k['id']}", A))[0] == 204
    assert 5 <= chunks < 20 and "revoked" in str(exc.value)
    st, k2 = await _call("POST", f"{gw.url}/admin/keys", A, {"tenant": "acme", "name": "leaky-2"})
    pending = asyncio.ensure_future(_chat(gw.url, k2["key"], "s"))  # its answer comes after 600 ms
    await asyncio.sleep(0.2)
    assert (await _call("DELETE", f"{gw.url}/admin/keys/{k2['id']}", A))[0] == 204
    assert await pending == 401
    await client.close()


async def test_a_revoked_key_stops_its_replay_of_a_stored_response(upstream, gateway):
    """GET /v1/responses/{id}?stream=true went on to its end after its key was revoked (review
    helper's repro): it ends with an error event at its next read, as the relay's streams do."""
    up = await upstream("up", tokens=40, itl_ms=1)
    up.responses.replay_itl_ms = 100  # 40 deltas: ~4 s of replay
    gw = await gateway(_policy(up.url, None))
    st, k = await _call("POST", f"{gw.url}/admin/keys", A, {"tenant": "acme", "name": "replayer"})
    assert st == 201
    h = {"Authorization": f"Bearer {k['key']}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/responses", json={"model": "m", "input": "hi", "background": True}, headers=h) as r:
            rid = (await r.json())["id"]
        await asyncio.sleep(0.5)  # completed on the backend
        async with http.get(gw.url + f"/v1/responses/{rid}?stream=true", headers=h) as r:
            assert r.status == 200
            buf = await r.content.readany()
            assert (await _call("DELETE", f"{gw.url}/admin/keys/{k['id']}", A))[0] == 204
            while chunk := await r.content.readany():
                buf += chunk
    assert b"response.completed" not in buf and b"event: error" in buf and b"revoked" in buf, buf[-300:]


def test_key_changes_travel_as_data_and_garbage_is_refused():
    """What a worker sends its supervisor (admin/relayed.py): each op round-trips through JSON and
    applies alike; anything else is a 400, not a crash of the supervisor's handler."""
    rec = {"id": "key_1", "tenant": "acme", "name": "n", "created_at": 1.0, "expires_at": None, "models": None,
           "revoked": False, "revoked_at": None, "digests": {"d0": None}}
    ops = [Add(rec, 2.0, 100.0, 10), Rotate("key_1", 3.0, 5.0, "d1"), Revoke("key_1", 4.0)]
    records: dict[str, Any] = {}
    for op in ops:
        again = key_ops.from_json(orjson.loads(orjson.dumps(key_ops.to_json(op))))
        assert again == op
        writes, _ = key_ops.apply(again, {k: dict(v) for k, v in records.items()})
        records.update(writes)  # type: ignore[arg-type]
    assert records["key_1"]["revoked"] is True and records["key_1"]["digests"] == {}
    for junk in ({}, {"op": "drop-table"}, {"op": "revoke"}, {"op": "add", "rec": {}, "now": 1}):
        with pytest.raises(BadRequest):
            key_ops.from_json(junk)
    with pytest.raises(NotFound):
        key_ops.apply(Revoke("key_nope", 1.0), records)
    with pytest.raises(Conflict):
        key_ops.apply(Rotate("key_1", 5.0, 0.0, "d2"), records)


def _sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


async def test_every_process_sees_a_revoke_on_the_same_poll_tick():
    """Two books (two workers) started half a period apart: both refuse a revoked key within a
    few ms of each other (they poll on the same wall-clock ticks), not half a period apart."""
    store = MemoryKeyStore()
    admin = KeyBook(store, VirtualKeysPolicy(poll_ms=200))
    made = await admin.create("acme", "ci", None, None)
    digest = _sha(made["key"])
    books = [KeyBook(store, VirtualKeysPolicy(poll_ms=200)) for _ in range(2)]
    await books[0].start()
    await asyncio.sleep(0.1)
    await books[1].start()
    try:
        assert all(b.lookup(digest) is not None for b in books)
        await admin.revoke(made["id"])
        t0, refused = time.monotonic(), [None, None]
        while None in refused and time.monotonic() - t0 < 2:
            for i, b in enumerate(books):
                if refused[i] is None and b.lookup(digest) is None:
                    refused[i] = time.monotonic() - t0
            await asyncio.sleep(0.002)
        assert None not in refused and max(refused) <= 0.2 + 0.1, refused  # within a poll
        assert abs(refused[0] - refused[1]) < 0.05, refused  # together
    finally:
        for b in books:
            await b.close()


class _SlowRead(MemoryKeyStore):
    """With `slow_next` set, the next read of the records is taken at once but answered 0.2 s
    later: a refresh that read before a revoke can then finish after one that read after it."""

    slow_next = False

    async def records(self) -> tuple[int, dict[str, dict[str, Any]]]:
        slow, self.slow_next = self.slow_next, False
        snapshot = await super().records()
        if slow:
            await asyncio.sleep(0.2)
        return snapshot


async def test_a_refresh_that_read_before_a_revoke_never_lands_after_one_that_read_after_it():
    store = _SlowRead()
    book, admin = KeyBook(store, VirtualKeysPolicy()), KeyBook(store, VirtualKeysPolicy())
    key = await book.create("acme", "ci", None, None)
    digest = _sha(key["key"])
    store.slow_next = True
    before = asyncio.create_task(book.refresh())  # reads the key live, answers late
    await asyncio.sleep(0.02)
    await admin.revoke(key["id"])
    after = asyncio.create_task(book.refresh())  # reads it revoked
    await asyncio.gather(before, after)
    assert book.lookup(digest) is None  # the newer read is what stays loaded


async def test_a_revoked_key_leading_a_flight_leaves_its_followers_their_whole_answer(upstream, gateway):
    """Two keys of one tenant ask the same question at once: the second follows the first's
    stream (single flight). Revoking the first key mid-stream cut both answers; now its own
    stream ends with the error, the follower's reads on to [DONE], and the whole answer is stored."""
    up = await upstream("up", tokens=60, itl_ms=20)
    policy = _policy(up.url, None)
    policy["cache"] = {"enabled": True}
    gw = await gateway(policy)
    keys = []
    for name in ("leader", "follower"):
        st, k = await _call("POST", f"{gw.url}/admin/keys", A, {"tenant": "acme", "name": name})
        assert st == 201
        keys.append(k)
    ask = {"model": "m", "messages": [{"role": "user", "content": "a story"}], "temperature": 0, "stream": True}
    leader = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=keys[0]["key"], max_retries=0)
    follower = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=keys[1]["key"], max_retries=0)

    async def follow() -> tuple[str, str]:
        await asyncio.sleep(0.1)  # the leader's flight is under way
        raw = await follower.chat.completions.with_raw_response.create(**ask)
        text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
        return raw.headers.get("x-gateway-cache", ""), text

    followed = asyncio.ensure_future(follow())
    chunks = 0
    with pytest.raises(openai.APIError) as exc:
        async for _ in await leader.chat.completions.create(**ask):
            chunks += 1
            if chunks == 10:
                assert (await _call("DELETE", f"{gw.url}/admin/keys/{keys[0]['id']}", A))[0] == 204
    assert chunks < 30 and "revoked" in str(exc.value)
    cache, text = await followed
    assert cache == "hit" and len(text.split()) == 60  # the leader's stream, whole
    again = await follower.chat.completions.with_raw_response.create(**ask)
    assert again.headers.get("x-gateway-cache") == "hit"
    assert "".join([c.choices[0].delta.content or "" async for c in again.parse() if c.choices]) == text
    await leader.close()
    await follower.close()


async def test_the_listing_comes_in_pages_newest_first_each_key_once():
    """The listing was every key in one answer (~6 MB of JSON for 10,000 keys). It comes in pages
    of at most 1,000 (100 unless asked), newest first, keys made in the same instant by id; a
    page's `next` goes on where it ended, and keys made meanwhile do not shift what follows."""
    now = [1_000.0]
    book = KeyBook(MemoryKeyStore(), VirtualKeysPolicy(), clock=lambda: now[0])
    made = []
    for i in range(250):
        now[0] += 1.0 if i % 3 == 0 else 0.0  # three keys to an instant
        made.append(await book.create("acme" if i % 5 else "beta", f"k{i}", None, None))
    newest_first = [k["id"] for k in sorted(made, key=lambda k: (k["created_at"], k["id"]), reverse=True)]
    pages, before = [], None
    while True:
        page = await book.page(None, 100, before)
        pages.append([k["id"] for k in page.data])
        if page.next is None:
            break
        before = page.next
        if len(pages) == 1:
            now[0] += 5
            await book.create("acme", "late", None, None)  # newer than every page: never in the ones that follow
    assert [len(p) for p in pages] == [100, 100, 50] and sum(pages, []) == newest_first
    assert len((await book.page(None)).data) == 100  # the default
    beta = (await book.page("beta", 20)).data
    rest = (await book.page("beta", 1000, (await book.page("beta", 20)).next)).data
    assert [k["id"] for k in beta + rest] == [k for k in newest_first if made[int(next(m["name"] for m in made if m["id"] == k)[1:])]["tenant"] == "beta"]
    assert all(k["tenant"] == "beta" for k in beta + rest) and len(beta + rest) == 50


async def test_the_listing_refuses_a_bad_page_request(upstream, gateway):
    up = await upstream("up")
    gw = await gateway(_policy(up.url, None))
    for i in range(3):
        assert (await _call("POST", f"{gw.url}/admin/keys", A, {"tenant": "acme", "name": f"k{i}"}))[0] == 201
    st, first = await _call("GET", f"{gw.url}/admin/keys?limit=2", V)
    assert st == 200 and len(first["data"]) == 2 and first["next"]
    st, rest = await _call("GET", f"{gw.url}/admin/keys?limit=2&before={first['next']}", V)
    assert st == 200 and len(rest["data"]) == 1 and rest["next"] is None
    assert {k["id"] for k in first["data"]}.isdisjoint(k["id"] for k in rest["data"])
    for bad in ("limit=0", "limit=1001", "limit=-1", "limit=1e3", "limit=" + "9" * 40, "before=nope", "before=inf~key_1",
                "before=nan~key_1", "before=1.5~", "before=" + "1" * 200 + "~k"):
        st, err = await _call("GET", f"{gw.url}/admin/keys?{bad}", V)
        assert st == 400 and err["error"]["param"] in ("limit", "before"), (bad, st, err)


async def test_a_follower_whose_key_is_revoked_gets_no_more_of_the_flights_answer(upstream, gateway):
    """A request that followed another's flight (single flight) read the whole answer after its
    own key was revoked, streamed or whole (review helper's repro): only the relay's reads and
    attempts asked. A streamed follower's stream now ends with the error; a whole one is a 401."""
    up = await upstream("up", tokens=100, itl_ms=20, ttft_ms=1000)
    policy = _policy(up.url, None)
    policy["cache"] = {"enabled": True}
    gw = await gateway(policy)
    keys = [(await _call("POST", f"{gw.url}/admin/keys", A, {"tenant": "acme", "name": n}))[1] for n in ("s", "w")]
    auth = [{"Authorization": f"Bearer {k['key']}"} for k in keys]
    ask = {"model": "m", "messages": [{"role": "user", "content": "a story"}], "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as s:
        async def lead(body: dict[str, Any]) -> tuple[int, str]:
            async with s.post(f"{gw.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {TENANT_KEY}"}) as r:
                return r.status, await r.text()

        leader = asyncio.ensure_future(lead(ask))
        await asyncio.sleep(0.2)
        got, chunks = b"", 0
        async with s.post(f"{gw.url}/v1/chat/completions", json=ask, headers=auth[0]) as r:
            assert r.headers.get("x-gateway-cache") == "hit"
            async for line in r.content:
                got += line
                chunks += line.startswith(b"data: {")
                if chunks == 5 and b"DELETE" not in got:
                    got += b"DELETE"
                    assert (await _call("DELETE", f"{gw.url}/admin/keys/{keys[0]['id']}", A))[0] == 204
        assert (await leader)[1].rstrip().endswith("data: [DONE]")  # the leader's own stream is whole
        assert b"revoked" in got and not got.rstrip().endswith(b"[DONE]") and chunks < 60

        whole = {**ask, "stream": False, "messages": [{"role": "user", "content": "wait for it"}]}
        leader = asyncio.ensure_future(lead(whole))  # 1 s for its whole answer
        await asyncio.sleep(0.1)

        async def follow() -> tuple[int, Any]:
            async with s.post(f"{gw.url}/v1/chat/completions", json=whole, headers=auth[1]) as r:
                return r.status, (r.headers.get("x-gateway-cache"), await r.json())

        follower = asyncio.ensure_future(follow())
        await asyncio.sleep(0.3)  # it waits for the leader's answer
        assert (await _call("DELETE", f"{gw.url}/admin/keys/{keys[1]['id']}", A))[0] == 204
        status, err = await follower
        assert status == 401 and "revoked" in err[1]["error"]["message"], err
        assert (await leader)[0] == 200
