"""A worker whose supervisor is killed (SIGKILL: it tells nobody) stops by itself, instead of
serving on the shared port forever with no one to reload, restart or stop it."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from tests.procs import serve


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_workers_stop_when_their_supervisor_is_killed(upstream, tmp_path):
    up = await upstream("up", tokens=2)
    policy = {"backends": {"up": {"url": up.url, "models": ["m"]}}, "reload": {"watch": False}, "server": {"drain_delay_ms": 0}}
    async with serve(policy, tmp_path, "--workers", "2") as g:
        workers = [p for p in _children(g.proc.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(workers) == 2
        os.kill(g.proc.pid, signal.SIGKILL)
        await g.proc.wait()
        for _ in range(100):
            if not any(_alive(p) for p in workers):
                break
            await asyncio.sleep(0.1)
        assert not any(_alive(p) for p in workers), "orphaned workers still running: " + g.log.read_text()[-3000:]
