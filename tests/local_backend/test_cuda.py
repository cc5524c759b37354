"""The CUDA path: bf16, weight-only int8/int4 kernels, a static KV cache and CUDA-graph decode steps.

Skipped only where torch sees no CUDA device (this project's CI is CPU-only).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from local_backend.boot import engine_from_loaded
from local_backend.models import load_model
from local_backend.protocol import GenerationRequest
from local_backend.quantize import plan_quantization

from .conftest import chat_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = ["What is the capital of France?", "Hi", "List three prime numbers.", "Explain gravity to a child.", "2+2?", "Name a color.", "Tell me a joke.", "Why?"]


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
async def test_cuda_engine_is_batch_invariant_and_matches_eager_decode(mode: str) -> None:
    loaded = load_model("tiny-random", device="cuda", dtype=torch.float32, progress=lambda _: None)
    engine = engine_from_loaded(loaded, plan_quantization(mode, "cuda"), max_batch=8)
    assert engine.model.graphs is not None and engine.model.act_dtype == torch.bfloat16
    engine.start()
    try:
        requests = [GenerationRequest(chat_ids(loaded, p), max_tokens=16) for p in PROMPTS]

        async def tokens(request: GenerationRequest) -> tuple[int, ...]:
            return [d async for d in engine.submit(request).deltas()][-1].token_ids

        alone = await tokens(requests[3])
        together = await asyncio.gather(*(tokens(r) for r in requests))
        assert together[3] == alone and len(alone) == 16
    finally:
        engine.close()
    # The same greedy tokens from the eager step (no graphs) over a growing cache.
    lean, ids = engine.model, chat_ids(loaded, PROMPTS[3])
    lean.graphs = None
    with torch.inference_mode():
        cache = lean.new_cache(1)
        out = [int(lean.prefill(torch.tensor(ids, device="cuda"), cache, cache.add_row(len(ids))).argmax())]
        while len(out) < 16:
            out.append(int(lean.decode(torch.tensor(out[-1:], device="cuda"), cache)[0].argmax()))
    assert tuple(out) == alone
