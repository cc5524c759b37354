"""Real Redis topologies on loopback for chaos tests: a Redis Cluster (masters with replicas) and a
Sentinel set (a master, a replica, three sentinels).

Every process is one the harness started: it is killed only by its own PID, and stopped (SIGTERM,
then SIGKILL) when the context manager exits, test failure or not. Each process logs to a file in
the topology's private temporary directory (removed at the end); a failed start quotes the tail of
the relevant log. The probes are short synchronous calls to local processes (no retries, a 1 s
socket timeout); every wait sleeps with `await asyncio.sleep`, never blocking the event loop.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.procs import free_port, needs_redis_server, needs_tool

__all__ = ["Cluster", "ClusterNode", "SentinelSet", "needs_redis_cli", "redis_cluster", "redis_sentinel"]

HOST = "127.0.0.1"
SLOTS = 16384
BUS_OFFSET = 10000  # a cluster node also listens on port + 10000 (the cluster bus)
POLL_S = 0.05
# Settings for every data node: no persistence, loopback only, and a full sync that starts at once
# (7.0's diskless sync otherwise waits 5 s for more replicas before it sends the first RDB).
DATA_NODE_ARGS = ["--save", "", "--appendonly", "no", "--bind", HOST, "--repl-diskless-sync-delay", "0"]


def needs_redis_cli() -> str:
    """The path of redis-cli; a skip, or a failure under CI, when it is not installed."""
    return needs_tool("redis-cli")


@contextmanager
def _client(port: int) -> Iterator[redis.Redis]:
    """A short-lived client of a local node: no retries (redis-py's default backs off for seconds,
    blocking the loop), a 1 s timeout, text answers."""
    client = redis.Redis(
        host=HOST, port=port, decode_responses=True, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    try:
        yield client
    finally:
        client.close()


def _command(client: redis.Redis, *args: str) -> Any:
    """A command whose first word has no redis-py parser (CLUSTER ..., ROLE): the server's answer as sent."""
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
        return True


class _PortTaken(Exception):
    """The port picked for a process was taken before the process could bind it: pick another."""


class _Procs:
    """The processes one topology started, by port; each logs to `<dir>/<name>-<port>.log`."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.names: dict[int, str] = {}
        self.taken: set[int] = set()

    def pick_port(self, bus: bool = False) -> int:
        """A free port not yet used by this topology; with `bus`, its cluster bus port is free too."""
        while True:
            port = free_port()
            if port in self.taken:
                continue
            bus_port = port + BUS_OFFSET
            if bus and (bus_port > 65535 or bus_port in self.taken or not _bindable(bus_port)):
                continue
            self.taken.update((port, bus_port) if bus else (port,))
            return port

    def log(self, port: int) -> Path:
        return self.dir / f"{self.names[port]}-{port}.log"

    def tail(self, port: int, chars: int = 2000) -> str:
        try:
            return self.log(port).read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(no log: {e})"

    def spawn(self, name: str, port: int, argv: list[str]) -> None:
        self.names[port] = name
        # A file, not a PIPE: a chatty process never blocks on output nobody reads.
        with self.log(port).open("wb") as out:
            self.procs[port] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=self.dir)

    def alive(self, port: int) -> bool:
        proc = self.procs.get(port)
        return proc is not None and proc.poll() is None

    def kill(self, port: int) -> None:
        """SIGKILL the process this topology started on `port` (by its PID), and reap it."""
        proc = self.procs.get(port)
        if proc is None:
            raise ValueError(f"no process of this topology listens on {port}")
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)  # a SIGKILLed process is gone within milliseconds

    async def stop_all(self, grace_s: float = 3.0) -> None:
        """SIGTERM every process still running, SIGKILL those that outlive `grace_s`; reap them all."""
        running = [p for p in self.procs.values() if p.poll() is None]
        for p in running:
            p.send_signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        end = loop.time() + grace_s
        while any(p.poll() is None for p in running) and loop.time() < end:
            await asyncio.sleep(POLL_S)
        for p in running:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait(5)

    async def start(self, name: str, argv_for: Callable[[int], list[str]], bus: bool = False, timeout_s: float = 10.0) -> int:
        """Start `argv_for(port)` on a fresh port and wait until it answers PING; returns the port.
        A port grabbed by someone else in between is retried with another one."""
        for _ in range(3):
            port = self.pick_port(bus)
            self.spawn(name, port, argv_for(port))
            try:
                await self._wait_ping(port, timeout_s)
                return port
            except _PortTaken:
                continue
        raise AssertionError(f"{name}: no free port after 3 tries; last log: {self.tail(port)}")

    async def _wait_ping(self, port: int, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while True:
            rc = self.procs[port].poll()
            if rc is not None:
                tail = self.tail(port)
                if "Address already in use" in tail:
                    raise _PortTaken()
                raise AssertionError(f"{self.names[port]} on {port} exited with {rc}: {tail}")
            try:
                with _client(port) as c:
                    if c.ping():
                        return
            except redis.RedisError:
                pass
            if loop.time() > end:
                raise AssertionError(f"{self.names[port]} on {port} did not answer PING within {timeout_s} s: {self.tail(port)}")
            await asyncio.sleep(POLL_S)


def _replicas_offline(port: int, repl: dict[str, Any], at_least: int) -> str | None:
    """None when a master (its INFO replication: `repl`) lists at least `at_least` replicas, every
    one online: after a diskless sync a master puts a replica online only at its first REPLCONF
    ACK, up to a second after the replica's side says "up", and until then a WAIT counts it out."""
    states = [v.get("state") for k, v in repl.items() if k.startswith("slave") and isinstance(v, dict)]
    if len(states) < at_least or any(state != "online" for state in states):
        return f"master {port}: replicas {states}"
    return None


