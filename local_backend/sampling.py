"""Choose the next token for each row of a batch: greedy, or sampled with temperature and top-p."""

from __future__ import annotations

import torch

from .protocol import SamplingParams

__all__ = ["choose_tokens", "make_generator"]


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A private generator per sampled request, so a seed reproduces its answer whatever its batch-mates do."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        pick = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(order[pick].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def choose_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """Pick one token per row of ``logits`` [batch, vocab]; greedy rows are decided in one argmax."""
    greedy = logits.argmax(dim=-1).tolist()
    for row, p in enumerate(params):
        if not p.greedy:
            greedy[row] = _sample_row(logits[row], p, generators[row])
    return [int(t) for t in greedy]
