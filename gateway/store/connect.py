"""Every Redis client of the gateway is made here, from the policy's `store` section: one Redis
(`redis://`, `rediss://`, `unix://`), a master found through Sentinel (`redis+sentinel://`), or a
Cluster (`redis+cluster://`); TLS from the URL's scheme (`rediss...`) and `store.tls`.

Each client has a bounded pool (`max_connections`) that callers wait on, within their own
timeout, instead of opening more: a single Redis through redis-py's BlockingConnectionPool, a
Sentinel master and a Cluster (whose pools refuse rather than wait) through a semaphore in front
of their commands. So a process holds at most the sum of its clients' bounds, whatever the load
(docs/operations.md, "Connection budget"). Also here: writes acknowledged by replicas (WAIT),
and the start-up check of the budget against the server's maxclients.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any, TypeVar, cast

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, PipelineCommand, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError, SlotNotCoveredError

from ..config.policy import StorePolicy, StoreTlsPolicy
from .target import Topology, parse_target

log = logging.getLogger("gateway.store")

T = TypeVar("T")

__all__ = ["FAILURES", "connect", "close_client", "relearn", "write_acked", "budget", "store_warnings", "warn_over_budget", "ADMIN_CONNECTIONS"]

# What a Redis call can fail with: a Cluster's client also raises RedisClusterException (no
# RedisError), for one when no node answers while it re-reads the topology.
FAILURES = (RedisError, RedisClusterException, OSError, TimeoutError)


def connect(
    url: str, tls: StoreTlsPolicy | None, *, timeout_s: float, max_connections: int, name: str, retries: int = 1
) -> Any:
    """A redis.asyncio client of the store at `url` (a `store.url`; `tls`: its `store.tls`) for
    callers that bound each call by `timeout_s` (asyncio.timeout): at most `max_connections`
    connections per node, waited for within that timeout, each named `name` on the server
    (CLIENT LIST shows whose they are); `retries` immediate retries of a failed command."""
    target = parse_target(url)
    # The callers bound each call with asyncio.timeout(timeout_s). redis-py's own timeouts, where
    # kept, are a backstop 50 ms past it: when both expired together, Python 3.11's nested
    # timeouts could turn the caller's cancellation into redis-py's TimeoutError, which its retry
    # then absorbed (a 150 ms call took 450 ms).
    backstop = timeout_s + 0.05
    common: dict[str, Any] = {
        "socket_timeout": backstop,
        "socket_connect_timeout": backstop,
        "client_name": name,
        **_tls(target.tls, tls),
    }
    if target.topology is Topology.SINGLE:
        pool = BlockingConnectionPool.from_url(
            target.url,
            max_connections=max_connections,
            timeout=backstop,  # waiting for a free pooled connection counts against the caller's budget
            # One immediate retry: after a Redis restart, the first command on each stale pooled
            # connection fails; the retry on a fresh connection hides that. No backoff: we have ms.
            retry=Retry(NoBackoff(), retries),
            # No read or write timeout of redis-py's own on one Redis: the caller's bounds each
            # call, and a cancelled read drops its connection. Theirs could absorb the caller's
            # cancellation (a 150 ms call took 950 ms even with them 50 ms past it; without them,
            # 150 ms in 30 of 30 stalls), and a send under them is a task per command. Sentinel
            # and Cluster keep theirs: their callers abandon a command at its deadline, and it
            # must still end by itself.
            **{**common, "socket_timeout": None},
        )
        return Redis(connection_pool=pool)
    auth = {"username": target.username, "password": target.password}
    if target.tls:
        common["ssl"] = True  # their clients take no scheme: TLS is a flag
    if target.topology is Topology.SENTINEL:
        # Asking the sentinels where the master is happens once per new connection: give it a
        # few hundred ms even when the calls have ten (the calls' own timeout still bounds them).
        t = max(timeout_s, 0.25)
        asking = {**common, "socket_timeout": t, "socket_connect_timeout": t}
        del asking["client_name"]
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=asking)  # type: ignore[no-untyped-call]
        spool = SentinelConnectionPool(  # type: ignore[no-untyped-call]
            target.service,
            sentinel,
            is_master=True,
            max_connections=max_connections,
            db=target.db,
            retry=Retry(NoBackoff(), retries),
            **auth,
            **common,
        )
        return _GatedRedis(connection_pool=spool, gate=max_connections)
    return _GatedCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in target.hosts],
        max_connections=max_connections,  # per node; the gate keeps the sum at this too
        gate=max_connections,
        # A node that is down fails the command at once; the client re-reads the topology on
        # the next one, so a promoted replica is found without us (and without a restart).
        retry=Retry(NoBackoff(), retries),
        **auth,
        **common,
    )


async def close_client(client: Any) -> None:
    """Close a client of connect() and every connection of its pool."""
    await client.aclose()
    pool = getattr(client, "connection_pool", None)
    if pool is not None:  # a Cluster's client closes its nodes' pools itself
        await pool.aclose()


async def relearn(client: Any) -> None:
    """Have a Cluster's client read the slots' masters again now (its commands do it by themselves
    after errors; a pub/sub subscription, which is not a command, does not)."""
    if isinstance(client, RedisCluster):
        await client.nodes_manager.initialize()


async def write_acked(client: Any, command: tuple[Any, ...], replicas: int, wait_ms: int) -> tuple[Any, int]:
    """Send `command` (a write of the key `command[1]`) and WAIT for `replicas` replicas on one
    connection (WAIT counts the writes of its own connection); its reply and how many replicas
    acknowledged it within `wait_ms`. On Sentinel and Cluster it takes its turn at the client's
    gate like any command: the pair bypasses execute_command, and their pools refuse rather than
    wait (36 of a burst of 40 failed "Too many connections" with a pool of 4)."""
    if isinstance(client, _Gated):
        return cast("tuple[Any, int]", await client.gated(_write_acked(client, command, replicas, wait_ms)))
    return await _write_acked(client, command, replicas, wait_ms)


async def _write_acked(client: Any, command: tuple[Any, ...], replicas: int, wait_ms: int) -> tuple[Any, int]:
    if not isinstance(client, RedisCluster):
        async with client.pipeline(transaction=False) as pipe:
            pipe.execute_command(*command)
            pipe.execute_command("WAIT", replicas, wait_ms)
            got, acks = await pipe.execute()
        return got, int(acks)
    # A Cluster's client sends WAIT to every node (and sums the answers): the pair goes to the
    # key's master on one of its connections, as the client's own pipelines do.
    pair = [PipelineCommand(0, *command), PipelineCommand(1, "WAIT", replicas, wait_ms)]
    await client.initialize()  # a no-op once the slots are known
    node = client.get_node_from_key(command[1])
    if node is None:
        raise SlotNotCoveredError(f"no master serves the slot of {command[1]!r}")
    await node.execute_pipeline(pair)
    for c in pair:
        if isinstance(c.result, Exception):
            await relearn(client)  # MOVED after a failover: the next try goes to the new master
            raise c.result
    return pair[0].result, int(cast("int", pair[1].result))


def budget(sp: StorePolicy, workers: int) -> int:
    """The most connections one replica (`workers` processes serving) opens to each Redis node
    of `sp`: per process the cache's, the quotas' and the Responses records' pools and the admin
    plane's two small ones; per replica the reload channel's."""
    # A Cluster's client keeps one more connection to the node it reads the topology from.
    extra = 1 if sp.url is not None and parse_target(sp.url).topology is Topology.CLUSTER else 0
    per_process = 3 * (sp.max_connections + extra) + 2 * (ADMIN_CONNECTIONS + extra)
    return workers * per_process + ADMIN_CONNECTIONS + extra + 1  # + the subscription's own connection


async def store_warnings(sp: StorePolicy, workers: int, *, evicts: bool = False) -> list[str | None]:
    """[the connection budget's problem, the eviction's problem] of the Redis `sp` names (each
    None when there is none, or the server cannot say). `evicts`: the store may evict (a cache's
    own), so eviction is no problem."""
    assert sp.url is not None
    client = connect(sp.url, sp.tls, timeout_s=2.0, max_connections=1, name=f"gw-check-{os.getpid()}", retries=0)
    try:
        async with asyncio.timeout(3.0):
            if isinstance(client, RedisCluster):  # every node, by name: the tightest counts
                infos = list((await client.info("clients", target_nodes=RedisCluster.ALL_NODES)).values())
                memory = list((await client.info("memory", target_nodes=RedisCluster.ALL_NODES)).values())
            else:
                infos, memory = [await client.info("clients")], [await client.info("memory")]
    except Exception:  # noqa: BLE001 - the store is down or refuses INFO: the calls will say so
        return [None, None]
    finally:
        await close_client(client)
    return [_over_budget(sp, workers, infos), None if evicts else _evicting(memory)]


def _over_budget(sp: StorePolicy, workers: int, infos: list[Any]) -> str | None:
    tightest = min(infos, key=lambda i: int(i.get("maxclients", 0) or 0))
    maxclients, connected = int(tightest.get("maxclients", 0) or 0), int(tightest.get("connected_clients", 0) or 0)
    need = sp.replicas * budget(sp, workers)
    if not maxclients or need <= maxclients:
        return None
    return (f"store: {sp.replicas} replica(s) x {budget(sp, workers)} connections ({workers} worker(s), "
            f"store.max_connections {sp.max_connections}) = {need} may be opened to each Redis node, "
            f"more than its maxclients {maxclients} ({connected} connected now): lower store.max_connections, or raise "
            "maxclients, or callers past it are refused by Redis (docs/operations.md, connection budget)")


def _evicting(memory: list[Any]) -> str | None:
    """Whether a node evicts keys past its maxmemory: the quota counters and Responses records
    have TTLs and go with the cache's least recently used entries (an idle tenant's day of tokens
    and spend started again under volatile-lru: review helper's repro); allkeys-lru takes the
    virtual keys too."""
    for info in memory:
        policy = str(info.get("maxmemory_policy") or "noeviction")
        if int(info.get("maxmemory", 0) or 0) and policy != "noeviction":
            return (f"store: Redis evicts keys past its maxmemory ({policy}): quota counters, Responses records"
                    f"{' and virtual keys' if policy.startswith('allkeys') else ''} may go with the cache's entries "
                    "(a tenant's daily limits start again); run it with noeviction and give the cache a Redis of "
                    "its own that may evict (cache.store.url; docs/operations.md)")
    return None


async def warn_over_budget(sp: StorePolicy, workers: int) -> None:
    """Log what is wrong with the store (`store_warnings`: its connection budget, and eviction,
    which it must not do), if anything (at start, in the background: it waits on Redis)."""
    if sp.url is not None:
        for problem in await store_warnings(sp, workers):
            if problem is not None:
                log.warning("%s", problem)


ADMIN_CONNECTIONS = 2  # the pool of each admin-plane client (keys, request log, reload channel)


class _Gated:
    """Mixin for the clients of Sentinel and Cluster: at most `gate` commands in flight, the rest
    wait their turn within their caller's timeout (their pools refuse rather than wait), and the
    callers' deadlines hold. Their command paths can absorb a cancellation (on Python 3.11 a
    timeout nested in their reconnects and retries turns it into a retry that goes on), so each
    command runs in a task of its own that the caller stops waiting for at its deadline; the task
    keeps its place at the gate until it ends, so the bound holds."""

    _gate: asyncio.Semaphore

    def execute_command(self, *args: Any, **options: Any) -> Coroutine[Any, Any, Any]:
        # Not async itself: its caller awaits gated() directly, no frame more per command.
        return self.gated(super().execute_command(*args, **options))  # type: ignore[misc]

    async def gated(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` (Redis calls on this client's pools that do not pass execute_command: a
        pipeline) in its turn at the gate, in a task of its own (above)."""
        try:
            await self._gate.acquire()
        except BaseException:
            work.close()  # never started: no "never awaited" warning
            raise
        try:
            task = asyncio.ensure_future(_as_store_failure(work))
        except BaseException:
            self._gate.release()
            work.close()
            raise
        task.add_done_callback(self._ended)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            raise

    def _ended(self, task: asyncio.Future[Any]) -> None:
        self._gate.release()
        if not task.cancelled():
            task.exception()  # an abandoned command's failure was already its caller's timeout


