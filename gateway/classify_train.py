"""Train the request classifier offline and write its weights file.

    python -m gateway.classify_train --data ../shared/eval/route-dev.jsonl \
        --out gateway/classify_weights.json [--limit N] [--folds 5]

L2-regularised logistic regression, fitted exactly by Newton's method (numpy; the gateway's
runtime never imports it). The hand-made rubric features get a light penalty and the hashed
n-grams a heavy one, so that the model leans on what makes a request hard rather than on the
phrasings of the development set. Cross-validation is grouped (an MT-bench question, a Wikipedia
article or a Personality-Chat scenario never straddles folds), and the shipped threshold is the
highest one at which out-of-fold recall for `complex` reaches the target.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.classify import WEIGHTS_FORMAT, Rules
from gateway.classify_features import MODEL_FEATURES, extract, hash_index

HASH_DIM = 4096
LAMBDA_DENSE = 3.0        # penalty on the rubric features
LAMBDA_HASH = 10.0        # penalty on each hashed n-gram bucket
LAMBDA_BIAS = 1e-2
RECALL_TARGET = 0.95      # complex recall the threshold is tuned for (out-of-fold)
SLICE_LIMIT, SLICE_FOLDS = 300, 3   # the quick run CI repeats to check reproducibility

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
    "given_task": -0.5, "premise_question": 1.0,
}


@dataclass(slots=True)
class Data:
    """The development set, vectorised."""

    rows: list[dict[str, Any]]
    x: np.ndarray             # n x (1 + features + HASH_DIM), column 0 is the bias
    y: np.ndarray             # 1.0 = complex
    groups: list[str]
    sources: list[str]
    forced: np.ndarray        # rows the default rules force to `complex` (long prompts)


def load_rows(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Read the JSONL set; `limit` keeps a deterministic pseudo-random slice of that size."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    if limit is not None and limit < len(rows):
        rows = sorted(rows, key=lambda r: zlib.crc32(r["id"].encode()))[:limit]
    return rows


def group_of(row: dict[str, Any]) -> str:
    """Items that share text or construction stay in one fold."""
    rid, src = row["id"], row["source"]
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
                forced)


def penalties(lambda_dense: float = LAMBDA_DENSE, lambda_hash: float = LAMBDA_HASH) -> np.ndarray:
    """Per-column L2 penalties, bias first."""
    d = len(MODEL_FEATURES)
    return np.concatenate([[LAMBDA_BIAS], np.full(d, lambda_dense), np.full(HASH_DIM, lambda_hash)])


def prior_weights() -> np.ndarray:
    """The prior weight vector (bias, features, hashed buckets)."""
    w0 = np.zeros(1 + len(MODEL_FEATURES) + HASH_DIM)
    for j, name in enumerate(MODEL_FEATURES):
        w0[1 + j] = PRIORS.get(name, 0.0)
    return w0


def fit(x: np.ndarray, y: np.ndarray, lam: np.ndarray, kernel: np.ndarray | None = None,
        iters: int = 50) -> np.ndarray:
    """Minimise logistic loss + 0.5 * sum(lam * (w - prior)**2) by Newton's method.

    There are far fewer rows than columns, so each Newton step is solved in row space with the
    Woodbury identity: kernel = X diag(1/lam) X^T is fixed and can be shared between folds.
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
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
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
            current = trial
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


def out_of_fold(data: Data, assign: np.ndarray, lam: np.ndarray) -> np.ndarray:
    """Probability of `complex` for each row from a model that did not see its fold; 1.0 where
    the default rules force `complex`."""
    kernel = (data.x / lam) @ data.x.T
    probs = np.zeros(len(data.y))
    for f in np.unique(assign):
        tr, te = assign != f, assign == f
        w = fit(data.x[tr], data.y[tr], lam, kernel[np.ix_(tr, tr)])
        probs[te] = 1.0 / (1.0 + np.exp(-(data.x[te] @ w)))
    return np.where(data.forced, 1.0, probs)    # as the gateway decides: rules first


def pick_threshold(y: np.ndarray, probs: np.ndarray, recall: float = RECALL_TARGET) -> float:
    """The highest threshold whose complex recall reaches `recall` (midpoint between scores)."""
    pos = np.sort(probs[y == 1.0])
    if len(pos) == 0:
        return 0.5
    k = int(np.floor((1.0 - recall) * len(pos) + 1e-9))    # positives we may lose
    hi = pos[k]
    below = probs[probs < hi]
    lo = below.max() if len(below) else 0.0
    return float(min(max((lo + hi) / 2.0, 1e-3), 0.999))


