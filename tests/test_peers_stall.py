"""The reload channel against a Redis that stalls without a reset (a frozen host, a SIGSTOPped
server): an announcement is bounded, and a subscription that went silent is made anew and the
policy file read again (announcements may have gone by meanwhile). A redis-server of the test's own."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from typing import Any

from gateway.config.policy import parse_policy
from gateway.process.peers import Peers
from tests.procs import redis_process


def _policy(url: str) -> Any:
    return parse_policy(f"version: 1\nbackends: {{b: {{url: 'http://127.0.0.1:9', models: [m]}}}}\n"
                        f"store:\n  url: '{url}'\nreload:\n  channel: ch-{secrets.token_hex(3)}\n")


async def test_an_announcement_to_a_stalled_redis_is_bounded():
    """POST /admin/reload's fan-out waited for as long as a single Redis stalled (8 s and more)."""
    async with redis_process() as (url, proc):
        async def on_reload(why: str) -> dict[str, Any]:
            return {"ok": True}

        peers = Peers(_policy(url), on_reload)
        await peers.start()
        try:
            assert await peers.announce() == []
            os.kill(proc.pid, signal.SIGSTOP)
            started = time.monotonic()
            result = await asyncio.wait_for(peers.announce(), 10)
            assert time.monotonic() - started < 6 and result and result[0]["ok"] is False, result
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            await peers.close()


async def test_a_subscription_silent_past_its_ping_is_made_anew_and_the_policy_read_again():
    """A subscriber stayed on a frozen Redis (a Sentinel master SIGSTOPped: the others promoted)
    and missed every announcement until the old host came back (review helper's repro)."""
    async with redis_process() as (url, proc):
        heard: list[str] = []

        async def on_reload(why: str) -> dict[str, Any]:
            heard.append(why)
            return {"ok": True}

        listener, announcer = Peers(_policy(url), on_reload), Peers(_policy(url), on_reload)
        listener.channel = announcer.channel = "ch-stall"
        await listener.start()
        await announcer.start()
        try:
            os.kill(proc.pid, signal.SIGSTOP)
            await asyncio.sleep(5.5)  # past its ping and the wait for its answer
            os.kill(proc.pid, signal.SIGCONT)
            async with asyncio.timeout(10):
                while "the reload channel came back" not in heard:
                    await asyncio.sleep(0.05)
            async with asyncio.timeout(10):  # and it hears the next announcement
                while not any(w.startswith("announced by") for w in heard):
                    await announcer.announce()
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            await listener.close()
            await announcer.close()
