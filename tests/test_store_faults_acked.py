"""Writes that replicas acknowledge (`responses.record_replicas`) under a burst, on Sentinel and
on a Cluster: store/connect.write_acked sends the write and its WAIT on one connection (a pipeline
on Sentinel, the node's pipeline on a Cluster), which bypassed the semaphore that every other
command of those clients waits at; their pools refuse rather than wait, so 36 of a burst of 40
such writes failed "Too many connections", and 28 of 40 stateful answers were withheld (503
response_record_failed). Real redis-server processes on loopback (tests/redis_topology.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import redis

from gateway.responses.affinity import Affinity, RecordFailed
from gateway.store.core import StoreError
from gateway.store.redis_store import RedisStore
from tests.redis_topology import redis_cluster, redis_sentinel


@asynccontextmanager
async def _records(kind: str, timeout_ms: int) -> AsyncIterator[tuple[RedisStore, list[int]]]:
    """A Responses records' store (a pool of 4) on a fresh topology of `kind`, once a write is
    acknowledged by a replica there; and the ports of its masters."""
    cm = redis_sentinel() if kind == "sentinel" else redis_cluster()
    async with cm as topo:
        ports = [topo.master_port()] if kind == "sentinel" else [p for _, p in topo.seeds]
        store = RedisStore(topo.url, timeout_ms=timeout_ms, max_connections=4, quotas=False, role="records")
        try:
            async with asyncio.timeout(10):  # set-up: the replicas attach, the client learns the topology
                while True:
                    with contextlib.suppress(StoreError):
                        await store.set("warm", b"1", 10, replicas=1)
                        break
                    await asyncio.sleep(0.05)
            yield store, ports
        finally:
            await store.close()


def _ours(port: int) -> int:
    with redis.Redis(port=port) as r:
        return sum(1 for c in r.client_list() if c.get("name") == f"gw-records-{os.getpid()}")


@pytest.mark.parametrize("kind", ["sentinel", "cluster"])
async def test_a_burst_of_acknowledged_writes_waits_for_the_pool_and_keeps_its_bound(kind):
    async with _records(kind, 1000) as (store, ports):
        # 10x the pool, all on one slot (one master of a Cluster): each write + WAIT takes ~1 ms,
        # well within the 1 s timeout once it has its turn.
        keys = [f"{{same}}:r{i}" for i in range(40)]
        results = await asyncio.gather(*(store.add(k, b"x", 30, replicas=1) for k in keys), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, f"{len(failed)} of 40 failed: {failed[:3]}"
        assert all(_ours(p) <= 4 + (kind == "cluster") for p in ports)
        # While the masters answer nobody, the callers still end at their own timeout, waiting
        # for their turn or for their write, and no connection is opened past the bound.
        for p in ports:
            with redis.Redis(port=p) as r:
                r.execute_command("CLIENT", "PAUSE", 400, "ALL")  # shorter than the sentinels' down-after
        started = time.monotonic()
        waits = await asyncio.gather(*(asyncio.wait_for(store.set(k, b"y", 30, replicas=1), 0.35) for k in keys),
                                     return_exceptions=True)
        assert time.monotonic() - started < 0.35 + 0.5  # a slack for a loaded machine; never the pause's
        assert all(isinstance(w, (StoreError, TimeoutError)) or w is None for w in waits), waits
        await asyncio.sleep(0.5)
        assert all(_ours(p) <= 4 + (kind == "cluster") for p in ports), [_ours(p) for p in ports]


async def test_a_burst_of_stateful_answers_with_record_replicas_is_not_withheld():
    """The same through the Responses records with the policy's defaults (250 ms x 3 tries)."""
    async with _records("sentinel", 250) as (store, _ports):
        records = Affinity(store, 600, timeout_s=0.25, attempts=3, replicas=1)
        results = await asyncio.gather(*(records.record([f"resp_{i}"], "b1", "tenant-a") for i in range(40)),
                                       return_exceptions=True)
        withheld = [r for r in results if isinstance(r, RecordFailed)]
        assert not withheld, f"{len(withheld)} of 40 stateful answers withheld (503)"
        assert not [r for r in results if isinstance(r, BaseException)], results
