"""`serve --workers N` reloads that race a worker's restart, and the file watcher after a reload it
did not start: every worker ends on the policy the file says."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gateway.classify.classifier import DEFAULT_WEIGHTS
from tests.procs import both_workers, serve


def _views(body: dict[str, Any]) -> list[tuple[int, tuple[str, ...]]]:
    return sorted((w["worker"], tuple(sorted(w["backends"]))) for w in body["workers"])


def _workers(supervisor: int) -> list[int]:
    """The supervisor's worker processes (spawned: `spawn_main` in their command line)."""
    out = []
    for task in Path(f"/proc/{supervisor}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text():
                    out.append(int(pid))
            except OSError:
                pass
    return out


def _opening_fifo(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/wchan").read_text().strip() in ("fifo_open", "wait_for_partner")
    except OSError:
        return False


@contextmanager
def _gated_weights(fifo: Path) -> Iterator[threading.Event]:
    """A classifier weights file that is a FIFO: each open of it gets the default weights once
    the returned event is set; until then a process that reads it (a worker building its
    runtime) waits in its start, after it read the policy."""
    os.mkfifo(fifo)
    weights = DEFAULT_WEIGHTS.read_bytes()
    allow, stop = threading.Event(), threading.Event()
    allow.set()

    def feed() -> None:
        while not stop.is_set():
            allow.wait()
            if stop.is_set():
                return
            try:
                with open(fifo, "wb") as f:  # blocks until a reader opens it
                    f.write(weights)
            except BrokenPipeError:
                pass
            time.sleep(0.3)  # the reader reaches EOF before the next writer opens

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        yield allow
    finally:
        stop.set()
        allow.set()
        try:  # a feeder blocked in open() returns
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        except OSError:
            pass
        feeder.join(5)


async def test_a_worker_restarting_during_a_watch_reload_catches_up(upstream: Any, tmp_path: Path) -> None:
    a, b = await upstream("a", tokens=2), await upstream("b", tokens=2)
    fifo = tmp_path / "weights.fifo"
    base = {"reload": {"watch": True, "interval_ms": 100}, "server": {"drain_delay_ms": 0}}
    pol_a = {**base, "backends": {"a": {"url": a.url, "models": ["m"]}},
             "classifier": {"weights_file": str(fifo), "encoder": {"enabled": False}}}
    pol_b = {**base, "backends": {"b": {"url": b.url, "models": ["m"]}}, "classifier": {"encoder": {"enabled": False}}}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(pol_a))
    with _gated_weights(fifo) as allow:
        async with serve(path, tmp_path, "--workers", "2") as g:
            await both_workers(g.url, {})
            allow.clear()
            # a feeder waiting in open() writes once more, to nobody, then parks on `allow`
            fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            await asyncio.sleep(0.3)
            os.read(fd, 1 << 20)
            os.close(fd)
            await asyncio.sleep(0.3)
            old = _workers(g.proc.pid)
            os.kill(old[0], signal.SIGKILL)
            for _ in range(400):  # the restarted worker read policy A and waits for its weights
                await asyncio.sleep(0.05)
                new = [p for p in _workers(g.proc.pid) if p not in old]
                if new and _opening_fifo(new[0]):
                    break
            else:
                raise AssertionError("the restarted worker never opened the weights file")
            tmp = path.with_suffix(".tmp")
            tmp.write_text(yaml.safe_dump(pol_b))
            tmp.replace(path)
            for _ in range(100):  # the watcher's fan-out, which cannot reach the starting worker
                await asyncio.sleep(0.1)
                if "did not reach 1 of 2 workers" in g.log.read_text():
                    break
            else:
                raise AssertionError(g.log.read_text()[-2000:])
            allow.set()  # the restarted worker finishes its start, on policy A, then catches up
            body = await both_workers(g.url, {})
            assert all(v[1] == ("b",) for v in _views(body)), _views(body)
            assert "policy changed while this worker started" in g.log.read_text()
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
                for i in range(10):
                    async with http.post(g.url + "/v1/chat/completions",
                                         json={"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}) as r:
                        assert (r.status, r.headers.get("x-gateway-backend")) == (200, "b")


async def test_the_watcher_reloads_a_revert_after_an_admin_reload(upstream: Any, tmp_path: Path) -> None:
    a, b = await upstream("a", tokens=2), await upstream("b", tokens=2)
    base = {"reload": {"watch": True, "interval_ms": 2000}, "server": {"drain_delay_ms": 0}}
    text_a = yaml.safe_dump({**base, "backends": {"a": {"url": a.url, "models": ["m"]}}})
    path = tmp_path / "policy.yaml"
    path.write_text(text_a)
    async with serve(path, tmp_path, "--workers", "2") as g:
        await both_workers(g.url, {})
        await asyncio.sleep(2.5)  # the watcher polls the unchanged file once
        path.write_text(yaml.safe_dump({**base, "backends": {"b": {"url": b.url, "models": ["m"]}}}))
        async with aiohttp.ClientSession() as http:
            async with http.post(g.url + "/admin/reload") as r:
                assert r.status == 200, await r.text()
        path.write_text(text_a)  # reverted to the bytes the watcher saw last
        for _ in range(60):  # within two polls
            body = await both_workers(g.url, {})
            if all(v[1] == ("a",) for v in _views(body)):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"the file says backend a; workers serve {_views(body)}")