async def _until(check: Callable[[], str | None], timeout_s: float, what: str) -> float:
    """Poll `check` (None: done; otherwise what is still wrong) until done; returns the seconds it
    took, AssertionError with the last problem after `timeout_s`. `check` talks to the nodes with
    blocking clients, so it runs in a thread: on the event loop it froze, for as long as a node
    took to answer, the gateways and load clients a test runs on that loop."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        problem = await asyncio.to_thread(check)
        took = loop.time() - start
        if problem is None:
            return took
        if took > timeout_s:
            raise AssertionError(f"{what} not within {timeout_s} s: {problem}")
        await asyncio.sleep(POLL_S)


@asynccontextmanager
async def _topology(prefix: str) -> AsyncIterator[_Procs]:
    """A private temporary directory and the processes started in it: all stopped, the directory
    removed, whatever happens."""
    procs = _Procs(Path(tempfile.mkdtemp(prefix=prefix)))
    try:
        yield procs
    finally:
        try:
            await procs.stop_all()
        finally:
            shutil.rmtree(procs.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- cluster


class ClusterNode(NamedTuple):
    """One node as the cluster lists it."""

    port: int
    role: str  # "master" or "replica"
    slots: list[tuple[int, int]]  # inclusive ranges; empty for a replica


class _Line(NamedTuple):
    """A parsed CLUSTER NODES line."""

    id: str
    port: int
    flags: frozenset[str]
    master_id: str  # "-" for a master
    slots: list[tuple[int, int]]


def _parse_nodes(text: str) -> list[_Line]:
    lines = []
    for raw in text.splitlines():
        parts = raw.split()
        if len(parts) < 8:
            continue
        # address: ip:port@cport[,hostname]
        port = int(parts[1].split("@", 1)[0].rsplit(":", 1)[1])
        slots = []
        for s in parts[8:]:
            if s.startswith("["):  # a slot being imported or migrated: not served here yet
                continue
            lo, _, hi = s.partition("-")
            slots.append((int(lo), int(hi or lo)))
        lines.append(_Line(parts[0], port, frozenset(parts[2].split(",")), parts[3], slots))
    return lines


class Cluster:
    """A running Redis Cluster on loopback. Every method that reads the cluster's state asks a node
    the harness has not killed."""

    def __init__(self, procs: _Procs, masters: list[int], ports: list[int]) -> None:
        self._procs = procs
        self.ports = ports  # every node started, killed ones included
        self.seeds: list[tuple[str, int]] = [(HOST, p) for p in masters]  # the masters at start
        self.url = "redis+cluster://" + ",".join(f"{HOST}:{p}" for p in masters)

    def live_ports(self) -> list[int]:
        """The nodes whose processes are still running."""
        return [p for p in self.ports if self._procs.alive(p)]

    def live_url(self) -> str:
        """A `redis+cluster://` URL seeded with the nodes still running: once a node is killed,
        its port is free for any process on the machine (the suite runs in parallel), and a
        client that tries a seed there may wait on something that is not Redis."""
        return "redis+cluster://" + ",".join(f"{HOST}:{p}" for p in self.live_ports())

    def log_tail(self, port: int, chars: int = 2000) -> str:
        """The end of a node's log (for an assertion message)."""
        return self._procs.tail(port, chars)

    def _lines(self) -> list[_Line]:
        errors = []
        for port in self.live_ports():
            try:
                with _client(port) as c:
                    return _parse_nodes(_command(c, "CLUSTER", "NODES"))
            except redis.RedisError as e:
                errors.append(f"{port}: {e!r}")
        raise AssertionError(f"no live cluster node answers CLUSTER NODES: {errors}")

    def nodes(self) -> list[ClusterNode]:
        """The nodes the cluster lists, as (port, role, slot ranges), less those the harness killed
        and those the cluster has marked failed."""
        return [
            ClusterNode(n.port, "master" if "master" in n.flags else "replica", n.slots)
            for n in self._lines()
            if self._procs.alive(n.port) and not n.flags & {"fail", "noaddr", "handshake"}
        ]

    def master_of(self, key: str) -> int:
        """The port of the master the cluster says serves `key`'s slot (a killed master until
        failover). LookupError when no master claims the slot."""
        slot = self._keyslot(key)
        for n in self._lines():
            if "master" in n.flags and any(lo <= slot <= hi for lo, hi in n.slots):
                return n.port
        raise LookupError(f"no master serves slot {slot} (key {key!r})")

    def _keyslot(self, key: str) -> int:
        for port in self.live_ports():
            try:
                with _client(port) as c:
                    return int(_command(c, "CLUSTER", "KEYSLOT", key))
            except redis.RedisError:
                continue
        raise AssertionError("no live cluster node answers CLUSTER KEYSLOT")

    def kill(self, port: int) -> None:
        """SIGKILL the node on `port` (only a process this harness started, by its PID)."""
        self._procs.kill(port)

    async def wait_ok(self, timeout_s: float = 20.0) -> float:
        """Wait until every live node says cluster_state:ok and, in every live node's view alike,
        each slot has a master that is alive and answers PING; returns the seconds it took."""
        return await _until(self.problem, timeout_s, "cluster state ok")

    def problem(self) -> str | None:
        """What keeps the cluster from being ok (see wait_ok), or None."""
        views: dict[int, tuple[tuple[int, int, int], ...]] = {}
        for port in self.live_ports():
            try:
                with _client(port) as c:
                    info = _command(c, "CLUSTER", "INFO")
                    if "cluster_state:ok" not in info:
                        return f"node {port}: CLUSTER INFO\n{info}"
                    lines = _parse_nodes(_command(c, "CLUSTER", "NODES"))
            except redis.RedisError as e:
                return f"node {port}: {e!r}"
            owned = sorted((lo, hi, n.port) for n in lines if "master" in n.flags for lo, hi in n.slots)
            next_slot = 0
            for lo, hi, owner in owned:
                if lo != next_slot:
                    return f"node {port}: slots {next_slot}..{lo - 1} have no master (CLUSTER INFO\n{info})"
                if not self._procs.alive(owner):
                    return f"node {port}: slots {lo}-{hi} are still served by the dead node {owner}"
                next_slot = hi + 1
            if next_slot != SLOTS:
                return f"node {port}: slots {next_slot}..{SLOTS - 1} have no master (CLUSTER INFO\n{info})"
            views[port] = tuple(owned)
        if len(set(views.values())) > 1:
            return f"nodes disagree on who serves which slots: {views}"
        for owner in {o for view in views.values() for _, _, o in view}:
            try:
                with _client(owner) as c:
                    c.ping()
            except redis.RedisError as e:
                return f"master {owner} does not answer PING: {e!r}"
        return None

    def _roles_problem(self, masters: int, replicas: int) -> str | None:
        """None once the cluster lists `masters` masters and `replicas` replicas."""
        roles = sorted(n.role for n in self.nodes())
        return None if roles == ["master"] * masters + ["replica"] * replicas else f"roles listed: {roles}"

    def _replicas_problem(self, per_master: int) -> str | None:
        """None once every replica follows a master and its replication link is up, and every
        master counts `per_master` replicas, each online (`_replicas_offline`). A node still a
        master of no slots is a replica to be: with at least 0 replicas it passed, and a WAIT
        right after the setup found its master's replica not yet there (0 of 1 acknowledged)."""
        for port in self.live_ports():
            try:
                with _client(port) as c:
                    me = next(n for n in _parse_nodes(_command(c, "CLUSTER", "NODES")) if "myself" in n.flags)
                    repl = c.info("replication")
            except redis.RedisError as e:
                return f"node {port}: {e!r}"
            if "master" in me.flags:
                if not me.slots:
                    return f"node {port}: a master of no slots (a replica to be)"
                if (problem := _replicas_offline(port, repl, at_least=per_master)) is not None:
                    return problem
            elif repl.get("master_link_status") != "up":
                return f"replica {port}: {repl}"
        return None