def metrics(y: np.ndarray, probs: np.ndarray, threshold: float) -> dict[str, Any]:
    """Accuracy, complex precision/recall and the confusion matrix at a threshold."""
    pred = probs >= threshold
    truth = y == 1.0
    tp, fp = int(np.sum(pred & truth)), int(np.sum(pred & ~truth))
    fn, tn = int(np.sum(~pred & truth)), int(np.sum(~pred & ~truth))
    n = max(len(y), 1)
    return {
        "accuracy": round((tp + tn) / n, 4),
        "complex_precision": round(tp / max(tp + fp, 1), 4),
        "complex_recall": round(tp / max(tp + fn, 1), 4),
        "confusion": {"complex->complex": tp, "complex->simple": fn,
                      "simple->complex": fp, "simple->simple": tn},
        "n": len(y),
    }


def per_source(data: Data, probs: np.ndarray, threshold: float) -> dict[str, dict[str, Any]]:
    """Accuracy and counts by source at a threshold."""
    out: dict[str, dict[str, Any]] = {}
    for s in sorted(set(data.sources)):
        m = np.array([src == s for src in data.sources])
        pred = probs[m] >= threshold
        out[s] = {"n": int(m.sum()), "accuracy": round(float(np.mean(pred == (data.y[m] == 1))), 4),
                  "complex": int(data.y[m].sum())}
    return out


def leave_one_source_out(data: Data, lam: np.ndarray) -> np.ndarray:
    """Out-of-source probabilities: each source scored by a model trained on the others."""
    assign = np.array([sorted(set(data.sources)).index(s) for s in data.sources])
    return out_of_fold(data, assign, lam)


def train(data: Data, folds: int, lam: np.ndarray | None = None) -> dict[str, Any]:
    """Cross-validate, pick the threshold, fit on everything; return the weights document."""
    lam = penalties() if lam is None else lam
    probs = out_of_fold(data, folds_of(data, folds), lam)
    threshold = pick_threshold(data.y, probs)
    w = fit(data.x, data.y, lam)
    d = len(MODEL_FEATURES)
    return {
        "format": WEIGHTS_FORMAT,
        "bias": round(float(w[0]), 6),
        "weights": {name: round(float(w[1 + j]), 6) for j, name in enumerate(MODEL_FEATURES)},
        "hash_weights": [round(float(v), 5) for v in w[1 + d:]],
        "threshold": round(threshold, 6),
        "training": {
            "rows": len(data.y),
            "folds": folds,
            "grouping": "mt_bench question, wikipedia article, personality_chat scenario",
            "hash": {"dim": HASH_DIM, "hash": "crc32", "terms": "instruction word 1-2-grams",
                     "scale": "1/sqrt(terms)"},
            "penalties": {"dense": float(lam[1]), "hash": float(lam[-1]), "bias": float(lam[0])},
            "recall_target": RECALL_TARGET,
            "cv": metrics(data.y, probs, threshold),
            "cv_per_source": per_source(data, probs, threshold),
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, required=True, help="labelled JSONL (route-dev.jsonl)")
    ap.add_argument("--out", type=Path, required=True, help="weights JSON to write")
    ap.add_argument("--limit", type=int, default=None, help="train on a slice of N rows")
    ap.add_argument("--folds", type=int, default=5)
    args = ap.parse_args(argv)

    raw = args.data.read_bytes()
    data = vectorize(load_rows(args.data, args.limit))
    doc = train(data, args.folds)
    doc["training"]["data"] = {"file": args.data.name, "sha256": hashlib.sha256(raw).hexdigest(),
                               "limit": args.limit}
    if args.limit is None:      # record what the quick CI run must reproduce
        quick = train(vectorize(load_rows(args.data, SLICE_LIMIT)), SLICE_FOLDS)["training"]["cv"]
        doc["training"]["slice_check"] = {"limit": SLICE_LIMIT, "folds": SLICE_FOLDS,
                                          "cv_accuracy": quick["accuracy"],
                                          "complex_recall": quick["complex_recall"]}
    args.out.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
    cv = doc["training"]["cv"]
    print(f"rows={cv['n']} folds={args.folds} threshold={doc['threshold']:.4f} "
          f"cv_accuracy={cv['accuracy']:.4f} complex_precision={cv['complex_precision']:.4f} "
          f"complex_recall={cv['complex_recall']:.4f} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
