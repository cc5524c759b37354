"""Token choice and log probabilities on hand-written logits: penalties, bias, floors (no model)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from local_backend.logprobs import TextOffsets, TokenText, chat_logprobs, completion_logprobs  # noqa: E402
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
    offsets = TextOffsets(3)
    body = completion_logprobs(entries, text_of, offsets)
    assert "".join(body["tokens"]) == "Hello world, again"
    assert body["text_offset"][0] == 3 and offsets.at == 3 + len("Hello world, again")
    assert all(math.isclose(v, -0.5) for v in body["token_logprobs"])
    assert all(text_of(i)[0] in top for i, top in zip(ids, body["top_logprobs"], strict=True))
    chat = chat_logprobs(entries[:1], text_of)
    assert chat["refusal"] is None and chat["content"][0]["top_logprobs"][1]["token"] == text_of(ids[0])[0]


def test_completion_offsets_count_a_character_split_across_tokens_once(tiny) -> None:
    # Each token's offset is the character its first byte belongs to, chunk after chunk: a token
    # showing U+FFFD for part of a character does not move the text on by a character of its own.
    text_of = TokenText(tiny.tokenizer)
    text = " héllo 日本 😀 and more"
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in text_of(i)[0] for i in ids)  # some character is split
    raw = b"".join(bytes(text_of(i)[1]) for i in ids)
    char_of_byte = [n for n, ch in enumerate(text) for _ in ch.encode("utf-8")]
    expected, at = [], 0
    for i in ids:
        expected.append(char_of_byte[at])
        at += len(text_of(i)[1])
    offsets = TextOffsets()
    entries = [TokenLogprob(i, -0.5, ()) for i in ids]
    got = [o for part in (entries[:3], entries[3:4], entries[4:]) for o in completion_logprobs(part, text_of, offsets)["text_offset"]]
    assert raw.decode("utf-8") == text and got == expected and offsets.at == len(text)


def _reference_nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """The nucleus from a full sort (what top-p means, written the slow way)."""
    values, order = torch.sort(probs, descending=True)
    keep = torch.cumsum(values, dim=-1) - values < top_p
    keep[0] = True
    return set(order[keep].tolist())


@pytest.mark.parametrize("scale", [8.0, 0.01], ids=["peaked: read from the first candidates", "flat: read from more"])
def test_the_nucleus_is_what_a_full_sort_gives(scale: float) -> None:
    from local_backend.sampling import _NUCLEUS_K, _nucleus

    probs = torch.softmax(torch.randn(5000, generator=torch.Generator().manual_seed(11)) * scale, dim=-1)
    for top_p in (0.5, 0.9, 0.99):
        weights, ids = _nucleus(probs, top_p)
        kept = set((torch.nonzero(weights > 0).squeeze(1) if ids is None else ids[weights > 0]).tolist())  # None: token order
        assert kept == _reference_nucleus(probs, top_p), top_p
        assert float(weights.sum()) >= top_p - 1e-6
    assert len(_reference_nucleus(probs, 0.9)) > _NUCLEUS_K or scale > 1  # the flat case needs more than the first read


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_wide_nucleus_is_the_full_sorts_without_sorting_the_vocabulary(seed: int) -> None:
    """A flat distribution over SmolLM2's 49,152 tokens (temperature 2) at top_p near 1: the set a
    full sort keeps (its running mass in float64), ties aside."""
    from local_backend.sampling import _wide_nucleus

    probs = torch.softmax(torch.randn(49_152, generator=torch.Generator().manual_seed(seed)) * 1.5, dim=-1)
    values, order = torch.sort(probs, descending=True)
    for top_p in (0.9, 0.999, 0.9999, 0.999999):
        keep = torch.cumsum(values, dim=-1, dtype=torch.float64) - values < top_p
        weights = _wide_nucleus(probs, top_p)
        assert set(torch.nonzero(weights > 0).squeeze(1).tolist()) == set(order[keep].tolist()), top_p
        assert torch.equal(weights[weights > 0], probs[weights > 0])


def test_sampled_tokens_follow_the_distribution_and_never_a_token_without_mass() -> None:
    # 8 tokens of known probability (one impossible), 8,000 draws: each frequency within 5 standard errors.
    logits = torch.log(torch.tensor([0.3, 0.2, 0.15, 0.15, 0.1, 0.05, 0.05, 0.0]))
    generator = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=1.0)
    n = 8_000
    counts = [0] * 8
    for _ in range(n):
        token = choose_tokens(logits[None], [params], [generator])[0]
        assert isinstance(token, int)
        counts[token] += 1
    for p, c in zip([0.3, 0.2, 0.15, 0.15, 0.1, 0.05, 0.05, 0.0], counts, strict=True):
        assert abs(c / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (p, c / n)
    assert counts[7] == 0
    # With top_p 0.5 only the first two (0.3, then 0.2 reaching 0.5) can come, in ratio 3:2.
    nucleus = SamplingParams(temperature=1.0, top_p=0.5)
    picks = [choose_tokens(logits[None], [nucleus], [generator])[0] for _ in range(2000)]
    assert set(picks) == {0, 1} and abs(picks.count(0) / 2000 - 0.6) < 5 * math.sqrt(0.24 / 2000)


def test_a_seed_gives_the_same_tokens_and_another_seed_others() -> None:
    logits = torch.randn(3, 2000, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=1.0, top_p=0.95, seed=9)] * 3

    def draw(seed: int) -> list[int | Exception]:
        gens: list[torch.Generator | None] = [torch.Generator().manual_seed(seed) for _ in range(3)]
        return [t for _ in range(20) for t in choose_tokens(logits, params, gens)]

    assert draw(9) == draw(9) and draw(9) != draw(10)
