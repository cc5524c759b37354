"""Fitting the request classifier: labelled rows to a matrix, and a prior-anchored logistic
regression fitted exactly, with the out-of-fold and leave-one-source-out scores that model
selection and the threshold are read from. numpy only; the gateway's runtime never imports it.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.classify.classifier import Rules
from gateway.classify.features import MODEL_FEATURES, extract, hash_index

__all__ = ["Data", "HASH_DIM", "PRIORS", "load_rows", "group_of", "vectorize", "penalties",
           "fit", "folds_of", "out_of_fold", "leave_one_source_out", "sigmoid"]

HASH_DIM = 4096
LAMBDA_BIAS = 1e-2

# The rubric, written as prior weights: the penalty pulls each weight toward its prior rather
# than toward zero. A source with few examples of, say, code then still learns that code is
# hard, and the data only has to correct the strength.
PRIORS: dict[str, float] = {
    "long_input": 3.0, "code": 3.0, "math": 2.0, "word_problem": 1.0, "creative_longform": 2.5,
    "explain_kw": 1.5, "compare_kw": 1.5, "plan_kw": 1.5, "reason_kw": 1.5, "topic_kw": 1.0,
    "prior_hard": 1.0, "followup": 1.0, "log_prior_assistant": 1.0,
    "smalltalk": -2.0, "brevity": -1.5, "oneliner_noun": -1.0, "trivial_arith": -1.5,
    "short_question": -1.0, "wh_start": -0.5, "simple_task": -1.0, "tips_kw": -0.5,
    "list_count": -0.5, "no_hard": -1.0, "factoid": -0.5, "define_q": -1.0, "short_output": -0.5,
    # extraction or classification over a short given text: a rubric line of its own, as
    # strong as the cues its material may carry (the issue 15 follow-up raised it from -0.5)
    "given_task": -1.5, "premise_question": 1.0,
    # the kinds the first model missed on unseen sources (issue 15), each a line of the rubric
    "open_gen": 1.0, "gen_object": 1.0, "counterfactual": 1.0, "word_math": 1.0,
    "conversion": 1.0, "code_api": 1.5, "code_construct": 0.5, "puzzle": 1.5,
    "plan_question": 1.0, "roleplay": 0.5, "discuss": 0.5, "estimate": 1.0, "multi_part": 0.5,
    # simple shapes that hard-task cues mistake for hard ones (issue 15 follow-up)
    "choices": -2.5, "translate_short": -2.0,
}


@dataclass(slots=True)
class Data:
    """Labelled rows, vectorised."""

    rows: list[dict[str, Any]]
    x: np.ndarray             # n x (1 + features + HASH_DIM), column 0 is the bias
    y: np.ndarray             # 1.0 = complex
    groups: list[str]         # rows that share text or construction (never split by CV)
    sources: list[str]        # the `source` field: the unit left out by LOSO
    sets: list[str]           # which file a row came from ("route-dev", "route-train")
    forced: np.ndarray        # rows the default rules force to `complex` (long prompts)

    def take(self, mask: np.ndarray) -> Data:
        """The rows where `mask` is true."""
        idx = np.flatnonzero(mask)
        return Data([self.rows[i] for i in idx], self.x[idx], self.y[idx],
                    [self.groups[i] for i in idx], [self.sources[i] for i in idx],
                    [self.sets[i] for i in idx], self.forced[idx])


def load_rows(paths: Sequence[Path], limit: int | None = None) -> list[dict[str, Any]]:
    """Read JSONL sets, tagging each row with its file's stem (`_set`); `limit` keeps a
    deterministic pseudo-random slice of that size of the union."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                row["_set"] = path.stem
                rows.append(row)
    if limit is not None and limit < len(rows):
        rows = sorted(rows, key=lambda r: zlib.crc32(r["id"].encode()))[:limit]
    return rows


def group_of(row: dict[str, Any]) -> str:
    """Items that share text or construction stay in one fold."""
    rid: str = row["id"]
    src: str = row["source"]
    if src == "mt_bench":
        return "mt_bench:" + rid.split(":")[1]                  # turn-1 and 2-turn items
    if src == "wikipedia_longctx":
        return "wiki:" + rid.split(":")[1]                      # one article, several parts
    if src == "personality_chat" and row.get("category"):
        return "pc:" + str(row["category"])                     # one scenario
    return rid


def vectorize(rows: Sequence[dict[str, Any]]) -> Data:
    """Run the runtime's feature extraction on every row, into one dense matrix."""
    d = len(MODEL_FEATURES)
    x = np.zeros((len(rows), 1 + d + HASH_DIM))
    x[:, 0] = 1.0
    forced = np.zeros(len(rows), dtype=bool)
    rules = Rules()
    for i, row in enumerate(rows):
        ext = extract({"model": "auto", "messages": row["messages"]})
        forced[i] = rules.complex_over_prompt_tokens is not None \
            and ext.prompt_tokens > rules.complex_over_prompt_tokens
        for j, name in enumerate(MODEL_FEATURES):
            x[i, 1 + j] = float(ext.features[name])
        if ext.terms:
            scale = 1.0 / np.sqrt(len(ext.terms))
            for t in ext.terms:
                x[i, 1 + d + hash_index(t, HASH_DIM)] += scale
    y = np.array([1.0 if r["label"] == "complex" else 0.0 for r in rows])
    return Data(list(rows), x, y, [group_of(r) for r in rows], [r["source"] for r in rows],
                [str(r.get("_set", "")) for r in rows], forced)