async def _as_store_failure(work: Coroutine[Any, Any, T]) -> T:
    try:
        return await work
    except FAILURES:
        raise
    except Exception as exc:
        raise _client_failure(exc) from exc


def _client_failure(exc: Exception) -> RedisConnectionError:
    """A failure of the client itself, as a store failure (callers fail open): redis-py's
    Sentinel and Cluster clients race with their own reconnects while a master fails over (a
    command sent on a connection another task just closed: AttributeError on its writer; a slot
    looked up while the topology is re-read: KeyError)."""
    return RedisConnectionError(f"the Redis client failed: {type(exc).__name__}: {exc}")


class _GatedRedis(_Gated, Redis):  # type: ignore[misc]  # redis-py's own bases disagree
    def __init__(self, *args: Any, gate: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gate = asyncio.Semaphore(gate)


class _GatedCluster(_Gated, RedisCluster):  # type: ignore[misc]
    def __init__(self, *args: Any, gate: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gate = asyncio.Semaphore(gate)


def _tls(on: bool, tls: StoreTlsPolicy | None) -> dict[str, Any]:
    if not on or tls is None:
        return {}  # plain, or TLS with the system's CAs and the hostname checked (redis-py's defaults)
    out: dict[str, Any] = {"ssl_cert_reqs": "required", "ssl_check_hostname": tls.check_hostname}
    if tls.ca_file:
        out["ssl_ca_certs"] = os.path.expanduser(tls.ca_file)
    if tls.cert_file:
        out["ssl_certfile"] = os.path.expanduser(tls.cert_file)
    if tls.key_file:
        out["ssl_keyfile"] = os.path.expanduser(tls.key_file)
    return out
