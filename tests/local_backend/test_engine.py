"""The continuous-batching engine over the tiny random model (fp32: the exact path)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from local_backend.engine import Engine
from local_backend.models import LoadedModel
from local_backend.protocol import Delta, GenerationRequest, QueueFull, SamplingParams

from .conftest import chat_ids

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about rain, please, and make it about autumn rain in a quiet village.",
    "List three prime numbers.",
    "2+2?",
    "Explain gravity to a child in two sentences, using an example with an apple.",
]


async def _eventually(check, timeout_s: float = 2.0) -> bool:
    for _ in range(int(timeout_s / 0.01)):
        if check():
            return True
        await asyncio.sleep(0.01)
    return bool(check())


async def _run(engine: Engine, request: GenerationRequest) -> tuple[list[Delta], str]:
    deltas = [d async for d in engine.submit(request).deltas()]
    return deltas, "".join(d.text for d in deltas)


async def test_batched_greedy_equals_one_at_a_time(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine(max_batch=8)
    requests = [GenerationRequest(chat_ids(tiny, q), max_tokens=24) for q in QUESTIONS]
    alone = [await _run(engine, r) for r in requests]

    # Staggered arrivals: later requests are spliced into a batch that is already decoding,
    # some with longer prompts than the batch so far, some shorter.
    async def delayed(i: int, r: GenerationRequest) -> tuple[list[Delta], str]:
        await asyncio.sleep(0.01 * (i % 3))
        return await _run(engine, r)

    batched = await asyncio.gather(*(delayed(i, r) for i, r in enumerate(requests)))
    for (a_deltas, a_text), (b_deltas, b_text) in zip(alone, batched, strict=True):
        assert b_text == a_text
        assert b_deltas[-1] == a_deltas[-1]


async def test_engine_matches_transformers_generate(tiny: LoadedModel, make_engine) -> None:
    ids = chat_ids(tiny, QUESTIONS[0])
    deltas, text = await _run(make_engine(), GenerationRequest(ids, max_tokens=20))
    with torch.inference_mode():
        out = tiny.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    assert text == tiny.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].completion_tokens == 20
    assert deltas[-1].prompt_tokens == len(ids)


async def test_max_tokens_one_finishes_at_prefill(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine()
    deltas, _ = await _run(engine, GenerationRequest(chat_ids(tiny, "Hi"), max_tokens=1))
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == 1
    assert await _eventually(lambda: engine.snapshot()["batch_size"] == 0)


async def test_stop_sequence_cuts_the_text_and_finishes(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine()
    ids = chat_ids(tiny, QUESTIONS[2])
    _, full = await _run(engine, GenerationRequest(ids, max_tokens=30))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and full.index(stop) > 0
    deltas, text = await _run(engine, GenerationRequest(ids, max_tokens=30, stop=(stop, "never-appears")))
    assert text == full[: full.index(stop)]
    assert deltas[-1].finish_reason == "stop"


async def test_end_of_turn_token_stops_and_is_not_shown(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine()
    ids = chat_ids(tiny, QUESTIONS[0])
    probe, _ = await _run(engine, GenerationRequest(ids, max_tokens=1))
    with torch.inference_mode():
        out = tiny.model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False)
    tokens = out[0, len(ids) :].tolist()
    engine.stop_token_ids = frozenset({tokens[3]})  # pretend the 4th token is the end of turn
    deltas, text = await _run(engine, GenerationRequest(ids, max_tokens=20))
    assert deltas[-1].finish_reason == "stop"
    assert deltas[-1].completion_tokens == 4
    assert text == tiny.tokenizer.decode(tokens[:3], skip_special_tokens=True)
    assert "<|im_end|>" not in text and probe


def test_chat_template_end_of_turn_is_a_stop_token(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine(start=False)
    assert tiny.tokenizer.convert_tokens_to_ids("<|im_end|>") in engine.stop_token_ids


async def test_cancel_frees_the_slot_at_the_next_step(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine()
    seq = engine.submit(GenerationRequest(chat_ids(tiny, "Hi"), max_tokens=3000))
    stream = seq.deltas()
    for _ in range(3):
        assert (await anext(stream)).finish_reason is None
    assert engine.snapshot()["batch_size"] == 1
    seq.cancel()
    assert await _eventually(lambda: engine.snapshot()["batch_size"] == 0)
    deltas, _ = await _run(engine, GenerationRequest(chat_ids(tiny, "Hi"), max_tokens=3))
    assert deltas[-1].completion_tokens == 3


async def test_queue_full_raises_and_cancelled_waiters_give_their_place_back(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine(start=False, max_queue=2)  # not started: everything stays waiting
    ids = chat_ids(tiny, "Hi")
    first = engine.submit(GenerationRequest(ids, max_tokens=2))
    engine.submit(GenerationRequest(ids, max_tokens=2))
    with pytest.raises(QueueFull):
        engine.submit(GenerationRequest(ids, max_tokens=2))
    first.cancel()
    engine.submit(GenerationRequest(ids, max_tokens=2))


async def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine()
    ids = chat_ids(tiny, QUESTIONS[3])
    sampled = GenerationRequest(ids, max_tokens=16, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=7))
    _, alone = await _run(engine, sampled)
    others = [GenerationRequest(chat_ids(tiny, q), max_tokens=16) for q in QUESTIONS[:3]]
    results = await asyncio.gather(_run(engine, sampled), *(_run(engine, r) for r in others))
    assert results[0][1] == alone
    _, greedy = await _run(engine, GenerationRequest(ids, max_tokens=16))
    _, other_seed = await _run(engine, GenerationRequest(ids, max_tokens=16, sampling=SamplingParams(1.0, 0.9, 8)))
    assert alone != greedy or alone != other_seed


async def test_prompt_longer_than_context_is_capped_by_length(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine()
    ids = chat_ids(tiny, "Hi")
    room = 5
    engine.context_length = len(ids) + room
    deltas, _ = await _run(engine, GenerationRequest(ids, max_tokens=100))
    assert deltas[-1].finish_reason == "length" and deltas[-1].completion_tokens == room


async def test_metrics_count_tokens_and_requests(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine()
    await _run(engine, GenerationRequest(chat_ids(tiny, "Hi"), max_tokens=5))
    text = engine.stats.render("tiny-random")
    assert 'local_backend_completion_tokens_total{model="tiny-random"} 5' in text
    assert 'local_backend_requests_total{model="tiny-random",finish_reason="length"} 1' in text
    assert 'local_backend_ttft_seconds_count{model="tiny-random"} 1' in text


async def test_a_failed_prefill_fails_the_requests_admitted_with_it_and_the_engine_goes_on(
    tiny: LoadedModel, make_engine, monkeypatch
) -> None:
    engine = make_engine(max_batch=8, start=False)
    real = engine.model.prefill
    calls = {"n": 0}

    def flaky(ids, cache, row, start=0):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated prefill failure")
        return real(ids, cache, row, start)

    monkeypatch.setattr(engine.model, "prefill", flaky)
    requests = [GenerationRequest(chat_ids(tiny, q), max_tokens=4) for q in QUESTIONS[:3]]
    first = [engine.submit(r) for r in requests]  # queued before the engine starts: admitted together
    engine.start()
    async def drain(seq) -> None:
        async for _ in seq.deltas():
            pass

    for seq in first:  # the failed one and the two admitted after it: none is left waiting forever
        with pytest.raises(RuntimeError, match="simulated prefill failure"):
            await asyncio.wait_for(drain(seq), 10)
    deltas, _ = await _run(engine, requests[0])  # the engine still serves
    assert deltas[-1].finish_reason in ("stop", "length")
    assert await _eventually(lambda: engine.snapshot()["batch_size"] == 0)


async def test_a_vanishing_temperature_decodes_greedily(tiny: LoadedModel, make_engine) -> None:
    """1e-45 passes the API's 0..2 check; logits / 1e-45 overflow to inf, and sampling them raised."""
    engine = make_engine()
    ids = chat_ids(tiny, QUESTIONS[0])
    _, greedy = await _run(engine, GenerationRequest(ids, max_tokens=12))
    for temperature in (1e-45, 1e-30, 1e-6):
        deltas, text = await _run(engine, GenerationRequest(ids, max_tokens=12, sampling=SamplingParams(temperature=temperature)))
        assert deltas[-1].finish_reason == "length" and text == greedy, temperature


