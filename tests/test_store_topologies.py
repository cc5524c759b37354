"""The store past one Redis: URLs of every kind, every Redis client of the gateway on a real
Cluster (3 masters, 3 replicas) and behind real Sentinels, and pools that stay within their bound
while Redis is slow. Real redis-server processes on loopback (tests/redis_topology.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis

from gateway.admin.key_ops import Add, Revoke
from gateway.admin.key_store import RedisKeyStore
from gateway.admin.log_store import Filter, RedisLogStore
from gateway.config.policy import PolicyError, StorePolicy, StoreTlsPolicy, parse_policy
from gateway.process.peers import Peers
from gateway.store.connect import budget
from gateway.store.core import StoreError
from gateway.store.redis_store import RedisStore
from gateway.store.target import Topology, parse_target
from gateway.tenants.quota_counters import Ask, Scope, Settle
from tests.conftest import simple_policy
from tests.procs import free_port, needs_redis_server, needs_tool, redis_server, serve
from tests.redis_topology import redis_cluster, redis_sentinel

# ------------------------------------------------------------------------------------------- URLs


def test_each_kind_of_url_is_read_with_its_hosts_service_and_credentials():
    t = parse_target("redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2,[::1]:5000/mymaster/2")
    assert (t.topology, t.hosts, t.service, t.db, t.password, t.tls) == (
        Topology.SENTINEL, (("10.0.0.1", 26379), ("10.0.0.2", 26379), ("::1", 5000)), "mymaster", 2, "s3cret", False,
    )  # fmt: skip
    t = parse_target("rediss+cluster://app:pw@n1:7000,n2:7001")
    assert (t.topology, t.hosts, t.username, t.password, t.tls) == (Topology.CLUSTER, (("n1", 7000), ("n2", 7001)), "app", "pw", True)
    for url in ("redis://h:1/0", "rediss://h", "unix:///tmp/r.sock", "redis://h/0?ssl_cert_reqs=none"):
        assert parse_target(url).topology is Topology.SINGLE
    assert parse_target("rediss://h").tls and not parse_target("redis://h").tls


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://h:6379", "must be a redis://"),
        ("redis+sentinel://h:26379", "names its service"),
        ("redis+sentinel://h:26379/a/b/c", "names its service"),
        ("redis+cluster://h:7000/0", "has no path"),
        ("redis+cluster://h:x", "port 'x' is not a number"),
        ("redis+cluster://h:7000?timeout=1", "go in the policy's `store` section"),
        ("redis+cluster://:pw@h:x", "<redacted>@"),  # a password is never repeated in an error
        ("redis://h:6379/0?max_connections=5000", "max_connections in the URL"),  # would undo the pool's bound
        ("rediss://h/0?ssl_cert_reqs=none&socket_timeout=9", "socket_timeout in the URL"),
    ],
)
def test_a_bad_store_url_is_refused_at_load_with_what_is_wrong(url, says):
    with pytest.raises(PolicyError) as err:
        parse_policy(f"version: 1\nstore:\n  url: '{url}'\n")
    assert says in str(err.value)
    assert "pw@" not in str(err.value).split("input_value")[0]


def test_tls_options_need_a_tls_url_and_a_certificate_needs_its_key():
    assert StorePolicy(url="rediss+cluster://h:1", tls={"ca_file": "/ca.pem"}).tls is not None
    with pytest.raises(ValueError, match="applies to a rediss://"):
        StorePolicy(url="redis://h:1", tls={"ca_file": "/ca.pem"})
    with pytest.raises(ValueError, match="go together"):
        StorePolicy(url="rediss://h:1", tls={"cert_file": "/c.pem"})


def test_the_budget_counts_every_pool_of_every_process_of_a_replica():
    sp = StorePolicy(url="redis://h:1", max_connections=10)
    assert budget(sp, 1) == 30 + 4 + 3
    assert budget(sp, 4) == 4 * (30 + 4) + 3
    # A Cluster's clients each keep one more connection, to the node they read the topology from.
    assert budget(StorePolicy(url="redis+cluster://h:1", max_connections=10), 4) == 4 * (33 + 6) + 4


async def test_a_budget_past_the_servers_maxclients_is_a_warning_at_start(tmp_path):
    async with redis_server() as url:
        fits = {"version": 1, "backends": {"b": {"url": "http://127.0.0.1:9", "models": ["m"]}},
                "store": {"url": url, "max_connections": 64, "replicas": 3}}
        over = {**fits, "store": {"url": url, "max_connections": 2000, "replicas": 3}}
        async with serve(fits, tmp_path, "--workers", "2") as ok, serve(over, tmp_path) as big:
            await asyncio.sleep(1.0)  # the check runs in the background at start
            assert "connections may be opened" not in ok.log.read_text()
            text = big.log.read_text()
            assert "3 replica(s) x 6007 connections (1 worker(s), store.max_connections 2000) = 18021 may be opened" in text
            assert "more than its maxclients 10000" in text


# ------------------------------------------------------------------- every client on a topology


async def _exercise(url: str) -> None:
    """Every Redis client of the gateway, on the store at `url`: the Store (cache entries across
    slots, locks, quotas with two scopes), the keys, the request log, and the reload channel."""
    prefix = f"t{secrets.token_hex(3)}:"
    # Generous timeouts: this checks that each call works on the topology, not how fast; a fresh
    # Cluster client's first call also reads the slots and loads the script (slow on a busy CI).
    store = RedisStore(url, timeout_ms=3000, quota_timeout_ms=3000, max_connections=4, prefix=prefix)
    keys = RedisKeyStore(url, prefix=prefix)
    log = RedisLogStore(url, 100, prefix=prefix)
    try:
        for i in range(40):  # 40 keys land on every master of a cluster
            await store.set(f"k{i}", b"v%d" % i, 30)
        assert [await store.get(f"k{i}") for i in range(40)] == [b"v%d" % i for i in range(40)]
        await store.delete("k0")
        assert await store.get("k0") is None
        assert await store.add("lock", b"me", 5) and not await store.add("lock", b"you", 5)
        assert not await store.delete_if("lock", b"you") and await store.delete_if("lock", b"me")

        scopes = (Scope("", rpm=3), Scope("m", rpm=10))  # a lease each: one lease's take again is a resend, taken once
        decisions = [await store.quota_take("acme", Ask(scopes, tokens=5, lease=f"l{i}", lease_ttl_ms=5000)) for i in range(1, 5)]
        assert [d.ok for d in decisions] == [True, True, True, False] and decisions[3].limit == "rpm"
        d = decisions[0]
        await store.quota_settle("acme", Settle(("", "m"), d.bucket, d.day, token_delta=2, spend_micro=7, lease="l1"))  # the first's
        usage = await store.quota_usage("acme", "m")
        assert (usage.window_requests, usage.window_tokens) == (3, 17)

        now = time.time()
        await keys.change(Add({"id": "k1", "tenant": "acme", "name": "ci", "digests": {"d": None}}, now, 60, 100))
        first, records = await keys.records()
        # A new store's version starts at a random number (key_store.py); each change adds one
        assert first > 0 and await keys.version() == first and set(records) == {"k1"}
        await keys.touch({"k1": now})
        assert await keys.last_used() == {"k1": now}
        await keys.change(Revoke("k1", now))
        version, records = await keys.records()
        assert version == first + 1 and records["k1"]["revoked"]

        await log.append([(1000 + i, "acme" if i % 2 else "beta", b'{"id":"r%d","tenant":"%s"}' % (i, b"acme" if i % 2 else b"beta"))
                          for i in range(10)])  # fmt: skip
        page = await log.page(Filter(tenant="acme"), 3, None)
        assert [e["id"] for e in page.entries] == ["r9", "r7", "r5"]
        assert len((await log.page(Filter(), 100, None)).entries) == 10
    finally:
        await store.close()
        await keys.close()
        await log.close()
    await _reload_announced(url)


async def _reload_announced(url: str) -> None:
    """Two replicas' reload channels on `url`: an announcement by one is answered by the other."""
    policy = parse_policy(f"version: 1\nbackends: {{b: {{url: 'http://127.0.0.1:9', models: [m]}}}}\n"
                          f"store:\n  url: '{url}'\nreload:\n  channel: ch-{secrets.token_hex(3)}\n")
    heard: list[str] = []

    async def on_reload(why: str) -> dict[str, Any]:
        heard.append(why)
        return {"ok": True, "policy_generation": 2}

    a, b = Peers(policy, on_reload), Peers(policy, on_reload)
    await a.start()
    await b.start()
    try:
        answers = await a.announce()
        assert answers == [{"node": b.node, "ok": True, "policy_generation": 2}]
        assert heard == [f"announced by {a.node}"]
    finally:
        await a.close()
        await b.close()