@asynccontextmanager
async def redis_cluster(masters: int = 3, replicas_per_master: int = 1) -> AsyncIterator[Cluster]:
    """A Redis Cluster of `masters` masters with `replicas_per_master` replicas each, on loopback
    (node timeout 1 s, replicas always eligible for failover, partial coverage allowed); yields once
    the cluster is ok on every node, every slot is served and every replica is in sync."""
    exe = needs_redis_server()
    cli = needs_redis_cli()
    async with _topology("redis-cluster-") as procs:

        def argv(port: int) -> list[str]:
            return [
                exe, "--port", str(port), "--dir", str(procs.dir), *DATA_NODE_ARGS,
                "--cluster-enabled", "yes", "--cluster-config-file", str(procs.dir / f"nodes-{port}.conf"),
                "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
                "--cluster-replica-validity-factor", "0", "--cluster-announce-ip", HOST,
            ]  # fmt: skip

        count = masters * (1 + replicas_per_master)
        ports = list(await asyncio.gather(*(procs.start("node", argv, bus=True) for _ in range(count))))
        # redis-cli makes the first `masters` addresses the masters.
        create = [cli, "--cluster", "create", *(f"{HOST}:{p}" for p in ports)]
        create += ["--cluster-replicas", str(replicas_per_master), "--cluster-yes"]
        created = await _run(procs.dir, "cluster-create", create, timeout_s=30)
        cluster = Cluster(procs, ports[:masters], ports)
        try:
            await cluster.wait_ok(20)
            await _until(lambda: cluster._replicas_problem(replicas_per_master), 20, "cluster replicas in sync")
            # A replica that still calls itself a master was skipped above, and the node the
            # harness asks may not have heard of a role yet: the roles as it lists them, too.
            await _until(lambda: cluster._roles_problem(masters, count - masters), 20, "cluster roles")
        except AssertionError as e:
            logs = "\n".join(f"node {p} log: {procs.tail(p, 800)}" for p in ports)
            raise AssertionError(f"{e}\nredis-cli --cluster create: {created[-1500:]}\n{logs}") from None
        yield cluster


