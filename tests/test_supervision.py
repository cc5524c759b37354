"""The supervisor's and the launcher's own tasks (process/serve.py, process/launcher.py): each one kept while it
runs, its failure logged rather than lost, and those still running ended at shutdown. No child
process is started here (the launcher's real children: tests/local_backend/test_launcher.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.process.launcher import ChildBackend, Children
from gateway.config.policy import LaunchPolicy
from gateway.process.serve import _Supervisor

DEFAULT_POLICY = Path(__file__).resolve().parent.parent / "policies" / "default.yaml"


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


async def test_a_supervisor_task_that_fails_is_logged_and_those_left_are_ended_at_shutdown(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sup = _Supervisor(DEFAULT_POLICY, "127.0.0.1", 0, 1, False, tmp_path)

    async def boom() -> None:
        raise RuntimeError("the policy file vanished")

    sup._background(boom(), "policy-watch")
    await _until(lambda: not sup._tasks)
    assert "supervisor: policy-watch failed: the policy file vanished" in caplog.text

    ended = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            ended.set()

    sup._background(forever(), "reload-SIGHUP")
    await asyncio.sleep(0)
    assert [t.get_name() for t in sup._tasks] == ["reload-SIGHUP"]  # held while it runs
    await sup._end_background()
    assert ended.is_set() and not sup._tasks


async def test_a_launcher_that_fails_is_logged_not_lost(caplog: pytest.LogCaptureFixture) -> None:
    children = Children(lambda name, state: None)
    # Not an http:// URL: the child's launcher fails at once (policy validation would refuse it).
    await children.reconcile([("b", "unix:///tmp/none.sock", LaunchPolicy(model="tiny-random"))])
    await _until(lambda: "launch-b failed" in caplog.text)
    assert "a launched backend needs an http://host:port URL" in caplog.text
    await children.stop()


async def test_the_stderr_pump_reads_on_past_a_line_over_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    """A line longer than the pipe reader's limit must not end the pump: a child whose stderr is
    no longer read blocks once the pipe is full."""
    caplog.set_level(logging.INFO, logger="gateway.launcher")
    child = ChildBackend("local", "http://127.0.0.1:1/v1", "tiny-random")
    stderr = asyncio.StreamReader()  # the limit asyncio's subprocess pipes get (64 KiB)
    stderr.feed_data(b"before\n" + b"x" * 200_000 + b"\nafter\n")
    stderr.feed_eof()
    await asyncio.wait_for(child._forward_stderr(SimpleNamespace(stderr=stderr)), 5)  # type: ignore[arg-type]
    assert list(child._tail) == ["before", "after"]
    assert "a stderr line too long to log, skipped" in caplog.text


async def test_a_failed_stderr_pump_is_logged_when_it_is_ended(caplog: pytest.LogCaptureFixture) -> None:
    child = ChildBackend("local", "http://127.0.0.1:1/v1", "tiny-random")

    async def broken() -> None:
        raise OSError("read failed")

    child._pump = asyncio.create_task(broken())
    await child._end_pump(1.0)
    assert child._pump is None and "[local] stderr could not be read: read failed" in caplog.text

    child._pump = asyncio.create_task(asyncio.sleep(3600))  # a pipe still open (a grandchild holds it)
    pump = child._pump
    await child._end_pump(0.01)
    assert pump.cancelled() and child._pump is None
