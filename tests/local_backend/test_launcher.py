"""ChildBackend: a real `python -m local_backend serve` child with the tiny model."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time

import aiohttp
import pytest

from gateway.process.launcher import ChildBackend, Children, LaunchError, LaunchState
from gateway.config.policy import LaunchPolicy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(port: int, model: str = "tiny-random", **kwargs: object) -> ChildBackend:
    return ChildBackend(
        "local", f"http://127.0.0.1:{port}/v1", model, quantize="none", device="cpu", threads=1, startup_timeout_s=60, **kwargs
    )  # type: ignore[arg-type]


async def _chat(port: int) -> dict[str, object]:
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            return await resp.json()  # type: ignore[no-any-return]


async def test_start_serve_restart_after_death_and_stop() -> None:
    port = _free_port()
    child = _child(port)
    await child.start()
    supervisor = asyncio.create_task(child.supervise())
    try:
        assert child.running
        assert (await _chat(port))["usage"] == {"prompt_tokens": 31, "completion_tokens": 3, "total_tokens": 34}
        first_pid = child.pid
        assert first_pid is not None
        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (child.running and child.pid != first_pid and await _healthy(port)):
            assert time.monotonic() < deadline, "the child was not restarted"
            await asyncio.sleep(0.2)
        await _chat(port)
    finally:
        await child.stop()
        supervisor.cancel()
        await asyncio.gather(supervisor, return_exceptions=True)
    assert not child.running
    await child.stop()  # idempotent
    assert not await _healthy(port)


async def _healthy(port: int) -> bool:
    try:
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/healthz") as resp:
            return resp.status == 200
    except aiohttp.ClientError:
        return False


async def test_a_child_that_exits_raises_launch_error_with_its_stderr() -> None:
    child = _child(_free_port(), model="/no/such/model")
    with pytest.raises(LaunchError) as info:
        await child.start()
    message = str(info.value)
    assert "'local'" in message and "exited with code 2" in message
    assert "--model /no/such/model" in message  # the command
    assert "unknown model" in message  # the child's last stderr lines
    assert not child.running


async def test_startup_timeout_kills_the_child() -> None:
    # A child that never answers /healthz: a python that just sleeps.
    child = ChildBackend("slow", f"http://127.0.0.1:{_free_port()}/v1", "tiny-random", startup_timeout_s=0.5, python=sys.executable, extra_args=())
    child.command = [sys.executable, "-c", "import time; time.sleep(30)"]
    with pytest.raises(LaunchError, match="not healthy after"):
        await child.start()
    assert not child.running


async def test_port_in_use_is_refused_before_spawning() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        child = _child(holder.getsockname()[1])
        with pytest.raises(LaunchError, match="already in use"):
            await child.start()
    assert child.pid is None


def test_the_default_temperature_is_passed_to_the_child() -> None:
    """The gateway's cache decides by launch.default_temperature: the server must use that one."""
    command = _child(_free_port(), default_temperature=0.0).command
    assert command[command.index("--default-temperature") + 1] == "0.0"
    assert "--default-temperature" not in _child(_free_port()).command  # unset: the server's own resolution


def test_the_launch_policys_memory_and_kernel_become_the_childs_flags() -> None:
    lp = LaunchPolicy(model="tiny-random", kv_cache_mb=64, prefix_cache_mb=0, kernel="avx2")
    assert lp.server_args() == ("--kv-cache-mb", "64", "--prefix-cache-mb", "0", "--kernel", "avx2")
    assert LaunchPolicy(model="tiny-random").server_args() == ()  # unset: the server's own defaults
    from local_backend.__main__ import _parser  # the flags are the server's own

    args = _parser().parse_args(["serve", *lp.server_args()])
    assert (args.kv_cache_mb, args.prefix_cache_mb, args.kernel) == (64, 0, "avx2")


def test_url_without_http_host_is_rejected() -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        ChildBackend("x", "unix:///tmp/sock", "tiny-random")


def test_launcher_does_not_import_torch_or_local_backend() -> None:
    import subprocess

    code = "import sys, gateway.process.launcher; print(any(m == 'torch' or m.startswith('local_backend') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def test_a_child_that_cannot_bind_says_why_in_one_line() -> None:
    """A socket bound but not listening passes the launcher's look (nothing answers) and makes the
    child's own bind fail: its one line on stderr becomes the launch error's summary."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        child = _child(holder.getsockname()[1])
        with pytest.raises(LaunchError) as info:
            await child.start()
    summary = info.value.summary
    assert "\n" not in summary
    assert summary.startswith("exited with code 1 before becoming healthy: local_backend: cannot listen on 127.0.0.1:")
    assert summary.endswith("address already in use")


async def _until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)


async def test_a_launch_blocked_by_a_taken_port_is_retried_and_comes_up_once_it_is_free() -> None:
    heard: list[tuple[str, LaunchState]] = []
    children = Children(lambda name, state: heard.append((name, state)))
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    lp = LaunchPolicy(model="tiny-random", quantize="none", device="cpu", threads=1, startup_timeout_s=60)
    try:
        await children.reconcile([("local", f"http://127.0.0.1:{port}/v1", lp)])
        assert heard[0] == ("local", LaunchState(False))  # starting: not routed to yet
        await _until(lambda: children.states()["local"].failures >= 2, 10, "the launch was not retried")
        state = children.states()["local"]
        assert not state.ready and state.failure == f"127.0.0.1:{port} is already in use (another process listens there)"
        assert state.describe().startswith(f"could not be launched: {state.failure}; retrying")
        assert 0 < state.retry_in_s() <= 30
        holder.close()  # the port frees: the next try starts the model
        await _until(lambda: children.states()["local"].ready, 90, "the backend never came up after the port freed")
        assert heard[-1] == ("local", LaunchState(True))
        assert await _healthy(port)
    finally:
        holder.close()
        await children.stop()
    assert heard[-1] == ("local", LaunchState(False)) and children.states() == {}
    assert not await _healthy(port)