async def test_every_client_works_on_a_cluster():
    async with redis_cluster() as cluster:
        await _exercise(cluster.url)


async def test_every_client_works_behind_sentinels():
    async with redis_sentinel() as sentinels:
        await _exercise(sentinels.url)


# ----------------------------------------------------------------------------- the pool's bound


@asynccontextmanager
async def _topology(kind: str) -> AsyncIterator[tuple[str, list[int]]]:
    """The URL of a fresh store of `kind` and the ports of its data nodes (the masters)."""
    if kind == "single":
        async with redis_server() as url:
            yield url, [int(url.rsplit(":", 1)[1].split("/")[0])]
    elif kind == "sentinel":
        async with redis_sentinel() as s:
            yield s.url, [s.master_port()]
    else:
        async with redis_cluster() as c:
            yield c.url, [p for _, p in c.seeds]


def _bound(kind: str, pool: int) -> int:
    """The most connections one client of a pool of `pool` holds to a node: a Cluster's client
    also keeps one to the node it last read the topology from (budget() counts it)."""
    return pool + (kind == "cluster")


async def _lateness(delay_s: float) -> float:
    """How much later than asked an asyncio.sleep of ``delay_s`` returned."""
    started = time.monotonic()
    await asyncio.sleep(delay_s)
    return max(0.0, time.monotonic() - started - delay_s)


