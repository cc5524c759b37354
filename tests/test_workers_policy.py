"""`gateway serve --workers N`: every worker runs the policy in force, whatever the file says.

Workers read the supervisor's copy of the policy it accepted (at start, on a reload, and when one
is restarted after a crash), never the file directly: a review found a worker restarted after a
crash read a later edit the reload had rejected, crashed in a loop, and the supervisor gave up on
the whole gateway; and one restarted before an edit was reloaded served it beside the others.
Real processes on loopback (tests/procs.py), a fake upstream per backend.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.procs import both_workers, serve


def _workers(supervisor: int) -> list[int]:
    """The supervisor's worker processes (spawned: their command line runs spawn_main)."""
    out: list[int] = []
    for task in Path(f"/proc/{supervisor}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():
                out.append(int(pid))
    return out


async def _restart_one(g: Any, old: list[int]) -> list[int]:
    """Kill one worker (as the OOM killer would) and wait until the supervisor has replaced it."""
    os.kill(old[0], signal.SIGKILL)
    for _ in range(200):
        await asyncio.sleep(0.1)
        now = _workers(g.proc.pid)
        if len(now) == 2 and old[0] not in now:
            await both_workers(g.url, {})  # the new one answers too (the other served meanwhile)
            return now
    raise AssertionError(f"worker {old[0]} was not replaced: {_workers(g.proc.pid)}")


def _routes(body: dict[str, Any]) -> list[tuple[tuple[str, ...], int]]:
    return sorted((tuple(sorted(w["backends"])), w["policy_generation"]) for w in body["workers"])


async def test_a_worker_restarted_after_a_rejected_edit_runs_the_policy_in_force(upstream, tmp_path):
    up = await upstream("up", tokens=2)
    policy = {"backends": {"up": {"url": up.url, "models": ["m"]}},
              "reload": {"watch": True, "interval_ms": 100}, "server": {"drain_delay_ms": 0}}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    async with serve(path, tmp_path, "--workers", "2") as g:
        await both_workers(g.url, {})
        workers = _workers(g.proc.pid)
        path.write_text("backends:\n  up: {url: 'not a url', models: [m]}\n")  # rejected by the reload
        for _ in range(50):
            await asyncio.sleep(0.1)
            if "rejected" in g.log.read_text():
                break
        assert "rejected" in g.log.read_text()
        for _ in range(3):  # each restart reads the policy in force: no crash loop, no "giving up"
            workers = await _restart_one(g, workers)
        body = await both_workers(g.url, {})
        assert _routes(body) == [(("up",), 1), (("up",), 1)], body
        assert g.proc.returncode is None and "giving up" not in g.log.read_text()
        async with aiohttp.ClientSession() as http:
            for i in range(4):
                async with http.post(g.url + "/v1/chat/completions",
                                     json={"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}) as r:
                    assert r.status == 200, await r.text()


async def test_a_restarted_worker_runs_what_the_others_run_reloaded_or_not(upstream, tmp_path):
    """reload.watch off: an edit not reloaded yet is not served by a worker restarted meanwhile;
    after the reload, a worker restarted later runs it, at the same generation as the others."""
    a, b = await upstream("a", tokens=2), await upstream("b", tokens=2)
    policy = {"backends": {"a": {"url": a.url, "models": ["m"]}},
              "reload": {"watch": False}, "server": {"drain_delay_ms": 0}}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    async with serve(path, tmp_path, "--workers", "2") as g:
        await both_workers(g.url, {})
        path.write_text(yaml.safe_dump({**policy, "backends": {"b": {"url": b.url, "models": ["m"]}}}))
        workers = await _restart_one(g, _workers(g.proc.pid))
        assert _routes(await both_workers(g.url, {})) == [(("a",), 1), (("a",), 1)]
        async with aiohttp.ClientSession() as http:
            async with http.post(g.url + "/admin/reload") as r:
                assert r.status == 200, await r.text()
        assert _routes(await both_workers(g.url, {})) == [(("b",), 2), (("b",), 2)]
        await _restart_one(g, workers)
        assert _routes(await both_workers(g.url, {})) == [(("b",), 2), (("b",), 2)]
