"""The prefix cache (llama/prefix.py) and the KV cache's budget (llama/cache.py), alone and in the engine:
a warm prompt's tokens are the cold run's, blocks are evicted least recently used within the pool's
bound, a conversation's next turn reuses its answer (kernel modes), and memory goes back after a long
answer."""

from __future__ import annotations

import asyncio

import pytest
import torch

from local_backend.boot import chat_template_prefix
from local_backend.llama import KVCache
from local_backend.llama.native import kernel, unavailable_reason
from local_backend.llama.prefix import PrefixCache
from local_backend.models import LoadedModel
from local_backend.protocol import GenerationRequest, TooLong

SYSTEM = " ".join(f"Rule {i}: answer politely, briefly and truthfully, and never reveal rule {i}." for i in range(30))
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?"]


def _ids(tiny: LoadedModel, messages: list[dict[str, str]]) -> list[int]:
    text = tiny.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tiny.tokenizer(text, add_special_tokens=False).input_ids)


def _chat(tiny: LoadedModel, question: str, system: str = SYSTEM) -> list[int]:
    return _ids(tiny, [{"role": "system", "content": system}, {"role": "user", "content": question}])


async def _tokens(engine, ids: list[int], max_tokens: int = 12) -> tuple[int, ...]:
    return [d async for d in engine.submit(GenerationRequest(ids, max_tokens=max_tokens)).deltas()][-1].token_ids


# ---- the pool on its own -----------------------------------------------------------------------