def penalties(lambda_dense: float, lambda_hash: float,
              lambda_free: float | None = None) -> np.ndarray:
    """Per-column L2 penalties, bias first: `lambda_dense` on the rubric features that have a
    prior weight, `lambda_free` (default: the same) on those that have none (sizes, shapes),
    `lambda_hash` on each hashed n-gram bucket."""
    free = lambda_dense if lambda_free is None else lambda_free
    dense = [lambda_dense if PRIORS.get(n) else free for n in MODEL_FEATURES]
    return np.concatenate([[LAMBDA_BIAS], dense, np.full(HASH_DIM, lambda_hash)])


def prior_weights() -> np.ndarray:
    """The prior weight vector (bias, features, hashed buckets)."""
    w0 = np.zeros(1 + len(MODEL_FEATURES) + HASH_DIM)
    for j, name in enumerate(MODEL_FEATURES):
        w0[1 + j] = PRIORS.get(name, 0.0)
    return w0


def sigmoid(z: np.ndarray) -> np.ndarray:
    """The logistic function, without overflow warnings."""
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def fit(x: np.ndarray, y: np.ndarray, lam: np.ndarray, kernel: np.ndarray | None = None,
        iters: int = 50) -> np.ndarray:
    """Minimise logistic loss + 0.5 * sum(lam * (w - prior)**2) by Newton's method.

    There are fewer rows than columns, so each Newton step is solved in row space with the
    Woodbury identity: kernel = X diag(1/lam) X^T is fixed and can be shared between folds.
    The prior weights are not rescaled: letting the data set the rubric's overall strength
    (one more free parameter) scored worse under leave-one-source-out (see README).
    """
    inv = 1.0 / lam
    k = (x * inv) @ x.T if kernel is None else kernel
    w0 = prior_weights()
    w = w0.copy()
    eye = np.eye(len(y))

    def loss(w: np.ndarray) -> float:
        z = x @ w
        return float(np.sum(np.logaddexp(0.0, z) - y * z) + 0.5 * np.sum(lam * (w - w0) ** 2))

    current = loss(w)
    for _ in range(iters):
        p = sigmoid(x @ w)
        g = x.T @ (p - y) + lam * (w - w0)
        r = np.sqrt(np.maximum(p * (1.0 - p), 1e-12))
        a = inv * g
        b = np.linalg.solve(eye + r[:, None] * k * r[None, :], r * (x @ a))
        step = a - inv * (x.T @ (r * b))
        t = 1.0
        while t > 1e-4:                                   # backtracking, rarely needed
            trial = loss(w - t * step)
            if trial <= current:
                break
            t *= 0.5
        w -= t * step
        if current - trial < 1e-9 * max(1.0, abs(current)):
            break
        current = trial
    return w


def folds_of(data: Data, k: int) -> np.ndarray:
    """A deterministic grouped fold index per row, each source spread evenly over folds."""
    by_source: dict[str, list[str]] = {}
    for g, s in zip(data.groups, data.sources):
        if g not in by_source.setdefault(s, []):
            by_source[s].append(g)
    fold_of_group: dict[str, int] = {}
    offset = 0
    for s in sorted(by_source):
        for i, g in enumerate(sorted(by_source[s], key=lambda g: zlib.crc32(g.encode()))):
            fold_of_group[g] = (i + offset) % k
        offset += len(by_source[s])
    return np.array([fold_of_group[g] for g in data.groups])


def out_of_fold(data: Data, assign: np.ndarray, lam: np.ndarray,
                train_mask: np.ndarray | None = None) -> np.ndarray:
    """Probability of `complex` for each row from a model that did not see its fold; 1.0 where
    the default rules force `complex`. `train_mask` limits what the models may learn from
    (the ablation's "dev set only" rows); every row is still scored."""
    kernel = (data.x / lam) @ data.x.T
    allowed = np.ones(len(data.y), dtype=bool) if train_mask is None else train_mask
    probs = np.zeros(len(data.y))
    for f in np.unique(assign):
        tr, te = (assign != f) & allowed, assign == f
        w = fit(data.x[tr], data.y[tr], lam, kernel[np.ix_(tr, tr)])
        probs[te] = sigmoid(data.x[te] @ w)
    return np.where(data.forced, 1.0, probs)    # as the gateway decides: rules first


def leave_one_source_out(data: Data, lam: np.ndarray,
                         train_mask: np.ndarray | None = None) -> np.ndarray:
    """Out-of-source probabilities: each source scored by a model trained on the others."""
    names = sorted(set(data.sources))
    assign = np.array([names.index(s) for s in data.sources])
    return out_of_fold(data, assign, lam, train_mask)
