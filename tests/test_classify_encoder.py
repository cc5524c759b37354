"""The classifier cascade's encoder (gateway/classify/encoder.py) and its worker and cascade
(gateway/classify/cascade.py), with a tiny random model for speed and the shipped one where
what it decides matters."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")  # the `local` extra: `make test` installs it

from gateway.classify.batch_cost import BatchCost  # noqa: E402
from gateway.classify.cascade import Band, Blend, Cascade, EncoderState, EncoderWorker, band_for  # noqa: E402
from gateway.classify.classifier import Classifier, Stage  # noqa: E402
from gateway.classify.encoder import (  # noqa: E402
    Encoder,
    EncoderConfig,
    MiniLM,
    dequantize_state,
    quantize_state,
    save,
    window_ids,
)
from gateway.classify.encoder_meta import ENCODER_DIR, meta_of  # noqa: E402
from gateway.config.policy import EncoderPolicy  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

TOKENIZER = ENCODER_DIR / "tokenizer.json"
TINY = EncoderConfig(hidden=32, layers=2, heads=4, intermediate=64, window_tokens=24)


def tiny_folder(tmp_path: Path, seed: int = 0, **meta: Any) -> Path:
    """A tiny random encoder saved as a weights folder (the shipped tokenizer, so real ids)."""
    torch.manual_seed(seed)
    model = MiniLM(TINY)
    out = tmp_path / f"tiny{seed}"
    save(model, TOKENIZER, out, {"lexical_sha256": "", "blend": {"lexical": 1.0, "encoder": 1.0, "bias": 0.0},
                                 "bands": [{"recall": 0.97, "low": 0.1, "high": 0.6, "threshold": 0.5}], **meta})
    return out


def test_forward_matches_transformers_bert() -> None:
    """Our BERT forward (fused qkv, SDPA, mean pooling over real tokens) is the reference one."""
    transformers = pytest.importorskip("transformers")
    from training.encoder_train import from_bert

    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=512)
    torch.manual_seed(1)
    ref = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    mine = MiniLM(TINY)
    state = from_bert(ref.state_dict(), 2)
    state["head.weight"], state["head.bias"] = mine.head.weight.detach(), mine.head.bias.detach()
    mine.load_state_dict(state)
    mine.eval()
    ids = torch.randint(1000, 5000, (3, 11))
    attend = torch.ones(3, 11, dtype=torch.long)
    attend[1, 7:] = 0  # padding must change nothing
    with torch.no_grad():
        h = ref(input_ids=ids, attention_mask=attend).last_hidden_state
        w = attend[..., None].float()
        expected = mine.head((h * w).sum(1) / w.sum(1)).squeeze(-1)
        got = mine(ids, attend)
        alone = mine(ids[1:2, :7], attend[1:2, :7])
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(got[1], alone[0], atol=1e-5)


def test_int8_round_trip_is_within_half_a_step() -> None:
    torch.manual_seed(2)
    model = MiniLM(TINY)
    q = quantize_state(model.state_dict())
    assert q["layers.0.qkv.weight"].dtype == torch.int8 and q["word.weight"].dtype == torch.int8
    assert q["head.weight"].dtype == torch.float32  # the head stays exact
    back = dequantize_state(q)
    for name, t in model.state_dict().items():
        if t.dim() == 2 and not name.startswith("head."):
            step = q[name + ".scale"][:, None]
            assert bool(((back[name] - t).abs() <= step / 2 + 1e-7).all()), name
        else:
            assert torch.equal(back[name], t)


def test_window_reads_the_head_and_the_tail_of_a_long_message() -> None:
    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_padding()
    tok.no_truncation()
    cfg = EncoderConfig(window_tokens=48)
    short = window_ids(tok, "What is the capital of France?", cfg)
    assert short == tok.encode("What is the capital of France?").ids  # [CLS] ... [SEP], whole
    text = "Summarize this. " + "lorem ipsum dolor sit amet " * 800 + "In one sentence please."
    got = window_ids(tok, text, cfg)
    full = tok.encode(text).ids
    assert len(got) == 48
    assert got == full[:36] + full[-12:]  # the character bound kept every token of the window
    assert got[0] == tok.token_to_id("[CLS]") and got[-1] == tok.token_to_id("[SEP]")


def test_saved_folder_loads_and_scores_as_the_model(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    enc = Encoder.load(folder, "cpu")
    texts = ["hi there", "Write a Python function that merges two sorted lists.", ""]
    got = enc.score(texts)
    torch.manual_seed(0)
    fp32 = MiniLM(TINY).eval()
    with torch.no_grad():
        expected = [torch.sigmoid(fp32(torch.tensor([enc.ids(t)]), torch.ones(1, len(enc.ids(t)), dtype=torch.long))).item()
                    for t in texts]
    assert got == pytest.approx(expected, abs=0.02)  # int8 weights, fp32 arithmetic
    assert enc.score(texts[:1]) == pytest.approx(got[:1], abs=1e-5)  # padding in a batch changes nothing
    assert meta_of(folder)["format"] == "gateway-encoder/1"


def test_a_damaged_folder_is_refused_with_its_path(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-10])
    with pytest.raises(ValueError, match="digest"):
        Encoder.load(folder)
    with pytest.raises(ValueError, match="encoder.json"):
        Encoder.load(tmp_path / "nowhere")
    (folder / "encoder.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="format"):
        Encoder.load(folder)


def test_band_table_recall_first() -> None:
    meta = {"blend": {"lexical": 1, "encoder": 2, "bias": -1},
            "bands": [{"recall": 0.95, "low": 0.2, "high": 0.5, "threshold": 0.4},
                      {"recall": 0.97, "low": 0.1, "high": 0.5, "threshold": 0.3}]}
    assert band_for(meta, 0.96) == Band(0.1, 0.5, 0.3, Blend(1.0, 2.0, -1.0))  # never below the target
    assert band_for(meta, 0.95).threshold == 0.4
    assert band_for(meta, 0.999).low == 0.1  # past the table: its last row
    with pytest.raises(ValueError):
        band_for({"bands": [{"recall": 0.9}], "blend": {"lexical": 1, "encoder": 1, "bias": 0}}, 0.9)
    assert Blend(1.0, 1.0, 0.0)(0.5, 0.5) == pytest.approx(0.5)


class _Slow:
    """The real tiny encoder behind a delay: the worker's deadline and batching seen from outside."""

    def __init__(self, enc: Encoder, delay_s: float) -> None:
        self.enc, self.delay_s, self.batches = enc, delay_s, []  # type: ignore[var-annotated]

    def score(self, texts: list[str]) -> list[float]:
        self.batches.append(len(texts))
        time.sleep(self.delay_s)
        return self.enc.score(texts)


