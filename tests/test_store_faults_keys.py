"""Virtual keys through the store's faults: a change whose reply was lost (redis-py sends it again)
and a change a failover lost (the store goes back to an earlier version, then changes again).
A redis-server of the test's own; the lost reply through tests/test_store_lost_reply.py's proxy,
the failover as the keys' Redis keys put back as they were (DUMP / RESTORE), which is what a
promoted replica that missed the last change holds."""

from __future__ import annotations

import hashlib
from typing import Any

import redis.asyncio as aredis

from gateway.admin import key_ops
from gateway.admin.key_ops import Add, Revoke, Rotate
from gateway.admin.key_store import MemoryKeyStore, RedisKeyStore
from gateway.admin.keys import KeyBook
from gateway.config.policy import VirtualKeysPolicy
from tests.procs import redis_server
from tests.test_store_lost_reply import _LosingProxy

NAMES = ["t:{keys}", "t:{keys}:version", "t:{keys}:change"]


def _d(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _book(url: str, **policy: Any) -> KeyBook:
    return KeyBook(RedisKeyStore(url, prefix="t:"), VirtualKeysPolicy(poll_ms=60_000, **policy))


async def _snapshot(raw: aredis.Redis) -> dict[str, Any]:
    return {k: await raw.dump(k) for k in NAMES}


async def _fail_over(raw: aredis.Redis, snap: dict[str, Any]) -> None:
    """The store as a replica that missed every change since `snap` holds it."""
    for k, v in snap.items():
        await raw.delete(k)
        if v is not None:
            await raw.restore(k, 0, v)


def test_each_op_applied_twice_is_applied_once():
    rec = {"id": "key_1", "tenant": "acme", "revoked": False, "digests": {"old": None}}
    records = {"key_1": dict(rec)}
    writes, _ = key_ops.apply(Add({**rec, "id": "key_2"}, 10.0, 60.0, 2), records)
    records.update(writes)  # type: ignore[arg-type]
    assert key_ops.apply(Add({**rec, "id": "key_2"}, 10.0, 60.0, 2), records) == ({}, None)  # not "too many keys"
    writes, first = key_ops.apply(Rotate("key_1", 20.0, 3600, "new"), records)
    records.update(writes)  # type: ignore[arg-type]
    assert first["digests"] == {"old": 3620.0, "new": None}
    assert key_ops.apply(Rotate("key_1", 21.0, 3600, "new"), records) == ({}, first)  # the old secret keeps its grace
    writes, _ = key_ops.apply(Revoke("key_1", 30.0), records)
    records.update(writes)  # type: ignore[arg-type]
    assert key_ops.apply(Revoke("key_1", 31.0), records) == ({}, None)


async def test_an_op_that_writes_nothing_leaves_the_version_alone():
    store = MemoryKeyStore()
    book = KeyBook(store, VirtualKeysPolicy())
    made = await book.create("acme", "k", None, None)
    await book.revoke(made["id"])
    version = await store.version()
    await book.revoke(made["id"])  # revoking twice is fine, and no change: nobody reloads
    assert await store.version() == version


async def test_a_rotation_whose_reply_was_lost_keeps_the_old_secret_for_its_grace():
    """The rotation's script runs, its reply is lost, redis-py sends it again: the resend finds
    the version moved (by the first run), and the change was computed again from the rotated
    record, making the new secret the graced one (then replaced by itself) and dropping the old
    secret at once, despite the grace promised."""
    async with redis_server() as url:
        proxy = _LosingProxy(int(url.rsplit(":", 1)[1].split("/")[0]))
        book = _book(await proxy.start())
        try:
            await book.refresh()
            made = await book.create("acme", "ci", None, None)  # loads the scripts too
            proxy.lose(b"rotated_at")  # the rotation's write runs; its reply is lost
            rotated = await book.rotate(made["id"], grace_s=3600)
            assert proxy.lost == 1
            assert book.lookup(_d(rotated["key"])) is not None
            assert rotated["previous_secret_until"] is not None, rotated
            assert book.lookup(_d(made["key"])) is not None, "the old secret stopped at once despite grace_s 3600"
        finally:
            await book.close()
            await proxy.close()


async def test_a_key_made_whose_reply_was_lost_is_made_once():
    """Applied again, the key it made counted against `max_keys`: a 409 for the very key made."""
    async with redis_server() as url:
        proxy = _LosingProxy(int(url.rsplit(":", 1)[1].split("/")[0]))
        book = _book(await proxy.start(), max_keys=2)
        try:
            await book.refresh()
            await book.create("acme", "first", None, None)  # loads the scripts
            proxy.lose(b"lost-reply")
            made = await book.create("acme", "lost-reply", None, None)
            assert proxy.lost == 1 and book.lookup(_d(made["key"])) is not None
            assert [k["name"] for k in (await book.page(None)).data] == ["lost-reply", "first"]
        finally:
            await book.close()
            await proxy.close()


async def test_a_process_that_loaded_a_change_a_failover_lost_reloads_at_the_next_change():
    """A failover to a replica that missed the last change takes the store back to version V; the
    next change made it V+1 again, with other records. A process that had loaded the lost V+1
    compared numbers, saw its own and never reloaded: it kept a key that exists nowhere (nobody
    could revoke it) and refused (401) the keys made since, until some later change. A version
    names the change that made it too (key_store.Version)."""
    async with redis_server() as url:
        raw = aredis.Redis.from_url(url)
        p1, p2 = _book(url), _book(url)
        try:
            await p1.refresh()
            await p1.create("acme", "base", None, None)
            await p2.refresh()
            before = await _snapshot(raw)  # what the replica holds

            lost = await p1.create("acme", "lost", None, None)  # the master took it, the replica never did
            await p2._check()  # p2's poll loads it
            assert p2.lookup(_d(lost["key"])) is not None

            await _fail_over(raw, before)
            made = await p1.create("beta", "after-failover", None, None)  # the next change
            await p2._check()  # p2's next poll
            assert p2.lookup(_d(made["key"])) is not None, "the key made after the failover is refused on p2"
            assert p2.lookup(_d(lost["key"])) is None, "the lost key (in no store) still works on p2"
            # The processes that never saw the lost change reload too, and agree.
            await p1._check()
            assert p1.lookup(_d(lost["key"])) is None and p1.lookup(_d(made["key"])) is not None
        finally:
            await raw.aclose()
            await p1.close()
            await p2.close()


async def test_a_version_written_by_an_earlier_replica_is_read_and_changed_alike():
    """During a rolling upgrade a replica of an earlier version counts the version up (INCR) and
    writes no change token: its changes reload this one all the same."""
    async with redis_server() as url:
        raw = aredis.Redis.from_url(url)
        book = _book(url)
        try:
            await book.create("acme", "k", None, None)
            await raw.incr("t:{keys}:version")  # an earlier replica's change
            await raw.hset("t:{keys}", "key_x", b'{"id": "key_x", "tenant": "acme", "revoked": false, "digests": {"dx": null}}')
            await book._check()
            assert book.lookup("dx") is not None
        finally:
            await raw.aclose()
            await book.close()
