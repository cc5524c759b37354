"""The real SmolLM2-135M-Instruct through the server and the official SDK (slow: loads the model)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
import torch

from local_backend.boot import EngineSettings, build_engine
from local_backend.engine import Engine
from local_backend.protocol import GenerationRequest
from local_backend.server import BackendState

from .conftest import RunningServer, start_server

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def real_server() -> Iterator[RunningServer]:
    engine = build_engine(EngineSettings(NAME), lambda _: None)  # the default (auto) quantization
    server, stop = start_server(BackendState(served_name=NAME, engine=engine))
    yield server
    stop()
    engine.close()


def test_paris_non_stream(real_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=real_server.base_url, api_key="unused", max_retries=0)
    resp = client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=32)
    assert "Paris" in (resp.choices[0].message.content or "")
    assert resp.choices[0].finish_reason == "stop"  # ended on <|im_end|>, not on the token limit


def test_paris_stream(real_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=real_server.base_url, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=32, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text and "<|im_end|>" not in text
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_paris_for_concurrent_clients(real_server: RunningServer) -> None:
    client = openai.AsyncOpenAI(base_url=real_server.base_url, api_key="unused", max_retries=0)
    replies = await asyncio.gather(
        *(client.chat.completions.create(model=NAME, messages=QUESTION, max_tokens=32) for _ in range(4))
    )
    assert all("Paris" in (r.choices[0].message.content or "") for r in replies)
    await client.close()


async def test_fp32_batched_equals_generate_on_the_real_model() -> None:
    engine: Engine = build_engine(EngineSettings(NAME, quantize="none", device="cpu"), lambda _: None)
    try:
        tok = engine.tokenizer
        questions = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?", "Say hello in Spanish."]
        prompts = [
            list(tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False), add_special_tokens=False).input_ids)
            for q in questions
        ]

        async def run(ids: list[int]) -> str:
            return "".join([d.text async for d in engine.submit(GenerationRequest(ids, max_tokens=16)).deltas()])

        batched = await asyncio.gather(*(run(p) for p in prompts))
        for ids, text in zip(prompts, batched, strict=True):
            with torch.inference_mode():
                out = engine.model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
            expected = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
            assert text == expected
    finally:
        engine.close()
