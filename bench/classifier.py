"""Benchmark the request classifier: held-out figures, an ablation, and latency.

    python bench/classifier.py [--ablation] [--dev ../shared/eval/route-dev.jsonl]
                               [--train ../shared/eval/route-train.jsonl]

Without --ablation (seconds): the figures stored with the shipped weights (leave-one-source-out
and pooled grouped CV over dev + train at the shipped threshold, per source, the dev set on its
own), the shipped model's threshold table, its weights file size, and in-process classify()
latency for a 50-token and a 2,000-token prompt.

With --ablation (minutes): every row is scored on the same rows (the union of the sets), the
same folds and the same left-out sources, so the rows compare; only what the models may learn
from, and the threshold, change:
  1. lexical only: hashed n-grams, trained on the dev set, threshold 0.5
  2. + rubric features (the ones before issue 15), dev set, 0.5
  3. + rubric features for the kinds issue 15 lists, dev set, 0.5
  4. + train set: trained on dev + train, 0.5
  5. + simple shapes (the follow-up's features: options given, short translation), dev + train,
     0.5. Rows 1-4 score without them; the follow-up's fixes to existing features and cue words
     (small talk, no_hard, compare/topic/code cues) are in every row
  6. + recall-first threshold: row 5's scores at the threshold LOSO gives for the target recall
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.classify.classifier import DEFAULT_WEIGHTS, WEIGHTS_FORMAT, Classifier  # noqa: E402
from gateway.classify.features import MODEL_FEATURES  # noqa: E402
from training import fit as F  # noqa: E402
from training.evaluate import metrics, pick_threshold  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared/eval"
# The features added for issue 15 (row 3 of the ablation adds them).
NEW_FEATURES = ("open_gen", "gen_object", "counterfactual", "word_math", "conversion",
                "code_api", "code_construct", "puzzle", "plan_question", "roleplay", "discuss",
                "estimate", "multi_part")
# The features added by the issue 15 follow-up (row 5 adds them).
SHAPE_FEATURES = ("choices", "translate_short")


def latency(clf: Classifier, body: dict[str, Any], n: int = 3000) -> tuple[float, float]:
    """p50 and p99 of one classify() call, in microseconds."""
    for _ in range(200):
        clf.classify(body)
    samples = []
    for _ in range(n):
        t = time.perf_counter()
        clf.classify(body)
        samples.append(time.perf_counter() - t)
    samples.sort()
    return samples[n // 2] * 1e6, samples[int(n * 0.99)] * 1e6


def prompts(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A ~50-token request and a ~2,000-token one (characters / 4, as the rules count)."""
    short = ("Write a Python function that checks whether a string is a palindrome, ignoring "
             "case, spaces and punctuation. Include a docstring, three example calls, and a "
             "short note on its time complexity for very long inputs.")
    doc = " ".join(r["messages"][-1]["content"] for r in rows
                   if r["source"] == "wikipedia_longctx")[:7900]
    return {
        "50-token prompt": {"model": "auto", "messages": [{"role": "user", "content": short}]},
        "2,000-token prompt": {"model": "auto", "messages": [{"role": "user", "content":
                               "Summarize the following article in three bullet points.\n\n"
                               + doc}]},
    }


def classifier_of(w: np.ndarray, threshold: float) -> Classifier:
    """A runtime classifier from a fitted weight vector (bias, features, hashed buckets)."""
    d = len(MODEL_FEATURES)
    return Classifier.from_dict({
        "format": WEIGHTS_FORMAT, "bias": float(w[0]),
        "weights": {n: float(w[1 + j]) for j, n in enumerate(MODEL_FEATURES)},
        "hash_weights": [float(v) for v in w[1 + d:]], "threshold": threshold})


