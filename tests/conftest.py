"""Shared fixtures: fake upstreams and gateways on loopback ports, the official openai SDK."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from aiohttp import web

from gateway.web.app import create_app
from gateway.web.edge import EdgeRunner
from gateway.admin.log_store import MemoryLogStore, RedisLogStore
from tests.fake_upstream import Behaviour, FakeUpstream
from tests.procs import redis_server

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class RunningGateway:
    def __init__(self, app: web.Application, runner: web.AppRunner, port: int, policy_path: Path) -> None:
        self.app = app
        self.runner = runner
        self.port = port
        self.policy_path = policy_path
        self.clients: list[openai.AsyncOpenAI] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "sk-test", **kw: Any) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)
        self.clients.append(c)  # closed by the fixture while the loop still runs
        return c

    def sync_client(self, key: str = "sk-test", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def write_policy(self, policy: dict[str, Any] | str) -> None:
        text = policy if isinstance(policy, str) else yaml.safe_dump(policy)
        tmp = self.policy_path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.policy_path)  # atomic, as an editor or a ConfigMap update does


@pytest.fixture
async def upstream() -> AsyncIterator[Callable[..., Any]]:
    """Factory: `await upstream(ttft_ms=..., mode=...)` starts a FakeUpstream on a free port."""
    started: list[FakeUpstream] = []

    async def make(name: str = "fake", **behaviour: Any) -> FakeUpstream:
        up = await FakeUpstream(Behaviour(**behaviour), name=name).start()
        started.append(up)
        return up

    yield make
    for up in started:
        await up.stop()


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """Factory: `await gateway(policy_dict)` writes the policy to a file and serves it on a free port.

    A policy dict that sets no `classifier.encoder.deadline_ms` gets a patient one (2 s): a test
    about where a class goes must not depend on the encoder answering within the default 12 ms on
    a loaded machine (the suite runs in parallel). The deadline's own tests set theirs."""
    running: list[RunningGateway] = []

    async def make(policy: dict[str, Any] | str, name: str = "policy.yaml") -> RunningGateway:
        if isinstance(policy, dict):
            policy = _patient_encoder(policy)
        path = tmp_path / name
        path.write_text(policy if isinstance(policy, str) else yaml.safe_dump(policy))
        app = create_app(path)
        # the runner `gateway serve` uses: the edge's header timeout, per-address cap and JSON parser errors
        runner = EdgeRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        gw = RunningGateway(app, runner, port, path)
        running.append(gw)
        return gw

    yield make
    for gw in running:
        for c in gw.clients:
            await c.close()
        await gw.runner.cleanup()


def _patient_encoder(policy: dict[str, Any]) -> dict[str, Any]:
    classifier = dict(policy.get("classifier") or {})
    encoder = dict(classifier.get("encoder") or {})
    encoder.setdefault("deadline_ms", 2000)
    return {**policy, "classifier": {**classifier, "encoder": encoder}}


def simple_policy(*ups: FakeUpstream, model: str = "gpt-test", **extra: Any) -> dict[str, Any]:
    """A policy routing `model` to the given upstreams, in order."""
    backends = {up.name: {"url": up.url, "models": [model]} for up in ups}
    # `ordered`: these tests are about failover in a known order; routing tests choose their strategy.
    policy: dict[str, Any] = {
        "version": 1,
        "backends": backends,
        "models": {model: {"backends": [u.name for u in ups], "strategy": "ordered"}},
    }
    policy.update(extra)
    return policy


@pytest.fixture(params=["memory", "redis"])
async def log_store(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A factory of empty request-log stores of `size` entries (in memory; on a Redis of the
    test's own, each under its own prefix)."""
    if request.param == "memory":
        yield MemoryLogStore
        return
    async with redis_server() as url:
        made: list[RedisLogStore] = []

        def make(size: int) -> RedisLogStore:
            made.append(RedisLogStore(url, size, prefix=f"t{len(made)}:"))
            return made[-1]

        yield make
        for s in made:
            await s.close()