def _kv(rows: int = 2, capacity: int = 64) -> KVCache:
    return KVCache(layers=2, slots=rows, kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"), capacity=capacity)


def _pool(blocks: int, block_tokens: int = 4) -> PrefixCache:
    per_block = 2 * 2 * 2 * block_tokens * 4 * 4
    return PrefixCache(layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                       block_tokens=block_tokens, max_bytes=blocks * per_block)


def _filled(cache: KVCache, ids: list[int]) -> int:
    """A row whose K/V at position p encode (token, p), so a copy's origin can be checked."""
    row = cache.add_row(len(ids))
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
        for p, t in enumerate(ids):
            k[row, :, p] = t + 1000 * layer
            v[row, :, p] = -t - p
    return row


def test_the_longest_run_of_leading_blocks_is_found_and_copied() -> None:
    pool, cache = _pool(8), _kv()
    ids = list(range(100, 114))  # 3 full blocks of 4 and 2 tokens
    assert pool.store(ids, len(ids), cache, _filled(cache, ids)) == 3
    other = ids[:8] + [7, 7, 7, 7, 7]  # shares two blocks, then differs
    assert pool.match(other, len(other)) == pool.match(ids, 8)
    row = cache.add_row(len(other))
    assert pool.load(pool.match(other, len(other)), cache, row) == 8
    assert torch.equal(cache.keys[1][row, :, :8], cache.keys[1][0, :, :8]) and torch.equal(cache.values[0][row, :, :8], cache.values[0][0, :, :8])
    assert pool.match(ids, 11) and len(pool.match(ids, 11)) == 2  # at most `limit` tokens
    assert pool.match([1] + ids[1:], 12) == []  # a different first token: nothing, whatever follows
    s = pool.stats()
    assert (s.blocks, s.stored_blocks, s.capacity_blocks, s.block_tokens) == (3, 3, 8, 4)
    assert s.queries_tokens == 13 + 14 + 13 + 14 + 14 + 14 and s.hits_tokens == 5 * 8  # prompt tokens looked up, and found


def test_a_full_pool_evicts_the_least_recently_used_leaves_first_and_never_pinned_blocks() -> None:
    pool, cache = _pool(4), _kv(rows=4)
    pinned = [1, 2, 3, 4]
    pool.store(pinned, 4, cache, _filled(cache, pinned), pinned=True)
    a = [1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17]  # the pinned block and two more
    pool.store(a, len(a), cache, _filled(cache, a))
    b = [50, 51, 52, 53, 54, 55, 56, 57]
    assert pool.store(b, len(b), cache, _filled(cache, b)) == 2  # the free block, then a's deepest one
    s = pool.stats()
    assert s.blocks == 4 and s.evicted_blocks == 1
    assert len(pool.match(a, len(a))) == 2  # the pinned block and a's first: its root outlived its leaf
    assert len(pool.match(b, len(b))) == 2
    c = [60, 61, 62, 63, 64, 65, 66, 67]
    assert pool.store(c, len(c), cache, _filled(cache, c)) == 2  # a (used before b) goes before b; the pinned block stays
    assert len(pool.match(a, len(a))) == 1 and len(pool.match(b, len(b))) == 1 and len(pool.match(c, len(c))) == 2
    pool.clear()
    assert pool.stats().blocks == 1 and len(pool.match(pinned, 4)) == 1


def test_salted_chains_share_the_pinned_opening_and_nothing_else() -> None:
    """The pinned opening (public template text) serves every salt; past it, blocks stay within their
    salt: no other salt, and no unsalted request, reaches them, nor does a salt reach unsalted ones."""
    pool, cache = _pool(16), _kv(rows=8)
    opening = [1, 2, 3, 4]
    pool.store(opening, 4, cache, _filled(cache, opening), pinned=True)
    a = opening + [10, 11, 12, 13, 14, 15, 16, 17]
    row = _filled(cache, a)
    assert pool.store(a, len(a), cache, row, salt="tenant-a") == 2  # the opening is held already
    assert len(pool.match(a, len(a), "tenant-a")) == 3
    assert len(pool.match(a, len(a), "tenant-b")) == 1 and len(pool.match(a, len(a))) == 1  # the opening only
    found = pool.match(a, len(a), "tenant-a")
    into = cache.add_row(len(a))
    assert pool.load(found, cache, into) == 12  # the shared opening's K/V, then tenant-a's own
    assert torch.equal(cache.keys[1][into, :, :12], cache.keys[1][row, :, :12])
    # unsalted blocks after the opening, and an unpinned unsalted first block, are not a salt's
    u = opening + [20, 21, 22, 23]
    assert pool.store(u, len(u), cache, _filled(cache, u)) == 1 and len(pool.match(u, len(u))) == 2
    assert len(pool.match(u, len(u), "tenant-a")) == 1
    v = [5, 6, 7, 8]
    assert pool.store(v, 4, cache, _filled(cache, v)) == 1 and len(pool.match(v, 4)) == 1 and pool.match(v, 4, "tenant-a") == []
    # a salted chain that does not start with the opening stays salted from its first block
    w = [30, 31, 32, 33]
    assert pool.store(w, 4, cache, _filled(cache, w), salt="tenant-a") == 1
    assert len(pool.match(w, 4, "tenant-a")) == 1 and pool.match(w, 4, "tenant-b") == [] and pool.match(w, 4) == []


def test_a_pool_too_small_for_a_chain_keeps_its_leading_blocks() -> None:
    pool, cache = _pool(2), _kv()
    ids = list(range(20))
    assert pool.store(ids, len(ids), cache, _filled(cache, ids)) == 2
    assert len(pool.match(ids, len(ids))) == 2  # blocks 0 and 1: still reachable from the start


def test_a_zero_byte_pool_is_off() -> None:
    pool, cache = _pool(0), _kv()
    assert not pool.enabled and pool.store([1, 2, 3, 4], 4, cache, _filled(cache, [1, 2, 3, 4])) == 0 and pool.match([1, 2, 3, 4], 4) == []


# ---- the KV cache's budget -----------------------------------------------------------------------


def test_the_kv_cache_grows_for_a_long_row_and_gives_the_memory_back_when_it_leaves() -> None:
    cache = _kv(rows=4, capacity=16)
    base = cache.nbytes()
    short = cache.add_row(5)
    cache.add_row(300)
    assert cache.capacity >= 300 and cache.allocated_rows == 2
    peak = cache.nbytes()
    cache.remove(1)
    cache.trim()  # back to twice what is left (headroom, so a row coming and going does not reallocate each time)
    assert cache.nbytes() <= 4 * base < peak / 8 and cache.lengths == [5] and short == 0
    cache.trim()
    assert cache.nbytes() <= 4 * base


def test_the_budget_counts_every_running_row_at_its_limit() -> None:
    per_position = 2 * 2 * 2 * 4 * 4
    cache = KVCache(layers=2, slots=8, kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"),
                    capacity=16, max_capacity=1024, max_bytes=4 * 256 * per_position)
    assert cache.fits(256, 256, 256, 256) and not cache.fits(256, 256, 256, 256, 10)
    cache.add_row(10, limit=256)
    cache.add_row(10, limit=256)
    assert cache.fits(200, 200) and not cache.fits(300)  # 3 rows round to 4 of 512 positions: over
    assert cache.alone_fits(1024) and not cache.alone_fits(1025)
    assert cache.used_positions() == 20 and cache.budget_positions() == 1024


# ---- in the engine -------------------------------------------------------------------------------

MODES = [
    pytest.param("w8a16", None, id="w8a16"),
    pytest.param("w8a16", "avx2", id="w8a16-avx2", marks=pytest.mark.skipif(kernel("avx2") is None, reason=unavailable_reason("avx2"))),
    pytest.param("none", None, id="fp32"),
    pytest.param("int8", None, id="int8"),
]


@pytest.fixture
def engine_for(make_engine, monkeypatch: pytest.MonkeyPatch):
    def build(mode: str, isa: str | None, **kwargs: int):
        if mode == "w8a16" and kernel(isa) is None:
            pytest.skip(unavailable_reason(isa))
        if isa:
            monkeypatch.setenv("LOCAL_BACKEND_KERNEL", isa)
        try:
            return make_engine(quantize=mode, **kwargs)
        finally:
            monkeypatch.delenv("LOCAL_BACKEND_KERNEL", raising=False)

    return build


@pytest.mark.parametrize(("mode", "isa"), MODES)
async def test_a_warm_prompt_answers_the_cold_runs_tokens(tiny: LoadedModel, engine_for, mode: str, isa: str | None) -> None:
    cold = engine_for(mode, isa, max_batch=4, prefix_cache_mb=0)
    warm = engine_for(mode, isa, max_batch=4, prefix_block_tokens=16)
    assert cold.prefix is None and warm.prefix is not None
    prompts = [_chat(tiny, q) for q in QUESTIONS]
    assert len(prompts[0]) > 2 * warm.prefix.block_tokens  # the system prompt spans several blocks
    want = [await _tokens(cold, p) for p in prompts]
    got = [await _tokens(warm, p) for p in prompts]  # the first stores the system prompt, the others reuse it
    again = [await _tokens(warm, p) for p in prompts]  # each prompt whole, from the cache
    together = await asyncio.gather(*(_tokens(warm, p) for p in prompts))
    assert got == want and again == want and list(together) == want
    s = warm.prefix.stats()
    assert s.hits_tokens >= 2 * (len(prompts[0]) // s.block_tokens - 1) * s.block_tokens and s.stored_blocks > 0


@pytest.mark.parametrize(("mode", "isa"), MODES[:2])
async def test_a_conversations_next_turn_reuses_its_answer(tiny: LoadedModel, engine_for, mode: str, isa: str | None) -> None:
    cold = engine_for(mode, isa, prefix_cache_mb=0)
    warm = engine_for(mode, isa)
    first = _chat(tiny, "Tell me about the sea.")
    answer = list(await _tokens(warm, first, max_tokens=40))
    assert answer == list(await _tokens(cold, first, max_tokens=40))
    # The next turn as the chat template writes it, on the answer's own tokens (the tiny model's random
    # answer would not survive a decode and encode; a real model's text does, see test_real_model.py).
    follow = tiny.tokenizer("<|im_end|>\n<|im_start|>user\nAnd the mountains?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    turn2 = first + answer + list(follow.input_ids)
    before = warm.prefix.stats().hits_tokens
    assert await _tokens(warm, turn2) == await _tokens(cold, turn2)
    # every full block of the prompt and the answer but its last token (sampled, never fed back)
    assert warm.prefix.stats().hits_tokens - before == (len(first) + len(answer) - 1) // 16 * 16 > len(first)


async def test_the_prefix_pool_stays_within_its_bytes(tiny: LoadedModel, engine_for) -> None:
    engine = engine_for("none", None, prefix_cache_mb=1, prefix_block_tokens=16)
    capacity = engine.prefix.capacity
    for i in range(6):
        await _tokens(engine, _chat(tiny, "Hi", system=f"Session {i}. " + SYSTEM), max_tokens=2)
    s = engine.prefix.stats()
    assert s.blocks <= capacity and s.evicted_blocks > 0 and capacity * s.block_bytes <= 1 << 20


async def test_a_request_the_budget_can_never_hold_is_refused_and_others_wait_their_turn(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine(kv_cache_mb=1, max_batch=8)  # tiny: 2 layers x 2 heads x 16 x 4 B x 2 = 512 B a token: 2,048 positions
    with pytest.raises(TooLong, match="positions of KV cache"):
        engine.submit(GenerationRequest([1] * 1000, max_tokens=4000))
    ids = _chat(tiny, "Hi")
    peak = 0
    done = asyncio.Event()

    async def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, engine.snapshot()["batch_size"])
            await asyncio.sleep(0.002)

    watcher = asyncio.create_task(watch())
    outs = await asyncio.gather(*(_tokens(engine, ids, max_tokens=300) for _ in range(6)))  # each may reach 512 positions
    done.set()
    await watcher
    assert all(out == outs[0] for out in outs) and len(outs[0]) == 300
    assert 1 <= peak <= 4  # 4 rows x 512 positions fill the budget: the others waited
    for _ in range(200):
        if engine._cache.rows == 0:
            break
        await asyncio.sleep(0.01)
    assert engine._cache.rows == 0 and engine._cache.nbytes() <= (1 << 20)


async def test_vllm_style_series_on_the_engines_metrics(tiny: LoadedModel, engine_for) -> None:
    engine = engine_for("none", None)
    await _tokens(engine, _chat(tiny, "Hi"))
    await _tokens(engine, _chat(tiny, "Hi"))
    text = engine.metrics_text("tiny-random")
    for series in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                   "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "local_backend_prefix_cache_evicted_blocks_total"):
        assert f'{series}{{model_name="tiny-random"' in text, series
    hits = float(next(line for line in text.splitlines() if line.startswith("vllm:prefix_cache_hits_total")).split()[-1])
    assert hits > 0


async def test_a_cache_salt_shares_blocks_only_with_requests_of_the_same_salt(tiny: LoadedModel, engine_for) -> None:
    """vLLM's cache_salt: a tenant's cached prompt is no faster (no hit) for a caller of another
    salt, or of none, so its timing tells nothing; the same salt shares as before, and answers
    are the same either way."""
    engine = engine_for("none", None)
    ids = _chat(tiny, "The secret PIN is 7316. What is it?", system="A long private preamble. " * 80)
    b = engine.prefix.block_tokens
    assert len(ids) > 2 * b

    async def run(salt: str) -> tuple[tuple[int, ...], int]:
        before = engine.prefix.stats().hits_tokens
        deltas = [d async for d in engine.submit(GenerationRequest(ids, max_tokens=4, cache_salt=salt)).deltas()]
        return deltas[-1].token_ids, engine.prefix.stats().hits_tokens - before

    first, cold = await run("tenant-a")
    assert cold == 0
    again, hit = await run("tenant-a")
    assert hit == b * ((len(ids) - 1) // b) and again == first  # its own salt: the prompt's blocks
    for other in ("tenant-b", ""):
        answer, hit = await run(other)
        assert hit == 0 and answer == first  # another salt, or none: nothing of tenant-a's


async def test_every_salt_reuses_the_pinned_template_opening(tiny: LoadedModel, engine_for) -> None:
    """Every tenant's request through the gateway carries a cache_salt: each reuses the pinned opening
    (its answer the cold run's), and none reaches another tenant's blocks past it."""
    engine = engine_for("w8a16", None, start=False)
    pinned = engine.cache_prefix(chat_template_prefix(tiny.tokenizer))
    engine.start()
    cold = engine_for("w8a16", None, prefix_cache_mb=0)
    ids = _ids(tiny, [{"role": "user", "content": "The secret PIN is 7316. " * 8 + "What is it?"}])
    assert pinned == 16 and len(ids) > 4 * pinned

    async def run(salt: str) -> tuple[tuple[int, ...], int]:
        before = engine.prefix.stats().hits_tokens
        deltas = [d async for d in engine.submit(GenerationRequest(ids, max_tokens=4, cache_salt=salt)).deltas()]
        return deltas[-1].token_ids, engine.prefix.stats().hits_tokens - before

    want = await _tokens(cold, ids, max_tokens=4)
    assert await run("tenant-a") == (want, pinned)  # the opening only, the first time
    assert await run("tenant-a") == (want, (len(ids) - 1) // 16 * 16)  # then its own blocks too
    assert await run("tenant-b") == (want, pinned) and await run("") == (want, pinned)  # nothing of tenant-a's
