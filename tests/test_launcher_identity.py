"""A launched model proves it is the child this launch started: the launcher passes a random token
in the child's environment, each /healthz check sends a nonce, and only an answer carrying
HMAC-SHA256(token, nonce) counts (process/launch_proof.py, local_backend/server.py). Another process
answering 200 on the port is not taken for the model, by the launcher nor by a worker; a server
started by hand (no token) answers /healthz as before, without the proof header."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gateway.process import launcher
from gateway.process.launched import watch_launched
from gateway.process.launcher import HEALTH_TOKEN_ENV, ChildBackend, LaunchError, LaunchState
from local_backend.server import BackendState, create_app
from tests.procs import free_port


def _proof(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


@contextlib.asynccontextmanager
async def _server(port: int, token: str | None = None, status: int = 200) -> AsyncIterator[list[str]]:
    """An aiohttp server on 127.0.0.1:`port` whose /healthz answers `status`, with the proof of
    `token` when given (none: an impostor). Yields the nonces it was asked with."""
    nonces: list[str] = []

    async def healthz(request: web.Request) -> web.Response:
        nonce = request.headers.get("X-Health-Nonce", "")
        nonces.append(nonce)
        headers = {"X-Health-Proof": _proof(token, nonce)} if token else None
        return web.json_response({"status": "ok"}, status=status, headers=headers)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield nonces
    finally:
        await runner.cleanup()


async def _until(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.05)


# ---- the launcher ------------------------------------------------------------------------------


async def test_an_impostor_that_takes_the_port_after_the_look_is_not_taken_for_the_model() -> None:
    """The port was free at the look before the spawn; another server takes it before the child
    listens (here the child never does) and answers /healthz 200: the launch fails at once,
    saying so and naming the port (supervise() logs it and retries), and the child is stopped."""
    port = free_port()
    child = ChildBackend("local", f"http://127.0.0.1:{port}/v1", "tiny-random", startup_timeout_s=10)
    child.command = [sys.executable, "-c", "import time; time.sleep(30)"]
    start = asyncio.create_task(child.start())
    await asyncio.sleep(0)  # the start ran up to the spawn: past its look at the port
    began = time.monotonic()
    async with _server(port) as nonces:
        with pytest.raises(LaunchError) as info:
            await start
    assert time.monotonic() - began < 5  # at once, not after the start-up timeout
    summary = info.value.summary
    assert summary.startswith(f"something else answers /healthz on 127.0.0.1:{port}: a 200 without the proof"), summary
    assert nonces and all(nonces)  # each check asked with a nonce
    assert f"something else answers /healthz on 127.0.0.1:{port}" in str(info.value)  # with the command and stderr
    assert not child.running


async def test_a_wrong_proof_is_no_proof() -> None:
    """Another launch's token (say, another gateway's model on the same port) does not pass either."""
    port = free_port()
    child = ChildBackend("local", f"http://127.0.0.1:{port}/v1", "tiny-random", startup_timeout_s=10)
    child.command = [sys.executable, "-c", "import time; time.sleep(30)"]
    start = asyncio.create_task(child.start())
    await asyncio.sleep(0)
    async with _server(port, token="another-launch"):
        with pytest.raises(LaunchError, match="something else answers"):
            await start
    assert not child.running


# A fake `local_backend serve`: /healthz 200 with the proof, until the file `noproof` exists (then
# 200 without it: as if another process answered on its port).
FAKE = r'''
import ctypes, hashlib, hmac, os, signal, sys
from pathlib import Path
from aiohttp import web

HERE = Path(__file__).resolve().parent
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: gone with its launcher
host, port = sys.argv[1], int(sys.argv[2])
token = os.environ.get("LOCAL_BACKEND_HEALTH_TOKEN", "")
with open(HERE / "pids", "a") as f:
    f.write(f"{os.getpid()}\n")
with open(HERE / "tokens", "a") as f:
    f.write(f"{token}\n")

async def healthz(request):
    proof = hmac.new(token.encode(), request.headers.get("X-Health-Nonce", "").encode(), hashlib.sha256).hexdigest()
    return web.json_response({"status": "ok"}, headers=None if (HERE / "noproof").exists() else {"X-Health-Proof": proof})

app = web.Application()
app.router.add_get("/healthz", healthz)
web.run_app(app, host=host, port=port, print=None, handle_signals=True)
'''


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "fake.py").write_text(FAKE)
    yield tmp_path
    pids = tmp_path / "pids"
    for pid in [int(p) for p in pids.read_text().split()] if pids.exists() else []:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a test that failed half-way (each one it started, by PID)


async def test_each_launch_has_its_own_token_in_the_environment_not_the_command_line(fake: Path) -> None:
    port = free_port()
    child = ChildBackend("local", f"http://127.0.0.1:{port}/v1", "fake", startup_timeout_s=20)
    child.command = [sys.executable, str(fake / "fake.py"), "127.0.0.1", str(port)]
    tokens = []
    for _ in range(2):
        try:
            await asyncio.wait_for(child.start(), 20)
            assert child.health_token is not None and child.pid is not None
            tokens.append(child.health_token)
            cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes().decode()
            assert child.health_token not in cmdline
        finally:
            await child.stop()
    assert (fake / "tokens").read_text().split() == tokens and tokens[0] != tokens[1]


async def test_a_ready_child_whose_port_answers_without_the_proof_is_restarted_saying_why(
    fake: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The periodic checks want the proof too: 200s without it fail them, and the reason names the port."""
    monkeypatch.setattr(launcher, "_HEALTH_EVERY_S", 0.1)
    monkeypatch.setattr(launcher, "_STOP_GRACE_S", 1.0)
    port = free_port()
    child = ChildBackend("local", f"http://127.0.0.1:{port}/v1", "fake", startup_timeout_s=20)
    child.command = [sys.executable, str(fake / "fake.py"), "127.0.0.1", str(port)]
    states: list[LaunchState] = []
    task = asyncio.create_task(child.supervise(states.append))
    try:
        await _until(lambda: states and states[-1].ready, 20, "the child never became ready")
        assert states[-1].health_token == child.health_token is not None
        (fake / "noproof").write_text("")
        await _until(lambda: not states[-1].ready, 10, "answers without the proof were taken for the model")
        assert states[-1].failure is not None
        assert states[-1].failure.startswith(f"something else answers /healthz on 127.0.0.1:{port}"), states[-1].failure
    finally:
        await child.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_the_token_travels_to_workers_in_the_state_but_is_no_part_of_it() -> None:
    state = LaunchState(True, health_token="t0k")
    assert state == LaunchState(True) and "t0k" not in repr(state)
    assert LaunchState.from_json(state.to_json()).health_token == "t0k"
    assert "health_token" not in LaunchState(False).to_json()


