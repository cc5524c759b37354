"""`gateway serve --workers 2` reloads at their edges: a slow one answered through /admin/reload,
the trigger each worker logs, and a policy one worker rejects while the other took it.

Real processes on loopback (tests/procs.py). Per-worker faults are injected by a sitecustomize
module on the gateway's PYTHONPATH (`_hooks`), driven by files the test writes:
- `slow-read`: a worker's reload reads the policy that many seconds late (in the reload's
  thread, so the worker's event loop keeps answering);
- `fail-<pid>`: that process cannot load the classifier's weights (as a weights file only one
  worker cannot read), after letting the number of loads the file holds through.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import yaml

from tests.procs import both_workers, redis_server, serve

_SITECUSTOMIZE = '''
import importlib.abc, os, sys, time
from pathlib import Path

_HOOKS = Path(os.environ["GW_TEST_HOOKS"])
_loads = [0]


def _patch(name, module):
    if name == "gateway.config.reload":
        read = module.read_policy

        def read_policy(*args, **kwargs):
            slow = _HOOKS / "slow-read"
            if slow.exists():
                time.sleep(float(slow.read_text() or 0))
            return read(*args, **kwargs)

        module.read_policy = read_policy
    elif name == "gateway.classify.classifier":
        load = module.Classifier.load.__func__

        def hooked(cls, path=None):
            fail = _HOOKS / f"fail-{os.getpid()}"
            if fail.exists():
                if _loads[0] >= int(fail.read_text() or 0):
                    raise ValueError(f"classifier weights {path}: cannot be read by this process (pid {os.getpid()})")
                _loads[0] += 1
            return load(cls, path)

        module.Classifier.load = classmethod(hooked)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in ("gateway.config.reload", "gateway.classify.classifier"):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(name, module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
'''


def _hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A sitecustomize for the gateway's processes (the supervisor and its spawned workers
    inherit the environment); returns the folder of the files that drive it."""
    site, hooks = tmp_path / "site", tmp_path / "hooks"
    site.mkdir()
    hooks.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("GW_TEST_HOOKS", str(hooks))
    return hooks


def _policy(url: str, *backends: str, **extra: Any) -> dict[str, Any]:
    p: dict[str, Any] = {"backends": {b: {"url": url, "models": ["m"]} for b in backends},
                         "reload": {"watch": False}, "server": {"drain_delay_ms": 0}}
    p.update(extra)
    return p


def _views(body: dict[str, Any]) -> list[tuple[int, tuple[str, ...]]]:
    return sorted((w["worker"], tuple(sorted(w["backends"]))) for w in body["workers"])


async def _reload(url: str, timeout_s: float = 60) -> tuple[int, dict[str, Any], float]:
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        async with http.post(url + "/admin/reload") as r:
            return r.status, await r.json(), time.monotonic() - started


async def _until(cond: Any, timeout_s: float, what: Any) -> None:
    """Poll `cond` until true; `what` (a string, or a function giving one) says what did not happen."""
    end = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < end, what() if callable(what) else what
        await asyncio.sleep(0.2)


def _worker_lines(log: Path) -> list[str]:
    """The workers' reload lines (the supervisor logs none for a reload that went well)."""
    return re.findall(r"gateway\.reload: (policy reload(?:ed)? \(.*)", log.read_text())


# ---- 1. /admin/reload answers in time, whatever the reload takes ------------------------------


async def test_an_admin_reload_behind_a_slow_one_answers_in_time_and_says_it_goes_on(upstream, tmp_path, monkeypatch):
    """SIGHUP starts a reload whose workers take 8 s; /admin/reload right after waits for it, then
    takes 8 s of its own: 16 s, past the 15 s a worker waits for the supervisor. That was a 500
    ("the reload could not reach the other workers") for a reload that went on and succeeded. Now
    the supervisor answers within its budget with what it knows: a 503 `reload_incomplete` naming
    the workers still reloading and that the reload goes on; the reload then ends everywhere."""
    hooks = _hooks(tmp_path, monkeypatch)
    up = await upstream("up", tokens=2)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(_policy(up.url, "a")))
    async with serve(path, tmp_path, "--workers", "2") as g:
        await both_workers(g.url, {})
        path.write_text(yaml.safe_dump(_policy(up.url, "a", "b")))
        (hooks / "slow-read").write_text("8")
        g.signal(signal.SIGHUP)
        await asyncio.sleep(0.5)
        status, body, took = await _reload(g.url)
        assert status != 500, body
        assert (status, body["error"]["code"]) == (503, "reload_incomplete"), body
        assert "goes on" in body["error"]["message"] and "worker-0.sock" in body["error"]["message"], body
        assert took < 14.5, took
        (hooks / "slow-read").unlink()

        async def both_at_3() -> bool:
            seen = await both_workers(g.url, {})
            return sorted(w["policy_generation"] for w in seen["workers"]) == [3, 3]

        await _until(both_at_3, 20, "both workers at generation 3 (SIGHUP's 2, then /admin/reload's)")
        assert _views(await both_workers(g.url, {})) == [(0, ("a", "b")), (1, ("a", "b"))]
        assert "answered before it ended" in g.log.read_text()


