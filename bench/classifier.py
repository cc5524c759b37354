"""Benchmark the request classifier on the development set.

    python bench/classifier.py [--data ../shared/eval/route-dev.jsonl] [--folds 5]

Prints grouped k-fold cross-validated accuracy, complex precision/recall and the confusion
matrix at the shipped threshold choice (recall >= 95% out of fold), a per-source breakdown,
leave-one-source-out accuracy (how it does on a source it never saw), the shipped model on the
whole set, and in-process classification latency for short and ~2,000-token prompts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway import classify_train as T  # noqa: E402
from gateway.classify import Classifier  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/eval/route-dev.jsonl"


def _row(name: str, m: dict[str, object]) -> str:
    c = m["confusion"]
    assert isinstance(c, dict)
    return (f"{name:<34} {m['accuracy']:>6.1%} {m['complex_precision']:>6.1%} "
            f"{m['complex_recall']:>6.1%}   {c['complex->complex']:>4} {c['complex->simple']:>4} "
            f"{c['simple->complex']:>4} {c['simple->simple']:>4}")


def latency(clf: Classifier, body: dict[str, object], n: int = 3000) -> tuple[float, float]:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--folds", type=int, default=5)
    args = ap.parse_args()

    rows = T.load_rows(args.data)
    data = T.vectorize(rows)
    lam = T.penalties()
    probs = T.out_of_fold(data, T.folds_of(data, args.folds), lam)
    thr = T.pick_threshold(data.y, probs)
    loso = T.leave_one_source_out(data, lam)
    clf = Classifier.load()
    shipped = np.array([clf.classify({"model": "auto", "messages": r["messages"]}).score
                        if not f else 1.0 for r, f in zip(rows, data.forced)])

    print(f"data: {args.data.name}, {len(rows)} rows ({int(data.y.sum())} complex); "
          f"rules: default (prompt > 1500 tokens -> complex)")
    print(f"threshold picked out of fold for complex recall >= {T.RECALL_TARGET:.0%}: {thr:.3f}"
          f" (shipped: {clf.default_threshold:.3f})\n")
    print(f"{'evaluation':<34} {'acc':>6} {'prec':>6} {'recall':>6}   "
          f"{'c->c':>4} {'c->s':>4} {'s->c':>4} {'s->s':>4}")
    print(_row(f"{args.folds}-fold grouped CV @ threshold", T.metrics(data.y, probs, thr)))
    print(_row(f"{args.folds}-fold grouped CV @ 0.5", T.metrics(data.y, probs, 0.5)))
    print(_row("leave-one-source-out @ threshold", T.metrics(data.y, loso, thr)))
    print(_row("shipped model on all rows (train)", T.metrics(data.y, shipped,
                                                              clf.default_threshold)))

    print(f"\n{'source':<34} {'n':>4} {'complex':>7} {'CV acc':>7} {'LOSO acc':>8}")
    cv_src, loso_src = T.per_source(data, probs, thr), T.per_source(data, loso, thr)
    for s, v in cv_src.items():
        print(f"{s:<34} {v['n']:>4} {v['complex']:>7} {v['accuracy']:>7.1%} "
              f"{loso_src[s]['accuracy']:>8.1%}")

    short = {"model": "auto", "messages": [{"role": "user", "content": "Who wrote Hamlet?"}]}
    medium = {"model": "auto", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a Python function that checks whether a string is a "
                                    "palindrome, ignoring case and punctuation, with tests."}]}
    doc = " ".join(r["messages"][-1]["content"] for r in rows
                   if r["source"] == "wikipedia_longctx")[:8000]       # ~2,000 tokens
    long = {"model": "auto", "messages": [
        {"role": "user", "content": "Summarize the following article in three bullet points.\n\n"
                                    + doc}]}
    print(f"\n{'latency (in-process, classify())':<34} {'p50 us':>8} {'p99 us':>8}")
    for name, body in (("short (4 words)", short), ("medium (30 words, system)", medium),
                       ("long (~2,000 tokens)", long)):
        p50, p99 = latency(clf, body)
        print(f"{name:<34} {p50:>8.1f} {p99:>8.1f}")
    print(f"\npython {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