async def _run(dir: Path, name: str, argv: list[str], timeout_s: float) -> str:
    """Run a one-shot command to completion (polling, never blocking the loop), its output going to
    `<dir>/<name>.log`; returns that output. AssertionError with it when the command fails or
    outlives `timeout_s` (then it is killed, by its PID)."""
    log = dir / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=dir)
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while proc.poll() is None and loop.time() < end:
            await asyncio.sleep(POLL_S)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(5)
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        raise AssertionError(f"{name} exited with {proc.returncode} (or ran past {timeout_s} s): {text[-3000:]}")
    return text


# ---------------------------------------------------------------------------------------------- sentinel


class SentinelSet:
    """A master, its replica and three sentinels (quorum 2) monitoring them as `service`."""

    def __init__(self, procs: _Procs, service: str, data_ports: list[int], sentinel_ports: list[int]) -> None:
        self._procs = procs
        self.service = service
        self.data_ports = data_ports  # the master and the replica at start
        self.sentinels: list[tuple[str, int]] = [(HOST, p) for p in sentinel_ports]
        self.url = "redis+sentinel://" + ",".join(f"{HOST}:{p}" for p in sentinel_ports) + f"/{service}"

    def log_tail(self, port: int, chars: int = 2000) -> str:
        """The end of a process's log (for an assertion message)."""
        return self._procs.tail(port, chars)

    def _ask_all(self) -> dict[int, int | str]:
        """Each live sentinel's answer to get-master-addr-by-name: a port, or what went wrong."""
        answers: dict[int, int | str] = {}
        for _, port in self.sentinels:
            if not self._procs.alive(port):
                continue
            try:
                with _client(port) as c:
                    addr = c.sentinel_get_master_addr_by_name(self.service)  # (ip, port) or None
                answers[port] = int(addr[1]) if isinstance(addr, tuple) else "no master"
            except redis.RedisError as e:
                answers[port] = repr(e)
        return answers

    def master_port(self) -> int:
        """The master's port, as the first live sentinel that knows it says."""
        answers = self._ask_all()
        for answer in answers.values():
            if isinstance(answer, int):
                return answer
        raise AssertionError(f"no sentinel names a master for {self.service}: {answers}")

    def kill_master(self) -> int:
        """SIGKILL the current master's process (by its PID); returns its port."""
        port = self.master_port()
        self._procs.kill(port)
        return port

    async def wait_promoted(self, old_port: int, timeout_s: float = 15.0) -> float:
        """Wait until every live sentinel names the same master other than `old_port`, and that
        node answers ROLE as a master; returns the seconds it took."""

        def problem() -> str | None:
            answers = self._ask_all()
            ports = set(answers.values())
            if len(ports) != 1 or old_port in ports:
                return f"sentinels name {answers} (old master {old_port})"
            (new,) = ports
            assert isinstance(new, int)
            try:
                with _client(new) as c:
                    role = _command(c, "ROLE")
            except redis.RedisError as e:
                return f"new master {new}: {e!r}"
            return None if role[0] == "master" else f"new master {new} says ROLE {role}"

        return await _until(problem, timeout_s, f"failover of {self.service} from {old_port}")

    def _ready_problem(self) -> str | None:
        """None once every sentinel sees the master up, the replica, and the 2 other sentinels."""
        master, replica = self.data_ports
        for _, port in self.sentinels:
            try:
                with _client(port) as c:
                    # redis-py parses these: a dict per instance, numbers as int, flags as a string
                    m = c.sentinel_master(self.service)
                    replicas = c.sentinel_slaves(self.service)
                    assert isinstance(m, dict) and isinstance(replicas, list)
            except redis.RedisError as e:
                return f"sentinel {port}: {e!r}"
            if m.get("flags") != "master" or int(m.get("port", 0)) != master:
                return f"sentinel {port}: master {m}"
            if int(m.get("num-other-sentinels", 0)) != 2:
                return f"sentinel {port} knows {m.get('num-other-sentinels')} other sentinels"
            if not any(int(r["port"]) == replica and r.get("flags") == "slave" for r in replicas):
                return f"sentinel {port}: replicas {replicas}"
        return None