def test_sampling_survives_logits_that_overflow_or_are_nan() -> None:
    from local_backend.sampling import choose_tokens

    logits = torch.tensor([[1.0, 3.0e38, -3.0e38, 2.0], [0.5, float("nan"), 4.0, 1.0]])
    hot = SamplingParams(temperature=1e-5 * 1.01, seed=1)  # sampled (above the greedy threshold), yet overflows
    got = choose_tokens(logits, [hot, hot], [torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)])
    assert got == [1, 2]  # the likeliest finite logit, as a vanishing temperature gives


async def test_a_row_whose_sampling_fails_fails_that_request_alone(tiny: LoadedModel, make_engine, monkeypatch) -> None:
    """A sampled row with no finite logits cannot pick a token: that request ends with an error (counted
    as finish "error"); its batch-mates, here a greedy one, carry on to the same answer as alone."""
    engine = make_engine(max_batch=8, start=False)
    ids = chat_ids(tiny, QUESTIONS[1])
    greedy = GenerationRequest(ids, max_tokens=10)
    sampled = GenerationRequest(chat_ids(tiny, QUESTIONS[0]), max_tokens=10, sampling=SamplingParams(temperature=1.0, seed=3))
    real = engine.model.decode

    def nan_in_the_sampled_row(tokens, cache):
        logits = real(tokens, cache)
        if logits.shape[0] == 2:
            logits[1] = float("nan")  # row 1: the sampled request (admitted second)
        return logits

    monkeypatch.setattr(engine.model, "decode", nan_in_the_sampled_row)
    seqs = [engine.submit(greedy), engine.submit(sampled)]  # queued before start: admitted together, in order
    engine.start()
    deltas = [d async for d in seqs[0].deltas()]
    with pytest.raises(ValueError, match="no finite logits"):
        async for _ in seqs[1].deltas():
            pass
    monkeypatch.setattr(engine.model, "decode", real)
    _, alone = await _run(engine, greedy)
    assert deltas[-1].finish_reason == "length" and "".join(d.text for d in deltas) == alone
    text = engine.stats.render("tiny-random")
    assert 'local_backend_requests_total{model="tiny-random",finish_reason="error"} 1' in text
    assert 'local_backend_requests_total{model="tiny-random",finish_reason="length"} 2' in text
    assert await _eventually(lambda: engine.snapshot()["batch_size"] == 0)


