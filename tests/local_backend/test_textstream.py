"""Incremental detokenization and stop sequences, fed token by token (no model needed)."""

from __future__ import annotations

from local_backend.models import LoadedModel
from local_backend.textstream import TextAssembler


def _pieces(tiny: LoadedModel, text: str, stop: tuple[str, ...] = ()) -> tuple[list[str], TextAssembler]:
    assembler = TextAssembler(tiny.tokenizer, stop)
    ids = tiny.tokenizer(text, add_special_tokens=False).input_ids
    pieces = [assembler.push(i) for i in ids]
    pieces.append(assembler.flush())
    return pieces, assembler


def test_multibyte_characters_are_never_split(tiny: LoadedModel) -> None:
    text = "Café 東京 🚀 naïve — ok"
    pieces, _ = _pieces(tiny, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_sequence_across_tokens_is_cut(tiny: LoadedModel) -> None:
    pieces, assembler = _pieces(tiny, "The answer is 42. END of story", stop=("END",))
    assert "".join(pieces) == "The answer is 42. "
    assert assembler.stopped


def test_partial_stop_prefix_is_held_then_released(tiny: LoadedModel) -> None:
    pieces, assembler = _pieces(tiny, "one two ENtire three", stop=("END",))
    assert "".join(pieces) == "one two ENtire three"
    assert not assembler.stopped


def test_earliest_of_several_stops_wins(tiny: LoadedModel) -> None:
    pieces, _ = _pieces(tiny, "alpha beta gamma delta", stop=("delta", "beta"))
    assert "".join(pieces) == "alpha "
