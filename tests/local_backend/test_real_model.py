"""The real SmolLM2-135M-Instruct through the engine, the server and the official SDK (slow: loads the model)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest
import torch

from local_backend.boot import EngineSettings, build_engine
from local_backend.checkset import CHECKS, chat_prompt_ids, run_checks
from local_backend.engine import Engine
from local_backend.protocol import GenerationRequest
from local_backend.server import BackendState

from .conftest import RunningServer, start_server

pytestmark = pytest.mark.slow

NAME = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def default_engine() -> Iterator[Engine]:
    engine = build_engine(EngineSettings(NAME, device="cpu", threads=1), lambda _: None)  # the default (auto) quantization
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def fp32_engine() -> Iterator[Engine]:
    engine = build_engine(EngineSettings(NAME, quantize="none", device="cpu", threads=1), lambda _: None)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def real_server(default_engine: Engine) -> Iterator[RunningServer]:
    server, stop = start_server(BackendState(served_name=NAME, engine=default_engine))
    yield server
    stop()


def test_the_default_on_cpu_is_w8a16_where_the_kernel_runs(default_engine: Engine) -> None:
    from local_backend.llama.native import kernel

    if kernel() is None:  # no AVX-512 VNNI or no compiler: torch's weight-only int8
        assert default_engine.model.mode == "int8" and default_engine.model.act_dtype == torch.bfloat16
    else:
        assert default_engine.model.mode == "w8a16" and default_engine.model.act_dtype == torch.float32


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


async def _tokens(engine: Engine, question: str, max_tokens: int = 24) -> tuple[int, ...]:
    request = GenerationRequest(chat_prompt_ids(engine.tokenizer, question), max_tokens=max_tokens, ignore_eos=True)
    return [d async for d in engine.submit(request).deltas()][-1].token_ids


async def test_default_mode_gives_a_prompt_the_same_tokens_alone_and_among_seven_others(default_engine: Engine) -> None:
    questions = [c.prompt for c in CHECKS[:8]]
    alone = await _tokens(default_engine, questions[5])
    together = await asyncio.gather(*(_tokens(default_engine, q) for q in questions))
    assert together[5] == alone


async def test_default_mode_answers_the_check_set_at_least_as_well_as_fp32(default_engine: Engine, fp32_engine: Engine) -> None:
    # 40 tokens, as the bench and the criterion: a shorter cut turns on where each answer's
    # sentence happens to put the expected word.
    default, fp32 = await run_checks(default_engine), await run_checks(fp32_engine)
    assert default.right >= fp32.right, f"default {default.right}, fp32 {fp32.right}; default got wrong: {default.wrong()}"
    assert fp32.right >= len(CHECKS) // 2  # the set is one this model mostly knows


async def test_fp32_first_tokens_match_transformers_generate(fp32_engine: Engine) -> None:
    # Our fp32 forward (fused QKV, its own attention) against transformers' on the same weights.
    from local_backend.models import load_model

    hf = load_model(NAME, device="cpu", dtype=torch.float32, progress=lambda _: None)
    for question in ("What is the capital of France?", "What is 2 + 2?", "Say hello in Spanish."):
        ids = chat_prompt_ids(hf.tokenizer, question)
        with torch.inference_mode():
            out = hf.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        ours = await _tokens(fp32_engine, question, max_tokens=8)
        assert list(ours) == out[0, len(ids) :].tolist()
