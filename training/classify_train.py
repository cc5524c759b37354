"""Train the request classifier offline and write its weights file.

    python -m training.classify_train \\
        --dev ../shared/eval/route-dev.jsonl --train ../shared/eval/route-train.jsonl \\
        --out gateway/classify/weights.json [--recall 0.97] [--limit N] [--folds 5]

The model is an L2-regularised logistic regression over the rubric features and hashed
n-grams, anchored to prior weights written from the rubric (see training.fit). It is fitted on
the union of the sets. Model selection and the threshold both come from leave-one-source-out
(LOSO) scores, each source scored by a model that never saw it, because pooled CV flatters
features that were read off errors of the sources it trains on: the penalties are the grid
point with the best LOSO accuracy at the recall target, and the shipped threshold is the
highest at which LOSO complex recall reaches the target. Recall first: an uncertain request
goes to the big model. A table of thresholds for other recalls ships too, for the policy key
`classifier.complex_recall_target`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gateway.classify.classifier import WEIGHTS_FORMAT
from gateway.classify.features import MODEL_FEATURES
from training.evaluate import metrics, per_source, pick_threshold, recall_table
from training.fit import (
    HASH_DIM,
    Data,
    fit,
    folds_of,
    leave_one_source_out,
    load_rows,
    out_of_fold,
    penalties,
    sigmoid,
    vectorize,
)

RECALL_TARGET = 0.97        # complex recall the shipped threshold is set for, on LOSO scores
# (rubric features, each hashed n-gram bucket): the candidates LOSO chooses among. The rubric
# features are pulled toward the prior weights written from the rubric (training.fit.PRIORS):
# a heavy penalty keeps those weights, a light one lets the data move them. A heavy hash
# penalty keeps the phrasing of a few sources out of the score.
PENALTY_GRID: tuple[tuple[float, float], ...] = ((10.0, 3.0), (100.0, 3.0), (1000.0, 1.0),
                                                 (1000.0, 3.0))
SLICE_LIMIT, SLICE_FOLDS = 400, 3       # the quick run CI repeats to check reproducibility
SLICE_PENALTIES = (1000.0, 3.0)
SHARED = Path(__file__).resolve().parents[2] / "shared" / "eval"


def evaluate(data: Data, lam: np.ndarray, folds: int, recall: float) -> dict[str, Any]:
    """LOSO and pooled grouped-CV scores for one penalty setting, and the figures at the
    threshold the LOSO scores give for `recall`."""
    loso = leave_one_source_out(data, lam)
    cv = out_of_fold(data, folds_of(data, folds), lam)
    thr = pick_threshold(data.y, loso, recall)
    return {"loso_scores": loso, "cv_scores": cv, "threshold": thr,
            "loso": metrics(data.y, loso, thr), "cv": metrics(data.y, cv, thr)}


def train(data: Data, folds: int, recall: float = RECALL_TARGET,
          grid: Sequence[tuple[float, float]] = PENALTY_GRID,
          dev_set: str = "route-dev") -> dict[str, Any]:
    """Select penalties by LOSO, set the threshold from LOSO scores, fit on every row; return
    the weights document (with every figure the README and CI quote, under `training`)."""
    if not grid:
        raise ValueError("train: the penalty grid is empty")
    tried: list[dict[str, Any]] = []
    runs: list[tuple[float, int, dict[str, Any], tuple[float, float]]] = []
    for i, (ld, lh) in enumerate(grid):
        ev = evaluate(data, penalties(ld, lh), folds, recall)
        tried.append({"penalties": [ld, lh], "loso_accuracy": ev["loso"]["accuracy"],
                      "loso_complex_recall": ev["loso"]["complex_recall"],
                      "cv_accuracy": ev["cv"]["accuracy"]})
        runs.append((-ev["loso"]["accuracy"], i, ev, (ld, lh)))
    _, _, best, best_pen = min(runs, key=lambda r: (r[0], r[1]))    # first of the best
    lam = penalties(*best_pen)
    thr, loso, cv = best["threshold"], best["loso_scores"], best["cv_scores"]
    w = fit(data.x, data.y, lam)
    d = len(MODEL_FEATURES)
    dev = np.array([s == dev_set for s in data.sets])
    training: dict[str, Any] = {
        "rows": len(data.y),
        "sets": {s: data.sets.count(s) for s in sorted(set(data.sets))},
        "folds": folds,
        "grouping": "mt_bench question, wikipedia article, personality_chat scenario",
        "hash": {"dim": HASH_DIM, "hash": "crc32", "terms": "instruction word 1-2-grams",
                 "scale": "1/sqrt(terms)"},
        "penalties": {"dense": best_pen[0], "hash": best_pen[1], "bias": float(lam[0])},
        "selection": {"criterion": f"LOSO accuracy at complex recall {recall}",
                      "tried": tried},
        "recall_target": recall,
        "threshold_from": "leave-one-source-out scores",
        "loso": best["loso"],
        "cv": best["cv"],
        "cv_own_threshold": metrics(data.y, cv, pick_threshold(data.y, cv, recall)),
        "per_source": {s: {"n": v["n"], "complex": v["complex"], "loso_accuracy": v["accuracy"],
                           "cv_accuracy": c["accuracy"]}
                       for (s, v), c in zip(per_source(data.sources, data.y, loso, thr).items(),
                                            per_source(data.sources, data.y, cv, thr).values())},
    }
    if dev.any() and not dev.all():
        # the dev set on its own: its rows' LOSO and CV scores, and a model fitted on the
        # other sets only (it never saw a dev row)
        other = fit(data.x[~dev], data.y[~dev], lam)
        unseen = np.where(data.forced[dev], 1.0, sigmoid(data.x[dev] @ other))
        training["dev"] = {"set": dev_set,
                           "loso": metrics(data.y[dev], loso[dev], thr),
                           "cv": metrics(data.y[dev], cv[dev], thr),
                           "fit_without_dev": metrics(data.y[dev], unseen, thr)}
    return {
        "format": WEIGHTS_FORMAT,
        "bias": round(float(w[0]), 6),
        "weights": {name: round(float(w[1 + j]), 6) for j, name in enumerate(MODEL_FEATURES)},
        "hash_weights": [round(float(v), 5) for v in w[1 + d:]],
        "threshold": round(thr, 6),
        "recall_thresholds": recall_table(data.y, loso),
        "training": training,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dev", type=Path, default=SHARED / "route-dev.jsonl",
                    help="the labelled development (validation) set, reported on by itself")
    ap.add_argument("--train", type=Path, action="append", default=None,
                    help="more labelled JSONL to train on (repeatable; default: "
                         "route-train.jsonl next to the dev set; 'none' for none)")
    ap.add_argument("--out", type=Path, required=True, help="weights JSON to write")
    ap.add_argument("--recall", type=float, default=RECALL_TARGET,
                    help="complex recall the shipped threshold is set for (LOSO scores)")
    ap.add_argument("--limit", type=int, default=None, help="train on a slice of N rows")
    ap.add_argument("--folds", type=int, default=5, help="folds of the pooled grouped CV")
    ap.add_argument("--penalties", type=float, nargs=2, metavar=("DENSE", "HASH"),
                    help="skip the LOSO selection and use these penalties")
    args = ap.parse_args(argv)

    train_files = [args.dev.with_name("route-train.jsonl")] if args.train is None else \
        [p for p in args.train if str(p) != "none"]
    files = [args.dev, *train_files]
    data = vectorize(load_rows(files, args.limit))
    grid = [tuple(args.penalties)] if args.penalties else PENALTY_GRID
    doc = train(data, args.folds, args.recall, grid, dev_set=args.dev.stem)
    doc["training"]["data"] = [{"file": p.name, "sha256": hashlib.sha256(p.read_bytes())
                                .hexdigest()} for p in files]
    doc["training"]["limit"] = args.limit
    if args.limit is None:      # record what the quick CI run must reproduce
        quick = train(vectorize(load_rows(files, SLICE_LIMIT)), SLICE_FOLDS, args.recall,
                      [SLICE_PENALTIES])["training"]
        doc["training"]["slice_check"] = {
            "limit": SLICE_LIMIT, "folds": SLICE_FOLDS, "penalties": list(SLICE_PENALTIES),
            "loso_accuracy": quick["loso"]["accuracy"],
            "loso_complex_recall": quick["loso"]["complex_recall"],
            "cv_accuracy": quick["cv"]["accuracy"]}
    args.out.write_text(json.dumps(doc, separators=(",", ":")) + "\n", encoding="utf-8")
    t = doc["training"]
    print(f"rows={t['rows']} penalties={t['penalties']['dense']}/{t['penalties']['hash']} "
          f"threshold={doc['threshold']:.4f} (LOSO, complex recall >= {args.recall})")
    for name in ("loso", "cv"):
        m = t[name]
        print(f"  {name:<4} accuracy={m['accuracy']:.4f} complex_precision="
              f"{m['complex_precision']:.4f} complex_recall={m['complex_recall']:.4f}")
    print(f"-> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