def ablation(data: F.Data, lam: np.ndarray, recall: float, bodies: dict[str, Any]) -> None:
    """Print the ablation table (see the module docstring)."""
    d = len(MODEL_FEATURES)
    dev = np.array([s == "route-dev" for s in data.sets])
    new_cols = [1 + MODEL_FEATURES.index(n) for n in NEW_FEATURES]
    shape_cols = [1 + MODEL_FEATURES.index(n) for n in SHAPE_FEATURES]
    lexical = data.x.copy()
    lexical[:, 1:1 + d] = 0.0
    no_shapes = data.x.copy()
    no_shapes[:, shape_cols] = 0.0
    old_rubric = no_shapes.copy()
    old_rubric[:, new_cols] = 0.0
    configs = [("lexical only (dev)", lexical, dev, None),
               ("+ rubric features (dev)", old_rubric, dev, None),
               ("+ rubric for missed kinds (dev)", no_shapes, dev, None),
               ("+ train set (dev + train)", no_shapes, None, None),
               ("+ simple shapes (dev + train)", data.x, None, None),
               (f"+ recall-first threshold ({recall})", data.x, None, recall)]
    folds = F.folds_of(data, 5)
    print(f"{'ablation (scored on dev + train)':<38} {'CV acc':>7} {'CV rec':>7} {'LOSO acc':>8} "
          f"{'LOSO rec':>8} {'thr':>6} {'CV@96':>6} {'LOSO@96':>7}  "
          + "  ".join(f"{k.split()[0]:>6} p50/p99 us" for k in bodies))
    cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for name, x, mask, rec in configs:
        key = id(x) * 2 + (mask is None)
        if key not in cache:
            sub = F.Data(data.rows, x, data.y, data.groups, data.sources, data.sets, data.forced)
            cv = F.out_of_fold(sub, folds, lam, mask)
            loso = F.leave_one_source_out(sub, lam, mask)
            m = np.ones(len(data.y), dtype=bool) if mask is None else mask
            cache[key] = (cv, loso, F.fit(x[m], data.y[m], lam))
        cv, loso, w = cache[key]
        thr = 0.5 if rec is None else pick_threshold(data.y, loso, rec)
        mc, ml = metrics(data.y, cv, thr), metrics(data.y, loso, thr)
        # accuracy at 96 % complex recall, each on its own scores: the operating point
        at96 = [metrics(data.y, p, pick_threshold(data.y, p, 0.96))["accuracy"] for p in (cv, loso)]
        clf = classifier_of(w, thr)
        lat = "  ".join("{:>8.0f}/{:<8.0f}".format(*latency(clf, b, 1500))
                        for b in bodies.values())
        print(f"{name:<38} {mc['accuracy']:>7.1%} {mc['complex_recall']:>7.1%} "
              f"{ml['accuracy']:>8.1%} {ml['complex_recall']:>8.1%} {thr:>6.3f} "
              f"{at96[0]:>6.1%} {at96[1]:>7.1%}  {lat}")


def stored(doc: dict[str, Any]) -> None:
    """Print the figures the training run stored with the weights."""
    t = doc["training"]
    print(f"trained on {t['rows']} rows {t['sets']}; penalties dense={t['penalties']['dense']} "
          f"hash={t['penalties']['hash']} (chosen by {t['selection']['criterion']})")
    print(f"threshold {doc['threshold']:.4f}: set on LOSO scores for complex recall >= "
          f"{t['recall_target']}\n")
    print(f"{'evaluation (at the shipped threshold)':<40} {'acc':>6} {'prec':>6} {'recall':>6}   "
          f"{'c->c':>4} {'c->s':>4} {'s->c':>4} {'s->s':>4}")
    rows = [("leave-one-source-out, dev + train", t["loso"]),
            (f"{t['folds']}-fold grouped CV, dev + train", t["cv"])]
    if "dev" in t:
        rows += [("dev set, its LOSO scores", t["dev"]["loso"]),
                 ("dev set, its CV scores", t["dev"]["cv"]),
                 ("dev set, fitted without any dev row", t["dev"]["fit_without_dev"])]
    for name, m in rows:
        c = m["confusion"]
        print(f"{name:<40} {m['accuracy']:>6.1%} {m['complex_precision']:>6.1%} "
              f"{m['complex_recall']:>6.1%}   {c['complex->complex']:>4} "
              f"{c['complex->simple']:>4} {c['simple->complex']:>4} {c['simple->simple']:>4}")
    print(f"\n{'source':<36} {'n':>4} {'complex':>7} {'LOSO acc':>8} {'CV acc':>7}")
    for s, v in t["per_source"].items():
        print(f"{s:<36} {v['n']:>4} {v['complex']:>7} {v['loso_accuracy']:>8.1%} "
              f"{v['cv_accuracy']:>7.1%}")
    print("\nselection (LOSO accuracy at the target recall):")
    for r in t["selection"]["tried"]:
        print(f"  penalties {r['penalties']}: LOSO {r['loso_accuracy']:.1%} at recall "
              f"{r['loso_complex_recall']:.1%}; CV {r['cv_accuracy']:.1%}")
    print("\nthresholds by target complex recall (classifier.complex_recall_target): "
          + ", ".join(f"{r:g}: {th:.3f}" for r, th in doc.get("recall_thresholds", [])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dev", type=Path, default=SHARED / "route-dev.jsonl")
    ap.add_argument("--train", type=Path, default=SHARED / "route-train.jsonl")
    ap.add_argument("--ablation", action="store_true", help="retrain and print the ablation")
    args = ap.parse_args()

    doc = json.loads(DEFAULT_WEIGHTS.read_text())
    clf = Classifier.load()
    stored(doc)
    size = DEFAULT_WEIGHTS.stat().st_size
    print(f"\nweights file: {DEFAULT_WEIGHTS.name}, {size / 1024:.0f} KiB")
    rows = F.load_rows([args.dev, args.train])
    bodies = prompts(rows)
    print(f"\n{'latency (in-process, classify())':<34} {'tokens':>6} {'p50 us':>8} {'p99 us':>8}")
    for name, body in bodies.items():
        p50, p99 = latency(clf, body)
        tokens = len(body["messages"][-1]["content"]) // 4
        print(f"{name:<34} {tokens:>6} {p50:>8.1f} {p99:>8.1f}")
    if args.ablation:
        print()
        t = doc["training"]
        lam = F.penalties(t["penalties"]["dense"], t["penalties"]["hash"])
        ablation(F.vectorize(rows), lam, t["recall_target"], bodies)
    print(f"\npython {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
