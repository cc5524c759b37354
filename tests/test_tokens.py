"""wire.tokens: token counts without a tokenizer, by script."""

from __future__ import annotations

import pytest

from gateway.wire.tokens import bytes_tokens, text_tokens


@pytest.mark.parametrize(("text", "per_char"), [
    ("a" * 400, 0.25),             # English: ~4 characters a token, as before
    ("中" * 400, 1.0),              # CJK: ~1 token a character (was 0.25)
    ("я" * 400, 2 / 3),             # Cyrillic: 2 bytes a letter
    ("\U0001F600" * 400, 4 / 3),    # emoji: 4 bytes each
])
def test_tokens_by_script(text: str, per_char: float) -> None:
    assert text_tokens(text) == pytest.approx(per_char * 400, abs=2)
    assert bytes_tokens(text.encode()) == pytest.approx(per_char * 400, abs=2)


def test_ascii_is_characters_over_four_rounded_as_before() -> None:
    assert [text_tokens("x" * n) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]  # the classifier's (n + 3) // 4
    assert [bytes_tokens(b"x" * n) for n in (0, 3, 4, 9)] == [0, 0, 1, 2]  # len(raw) // 4


def test_a_lone_surrogate_is_counted_not_an_error() -> None:
    assert text_tokens("\ud800" * 4) == 4  # JSON may carry one ("\\ud800"); its 3 bytes count as CJK's
