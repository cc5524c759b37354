"""Choose the next token for each row of a batch: greedy, or sampled with temperature and top-p,
after the request's penalties and logit bias; and the log probabilities a request asked for."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .protocol import SamplingParams, TokenLogprob

__all__ = ["choose_tokens", "logprobs_of", "make_generator"]

# What OpenAI reports for a token the model gives no chance (JSON has no -inf).
_LOGPROB_FLOOR = -9999.0
# Candidates read first for top_p: the nucleus of a real model's distribution is mostly a few to a
# few hundred tokens. A wider one is found by the probabilities' magnitudes (_wide_nucleus).
_NUCLEUS_K = 256
_BUCKETS_PER_OCTAVE = 8  # _wide_nucleus's classes of probability: [2^-(i+1)/8, 2^-i/8)
_BUCKETS = 150 * _BUCKETS_PER_OCTAVE  # down to float32's smallest: every probability has one


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A private generator per sampled request, so a seed reproduces its answer whatever its batch-mates do."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        # Any integer a caller sends (and seed + i for its i-th choice) maps to a seed torch takes:
        # manual_seed raises past 2**64 - 1, which here would fail the whole batch.
        generator.manual_seed(params.seed % 2**64)
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
    # sampling would fail, so take the limit of a vanishing temperature instead.
    if not bool(torch.isfinite(probs).all()):
        return _argmax_finite(logits)
    if params.top_p < 1.0:
        weights, ids = _nucleus(probs, params.top_p)
        drawn = _draw(weights, generator)
        return drawn if ids is None else int(ids[drawn].item())
    return _draw(probs, generator)


def _nucleus(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The smallest set of likeliest tokens whose mass reaches `top_p`: (their probabilities, the
    others zeroed; their ids, None when the weights are the whole vocabulary's). Read from the top
    `_NUCLEUS_K` first (a top-k: 0.1 ms over 49k tokens), then by `_wide_nucleus`. Masses are summed
    in float64: float32's rounding over thousands of small probabilities moved the cut."""
    values, ids = torch.topk(probs, min(_NUCLEUS_K, probs.shape[-1]))  # in descending order
    mass = torch.cumsum(values, dim=-1, dtype=torch.float64)
    if float(mass[-1]) < top_p and values.shape[-1] < probs.shape[-1]:
        return _wide_nucleus(probs, top_p), None
    # Keep the smallest prefix whose mass reaches top_p. The first token always stays: a top_p
    # under float32's smallest step is 0 there, which would drop every token.
    drop = mass - values >= top_p
    drop[0] = False
    return values.masked_fill(drop, 0.0), ids


def _wide_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_nucleus` over a whole vocabulary, without sorting it: the probabilities' masses by class
    of magnitude (1/8 of an octave each) say which classes are kept whole and in which one the
    cut falls; only that class is sorted. Widening the top-k to a full sort cost 5.8 ms a row
    (49k tokens): one request of n=8 at temperature 2 and top_p 0.9999 made every batch-mate's
    tokens ~5x slower (review helper's repro); this costs ~0.3 ms. The weights, in token order."""
    level = torch.log2(probs).mul_(-_BUCKETS_PER_OCTAVE).floor_().clamp_(0, _BUCKETS - 1).long()  # 0: the likeliest
    mass = torch.zeros(_BUCKETS, dtype=torch.float64, device=probs.device).index_add_(0, level, probs.double())
    running = torch.cumsum(mass, dim=0)
    cut = min(int(torch.searchsorted(running, torch.tensor(top_p, dtype=torch.float64, device=probs.device)).item()), _BUCKETS - 1)
    weights = torch.where(level < cut, probs, 0.0)
    members = torch.nonzero(level == cut).squeeze(1)
    values, order = torch.sort(probs[members], descending=True)
    before = (float(running[cut - 1]) if cut > 0 else 0.0) + torch.cumsum(values, dim=0, dtype=torch.float64) - values
    take = int((before < top_p).sum())  # before grows along the sorted class: a prefix of it
    kept = members[order[:take]]
    weights[kept] = probs[kept]
    return weights


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """An index drawn with probability proportional to `weights` (non-negative, some positive) by
    inverting their running sum at one uniform number: 0.15-0.4 ms over 49k weights against 3.3 ms
    for torch.multinomial on this CPU. In float64, so that rounding gives a zero weight no share."""
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    u = torch.rand((), generator=generator, dtype=torch.float64, device=weights.device) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True).item())
    if i >= weights.shape[-1]:  # u rounded up to the total: the last token with any weight
        i = int(torch.nonzero(weights).max().item())
    return i


def _adjusted(logits: torch.Tensor, params: SamplingParams, history: Sequence[int]) -> torch.Tensor:
    """``logits`` [vocab] after OpenAI's presence and frequency penalties (on the tokens this
    request generated so far) and its logit bias; a copy, the batch's logits stay as they were."""
    out = logits.float().clone()
    vocab = out.shape[-1]
    if history and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(history, dtype=torch.long, device=out.device), minlength=vocab)[:vocab].to(out.dtype)
        out -= counts * params.frequency_penalty + (counts > 0).to(out.dtype) * params.presence_penalty
    bias = [(t, b) for t, b in params.logit_bias if 0 <= t < vocab]  # the server checked ids against the tokenizer
    if bias:
        ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=out.device)
        out.index_add_(0, ids, torch.tensor([b for _, b in bias], dtype=out.dtype, device=out.device))
    return out


def choose_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    histories: Sequence[Sequence[int]] | None = None,
) -> list[int | Exception]:
    """Pick one token per row of ``logits`` [batch, vocab]; greedy rows without penalties or bias
    are decided in one argmax. ``histories``: each row's generated tokens (for the penalties).

    A row whose sampling raises gets its exception in place of a token, so the caller fails that
    request alone: one request's parameters must never cost its batch-mates their answers."""
    chosen: list[int | Exception] = [int(t) for t in logits.argmax(dim=-1).tolist()]
    for row, p in enumerate(params):
        if p.greedy and not p.adjusts_logits:
            continue
        try:
            row_logits = _adjusted(logits[row], p, histories[row] if histories else ()) if p.adjusts_logits else logits[row]
            chosen[row] = _argmax_finite(row_logits) if p.greedy else _sample_row(row_logits, p, generators[row])
        except Exception as exc:  # noqa: BLE001 - handed to the engine, which fails this row only
            chosen[row] = exc
    return chosen


def _floored(value: float) -> float:
    return value if value >= _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also NaN (every comparison is false)


def logprobs_of(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int | Exception]) -> list[TokenLogprob | None]:
    """Each row's chosen token's log probability and its ``params.logprobs`` likeliest alternatives,
    for the rows that asked (None for the others and for failed rows).

    As vLLM reports them by default: the model's own distribution (log-softmax of the raw logits),
    before temperature, top-p, penalties and bias change what is sampled."""
    out: list[TokenLogprob | None] = [None] * len(params)
    for row, (p, token) in enumerate(zip(params, tokens, strict=True)):
        if p.logprobs is None or isinstance(token, Exception):
            continue
        lp = torch.log_softmax(logits[row].float(), dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs > 0:
            values, ids = torch.topk(lp, min(p.logprobs, lp.shape[-1]))
            top = tuple((int(i), _floored(float(v))) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
        out[row] = TokenLogprob(token, _floored(float(lp[token])), top)
    return out
