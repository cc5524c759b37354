"""What a batch costs the encoder: a line through the batches it ran, so the worker never starts
work that cannot end before its callers' deadlines.

On a CPU a forward pass costs about `fixed + per_unit * units`, where units are the batch's
padded tokens (rows x the longest row's window): measured on a 2-core EPYC, fixed ~4-5 ms and
~0.13 ms a unit, so batching saves only the fixed part and a batch of 8 full windows takes ~35 ms,
three times the default deadline. The line is fitted by exponentially weighted least squares
over the batches seen (recent ones count most: the machine's load moves it), seeded by timed
passes when the encoder loads.
"""

from __future__ import annotations

import math

__all__ = ["BatchCost", "text_units"]

_CHARS_PER_TOKEN = 4  # English text runs ~4 characters a WordPiece token; a window caps the rest


def text_units(text: str, window: int) -> int:
    """The window length the encoder will read for `text`, estimated from its characters without
    tokenizing it ([CLS] and [SEP] included; at most `window`)."""
    return min(window, 2 + math.ceil(len(text) / _CHARS_PER_TOKEN))


class BatchCost:
    """seconds ~ fixed + per_unit * units, fitted on the batches observed.

    One thread observes; any thread may predict: the fitted line is published as one tuple, so a
    reader never sees half of an update."""

    __slots__ = ("_decay", "_w", "_x", "_y", "_xx", "_xy", "line")

    def __init__(self, decay: float = 0.8) -> None:
        """`decay`: the weight an observation keeps at each newer one (0.8: the last ~5 batches)."""
        self._decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.line: tuple[float, float] | None = None  # (fixed s, s per unit); None until a batch is seen

    def observe(self, units: int, seconds: float) -> None:
        """One batch of `units` padded tokens took `seconds`."""
        d = self._decay
        x, y = float(units), seconds
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.line = self._fit()

    def _fit(self) -> tuple[float, float]:
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var > 0.01 * mx * mx:  # batches of different sizes: a slope to fit
            per_unit = (self._xy / self._w - mx * my) / var
            fixed = my - per_unit * mx
            if per_unit > 0.0 and fixed >= 0.0:
                return fixed, per_unit
        # Batches of about one size (most are, under a tight deadline), or a line that makes no
        # sense (two regimes, a noisy spell): the last good line's shape, scaled to the batches'
        # mean cost; without one, the line through the origin (a larger batch never undercuts it).
        if self.line is not None and self.line[0] > 0.0 and mx > 0:
            scale = my / (self.line[0] + self.line[1] * mx)
            return self.line[0] * scale, self.line[1] * scale
        return 0.0, my / mx if mx > 0 else 0.0

    def predict(self, units: int, batches: int = 1) -> float:
        """Seconds for `batches` forward passes over `units` padded tokens in all (0 before any
        batch was seen: nothing is refused on a guess)."""
        line = self.line
        if line is None:
            return 0.0
        return line[0] * batches + line[1] * units
