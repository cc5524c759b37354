"""The training script reproduces the shipped weights (on a quick slice of the data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway import classify_train
from gateway.classify import Classifier

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared/eval/route-dev.jsonl"
SHIPPED = ROOT / "gateway" / "classify_weights.json"

pytestmark = pytest.mark.skipif(not DATA.exists(),
                                reason=f"development set not found at {DATA}")


def test_slice_training_reproduces_the_shipped_accuracy(tmp_path: Path) -> None:
    shipped = json.loads(SHIPPED.read_text())["training"]
    check = shipped["slice_check"]
    out = tmp_path / "w.json"
    rc = classify_train.main(["--data", str(DATA), "--out", str(out),
                              "--limit", str(check["limit"]), "--folds", str(check["folds"])])
    assert rc == 0
    trained = json.loads(out.read_text())["training"]
    assert abs(trained["cv"]["accuracy"] - check["cv_accuracy"]) <= 0.01
    assert trained["cv"]["complex_recall"] >= 0.95
    assert trained["data"]["sha256"] == shipped["data"]["sha256"], "the data set changed"
    # the file it writes is one the gateway loads
    clf = Classifier.load(out)
    assert clf.classify({"messages": [{"role": "user", "content": "hi"}]}).cls == "simple"


def test_shipped_weights_meet_the_recall_target() -> None:
    cv = json.loads(SHIPPED.read_text())["training"]["cv"]
    assert cv["complex_recall"] >= classify_train.RECALL_TARGET
    assert cv["n"] == len(classify_train.load_rows(DATA))


def test_folds_are_grouped_and_deterministic() -> None:
    data = classify_train.vectorize(classify_train.load_rows(DATA, 200))
    a, b = classify_train.folds_of(data, 5), classify_train.folds_of(data, 5)
    assert (a == b).all()
    fold_of: dict[str, int] = {}
    for g, f in zip(data.groups, a):
        assert fold_of.setdefault(g, int(f)) == f, f"group {g} straddles folds"