def _ours(port: int, name: str) -> int:
    with redis.Redis(port=port) as r:
        return sum(1 for c in r.client_list() if c.get("name") == name)


@pytest.mark.parametrize("kind", ["single", "sentinel", "cluster"])
async def test_a_slow_redis_makes_callers_wait_and_time_out_within_the_pools_bound(kind):
    async with _topology(kind) as (url, ports):
        store = RedisStore(url, timeout_ms=150, max_connections=3)
        name = f"gw-store-{os.getpid()}"
        try:
            # Set-up, not the check: a Cluster client's first call also reads the topology, which
            # on a loaded machine (the suite on 2 cores) can take longer than the 150 ms timeout.
            async with asyncio.timeout(10):
                while True:
                    with contextlib.suppress(StoreError):
                        await store.set("warm", b"1", 10)
                        break
                    await asyncio.sleep(0.05)
            for _ in range(2):  # and again: nothing left over from the first time adds up
                # Every master stops answering clients for a while (CLIENT PAUSE), and a 10x
                # burst of callers arrives: each one gives up within its timeout, none opens a
                # connection past the bound.
                for p in ports:
                    with redis.Redis(port=p) as r:
                        # 400 ms: shorter than the sentinels' down-after (500 ms), so no failover
                        r.execute_command("CLIENT", "PAUSE", 400, "ALL")
                paused = time.monotonic()
                # A timer of the same length beside the callers: how late this loop itself was
                # (on 2 busy cores a timer fired up to ~0.25 s late), which no store bound can help.
                results, late = await asyncio.gather(
                    asyncio.gather(*(store.get(f"k{i}") for i in range(30)), return_exceptions=True), _lateness(0.15)
                )
                took = time.monotonic() - paused - late
                # Every caller is answered or told the store failed (a Cluster's client may find a
                # node to serve a few), nothing else.
                assert all(r is None or isinstance(r, StoreError) for r in results), results
                assert sum(isinstance(r, StoreError) for r in results) >= 20, results
                assert took < 0.25, f"callers waited {took:.2f} s for a 150 ms timeout (the loop itself was {late:.2f} s late)"
                await asyncio.sleep(max(0.0, 0.5 - (time.monotonic() - paused)))
                assert all(_ours(p, name) <= _bound(kind, 3) for p in ports), [_ours(p, name) for p in ports]
                # Afterwards the same pool answers again, to a burst too.
                async with asyncio.timeout(5):
                    while True:
                        with contextlib.suppress(StoreError):
                            if await store.get("warm") == b"1":
                                break
                        await asyncio.sleep(0.05)
                await asyncio.gather(*(store.get(f"k{i}") for i in range(30)))
                assert all(_ours(p, name) <= _bound(kind, 3) for p in ports), [_ours(p, name) for p in ports]
        finally:
            await store.close()