# ---- 2. each worker names the reload's real trigger --------------------------------------------


async def test_each_worker_logs_the_trigger_of_the_reload(upstream, tmp_path):
    """A reload through the supervisor was logged by every worker as "admin, through the
    supervisor", whether it came from SIGHUP, the file watcher, /admin/reload or another replica."""
    up = await upstream("up", tokens=2)
    async with redis_server() as redis_url:
        channel = "edges-" + os.urandom(4).hex()
        path = tmp_path / "policy.yaml"
        policy = _policy(up.url, "a", store={"url": redis_url}, reload={"watch": True, "interval_ms": 100, "channel": channel})
        path.write_text(yaml.safe_dump(policy))
        async with serve(path, tmp_path, "--workers", "2") as g:
            await both_workers(g.url, {})

            async def logged(trigger: str) -> None:
                async def twice() -> bool:
                    return sum(line.startswith(f"policy reloaded ({trigger}") for line in _worker_lines(g.log)) == 2

                await _until(twice, 15, lambda: f"both workers log a reload by {trigger!r}: {_worker_lines(g.log)}")

            g.signal(signal.SIGHUP)
            await logged("SIGHUP")
            path.write_text(yaml.safe_dump({**policy, "backends": {"b": {"url": up.url, "models": ["m"]}}}))
            await logged("file change")
            status, body, _ = await _reload(g.url)
            assert status == 200, body
            await logged("/admin/reload")
            client = redis.Redis.from_url(redis_url)
            try:
                client.publish(channel, b'{"id": "t1", "node": "test-replica"}')
            finally:
                client.close()
            await logged("announced by test-replica")
            assert not any("admin, through" in line for line in _worker_lines(g.log)), _worker_lines(g.log)


# ---- 3. a policy one worker rejects is rolled back where it was taken ---------------------------


async def _pids(url: str) -> dict[int, int]:
    return {w["worker"]: w["pid"] for w in (await both_workers(url, {}))["workers"]}


async def test_a_policy_one_worker_rejects_is_rolled_back_in_the_others(upstream, tmp_path, monkeypatch):
    """Worker 1 cannot load the classifier's weights; worker 0 can. The reload is a 400
    invalid_policy ("the previous one stays in force"), but worker 0 served the new policy
    beside worker 1 on the old one. Now worker 0 goes back to the policy in force."""
    hooks = _hooks(tmp_path, monkeypatch)
    up = await upstream("up", tokens=2)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(_policy(up.url, "a")))
    async with serve(path, tmp_path, "--workers", "2") as g:
        pids = await _pids(g.url)
        (hooks / f"fail-{pids[1]}").write_text("0")
        path.write_text(yaml.safe_dump(_policy(up.url, "a", "b")))
        status, body, _ = await _reload(g.url)
        assert (status, body["error"]["code"]) == (400, "invalid_policy"), body
        assert "cannot be read by this process" in body["error"]["message"]
        assert _views(await both_workers(g.url, {})) == [(0, ("a",)), (1, ("a",))], "every worker on the policy in force"
        assert await _pids(g.url) == pids  # rolled back, not restarted
        assert any(line.startswith("policy reloaded (rollback") for line in _worker_lines(g.log)), _worker_lines(g.log)
        (hooks / f"fail-{pids[1]}").unlink()
        status, body, _ = await _reload(g.url)
        assert status == 200, body
        assert _views(await both_workers(g.url, {})) == [(0, ("a", "b")), (1, ("a", "b"))]


async def test_a_worker_that_cannot_roll_back_is_restarted_on_the_policy_in_force(upstream, tmp_path, monkeypatch):
    """Worker 0 takes the new policy, then fails to build the old one again (its weights became
    unreadable to it in between); worker 1 rejected the new one. Worker 0 is restarted: it starts
    on the supervisor's copy of the policy in force."""
    hooks = _hooks(tmp_path, monkeypatch)
    up = await upstream("up", tokens=2)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(_policy(up.url, "a")))
    async with serve(path, tmp_path, "--workers", "2") as g:
        pids = await _pids(g.url)
        (hooks / f"fail-{pids[1]}").write_text("0")
        (hooks / f"fail-{pids[0]}").write_text("1")  # the new policy's build passes, the rollback's does not
        path.write_text(yaml.safe_dump(_policy(up.url, "a", "b")))
        status, body, _ = await _reload(g.url)
        assert (status, body["error"]["code"]) == (400, "invalid_policy"), body

        async def replaced() -> bool:
            now = await _pids(g.url)
            return now[0] != pids[0] and now[1] == pids[1]

        await _until(replaced, 30, "worker 0 restarted, worker 1 kept")
        assert _views(await both_workers(g.url, {})) == [(0, ("a",)), (1, ("a",))]
        assert "giving up" not in g.log.read_text()
