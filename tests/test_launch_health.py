"""A launched model that stays alive but stops answering /healthz (a hung engine) is killed and
restarted, and /readyz says so meanwhile, in one process and with --workers 2 alike.

The child is a fake `python -m local_backend serve` (a few lines of aiohttp, written to a temp
folder): its /healthz fails on demand, so no model has to load. The gateway runs with that
folder as its working directory, where `python -m local_backend` finds the fake first."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import yaml

from gateway.process import launcher
from gateway.process.launcher import NOT_ANSWERING, ChildBackend, LaunchState
from tests.procs import free_port, wait_http

ROOT = Path(__file__).resolve().parents[1]

# Its /healthz: 503 while the file `sick` names its pid (`PID flaky`: every other check), else 200,
# with the proof of the launch's health token that the real server gives (local_backend/server.py).
FAKE = r'''
import ctypes, hashlib, hmac, os, signal, sys
from pathlib import Path
from aiohttp import web

HERE = Path(__file__).resolve().parent.parent
ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: gone with its launcher
argv = sys.argv
host, port = argv[argv.index("--host") + 1], int(argv[argv.index("--port") + 1])
with open(HERE / "pids", "a") as f:
    f.write(f"{os.getpid()}\n")
checks = 0
token = os.environ.get("LOCAL_BACKEND_HEALTH_TOKEN", "")

async def healthz(request):
    global checks
    checks += 1
    sick = (HERE / "sick").read_text().split() if (HERE / "sick").exists() else []
    if sick and sick[0] == str(os.getpid()) and ("flaky" not in sick or checks % 2):
        return web.json_response({"status": "error"}, status=503)
    nonce = request.headers.get("X-Health-Nonce", "")
    proof = hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()
    return web.json_response({"status": "ok"}, headers={"X-Health-Proof": proof} if token else None)

app = web.Application()
app.router.add_get("/healthz", healthz)
web.run_app(app, host=host, port=port, print=None, handle_signals=True)
'''


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Path]:
    """A folder holding the fake `local_backend` package; the children it started are killed at the end."""
    pkg = tmp_path / "local_backend"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(FAKE)
    yield tmp_path
    for pid in _pids(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a test that failed half-way (each one it started, by PID)


def _pids(fake: Path) -> list[int]:
    path = fake / "pids"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone too: its launcher just has not reaped it yet.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return False


def _child(fake: Path, host: str = "127.0.0.1") -> ChildBackend:
    port = free_port()
    child = ChildBackend("local", f"http://{'[::1]' if host == '::1' else host}:{port}/v1", "fake", startup_timeout_s=20)
    child.command = [sys.executable, str(fake / "local_backend" / "__main__.py"), "--host", host, "--port", str(port)]
    return child


async def _until(cond: Callable[[], object], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def _supervised(child: ChildBackend) -> AsyncIterator[list[LaunchState]]:
    """The child supervised (its states, in order), once ready; stopped after."""
    states: list[LaunchState] = []
    task = asyncio.create_task(child.supervise(states.append))
    try:
        await _until(lambda: bool(states) and states[-1].ready, 20, "the child never became ready")
        yield states
    finally:
        await child.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_child_that_hangs_is_killed_and_restarted(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGSTOP: alive, its port open, nothing answered. The supervisor kills it (SIGTERM cannot
    reach a stopped process: SIGKILL after the grace) and starts a new one."""
    monkeypatch.setattr(launcher, "_HEALTH_EVERY_S", 0.2)
    monkeypatch.setattr(launcher, "_HEALTH_TIMEOUT_S", 0.5)
    monkeypatch.setattr(launcher, "_STOP_GRACE_S", 1.0)
    child = _child(fake)
    async with _supervised(child) as states:
        first = child.pid
        assert first is not None
        os.kill(first, signal.SIGSTOP)
        await _until(lambda: not states[-1].ready, 10, "a hung child was never noticed")
        assert states[-1].failure == NOT_ANSWERING and states[-1].retry_at > 0
        await _until(lambda: states[-1].ready and child.pid != first, 20, "a hung child was never restarted")
        assert not _alive(first)
        assert [s.ready for s in states] == [True, False, True]  # never "starting" in between


async def test_a_child_that_answers_now_and_then_is_not_killed(fake: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only failed checks in a row count: one that passes every other check keeps running."""
    monkeypatch.setattr(launcher, "_HEALTH_EVERY_S", 0.1)
    child = _child(fake)
    async with _supervised(child) as states:
        first = child.pid
        assert first is not None
        (fake / "sick").write_text(f"{first} flaky")
        await asyncio.sleep(2.0)  # ~20 checks, half of them failed
        assert child.pid == first and _alive(first) and [s.ready for s in states] == [True]


async def test_an_ipv6_loopback_child_becomes_ready(fake: Path) -> None:
    """`http://[::1]:P/v1` is allowed for a launched backend: its health URL keeps the brackets."""
    child = _child(fake, "::1")
    assert child.health_url == f"http://[::1]:{child.port}/healthz"
    try:
        await asyncio.wait_for(child.start(), 20)
    finally:
        await child.stop()


def _policy(port: int) -> dict[str, object]:
    return {
        "backends": {"local": {"url": f"http://127.0.0.1:{port}/v1", "launch": {"model": "fake"}, "models": ["fake"]}},
        "models": {"auto": {"simple": ["local"], "complex": ["local"]}},
        "reload": {"watch": False},
        "classifier": {"encoder": {"enabled": False}},
    }


async def _readyz(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.get(url + "/readyz") as r:
        return r.status, (await r.json()).get("backends_not_ready", {}).get("local", "")


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_gateway_restarts_a_launched_model_that_stops_answering(fake: Path, workers: int) -> None:
    """With the real intervals: the child is replaced and /readyz is 200 again. In one process
    /readyz is 503 meanwhile, saying the model stopped answering its health check (never
    "starting"); a worker may see only the restart's new child starting, or nothing when the
    restart is quicker than its own polls."""
    port = free_port()
    policy = fake / "policy.yaml"
    policy.write_text(yaml.safe_dump(_policy(port)))
    gw_port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    log = fake / "gateway.log"
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "serve", "--policy", str(policy), "--port", str(gw_port),
            *(["--workers", str(workers)] if workers > 1 else []),
            cwd=fake, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    url = f"http://127.0.0.1:{gw_port}"
    try:
        await wait_http(url + "/readyz", 60)
        [first] = _pids(fake)
        (fake / "sick").write_text(str(first))
        reasons: set[str] = set()
        # A connection per poll: with --workers 2 each worker's view counts (a kept-alive
        # connection asks one worker, which may see the child down for less than a poll).
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            end = time.monotonic() + 40
            while True:
                status, why = await _readyz(http, url)
                if status != 200:
                    reasons.add(why)
                elif (reasons or workers > 1) and len(_pids(fake)) == 2:
                    # Up again on a new child. With workers, a restart quicker than their own
                    # polls notice (the supervisor's 3 checks vs theirs) may never show as down.
                    break
                assert time.monotonic() < end, f"never down and up again: {reasons}\n{log.read_text()[-3000:]}"
                await asyncio.sleep(0.1)
        down = {why for why in reasons if why.startswith(f"the backend could not be launched: {NOT_ANSWERING}; retrying")}
        if workers == 1:
            assert down and reasons == down, reasons
        else:  # a worker may see only the supervisor's restart (its new child starting), or nothing
            assert reasons - down <= {"the backend is starting"}, reasons
        assert len(_pids(fake)) == 2 and not _alive(first)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