async def test_requests_failed_by_a_forward_pass_are_counted_as_errors(tiny: LoadedModel, make_engine, monkeypatch) -> None:
    engine = make_engine(max_batch=8, start=False)
    real = engine.model.decode
    calls = {"n": 0}

    def fails_once(tokens, cache):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated decode failure")
        return real(tokens, cache)

    monkeypatch.setattr(engine.model, "decode", fails_once)
    seqs = [engine.submit(GenerationRequest(chat_ids(tiny, q), max_tokens=50, ignore_eos=True)) for q in QUESTIONS[:2]]
    engine.start()  # both queued first: admitted together, so the failed pass is both of theirs
    for seq in seqs:
        with pytest.raises(RuntimeError, match="simulated decode failure"):
            async for _ in seq.deltas():
                pass
    assert 'local_backend_requests_total{model="tiny-random",finish_reason="error"} 2' in engine.stats.render("tiny-random")


async def test_a_request_that_does_not_fit_yet_lets_smaller_ones_go_ahead_a_bounded_number_of_times(
    tiny: LoadedModel, make_engine
) -> None:
    """The KV budget (1 MB: 2,048 tiny positions) holds a running answer A (~256 positions) with small
    requests, but not A with B (~1,030 positions: every row is priced at the largest, 2 x 2,048). Strictly
    FIFO, B kept every small request behind it waiting for A to finish. Now small ones overtake B, but at
    most max_batch (4) of them: the fifth and sixth wait behind B, so B is not starved either."""
    engine = make_engine(max_batch=4, kv_cache_mb=1)
    ids = chat_ids(tiny, "Hi")
    order: list[str] = []

    async def run(name: str, deltas) -> None:
        async for _ in deltas:
            pass
        order.append(name)

    a = engine.submit(GenerationRequest(ids, max_tokens=200, ignore_eos=True)).deltas()
    await anext(a)  # A is decoding
    tasks = [asyncio.create_task(run("A", a))]
    big = engine.submit(GenerationRequest(ids, max_tokens=1000, ignore_eos=True))
    tasks.append(asyncio.create_task(run("B", big.deltas())))
    small = [engine.submit(GenerationRequest(ids, max_tokens=4, ignore_eos=True)) for _ in range(6)]
    tasks += [asyncio.create_task(run(f"s{i}", seq.deltas())) for i, seq in enumerate(small, 1)]
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert sorted(order[:4]) == ["s1", "s2", "s3", "s4"], order  # they went ahead of B while A ran
    assert order[4:6] == ["A", "B"] and sorted(order[6:]) == ["s5", "s6"], order  # then B's turn came


