"""Policy reloads announced between replicas over Redis pub/sub.

Replicas on one Redis (the policy's `store.url`) subscribe to `reload.channel`. A reload through
one replica's /admin/reload is announced there; every other replica reloads its own policy file
and pushes its result to a short-lived list, which the announcing replica reads back, so its
answer says what each replica did. One subscriber per replica: the single gateway process, or the
supervisor of `--workers N` (which passes the reload on to its workers).

The channel and the store are read once, at start (a change to either takes a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from ..config.policy import Policy
from ..store.connect import ADMIN_CONNECTIONS, FAILURES, close_client, connect, relearn

__all__ = ["Peers"]

log = logging.getLogger("gateway.peers")

_ANSWER_WAIT_S = 3.0  # how long an announcement waits for the other replicas' results
_RESULT_TTL_S = 60
_RETRY_S = 1.0
# A subscription that has heard nothing this long is pinged; one that then hears nothing for as
# long again is taken for dead and made anew. A Redis host that is gone without a reset (a frozen
# Sentinel master) kept the subscriber on it while every announcement went to the promoted one:
# 11 reloads missed over 28 s (review helper's repro).
_PING_S = 2.0
_CALL_S = 2.0  # one answer's write to Redis (a single server's client has no timeout of its own)


class Peers:
    """Announces reloads to the other replicas and answers theirs (a no-op without Redis)."""

    def __init__(self, policy: Policy, on_reload: Callable[[str], Awaitable[dict[str, Any]]]) -> None:
        self.url = policy.store.url
        self.tls = policy.store.tls
        self.channel = policy.reload.channel
        self.node = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"
        self._on_reload = on_reload
        self._redis: Any = None
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    @property
    def enabled(self) -> bool:
        return self.url is not None and self.channel is not None

    async def start(self) -> None:
        """Subscribe (in the background: a Redis that is down is retried, never fatal)."""
        if not self.enabled:
            return
        assert self.url is not None
        # The subscription holds one connection of its own (on a Cluster: a node's; a PUBLISH on
        # any node reaches every node's subscribers); announcing takes one more.
        self._redis = connect(self.url, self.tls, timeout_s=2.0, max_connections=ADMIN_CONNECTIONS,
                              name=f"gw-peers-{os.getpid()}")
        self._task = asyncio.create_task(self._listen(), name="peers-listen")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self._subscribed.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._redis is not None:
            await close_client(self._redis)

    async def announce(self) -> list[dict[str, Any]]:
        """Ask every other replica to reload; their results (those that answered in time)."""
        if self._redis is None or self.channel is None:
            return []
        rid = os.urandom(8).hex()
        key = f"{self.channel}:{rid}"
        got: list[bytes] = []
        try:
            # Bounded: a stalled single Redis held /admin/reload for as long as it stalled.
            async with asyncio.timeout(_ANSWER_WAIT_S + _CALL_S):
                receivers = await self._redis.publish(self.channel, orjson.dumps({"id": rid, "node": self.node}))
                expected = max(0, int(receivers) - (1 if self._subscribed.is_set() else 0))
                deadline = time.monotonic() + _ANSWER_WAIT_S
                while len(got) < expected and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                    got = await self._redis.lrange(key, 0, -1)
        except FAILURES as exc:
            log.warning("reload announcement on %s failed: %s", self.channel, exc)
            return [{"ok": False, "error": f"could not announce the reload on Redis: {exc}"}]
        out = [orjson.loads(g) for g in got]
        if len(out) < expected:
            out.append({"ok": False, "error": f"{expected - len(out)} replica(s) did not answer in {_ANSWER_WAIT_S:.0f} s"})
        return out

    async def _listen(self) -> None:
        lost = False  # a subscription was lost: announcements may have gone by meanwhile
        while True:
            pubsub = self._redis.pubsub()
            try:
                # A Cluster's client learns its slots on its first command: before it, it cannot
                # tell which node a subscription goes to.
                async with asyncio.timeout(_CALL_S):
                    await self._redis.ping()
                    await pubsub.subscribe(self.channel)
                self._subscribed.set()
                if lost:  # the file is read again: what a missed announcement would have done
                    lost = False
                    await self._on_reload("the reload channel came back")
                await self._hear(pubsub)
            except Exception as exc:  # noqa: BLE001 - a listener that died would miss every reload after
                lost = True
                self._subscribed.clear()
                log.warning("reload channel %s: %s: %s; resubscribing in %.0f s", self.channel, type(exc).__name__, exc, _RETRY_S)
                await asyncio.sleep(_RETRY_S)
                with contextlib.suppress(Exception):
                    await relearn(self._redis)  # a Cluster's failover moved the channel's node
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _hear(self, pubsub: Any) -> None:
        """Answer the announcements on `pubsub` until it fails; a quiet one is pinged, and one
        silent after its ping raises TimeoutError."""
        heard = time.monotonic()
        pinged = False
        while True:
            msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=_PING_S / 4)
            now = time.monotonic()
            if msg is not None:
                heard, pinged = now, False
                if msg.get("type") == "message":
                    await self._answer(msg["data"])
            elif now - heard >= 2 * _PING_S and pinged:
                raise TimeoutError(f"no answer to a ping in {_PING_S:.0f} s")
            elif now - heard >= _PING_S and not pinged:
                async with asyncio.timeout(_CALL_S):
                    await pubsub.ping()
                pinged = True

    async def _answer(self, data: bytes) -> None:
        try:
            ask = orjson.loads(data)
            rid, node = str(ask["id"]), str(ask["node"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return
        if node == self.node:
            return
        result = await self._on_reload(f"announced by {node}")
        key = f"{self.channel}:{rid}"
        pipe = self._redis.pipeline()
        pipe.rpush(key, orjson.dumps({"node": self.node, **result}))
        pipe.expire(key, _RESULT_TTL_S)
        async with asyncio.timeout(_CALL_S):
            await pipe.execute()
