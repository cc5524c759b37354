"""Scoring the request classifier: thresholds chosen for a complex recall, and the figures
reported for a set of scores (accuracy, complex precision and recall, the confusion matrix,
per source). numpy only; offline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["RECALL_GRID", "pick_threshold", "recall_table", "metrics", "per_source", "auc"]

# The complex recalls the weights file tabulates a threshold for (policy:
# classifier.complex_recall_target picks among them).
RECALL_GRID: tuple[float, ...] = (0.80, 0.85, 0.90, 0.91, 0.92, 0.93, 0.94, 0.95, 0.96, 0.97,
                                  0.98, 0.99, 0.995, 1.0)


def pick_threshold(y: np.ndarray, probs: np.ndarray, recall: float) -> float:
    """The highest threshold whose complex recall on these scores reaches `recall` (midway
    between the last complex score kept and the next score below it)."""
    pos = np.sort(probs[y == 1.0])
    if len(pos) == 0:
        return 0.5
    k = int(np.floor((1.0 - recall) * len(pos) + 1e-9))    # positives we may lose
    hi = pos[min(k, len(pos) - 1)]
    below = probs[probs < hi]
    lo = below.max() if len(below) else 0.0
    return float(min(max((lo + hi) / 2.0, 1e-4), 0.999))


def recall_table(y: np.ndarray, probs: np.ndarray) -> list[list[float]]:
    """[recall, threshold] for each recall of RECALL_GRID, from the given (out-of-source)
    scores."""
    return [[r, round(pick_threshold(y, probs, r), 6)] for r in RECALL_GRID]


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


def per_source(sources: Sequence[str], y: np.ndarray, probs: np.ndarray,
               threshold: float) -> dict[str, dict[str, Any]]:
    """Accuracy, size and number of complex rows by source at a threshold."""
    src = np.array(sources)
    out: dict[str, dict[str, Any]] = {}
    for s in sorted(set(sources)):
        m = src == s
        pred = probs[m] >= threshold
        out[s] = {"n": int(m.sum()), "complex": int(y[m].sum()),
                  "accuracy": round(float(np.mean(pred == (y[m] == 1.0))), 4)}
    return out


def auc(y: np.ndarray, probs: np.ndarray) -> float:
    """Area under the ROC curve (ties count half): how well the scores rank, at any threshold."""
    pos, neg = probs[y == 1.0], probs[y == 0.0]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="mergesort")
    allp = np.concatenate([pos, neg])[order]
    ranks = np.empty(len(allp))
    i = 0
    while i < len(allp):                          # average ranks over ties
        j = i
        while j + 1 < len(allp) and allp[j + 1] == allp[i]:
            j += 1
        ranks[i:j + 1] = (i + j) / 2.0 + 1.0
        i = j + 1
    r = np.empty(len(allp))
    r[order] = ranks
    return float((r[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))
