"""Fixtures for the local backend: the tiny random model, engines, and servers on real loopback sockets."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from aiohttp import web  # noqa: E402

from local_backend.boot import engine_from_loaded  # noqa: E402
from local_backend.engine import Engine  # noqa: E402
from local_backend.models import LoadedModel, load_model  # noqa: E402
from local_backend.quantize import plan_quantization  # noqa: E402
from local_backend.server import BackendState, create_app  # noqa: E402


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """The 2-layer random Llama with the SmolLM2 tokenizer, in fp32 (the exact path)."""
    torch.set_num_threads(1)  # the test machine's cores are shared; one thread avoids spin-wait stalls
    return load_model("tiny-random", device="cpu", dtype=torch.float32, progress=lambda _: None)


def chat_ids(model: LoadedModel, question: str) -> list[int]:
    """Prompt token ids for one user message, through the chat template."""
    tok = model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False).input_ids)


@pytest.fixture
def make_engine(tiny: LoadedModel) -> Iterator[Callable[..., Engine]]:
    """Build engines over the tiny model (fp32 unless ``quantize`` says otherwise); each is closed after
    the test. start=False leaves it idle."""
    engines: list[Engine] = []

    def build(*, start: bool = True, quantize: str = "none", **kwargs: int) -> Engine:
        engine = engine_from_loaded(tiny, plan_quantization(quantize, "cpu"), **kwargs)
        if start:
            engine.start()
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.close()


@dataclass
class RunningServer:
    """A server started on its own thread and event loop (so sync clients can call it)."""

    base_url: str  # http://127.0.0.1:PORT/v1
    root: str  # http://127.0.0.1:PORT
    state: BackendState
    engine: Engine | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(state: BackendState) -> tuple[RunningServer, Callable[[], None]]:
    """Run create_app(state) on a free loopback port in a background thread; returns it and its stop."""
    port = _free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(create_app(state), handler_cancellation=True, access_log=None)

    async def boot() -> None:
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(boot(), loop).result(10)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

    root = f"http://127.0.0.1:{port}"
    return RunningServer(base_url=f"{root}/v1", root=root, state=state, engine=state.engine), stop


@pytest.fixture
def serve() -> Iterator[Callable[..., RunningServer]]:
    """Start servers over given engines (None: still loading); all stopped after the test."""
    stops: list[Callable[[], None]] = []

    def start(engine: Engine | None, *, served_name: str = "tiny-random", **state_kwargs: int) -> RunningServer:
        server, stop = start_server(BackendState(served_name=served_name, engine=engine, **state_kwargs))
        stops.append(stop)
        return server

    yield start
    for stop in stops:
        stop()
