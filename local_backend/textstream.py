"""Turn a stream of token ids into text deltas, honouring stop sequences.

Decoding goes through the tokenizers decode stream, which buffers incomplete UTF-8 so a
multi-byte character is never split across deltas. Text that could be the start of a stop
sequence is held back until it either completes the stop (and is dropped) or cannot.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

__all__ = ["TextAssembler"]


class TextAssembler:
    """Per-request incremental detokenizer with stop-sequence matching."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        # `tokenizer` is a transformers fast tokenizer; the decode stream wants its Rust core.
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now safe to send (may be empty)."""
        if self.stopped:
            return ""
        piece = self._stream.step(self._backend, token_id) or ""
        if not self._stop:
            return piece
        text = self._held + piece
        cut = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        keep = self._partial_stop_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back text, once the sequence ended without completing a stop."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop sequence."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
