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


def _argmax_finite(logits: torch.Tensor) -> int:
    """The likeliest token among the finite logits (what sampling tends to as temperature goes to 0)."""
    finite = torch.isfinite(logits)
    if not bool(finite.any()):
        raise ValueError("the model produced no finite logits for this sequence")
    return int(torch.where(finite, logits, float("-inf")).argmax().item())


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits.float()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    # logits / temperature can overflow to inf (inf - inf = NaN in softmax), or the model can give NaN:
    # multinomial would raise, so take the limit of a vanishing temperature instead.
    if not bool(torch.isfinite(probs).all()):
        return _argmax_finite(logits)
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
) -> list[int | Exception]:
    """Pick one token per row of ``logits`` [batch, vocab]; greedy rows are decided in one argmax.

    A row whose sampling raises gets its exception in place of a token, so the caller fails that
    request alone: one request's parameters must never cost its batch-mates their answers."""
    chosen: list[int | Exception] = [int(t) for t in logits.argmax(dim=-1).tolist()]
    for row, p in enumerate(params):
        if not p.greedy:
            try:
                chosen[row] = _sample_row(logits[row], p, generators[row])
            except Exception as exc:  # noqa: BLE001 - handed to the engine, which fails this row only
                chosen[row] = exc
    return chosen