def _reference_greedy(tiny: LoadedModel, ids: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy decoding by transformers' forward pass with OpenAI's penalties and bias applied by hand."""
    out: list[int] = []
    bias = dict(params.logit_bias)
    with torch.inference_mode():
        for _ in range(n):
            logits = tiny.model(torch.tensor([ids + out])).logits[0, -1].float()
            for token in set(out):
                logits[token] -= out.count(token) * params.frequency_penalty + params.presence_penalty
            for token, b in bias.items():
                logits[token] += b
            out.append(int(logits.argmax()))
    return out


async def test_penalties_and_bias_decode_as_openai_defines_them_and_leave_batch_mates_alone(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine(max_batch=4)
    ids = chat_ids(tiny, QUESTIONS[0])
    plain = GenerationRequest(ids, max_tokens=12, ignore_eos=True)
    _, alone = await _run(engine, plain)
    first_plain = (await _run(engine, GenerationRequest(ids, max_tokens=1, ignore_eos=True)))[0][-1].token_ids[0]
    cases = [
        SamplingParams(frequency_penalty=2.0),
        SamplingParams(presence_penalty=2.0, frequency_penalty=0.5),
        SamplingParams(logit_bias=((first_plain, -100.0),)),
    ]
    results = await asyncio.gather(*(_run(engine, GenerationRequest(ids, 12, p, ignore_eos=True)) for p in cases), _run(engine, plain))
    for params, (deltas, _) in zip(cases, results, strict=False):
        assert list(deltas[-1].token_ids) == _reference_greedy(tiny, ids, 12, params), params
    assert results[-1][1] == alone  # the plain request batched with them decodes as alone
    assert results[2][0][-1].token_ids[0] != first_plain  # the banned token did not come


async def test_logprobs_come_with_the_deltas_of_their_tokens(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine(max_batch=4)
    ids = chat_ids(tiny, QUESTIONS[1])
    asks = GenerationRequest(ids, max_tokens=10, sampling=SamplingParams(logprobs=3), ignore_eos=True)
    deltas, text = await _run(engine, asks)
    entries = [e for d in deltas for e in d.logprobs]
    assert [e.token for e in entries] == list(deltas[-1].token_ids)
    for e in entries:  # greedy: the chosen token is the likeliest, and the alternatives come best first
        assert len(e.top) == 3 and e.top[0] == (e.token, e.logprob)
        assert [lp for _, lp in e.top] == sorted((lp for _, lp in e.top), reverse=True)
    assert b"".join(bytes(engine.token_text(e.token)[1]) for e in entries).decode("utf-8", "replace") == text
    plain, _ = await _run(engine, GenerationRequest(ids, max_tokens=10, ignore_eos=True))
    assert all(d.logprobs == () for d in plain)  # nobody pays for what they did not ask


async def test_the_end_of_turn_token_has_no_logprob(tiny: LoadedModel, make_engine) -> None:
    engine = make_engine()
    ids = chat_ids(tiny, QUESTIONS[1])
    eot = next(iter(engine.stop_token_ids))
    deltas, _ = await _run(engine, GenerationRequest(ids, max_tokens=5, sampling=SamplingParams(logprobs=0, logit_bias=((eot, 100.0),))))
    assert deltas[-1].finish_reason == "stop" and deltas[-1].token_ids == (eot,)
    assert [e for d in deltas for e in d.logprobs] == []


@pytest.mark.parametrize("mode", ["none", "int8"])
async def test_a_long_prompt_is_read_between_the_decode_steps_of_running_streams(tiny: LoadedModel, make_engine, mode: str) -> None:
    """A 7,000-token prompt was prefilled in one pass: every running stream stopped for ~26 s of
    SmolLM2 on CPU (review helper's repro). Arriving while others decode, it is read a chunk
    between two of their steps, and every request's tokens are the ones it gets alone."""
    short = GenerationRequest(chat_ids(tiny, "Hi"), max_tokens=400, ignore_eos=True)
    long = GenerationRequest(chat_ids(tiny, "word " * 1500), max_tokens=8)
    assert len(long.prompt_ids) > 1400
    first = make_engine(quantize=mode, max_batch=4)  # another engine: this one's prefix cache would hold the prompt

    async def tokens(request: GenerationRequest) -> tuple[int, ...]:
        return [d async for d in first.submit(request).deltas()][-1].token_ids

    alone = (await tokens(short), await tokens(long))
    engine = make_engine(quantize=mode, max_batch=4)
    events: list[str] = []

    async def stream(request: GenerationRequest, name: str) -> tuple[int, ...]:
        last = None
        async for d in engine.submit(request).deltas():
            events.append(name)
            last = d
        assert last is not None
        return last.token_ids

    running = asyncio.create_task(stream(short, "short"))
    assert await _eventually(lambda: len(events) >= 3)
    events.append("long submitted")
    reading = asyncio.create_task(stream(long, "long"))
    together = (await running, await reading)
    assert together == alone
    between = events[events.index("long submitted"):events.index("long")]
    assert 8 <= between.count("short") < 300, between  # ~11 chunks of 128 tokens, a decode step after each
    assert await _eventually(lambda: engine.snapshot()["batch_size"] == 0 and engine._cache.rows == 0)


async def test_batch_mates_finishing_or_leaving_while_a_long_prompt_is_read_leave_it_whole(tiny: LoadedModel, make_engine) -> None:
    """Rows freed while a prompt is read a chunk at a time (it holds the cache's last row) leave it
    last and whole; one cancelled while it is read frees its row; requests that arrive meanwhile
    wait for it, then join."""
    prompts = {"brief": (chat_ids(tiny, "2+2?"), 3), "long": (chat_ids(tiny, "word " * 1500), 8),
               "steady": (chat_ids(tiny, "Hi"), 60), "later": (chat_ids(tiny, "List three prime numbers."), 5)}
    first = make_engine(quantize="int8", max_batch=4)
    alone = {name: [d async for d in first.submit(GenerationRequest(ids, max_tokens=n)).deltas()][-1].token_ids
             for name, (ids, n) in prompts.items()}
    engine = make_engine(quantize="int8", max_batch=4)

    async def tokens(name: str) -> tuple[int, ...]:
        ids, n = prompts[name]
        return [d async for d in engine.submit(GenerationRequest(ids, max_tokens=n)).deltas()][-1].token_ids

    steady = asyncio.create_task(tokens("steady"))
    await asyncio.sleep(0.05)
    brief = asyncio.create_task(tokens("brief"))  # finishes while the long prompt is read
    leaving = engine.submit(GenerationRequest(chat_ids(tiny, "word " * 1400), max_tokens=8))
    long = asyncio.create_task(tokens("long"))
    later = asyncio.create_task(tokens("later"))
    await asyncio.sleep(0)
    leaving.cancel()
    got = {"steady": await steady, "brief": await brief, "long": await long, "later": await later}
    assert got == alone
    assert await _eventually(lambda: engine.snapshot()["batch_size"] == 0 and engine._cache.rows == 0)
