"""Token counts estimated without a tokenizer (the gateway has none for every backend's model).

English text runs about 4 characters a token. Text in other scripts runs far fewer characters a
token: a Chinese or Japanese character is about one token, an emoji one to three, a Cyrillic
letter about half of one. Counting characters / 4 made a 100,000-character Chinese prompt look
like 25,000 tokens, so a tenant writing it was reserved a quarter of what it used (and the
long-prompt rule sent it to the small model). Counting UTF-8 bytes, with a third more for the
bytes of non-ASCII characters, gives ~1 token a CJK character, ~1.3 an emoji, ~0.7 a Cyrillic
or accented letter, and leaves ASCII at characters / 4. Both functions are O(n) in C and return
at once for ASCII, which is what most requests are.
"""

from __future__ import annotations

__all__ = ["bytes_tokens", "text_tokens"]

_HIGH = bytes(range(0x80, 0x100))  # the bytes of non-ASCII characters in UTF-8


def bytes_tokens(data: bytes) -> int:
    """Tokens in UTF-8 text or JSON (rounded down; 0 for nothing)."""
    return len(data) // 4 if data.isascii() else _weight(data) // 4


def text_tokens(text: str) -> int:
    """Tokens in a text (rounded up, as the classifier's characters / 4 is: 1 for a character)."""
    if text.isascii():
        return (len(text) + 3) // 4
    # A lone surrogate from JSON's \\ud800 encodes to 3 bytes, as a CJK character does.
    return (_weight(text.encode("utf-8", "surrogatepass")) + 3) // 4


def _weight(data: bytes) -> int:
    """Four times the tokens of non-ASCII UTF-8: its bytes, and a third more for the high ones."""
    high = len(data) - len(data.translate(None, _HIGH))
    return len(data) + high // 3
