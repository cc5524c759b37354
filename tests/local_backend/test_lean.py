"""The lean Llama forward and its preallocated KV cache, over the tiny random model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from local_backend.boot import chat_template_prefix
from local_backend.llama import KVCache, LeanLlama
from local_backend.llama.native import kernel, unavailable_reason
from local_backend.models import LoadedModel
from local_backend.protocol import GenerationRequest

from .conftest import chat_ids

PROMPTS = ["What is the capital of France?", "Hi", "List three prime numbers.", "Explain gravity to a child, please.", "2+2?", "Name a color.", "Tell me a joke about cats.", "Why?"]


def _lean(tiny: LoadedModel, mode: str) -> LeanLlama:
    """``w8a16``/``w8a8k``: our kernel's best build here (fp32 in and out, prefill through the kernel
    too); ``w8a16-avx2``: its AVX2 build, which runs on AVX-512 machines too."""
    if mode in ("w8a16", "w8a8k", "w8a16-avx2"):
        isa = "avx2" if mode.endswith("avx2") else None
        if kernel(isa) is None:
            pytest.skip(unavailable_reason(isa))
        return LeanLlama.from_hf(tiny.model, mode="w8a8" if mode == "w8a8k" else "w8a16", act_dtype=torch.float32, isa=isa)
    dtype = torch.float32 if mode == "none" else torch.bfloat16
    return LeanLlama.from_hf(tiny.model, mode=mode, act_dtype=dtype, dense_prefill=mode != "none")


def _greedy(lean: LeanLlama, cache: KVCache, prompts: list[list[int]], steps: int) -> list[list[torch.Tensor]]:
    """Prefill each prompt into its own row, then decode all rows together; logits per row per step."""
    logits: list[list[torch.Tensor]] = []
    for ids in prompts:
        logits.append([lean.prefill(torch.tensor(ids), cache, cache.add_row(len(ids)))])
    for _ in range(steps):
        tokens = torch.tensor([int(rows[-1].argmax()) for rows in logits])
        step = lean.decode(tokens, cache)
        for row, rows in enumerate(logits):
            rows.append(step[row])
    return logits


@torch.inference_mode()
def test_fp32_logits_match_transformers(tiny: LoadedModel) -> None:
    lean = _lean(tiny, "none")
    ids = chat_ids(tiny, PROMPTS[0])
    ours = _greedy(lean, lean.new_cache(1), [ids], steps=6)[0]
    tokens = ids + [int(x.argmax()) for x in ours[:-1]]
    theirs = tiny.model(torch.tensor([tokens])).logits[0, len(ids) - 1 :]
    assert torch.allclose(torch.stack(ours), theirs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["int8", "w8a8", "int4", "w8a16", "w8a8k", "w8a16-avx2"])
@torch.inference_mode()
def test_quantized_row_is_bit_identical_alone_and_among_seven_others(tiny: LoadedModel, mode: str) -> None:
    lean = _lean(tiny, mode)
    prompts = [chat_ids(tiny, p) for p in PROMPTS]
    alone = _greedy(lean, lean.new_cache(8), [prompts[2]], steps=8)[0]
    together = _greedy(lean, lean.new_cache(8), prompts, steps=8)[2]  # longer and shorter rows around it
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b)


@torch.inference_mode()
def test_removing_a_row_and_growing_the_cache_leave_the_others_unchanged(tiny: LoadedModel) -> None:
    lean = _lean(tiny, "int8")
    prompts = [chat_ids(tiny, p) for p in PROMPTS[:3]]
    reference = _greedy(lean, lean.new_cache(4), prompts, steps=6)
    cache = lean.new_cache(4, capacity=8)  # the prompts are longer: the cache grows on the way
    logits = _greedy(lean, cache, prompts, steps=2)
    assert cache.capacity >= max(map(len, prompts)) + 2
    cache.remove(0)  # row 2 moves into row 0
    kept = [logits[2], logits[1]]
    for _ in range(4):
        step = lean.decode(torch.tensor([int(rows[-1].argmax()) for rows in kept]), cache)
        for row, rows in enumerate(kept):
            rows.append(step[row])
    assert all(torch.equal(a, b) for a, b in zip(kept[0], reference[2], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(kept[1], reference[1], strict=True))
    assert cache.rows == 2 and cache.lengths == [len(prompts[2]) + 6, len(prompts[1]) + 6]


def test_cache_refuses_rows_beyond_its_slots_and_lengths_beyond_its_context() -> None:
    cache = KVCache(layers=1, slots=1, kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"), capacity=4, max_capacity=16)
    cache.add_row(3)
    with pytest.raises(RuntimeError, match="cache rows"):
        cache.add_row(3)
    cache.clear()
    with pytest.raises(ValueError, match="16 positions"):
        cache.add_row(17)


@pytest.mark.parametrize("mode", ["none", "int8", "w8a8", "int4", "w8a16"])
async def test_engine_gives_a_prompt_the_same_tokens_alone_and_among_seven_others(tiny: LoadedModel, make_engine, mode: str) -> None:
    engine = make_engine(quantize=mode, max_batch=8)
    requests = [GenerationRequest(chat_ids(tiny, p), max_tokens=20) for p in PROMPTS]

    async def tokens(request: GenerationRequest) -> tuple[int, ...]:
        return [d async for d in engine.submit(request).deltas()][-1].token_ids

    alone = await tokens(requests[3])
    together = await asyncio.gather(*(tokens(r) for r in requests))
    assert together[3] == alone and len(alone) == 20


@torch.inference_mode()
def test_prefill_after_a_cached_prefix_matches_a_full_prefill(tiny: LoadedModel) -> None:
    lean = _lean(tiny, "none")
    prefix, ids = chat_template_prefix(tiny.tokenizer), chat_ids(tiny, PROMPTS[2])
    assert len(prefix) > 10 and ids[: len(prefix)] == prefix
    full = _greedy(lean, lean.new_cache(1), [ids], steps=4)[0]
    cache = lean.new_cache(2)
    row = cache.add_row(len(prefix))
    lean.prefill(torch.tensor(prefix), cache, row)
    saved = cache.snapshot(row, len(prefix))
    cache.clear()
    row = cache.add_row(len(ids))
    cache.restore(row, saved)
    cached = [lean.prefill(torch.tensor(ids), cache, row, start=len(prefix))]
    for _ in range(4):
        cached.append(lean.decode(torch.tensor([int(cached[-1].argmax())]), cache)[0])
    assert torch.allclose(torch.stack(cached), torch.stack(full), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["none", "int8", "w8a8", "w8a16"])
async def test_engine_with_the_template_prefix_cached_gives_the_same_tokens(tiny: LoadedModel, make_engine, mode: str) -> None:
    plain, cached = make_engine(quantize=mode, max_batch=8, start=False), make_engine(quantize=mode, max_batch=8, start=False)
    cached.cache_prefix(chat_template_prefix(tiny.tokenizer))
    plain.start()
    cached.start()

    async def tokens(engine, prompt: str) -> tuple[int, ...]:
        request = GenerationRequest(chat_ids(tiny, prompt), max_tokens=12)
        return [d async for d in engine.submit(request).deltas()][-1].token_ids

    want = [await tokens(plain, p) for p in PROMPTS]
    assert list(await asyncio.gather(*(tokens(cached, p) for p in PROMPTS))) == want


def test_cache_usage_counts_what_admission_reserves() -> None:
    """vllm:kv_cache_usage_perc read the positions written (0.34) while two long-limit rows had
    left no room for a third (review helper's repro): it reads what admission counts, the rows at
    their limits rounded up to powers of two, against the byte budget."""
    per_position = 2 * 1 * 1 * 4 * 4  # K and V, one layer, one head, head_dim 4, fp32
    cache = KVCache(layers=1, slots=8, kv_heads=1, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                    capacity=4, max_capacity=64, max_bytes=3 * 64 * per_position)
    assert cache.usage() == 0.0
    for _ in range(2):
        cache.add_row(10, 64)  # 10 written, may grow to 64
    assert not cache.fits(1)  # 4 rows x 64 positions: past the budget of 3 x 64
    assert cache.usage() == pytest.approx(2 * 64 / (3 * 64))
    assert cache.usage() > 20 / cache.budget_positions()  # what it read before
