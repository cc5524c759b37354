"""The Redis topology harness itself (tests/redis_topology.py), checked with plain redis-py clients:
a cluster fails a killed master over to its replica, sentinels promote the replica of a killed master.

Each test starts its own redis-server processes on free loopback ports (skipped without
redis-server / redis-cli, failed under CI) and takes a few seconds.
"""

from __future__ import annotations

import asyncio

from redis.asyncio.cluster import ClusterNode as Seed
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel

from tests.redis_topology import redis_cluster, redis_sentinel


async def test_cluster_fails_a_killed_master_over_to_its_replica() -> None:
    async with redis_cluster(masters=3, replicas_per_master=1) as cluster:
        assert cluster.url == "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in cluster.seeds)
        nodes = cluster.nodes()
        assert sorted(n.role for n in nodes) == ["master"] * 3 + ["replica"] * 3
        assert sum(hi - lo + 1 for n in nodes for lo, hi in n.slots) == 16384

        client = RedisCluster(startup_nodes=[Seed(h, p) for h, p in cluster.seeds], decode_responses=True, socket_timeout=1)
        try:
            keys = [f"key:{i}" for i in range(100)]
            for k in keys:
                await client.set(k, k)
            assert [await client.get(k) for k in keys] == keys
            assert len({cluster.master_of(k) for k in keys}) == 3  # the keys span every master

            key = keys[0]
            old = cluster.master_of(key)
            cluster.kill(old)
            took = await cluster.wait_ok(15)
            assert took < 15
            new = cluster.master_of(key)
            assert new != old and new in cluster.live_ports()
            assert old not in [n.port for n in cluster.nodes()]
            assert len([n for n in cluster.nodes() if n.role == "master"]) == 3

            for k in keys:  # the same client: it finds the new master by itself
                await client.set(k, "after")
            assert [await client.get(k) for k in keys] == ["after"] * 100
        finally:
            await client.aclose()


async def test_sentinels_promote_the_replica_of_a_killed_master() -> None:
    async with redis_sentinel("gwmaster") as topo:
        assert topo.url == "redis+sentinel://" + ",".join(f"{h}:{p}" for h, p in topo.sentinels) + "/gwmaster"
        sentinel = Sentinel(topo.sentinels, socket_timeout=1)  # type: ignore[no-untyped-call]
        clients = [sentinel.master_for("gwmaster", decode_responses=True, socket_timeout=1)]
        try:
            await clients[0].set("before", "1")
            assert await clients[0].wait(1, 2000) == 1  # on the replica before the master dies

            old = topo.kill_master()
            took = await topo.wait_promoted(old, 15)
            assert took < 15
            new = topo.master_port()
            assert new != old

            clients.append(sentinel.master_for("gwmaster", decode_responses=True, socket_timeout=1))
            await clients[1].set("after", "2")
            assert await clients[1].get("after") == "2"
            assert await clients[1].get("before") == "1"
            assert (await clients[1].execute_command("ROLE"))[0] == "master"
        finally:
            await asyncio.gather(*(c.aclose() for c in clients), *(s.aclose() for s in sentinel.sentinels))
