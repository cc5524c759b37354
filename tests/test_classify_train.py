"""The training script reproduces the shipped weights' figures (on a quick slice of the data),
and the figures stored with them hold what the README says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gateway.classify.classifier import Classifier
from training import classify_train, fit
from training.evaluate import RECALL_GRID, pick_threshold

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT.parent / "shared/eval/route-dev.jsonl"
TRAIN = ROOT.parent / "shared/eval/route-train.jsonl"
SHIPPED = ROOT / "gateway" / "classify" / "weights.json"

pytestmark = pytest.mark.skipif(not (DEV.exists() and TRAIN.exists()),
                                reason=f"labelled sets not found next to {DEV}")


def test_slice_training_reproduces_the_stored_figures(tmp_path: Path) -> None:
    shipped = json.loads(SHIPPED.read_text())["training"]
    check = shipped["slice_check"]
    out = tmp_path / "w.json"
    rc = classify_train.main(["--dev", str(DEV), "--train", str(TRAIN), "--out", str(out),
                              "--limit", str(check["limit"]), "--folds", str(check["folds"]),
                              "--penalties", *map(str, check["penalties"])])
    assert rc == 0
    doc = json.loads(out.read_text())
    trained = doc["training"]
    assert abs(trained["loso"]["accuracy"] - check["loso_accuracy"]) <= 0.01
    assert abs(trained["cv"]["accuracy"] - check["cv_accuracy"]) <= 0.01
    assert trained["loso"]["complex_recall"] >= shipped["recall_target"]
    assert [d["sha256"] for d in trained["data"]] == [d["sha256"] for d in shipped["data"]], \
        "a labelled set changed: retrain (see README, Classifier)"
    # the file it writes is one the gateway loads, with its threshold table
    clf = Classifier.load(out)
    assert clf.classify({"messages": [{"role": "user", "content": "hi"}]}).cls == "simple"
    assert [r for r, _ in clf.recall_thresholds] == list(RECALL_GRID)


def test_shipped_weights_were_trained_on_dev_and_train() -> None:
    t = json.loads(SHIPPED.read_text())["training"]
    n_dev, n_train = (len(fit.load_rows([p])) for p in (DEV, TRAIN))
    assert t["sets"] == {"route-dev": n_dev, "route-train": n_train}
    assert t["loso"]["n"] == t["cv"]["n"] == n_dev + n_train
    assert t["loso"]["complex_recall"] >= t["recall_target"] == classify_train.RECALL_TARGET
    assert t["dev"]["loso"]["n"] == n_dev
    assert [r["penalties"] for r in t["selection"]["tried"]] == \
        [list(p) for p in classify_train.PENALTY_GRID]
    best = max(r["loso_accuracy"] for r in t["selection"]["tried"])
    assert t["loso"]["accuracy"] == best, "penalties are chosen by LOSO accuracy"


def test_shipped_weights_are_small() -> None:
    assert SHIPPED.stat().st_size < 30 * 1024 * 1024


def test_threshold_is_the_highest_that_reaches_the_recall() -> None:
    y = np.array([1, 1, 1, 1, 0, 0, 0, 0], dtype=float)
    p = np.array([0.9, 0.8, 0.6, 0.2, 0.7, 0.3, 0.1, 0.05])
    assert pick_threshold(y, p, 1.0) == pytest.approx(0.15)     # keeps all four complex
    assert pick_threshold(y, p, 0.75) == pytest.approx(0.45)    # may lose one of four
    assert pick_threshold(y, p, 0.75) > pick_threshold(y, p, 1.0)


def test_folds_are_grouped_and_deterministic() -> None:
    data = fit.vectorize(fit.load_rows([DEV, TRAIN], 300))
    a, b = fit.folds_of(data, 5), fit.folds_of(data, 5)
    assert (a == b).all()
    fold_of: dict[str, int] = {}
    for g, f in zip(data.groups, a):
        assert fold_of.setdefault(g, int(f)) == f, f"group {g} straddles folds"


def test_leave_one_source_out_never_trains_on_the_scored_source() -> None:
    data = fit.vectorize(fit.load_rows([DEV, TRAIN], 250))
    lam = fit.penalties(10.0, 3.0)
    loso = fit.leave_one_source_out(data, lam)
    # score one source by hand with a model fitted on the others: the same numbers
    src = np.array(data.sources)
    name = "oasst"
    held = src == name
    w = fit.fit(data.x[~held], data.y[~held], lam)
    by_hand = np.where(data.forced[held], 1.0, fit.sigmoid(data.x[held] @ w))
    assert np.allclose(loso[held], by_hand, atol=1e-6)
