"""Benchmark the classifier cascade: its ablation (from the shipped encoder.json) and its latency.

    .venv/bin/python bench/classifier_cascade.py [--n 400] [--threads 1]

Accuracy: the figures `training.encoder_train` stored, all from out-of-sample scores over
dev + train (2,159 rows): leave-one-source-out (LOSO) and pooled 5-fold grouped CV, each at the
threshold that reaches 96 % complex recall on those scores (the cascade: its band table's row).

Latency: classification as the gateway runs it (the lexical scorer, then the shipped encoder in
its worker thread for a request in the band, with the policy's default deadline), in process,
on this machine:
  - the labelled prompts in their own mix, one at a time and 8 at once;
  - a 50-token and a 2,000-token prompt forced into the band (the worst case: every request
    waits for the encoder), one at a time and 8 at once.
A 2,000-token prompt is `complex` by the long-prompt rule before any score is read; forcing it
into the band shows what the encoder's bounded window costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.classify.cascade import Cascade, EncoderWorker, band_for  # noqa: E402
from gateway.classify.classifier import Classifier, Rules, Verdict  # noqa: E402
from gateway.classify.encoder_meta import ENCODER_DIR, meta_of  # noqa: E402
from gateway.config.policy import ClassifierPolicy, EncoderPolicy  # noqa: E402
from local_backend.llama.native import cpu_flags  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared/eval"
NO_RULES = Rules(complex_over_prompt_tokens=None)


def labelled_rows() -> list[dict[str, Any]]:
    """The labelled prompts, dev then train (each a row of ../shared/eval's JSONL files)."""
    return [json.loads(x) for f in ("route-dev.jsonl", "route-train.jsonl") for x in (SHARED / f).read_text().splitlines() if x]


def cpu() -> str:
    flags = cpu_flags()
    kind = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    return f"{platform.processor() or platform.machine()}, {kind}, {os.cpu_count()} cores"


def ablation(meta: dict[str, Any]) -> None:
    t = meta["training"]
    ab = t["ablation"]
    b96 = next(b for b in meta["bands"] if b["recall"] == 0.96)
    print(f"accuracy at 96 % complex recall, out-of-sample over dev + train ({t['rows']} rows; "
          f"LOSO: {t['loso_folds']} folds, sources under 15 rows left out together)")
    print(f"{'model':<44}{'LOSO acc':>9}{'AUC':>7}{'CV acc':>8}{'AUC':>7}")
    rows = [("lexical only (the shipped scorer's model)", ab["lexical"]),
            (f"encoder only (fine-tuned MiniLM, {t['layers']} layer(s))", ab["encoder"]),
            ("blend of both, on every request", ab["blend_everywhere"])]
    for name, f in rows:
        print(f"{name:<44}{f['loso']['accuracy']:>9.1%}{f['loso']['auc']:>7.3f}{f['cv']['accuracy']:>8.1%}{f['cv']['auc']:>7.3f}")
    print(f"{'cascade (band ' + format(b96['band_share'], '.0%') + ' of rows to the encoder)':<44}"
          f"{b96['accuracy']:>9.1%}{'':>7}{b96['cv_accuracy']:>8.1%}")
    print(f"(lexical, each source left out alone: {ab['lexical']['loso_each_source']['accuracy']:.1%})\n")
    print(f"{'recall target':>13}{'band':>20}{'share':>7}{'threshold':>10}{'LOSO acc':>9}{'recall':>8}{'CV acc':>8}")
    for b in meta["bands"]:
        print(f"{b['recall']:>13}{'[' + format(b['low'], '.3f') + ', ' + format(b['high'], '.3f') + ')':>20}"
              f"{b['band_share']:>7.0%}{b['threshold']:>10.3f}{b['accuracy']:>9.1%}{b['complex_recall']:>8.1%}"
              f"{b['cv_accuracy']:>8.1%}")
    print()


def body(text: str) -> dict[str, Any]:
    return {"model": "auto", "messages": [{"role": "user", "content": text}]}


async def measure(classify: Callable[[dict[str, Any]], Any], bodies: list[dict[str, Any]], concurrency: int,
                  n: int, pause_s: float = 0.0) -> tuple[float, float, dict[str, int]]:
    """p50 and p99 (ms) of `classify` over `n` requests, `concurrency` at a time, each client
    pausing `pause_s` between its requests (0: back to back, the CPU saturated); stages seen."""
    samples: list[float] = []
    stages: dict[str, int] = {}
    it = iter(range(n))

    async def one() -> None:
        for i in it:
            t0 = time.perf_counter()
            v: Verdict = await classify(bodies[i % len(bodies)])
            samples.append(time.perf_counter() - t0)
            stages[v.stage.value] = stages.get(v.stage.value, 0) + 1
            # Back to back still yields once between requests, as a server's requests do (each
            # arrives by a socket read): a decision that never waits must not starve the others.
            await asyncio.sleep(pause_s)

    await asyncio.gather(*(one() for _ in range(concurrency)))
    samples.sort()
    return samples[len(samples) // 2] * 1e3, samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e3, stages


async def latency(n: int, settings: EncoderPolicy) -> None:
    lexical = Classifier.load()
    worker = EncoderWorker(settings)
    worker.start()
    if not await asyncio.to_thread(worker.wait_loaded, 120) or not worker.ready:
        raise SystemExit(f"the encoder did not load: {worker.detail}")
    meta = meta_of(Path(settings.weights_dir) if settings.weights_dir else None)
    band = band_for(meta, ClassifierPolicy().complex_recall_target)
    cascade = Cascade(worker, band, settings.deadline_ms / 1000)
    threshold = lexical.threshold_for_recall(ClassifierPolicy().complex_recall_target)

    async def classify(b: dict[str, Any]) -> Verdict:
        v = lexical.classify(b, threshold=threshold)
        return await cascade.decide(v, b) if cascade.uncertain(v) else v

    async def forced(b: dict[str, Any]) -> Verdict:  # into the band whatever its score
        v = lexical.classify(b, threshold=threshold, rules=NO_RULES)
        return await cascade.decide(replace(v, score=(band.low + band.high) / 2), b)

    mix = [{"model": "auto", "messages": r["messages"]} for r in labelled_rows()]
    short = body("Could you explain what the tuple type in TypeScript is for, with a short example of how "
                 "one would use it in a function signature, and when an array type is the better choice?")
    long = body("Summarize the following notes in three bullet points.\n\n"
                + "The quarterly review covered sales, hiring, infrastructure costs and the roadmap. " * 140)
    print(f"latency, in process, {cpu()}; encoder: {worker.detail}; deadline {settings.deadline_ms:g} ms, "
          f"max_batch {settings.max_batch}")
    print("conc.: clients at once; 8/10ms: 8 clients, each pausing 10 ms between requests (as a "
          "request's other stages would); 8: back to back, both cores saturated")
    print(f"{'prompts':<46}{'conc.':>8}{'p50 ms':>8}{'p99 ms':>8}  stages")
    cases = [("dev + train mix (the cascade as shipped)", classify, mix),
             ("~50 tokens, forced into the band", forced, [short]),
             ("~2,000 tokens, forced into the band", forced, [long])]
    for name, fn, bodies in cases:
        for conc, pause, label in ((1, 0.0, "1"), (8, 0.01, "8/10ms"), (8, 0.0, "8")):
            # Each row from an idle encoder: what the row before taught it (a saturated loop makes
            # it refuse for a while; see cascade.EncoderWorker._late) wears off in 0.25 s.
            await asyncio.sleep(0.5)
            p50, p99, stages = await measure(fn, bodies, conc, n, pause)
            shown = ", ".join(f"{k} {v / n:.0%}" for k, v in sorted(stages.items()))
            print(f"{name:<46}{label:>8}{p50:>8.2f}{p99:>8.2f}  {shown}")
    worker.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400, help="requests per latency row")
    ap.add_argument("--threads", type=int, default=EncoderPolicy().threads)
    ap.add_argument("--max-batch", type=int, default=EncoderPolicy().max_batch)
    ap.add_argument("--deadline-ms", type=float, default=EncoderPolicy().deadline_ms)
    ap.add_argument("--latency-only", action="store_true")
    ap.add_argument("--weights-dir", default=None, help="an encoder folder (default: the shipped one)")
    args = ap.parse_args()
    if not args.latency_only:
        ablation(meta_of(Path(args.weights_dir) if args.weights_dir else None))
    settings = EncoderPolicy(threads=args.threads, max_batch=args.max_batch, deadline_ms=args.deadline_ms,
                             weights_dir=args.weights_dir)
    asyncio.run(latency(args.n, settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