@asynccontextmanager
async def redis_sentinel(service: str = "gwmaster") -> AsyncIterator[SentinelSet]:
    """A master, one replica and three sentinels (quorum 2, down after 500 ms, failover timeout 3 s)
    on loopback; yields once the replica is in sync and every sentinel knows the master, the
    replica and the other two sentinels."""
    exe = needs_redis_server()
    needs_redis_cli()  # the same tools as the cluster: a machine that lacks one skips both alike
    async with _topology("redis-sentinel-") as procs:
        master = await procs.start("master", lambda port: [exe, "--port", str(port), "--dir", str(procs.dir), *DATA_NODE_ARGS])
        replica = await procs.start(
            "replica",
            lambda port: [exe, "--port", str(port), "--dir", str(procs.dir), *DATA_NODE_ARGS, "--replicaof", HOST, str(master)],
        )

        def link_problem() -> str | None:
            """None once the replica's link is up and the master counts it online (`_replicas_offline`)."""
            try:
                with _client(replica) as c:
                    repl = c.info("replication")
                with _client(master) as c:
                    mine = c.info("replication")
            except redis.RedisError as e:
                return f"replica {replica}: {e!r}"
            if repl.get("master_link_status") != "up":
                return f"replica {replica}: {repl}"
            return _replicas_offline(master, mine, at_least=1)

        try:
            await _until(link_problem, 20, "replica in sync")
        except AssertionError as e:
            raise AssertionError(f"{e}\nreplica log: {procs.tail(replica)}\nmaster log: {procs.tail(master)}") from None

        def sentinel_argv(port: int) -> list[str]:
            # Its own file: a sentinel rewrites its configuration (state, discovered peers) as it goes.
            conf = procs.dir / f"sentinel-{port}.conf"
            conf.write_text(
                f"port {port}\nbind {HOST}\ndir {procs.dir}\n"
                "sentinel resolve-hostnames no\n"
                f"sentinel announce-ip {HOST}\n"
                f"sentinel monitor {service} {HOST} {master} 2\n"
                f"sentinel down-after-milliseconds {service} 500\n"
                f"sentinel failover-timeout {service} 3000\n"
                f"sentinel parallel-syncs {service} 1\n"
            )
            return [exe, str(conf), "--sentinel"]

        sentinel_ports = list(await asyncio.gather(*(procs.start("sentinel", sentinel_argv) for _ in range(3))))
        sentinels = SentinelSet(procs, service, [master, replica], sentinel_ports)
        try:
            await _until(sentinels._ready_problem, 20, "sentinels ready")
        except AssertionError as e:
            logs = "\n".join(f"sentinel {p} log: {procs.tail(p, 1000)}" for p in sentinel_ports)
            raise AssertionError(f"{e}\n{logs}") from None
        yield sentinels