# ---- a worker ----------------------------------------------------------------------------------


async def _watch(port: int, token: str | None, run_s: float, states: list[LaunchState]) -> None:
    """Run watch_launched over one backend on `port` for `run_s`, the launcher saying it is ready
    with `token`; its states go to `states`."""

    def backends() -> list[tuple[str, str, Callable[[LaunchState], None]]]:
        return [("local", f"http://127.0.0.1:{port}/v1", states.append)]

    async def launch_states() -> Mapping[str, LaunchState]:
        return {"local": LaunchState(True, health_token=token)}

    task = asyncio.create_task(watch_launched(backends, launch_states))
    await asyncio.sleep(run_s)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_worker_takes_the_launched_model_for_ready_only_with_its_proof(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gateway.launcher")
    port = free_port()
    states: list[LaunchState] = []
    async with _server(port, token="the-launch"):
        await _watch(port, "the-launch", 2.0, states)
    assert states and states[-1].ready
    states.clear()
    async with _server(port):  # an impostor; the launcher (wrongly, or not yet) says ready
        await _watch(port, "the-launch", 2.5, states)
    assert states and not any(s.ready for s in states)
    warned = [r.getMessage() for r in caplog.records if "something else answers" in r.getMessage()]
    assert len(warned) == 1 and f"127.0.0.1:{port}" in warned[0]  # once, naming the port


# ---- the local backend's /healthz --------------------------------------------------------------


@contextlib.asynccontextmanager
async def _backend(token: str | None) -> AsyncIterator[str]:
    """local_backend's app on a free port, its model "loaded" (/healthz only asks whether there is one)."""
    state = BackendState(served_name="tiny-random", health_token=token)
    state.engine = object()  # type: ignore[assignment]
    runner = web.AppRunner(create_app(state), access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/healthz"
    finally:
        await runner.cleanup()


async def test_a_local_backend_started_by_hand_answers_healthz_without_the_proof() -> None:
    async with _backend(None) as url, aiohttp.ClientSession() as http:
        for headers in ({}, {"X-Health-Nonce": "abc"}):
            async with http.get(url, headers=headers) as resp:
                assert resp.status == 200 and await resp.json() == {"status": "ok", "model": "tiny-random"}
                assert "X-Health-Proof" not in resp.headers


async def test_a_launched_local_backend_proves_the_token_for_each_nonce() -> None:
    async with _backend("secret") as url, aiohttp.ClientSession() as http:
        async with http.get(url, headers={"X-Health-Nonce": "n1"}) as resp:
            assert resp.status == 200 and resp.headers["X-Health-Proof"] == _proof("secret", "n1")
        async with http.get(url) as resp:  # no nonce: nothing to prove
            assert resp.status == 200 and "X-Health-Proof" not in resp.headers
        async with http.get(url, headers={"X-Health-Nonce": "x" * 1000}) as resp:  # not a launcher's
            assert resp.status == 200 and "X-Health-Proof" not in resp.headers


async def test_a_real_launch_of_the_tiny_model_is_ready_and_keeps_its_token_to_itself() -> None:
    """`python -m local_backend serve` launched as the gateway does: ready as before; the token is
    in its environment, not on its command line; its /healthz proves it."""
    with socket.socket() as s:  # reserved (bound, not listening) until the child listens: see test_launched_backend
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        child = ChildBackend(
            "local", f"http://127.0.0.1:{port}/v1", "tiny-random", quantize="none", device="cpu", threads=1, startup_timeout_s=90
        )
        try:
            await child.start()
            token, pid = child.health_token, child.pid
            assert token is not None and pid is not None and child.running
            assert token not in Path(f"/proc/{pid}/cmdline").read_bytes().decode()
            environ = Path(f"/proc/{pid}/environ").read_bytes()  # what it was started with: ours
            assert f"{HEALTH_TOKEN_ENV}={token}".encode() in environ
            async with aiohttp.ClientSession() as http:
                async with http.get(child.health_url, headers={"X-Health-Nonce": "n"}) as resp:
                    assert resp.status == 200 and resp.headers["X-Health-Proof"] == _proof(token, "n")
                async with http.get(child.health_url) as resp:
                    assert resp.status == 200 and "X-Health-Proof" not in resp.headers
        finally:
            await child.stop()
    assert not child.running
