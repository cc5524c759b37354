"""Token choice and log probabilities on hand-written logits: penalties, bias, floors (no model)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from local_backend.logprobs import TokenText, chat_logprobs, completion_logprobs  # noqa: E402
from local_backend.protocol import SamplingParams, TokenLogprob  # noqa: E402
from local_backend.sampling import choose_tokens, logprobs_of  # noqa: E402

GREEDY = SamplingParams()


def test_frequency_and_presence_penalties_follow_openais_formula() -> None:
    # logit -= count x frequency + (count > 0) x presence, on the tokens generated so far.
    logits = torch.tensor([[5.0, 4.0, 3.9, 0.0]])
    history = [0, 0, 1]
    # token 0: 5 - 2x1.0 - 0.5 = 2.5; token 1: 4 - 1.0 - 0.5 = 2.5 - tie broken by argmax's first; token 2: 3.9
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5)
    assert choose_tokens(logits, [params], [None], [history]) == [2]
    assert choose_tokens(logits, [SamplingParams(presence_penalty=1.2)], [None], [history]) == [2]  # 3.8 / 2.8 / 3.9
    assert choose_tokens(logits, [SamplingParams(presence_penalty=1.0)], [None], [history]) == [0]  # 4.0 / 3.0 / 3.9
    assert choose_tokens(logits, [SamplingParams(frequency_penalty=-2.0)], [None], [[1]]) == [1]  # negative: repeat
    # No history yet (the first token): penalties change nothing.
    assert choose_tokens(logits, [params], [None], [[]]) == [0]


def test_logit_bias_forces_and_bans_tokens_for_its_row_only() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0], [5.0, 4.0, 3.0, 0.0]])
    forced = SamplingParams(logit_bias=((3, 100.0),))
    banned = SamplingParams(logit_bias=((0, -100.0), (1, -100.0)))
    assert choose_tokens(logits, [forced, GREEDY], [None, None], [[], []]) == [3, 0]
    assert choose_tokens(logits, [banned, GREEDY], [None, None], [[], []]) == [2, 0]
    assert logits[0].tolist() == [5.0, 4.0, 3.0, 0.0]  # the batch's logits are not changed in place
    # Sampled rows see the bias too: with token 3 at +100 nothing else has any mass left.
    sampled = SamplingParams(temperature=1.0, seed=3, logit_bias=((3, 100.0),))
    generator = torch.Generator().manual_seed(3)
    assert choose_tokens(logits[:1], [sampled], [generator], [[]]) == [3]


def test_logprobs_are_the_models_log_softmax_with_the_likeliest_alternatives() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -50.0], [0.0, 0.0, 0.0, 0.0]])
    asks = SamplingParams(logprobs=2, logit_bias=((3, 100.0),))
    tokens = choose_tokens(logits, [asks, GREEDY], [None, None], [[], []])
    got = logprobs_of(logits, [asks, GREEDY], tokens)
    assert got[1] is None  # the other row did not ask
    first = got[0]
    expected = torch.log_softmax(logits[0], dim=-1)
    # The bias chose token 3; its logprob is the model's own (before the bias), as vLLM reports.
    assert tokens[0] == 3 and first is not None and first.token == 3
    assert first.logprob == pytest.approx(float(expected[3]))
    assert [t for t, _ in first.top] == [0, 1]
    assert [lp for _, lp in first.top] == pytest.approx([float(expected[0]), float(expected[1])])
    assert logprobs_of(logits, [SamplingParams(logprobs=0)], [0])[0] == TokenLogprob(0, pytest.approx(float(expected[0])), ())


def test_a_token_without_any_chance_reports_openais_floor() -> None:
    # JSON has no -inf: OpenAI reports -9999.0.
    logits = torch.tensor([[2.0, float("-inf")]])
    got = logprobs_of(logits, [SamplingParams(logprobs=2)], [1])[0]
    assert got is not None and got.logprob == -9999.0 and got.top[1] == (1, -9999.0)


def test_a_failed_row_gets_no_logprobs() -> None:
    logits = torch.tensor([[0.0, 1.0]])
    assert logprobs_of(logits, [SamplingParams(logprobs=1)], [ValueError("no finite logits")]) == [None]


def test_token_text_gives_exact_bytes_for_pieces_of_a_character(tiny) -> None:
    text_of = TokenText(tiny.tokenizer)
    ids = tiny.tokenizer.encode(" héllo 日本 😀", add_special_tokens=False)
    raw = b"".join(bytes(text_of(i)[1]) for i in ids)
    assert raw.decode("utf-8") == " héllo 日本 😀"
    assert any("\ufffd" in text_of(i)[0] for i in ids)  # a token holding part of a character shows U+FFFD


def test_completion_logprobs_offsets_follow_the_text(tiny) -> None:
    text_of = TokenText(tiny.tokenizer)
    ids = tiny.tokenizer.encode("Hello world, again", add_special_tokens=False)
    entries = [TokenLogprob(i, -0.5, ((i, -0.5), (ids[0], -1.0))) for i in ids]
    body, end = completion_logprobs(entries, text_of, 3)
    assert "".join(body["tokens"]) == "Hello world, again"
    assert body["text_offset"][0] == 3 and end == 3 + len("Hello world, again")
    assert all(math.isclose(v, -0.5) for v in body["token_logprobs"])
    assert all(text_of(i)[0] in top for i, top in zip(ids, body["top_logprobs"], strict=True))
    chat = chat_logprobs(entries[:1], text_of)
    assert chat["refusal"] is None and chat["content"][0]["top_logprobs"][1]["token"] == text_of(ids[0])[0]