def _swap(w: EncoderWorker, scorer: _Slow) -> _Slow:
    """Put `scorer` in the worker, which learns its cost anew (as a loaded encoder calibrates
    itself): what the tiny model cost says nothing about a scorer 100 times slower."""
    w._scorer = scorer
    w._cost = BatchCost()
    return scorer


async def _ready(settings: EncoderPolicy) -> EncoderWorker:
    w = EncoderWorker(settings)
    w.start()
    assert await asyncio.to_thread(w.wait_loaded, 60)
    assert w.state is EncoderState.READY, w.detail
    return w


async def test_worker_batches_waiting_requests_and_keeps_order(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    w = await _ready(EncoderPolicy(weights_dir=str(folder), max_batch=8))
    slow = _Slow(Encoder.load(folder), 0.05)
    w._scorer = slow
    try:
        texts = [f"question number {i} about {'code ' * i}" for i in range(12)]
        got = await asyncio.gather(*(w.score(t, 5.0) for t in texts))
        assert got == pytest.approx(slow.enc.score(texts), abs=1e-5)  # each its own score
        assert max(slow.batches) > 1 and sum(slow.batches) == 12 and max(slow.batches) <= 8
    finally:
        w.close()


async def test_worker_deadline_and_flood_are_bounded(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    seen: list[float] = []
    w = EncoderWorker(EncoderPolicy(weights_dir=str(folder), max_batch=2, max_waiting=4), observe=seen.append)
    w.start()
    assert await asyncio.to_thread(w.wait_loaded, 60)
    slow = _Slow(Encoder.load(folder), 0.3)
    w._scorer = slow
    try:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(w.score(f"text {i}", 0.05) for i in range(50)))
        took = time.perf_counter() - t0
        assert got == [None] * 50 and took < 0.3  # the deadline, not the scorer, ends each wait
        assert len(seen) == 4  # only 4 were queued; 46 found too many waiting and never queued
        await asyncio.sleep(0.7)  # the batch in progress ends; the abandoned rest is skipped
        assert sum(slow.batches) <= 2
        assert await w.score("after the flood", 2.0) is not None  # and it serves again
    finally:
        w.close()


class _PerText(_Slow):
    """A delay per text in the batch: what a batch costs grows with its size, as on a CPU."""

    def score(self, texts: list[str]) -> list[float]:
        self.batches.append(len(texts))
        time.sleep(self.delay_s * len(texts))
        return self.enc.score(texts)


async def test_a_request_that_would_be_late_is_told_at_once(tmp_path: Path) -> None:
    """While a batch runs that ends after a request's deadline, the request is not queued to wait
    for its deadline: it goes on at once (the big model), and the encoder does no work for it."""
    folder = tiny_folder(tmp_path)
    w = await _ready(EncoderPolicy(weights_dir=str(folder)))
    slow = _swap(w, _Slow(Encoder.load(folder), 0.2))
    try:
        assert await w.score("a first request, to learn the cost", 5.0) is not None
        busy = asyncio.create_task(w.score("a request being scored", 5.0))
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        assert await w.score("a request with 50 ms to spare", 0.05) is None
        assert time.perf_counter() - t0 < 0.03  # told at once, not at its deadline
        assert await busy is not None
        assert slow.batches == [1, 1]  # nothing scored for the request told at once
    finally:
        w.close()


async def test_an_idle_encoder_tries_a_request_now_and_then_to_correct_its_estimate(tmp_path: Path) -> None:
    """An estimate from a slow spell would refuse every request for good: an idle encoder takes
    one every quarter second all the same, and what it measures then is what it expects next."""
    folder = tiny_folder(tmp_path)
    w = await _ready(EncoderPolicy(weights_dir=str(folder)))
    slow = _swap(w, _Slow(Encoder.load(folder), 0.08))
    try:
        assert await w.score("a slow spell", 5.0) is not None
        # Idle, and its scores came in time: taken, though the estimate says late (they are).
        for i in range(2):
            assert await w.score(f"expected late {i}", 0.03) is None
            await asyncio.sleep(0.06)  # its score ends, late
        assert slow.batches == [1, 1, 1]
        t0 = time.perf_counter()  # two late in a row: a request expected late is told at once
        assert await w.score("expected late again", 0.03) is None
        assert time.perf_counter() - t0 < 0.02 and slow.batches == [1, 1, 1]
        await asyncio.sleep(0.3)
        slow.delay_s = 0.0  # the spell is over
        assert await w.score("a probe", 0.5) is not None  # taken although the estimate says late
        assert await w.score("and the next one", 0.5) is not None  # the estimate was corrected
        assert slow.batches == [1, 1, 1, 1, 1]
    finally:
        w.close()


async def _learn_cost(w: EncoderWorker) -> None:
    """Batches of one and two texts, four times each: the worker's cost line for its scorer."""
    for n in (1, 2) * 4:
        assert all(x is not None for x in await asyncio.gather(*(w.score(f"learn {i}", 5.0) for i in range(n))))


async def test_a_batch_holds_only_what_ends_before_its_first_deadline(tmp_path: Path) -> None:
    """Eight requests at once, each with 0.35 s, a text costing 0.1 s: one batch of eight would
    end after every deadline; a batch of what fits scores some of them in time, and the rest are
    told at once."""
    folder = tiny_folder(tmp_path)
    w = await _ready(EncoderPolicy(weights_dir=str(folder), max_batch=8))
    slow = _swap(w, _PerText(Encoder.load(folder), 0.1))
    try:
        await _learn_cost(w)  # 0.1 s a text
        slow.batches.clear()
        got = await asyncio.gather(*(w.score(f"request {i}", 0.35) for i in range(8)))
        assert sum(s is not None for s in got) >= 2, (got, slow.batches)
        assert slow.batches and max(slow.batches) <= 4, slow.batches  # never a batch past the deadline
    finally:
        w.close()


@pytest.mark.parametrize("share", [None, 2])
async def test_one_tenants_flood_holds_only_its_share_of_the_queue(tmp_path: Path, share: int | None) -> None:
    """A tenant sending many uncertain requests at once: with no share, its queue makes the other
    tenant's request late (None at once: the big model); with a share, it waits its share and
    the other tenant's request is scored in time."""
    folder = tiny_folder(tmp_path)
    w = await _ready(EncoderPolicy(weights_dir=str(folder), max_batch=4))
    slow = _swap(w, _PerText(Encoder.load(folder), 0.05))
    try:
        await _learn_cost(w)  # 0.05 s a text
        flood = [asyncio.create_task(w.score(f"flood {i}", 0.6, "mallory", share)) for i in range(30)]
        await asyncio.sleep(0.01)
        other = await w.score("alice's question", 0.3, "alice", share)
        got = await asyncio.gather(*flood)
        if share is None:
            assert other is None  # the hole: mallory's queue made alice late
        else:
            assert other is not None
            assert sum(x is not None for x in got) <= share  # the rest found its share waiting: the big model at once
        assert w._waiting_of == {}  # nobody waits: the map holds nothing
    finally:
        w.close()


def test_the_one_graph_forward_equals_the_module_and_batches_equal_single_texts(tmp_path: Path) -> None:
    """The traced forward pass (one graph: no GIL between its operations) gives the module's
    logits for any batch and width, and a text scores the same alone (encode) as in a batch
    (encode_batch, padding masked)."""
    enc = Encoder.load(tiny_folder(tmp_path))
    assert enc._forward is not enc.model  # traced on this torch
    for batch, width in ((1, 5), (3, 17), (2, 64)):
        ids = torch.randint(1000, 2000, (batch, width))
        attend = torch.ones(batch, width, dtype=torch.long)
        attend[0, width // 2:] = 0
        with torch.inference_mode():
            assert torch.allclose(enc._forward(ids, attend), enc.model(ids, attend), atol=1e-5)
    texts = ["What is RLHF?", "Explain how a B-tree stays balanced when keys are inserted and deleted, " * 3]
    assert enc.score(texts) == pytest.approx([enc.score([t])[0] for t in texts], abs=1e-5)


async def test_cascade_decides_only_the_band(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path)
    w = await _ready(EncoderPolicy(weights_dir=str(folder)))
    lexical = Classifier.load()
    try:
        band = Band(0.0, 1.01, 0.5, Blend(0.0, 1.0, 0.0))  # everything uncertain; the encoder alone decides
        c = Cascade(w, band, 5.0)
        body = {"model": "auto", "messages": [{"role": "user", "content": "Tell me about Rome."}]}
        v = lexical.classify(body)
        assert c.uncertain(v)
        d = await c.decide(v, body)
        assert d.stage is Stage.ENCODER and d.lexical_score == v.score and d.encoder_score is not None
        assert d.cls == ("complex" if d.encoder_score >= 0.5 else "simple") and d.score == pytest.approx(d.encoder_score)
        forced = lexical.classify({**body, "tools": [{"type": "function", "function": {"name": "f"}}]})
        assert forced.stage is Stage.RULE and not c.uncertain(forced)  # a rule is never second-guessed
        assert not Cascade(w, Band(0.0, 0.0, 0.5, band.blend), 5.0).uncertain(v)
        # not ready (loading, failed, no torch): the lexical verdict stands
        assert await Cascade(None, band, 5.0).decide(v, body) is v
        w._scorer = _Slow(Encoder.load(folder), 0.2)
        late = await Cascade(w, band, 0.02).decide(v, body)
        assert (late.cls, late.stage) == ("complex", Stage.DEADLINE)  # recall first
    finally:
        w.close()


def test_shipped_encoder_loads_and_tells_the_obvious_apart() -> None:
    enc = Encoder.load()
    meta = enc.meta
    assert meta["training"]["layers"] == enc.config.layers
    assert (ENCODER_DIR / "model.safetensors").stat().st_size < 30 * 2**20
    simple, hard = enc.score(["Hi! How are you today?",
                              "Implement a thread-safe LRU cache in C++ with O(1) operations and explain the design."])
    assert simple < 0.5 < hard


def test_a_copied_folder_loads_from_anywhere(tmp_path: Path) -> None:
    copy = tmp_path / "enc"
    shutil.copytree(ENCODER_DIR, copy)
    assert Encoder.load(copy).score(["hello"]) == pytest.approx(Encoder.load().score(["hello"]), abs=1e-6)


def test_shipped_encoder_matches_the_data_and_the_lexical_weights() -> None:
    """The encoder's band was fitted on these labels and these lexical weights: a change to either
    means `make encoder` (else the runtime turns the cascade off for other lexical weights)."""
    import hashlib

    from gateway.classify.classifier import DEFAULT_WEIGHTS

    meta = meta_of(ENCODER_DIR)
    assert meta["lexical_sha256"] == hashlib.sha256(DEFAULT_WEIGHTS.read_bytes()).hexdigest(), \
        "the lexical weights changed since the encoder was trained: run `make encoder`"
    shared = Path(__file__).resolve().parents[2] / "shared" / "eval"
    for d in meta["training"]["data"]:
        path = shared / d["file"]
        if path.exists():
            assert hashlib.sha256(path.read_bytes()).hexdigest() == d["sha256"], \
                f"{d['file']} changed since the encoder was trained: run `make encoder`"
    for b in meta["bands"]:  # the band holds the lexical threshold for its recall (runtime pairs them)
        thr = Classifier.load().threshold_for_recall(b["recall"])
        assert b["low"] <= thr < b["high"], b


def _policy(tenants: int = 0, **classifier: Any) -> Any:
    from gateway.config.policy import parse_policy

    return parse_policy(json.dumps({
        "version": 1, "backends": {"a": {"url": "http://127.0.0.1:9", "models": ["m"]}},
        "models": {"auto": {"simple": ["a"], "complex": ["a"]}}, "classifier": classifier,
        "tenants": {f"t{i}": {"key_sha256": [f"{i:064x}"]} for i in range(tenants)}}))


def test_a_tenants_share_of_the_encoders_queue_applies_with_two_tenants_or_more() -> None:
    from gateway.config.runtime import build_runtime

    assert build_runtime(_policy(), {}, 1).cascade.share is None  # open mode: one caller
    assert build_runtime(_policy(tenants=1), {}, 1).cascade.share is None
    assert build_runtime(_policy(tenants=2), {}, 1).cascade.share == 4  # half of max_batch (8)
    assert build_runtime(_policy(tenants=2, encoder={"max_waiting_per_tenant": 6}), {}, 1).cascade.share == 6


def test_each_policy_build_picks_its_band_and_deadline(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The band follows complex_recall_target and the deadline follows the policy on every build
    (so on reload); an explicit threshold, the encoder off, or lexical weights the band was not
    fitted on leave the lexical scorer alone."""
    from gateway.config.runtime import build_runtime

    meta = meta_of(ENCODER_DIR)
    rt = build_runtime(_policy(encoder={"deadline_ms": 30}), {}, 1)
    assert rt.cascade.deadline_s == pytest.approx(0.03)
    assert rt.cascade.band == band_for(meta, 0.97)
    assert build_runtime(_policy(complex_recall_target=0.9), {}, 1).cascade.band == band_for(meta, 0.9)
    assert build_runtime(_policy(threshold=0.4), {}, 1).cascade.band is None
    assert build_runtime(_policy(encoder={"enabled": False}), {}, 1).cascade.band is None
    other = tmp_path / "weights.json"
    from gateway.classify.classifier import DEFAULT_WEIGHTS

    doc = json.loads(DEFAULT_WEIGHTS.read_text())
    doc["bias"] += 0.1
    other.write_text(json.dumps(doc))
    with caplog.at_level("WARNING"):
        assert build_runtime(_policy(weights_file=str(other)), {}, 1).cascade.band is None
    assert "calibrated on other lexical weights" in caplog.text
    with pytest.raises(ValueError, match="encoder.json"):
        build_runtime(_policy(encoder={"weights_dir": str(tmp_path / "missing")}), {}, 1)


class _Broken:
    def score(self, texts: list[str]) -> list[float]:
        raise RuntimeError("weights went bad")


async def test_a_failing_encoder_sends_uncertain_requests_to_complex(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    w = await _ready(EncoderPolicy(weights_dir=str(tiny_folder(tmp_path))))
    w._scorer = _Broken()
    try:
        band = Band(0.0, 1.01, 0.5, Blend(0.0, 1.0, 0.0))
        body = {"model": "auto", "messages": [{"role": "user", "content": "Tell me about Rome."}]}
        v = Classifier.load().classify(body)
        with caplog.at_level("ERROR"):
            got = [await Cascade(w, band, 2.0).decide(v, body) for _ in range(3)]
        assert {(d.cls, d.stage) for d in got} == {("complex", Stage.DEADLINE)}
        logged = [r for r in caplog.records if "scoring a batch" in r.getMessage()]
        assert len(logged) == 1 and "weights went bad" in (logged[0].exc_text or "")  # once, not per batch
    finally:
        w.close()