async def test_a_master_killed_under_concurrent_callers_fails_them_only_as_store_failures():
    # redis-py's Cluster client races with its own reconnects while a master fails over (a command
    # sent on a connection another task just closed raised AttributeError): every failure a
    # caller sees must be a StoreError, which it fails open on, never anything else (a 500).
    async with redis_cluster() as cluster:
        store = RedisStore(cluster.url, timeout_ms=50, quota_timeout_ms=250, max_connections=8)
        other: list[BaseException] = []
        stop = asyncio.Event()

        async def caller(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    await store.get(f"k{i}-{n % 50}")
                    await store.set(f"k{i}-{n % 50}", b"v", 30)
                    await store.quota_take("t", Ask((Scope("", rpm=10**6),), 0, f"l{i}-{n}", 5000))
                except StoreError:
                    pass
                except Exception as exc:  # noqa: BLE001 - what the test is looking for
                    other.append(exc)
                await asyncio.sleep(0.001)

        callers = [asyncio.create_task(caller(i)) for i in range(30)]
        try:
            await asyncio.sleep(1.0)
            cluster.kill(cluster.master_of("{gwq:t}"))
            await cluster.wait_ok(20.0)
            await asyncio.sleep(1.5)
        finally:
            stop.set()
            await asyncio.gather(*callers)
            await store.close()
        assert not other, other[:5]
        # A fresh client, seeded by the live nodes (the killed node's port is no longer ours).
        failed = await _fails(store_url=cluster.live_url())
        assert failed is None, f"the store answers again after the promotion: {failed}; cluster: {cluster.problem() or 'ok'}"


async def _fails(store_url: str, within_s: float = 10.0) -> str | None:
    """None when a new client of `store_url` writes a key and reads it back within `within_s`
    (tried again after a failure: a fresh Cluster client's first call reads the topology, and on
    a loaded CI machine right after a promotion that once took past its 500 ms); else what
    failed last."""
    deadline = time.monotonic() + within_s
    while True:
        store = RedisStore(store_url, timeout_ms=500)
        try:
            await store.set("after", b"1", 10)
            got = await store.get("after")
            failed = None if got == b"1" else f"read back {got!r}"
        except StoreError as exc:
            failed = repr(exc)
        finally:
            await store.close()
        if failed is None or time.monotonic() >= deadline:
            return failed
        await asyncio.sleep(0.5)


# ------------------------------------------------------------------- writes replicas acknowledge


@pytest.mark.parametrize("kind", ["sentinel", "cluster"])
async def test_a_write_can_wait_for_its_replicas_and_fails_when_too_few_hold_it(kind):
    async with _topology(kind) as (url, _ports):
        # 1 s: a replica's ack within the call's timeout even on a loaded machine (the suite runs
        # in parallel; 300 ms was missed there); the failing write below is bounded by it all the same.
        store = RedisStore(url, timeout_ms=1000, max_connections=4)
        try:
            for i in range(12):  # keys on every master of a cluster
                assert await store.add(f"r{i}", b"x", 30, replicas=1)
                await store.set(f"r{i}", b"y", 30, replicas=1)
            assert not await store.add("r0", b"z", 30, replicas=1)  # NX: taken, and nothing waited for
            t0 = time.monotonic()
            with pytest.raises(StoreError, match="1 of 2 replica"):
                await store.set("r1", b"z", 30, replicas=2)  # each master has one replica
            assert time.monotonic() - t0 < 1.0 + 0.3  # the timeout, and no more
            assert await store.get("r1") == b"z"  # it stands on the master (and its one replica)
        finally:
            await store.close()


async def test_on_a_redis_without_replicas_a_write_that_asks_for_one_fails():
    async with redis_server() as url:
        store = RedisStore(url, timeout_ms=200, max_connections=2)
        try:
            with pytest.raises(StoreError, match="0 of 1 replica"):
                await store.add("k", b"v", 10, replicas=1)
            await store.set("k2", b"v", 10)  # without: the master's word
        finally:
            await store.close()


# ---------------------------------------------------------------------------------------- TLS


def _certs(d: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, signed by it (openssl)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca", "-keyout", "ca.key", "-out", "ca.pem")
    for who, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={who}", "-keyout", f"{who}.key", "-out", f"{who}.csr")
        (d / f"{who}.ext").write_text(ext + "\n")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
            "-extfile", f"{who}.ext", "-out", f"{who}.pem")
    return {n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@asynccontextmanager
async def _tls_redis(d: Path) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """A redis-server that speaks only TLS and wants a client certificate."""
    needs_tool("openssl")  # as for redis-server: a skip here, a failure under CI
    certs = _certs(d)
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        needs_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--tls-cert-file", certs["server.pem"], "--tls-key-file", certs["server.key"], "--tls-ca-cert-file", certs["ca.pem"],
        "--tls-auth-clients", "yes", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                break
            await asyncio.sleep(0.05)
        yield f"rediss://127.0.0.1:{port}/0", certs
    finally:
        proc.terminate()
        await proc.wait()


async def test_a_tls_redis_with_client_certificates(tmp_path, upstream, gateway):
    async with _tls_redis(tmp_path) as (url, certs):
        tls = {"ca_file": certs["ca.pem"], "cert_file": certs["client.pem"], "key_file": certs["client.key"]}
        store = RedisStore(url, timeout_ms=1000, tls=StoreTlsPolicy(**tls))
        try:
            await store.set("k", b"over tls", 10)
            assert await store.get("k") == b"over tls"
        finally:
            await store.close()
        # Without its certificate the client is refused; without the CA the server is not trusted.
        for partial in ({"ca_file": certs["ca.pem"]}, {"cert_file": certs["client.pem"], "key_file": certs["client.key"]}):
            store = RedisStore(url, timeout_ms=1000, tls=StoreTlsPolicy(**partial))
            try:
                with pytest.raises(StoreError):
                    await store.set("k", b"x", 10)
            finally:
                await store.close()
        # Through the policy: the second answer comes from the cache on that Redis.
        up = await upstream("up", tokens=3)
        gw = await gateway(simple_policy(up, store={"url": url, "tls": tls, "timeout_ms": 1000}))
        async with aiohttp.ClientSession() as http:
            body = {"model": "gpt-test", "messages": [{"role": "user", "content": "tls?"}], "temperature": 0}
            seen = []
            for _ in range(2):
                async with http.post(gw.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200
                    seen.append(r.headers["x-gateway-cache"])
        assert seen == ["miss", "hit"]
