"""The hot children (gateway/observe/hot.py): what /metrics shows is what prometheus_client's own
children would show for the same updates, whenever the registry is read."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.observe.hot import Folder, Hot, HotCounter, HotGauge, HotHistogram
from gateway.observe.metrics import Metrics

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 2.5)


def _pair(hot: Hot) -> tuple[CollectorRegistry, CollectorRegistry, dict[str, object], dict[str, object]]:
    """Two registries with the same metrics: one updated through hot children, one directly."""
    mine, ref = CollectorRegistry(auto_describe=True), CollectorRegistry(auto_describe=True)
    mine.register(Folder(hot))
    made: list[dict[str, object]] = []
    for r in (mine, ref):
        made.append({
            "c": Counter("t_requests", "h", ["k"], registry=r).labels("a"),
            "g": Gauge("t_inflight", "h", ["k"], registry=r).labels("a"),
            "h": Histogram("t_seconds", "h", ["k"], buckets=_BUCKETS, registry=r).labels("a"),
        })
    wrapped = {"c": hot.counter(made[0]["c"]), "g": hot.gauge(made[0]["g"]), "h": hot.histogram(made[0]["h"])}
    return mine, ref, wrapped, made[1]


def _exposed(r: CollectorRegistry) -> list[tuple[str, float | str]]:
    """The exposition's lines, values as numbers compared to ~1e-12 (a sum added in another
    order may differ in its last bits)."""
    lines = [line for line in generate_latest(r).decode().splitlines() if "_created" not in line]
    return [(line, "") if line.startswith("#") else (line.rsplit(" ", 1)[0], pytest.approx(float(line.rsplit(" ", 1)[1]), rel=1e-12))
            for line in lines]


def test_hot_children_expose_what_prometheus_client_would():
    hot = Hot(multiprocess=False)
    mine, ref, fast, plain = _pair(hot)
    assert isinstance(fast["c"], HotCounter) and isinstance(fast["g"], HotGauge) and isinstance(fast["h"], HotHistogram)
    rng = random.Random(7)
    # Values on the bucket bounds too: prometheus_client counts a value in the first bucket whose bound is >= it.
    values = [rng.choice([*_BUCKETS, 0.0, 3.0, 1e9]) for _ in range(200)] + [rng.random() * 3 for _ in range(2000)]
    for i, v in enumerate(values):
        for side in (fast, plain):
            side["h"].observe(v)  # type: ignore[attr-defined]
            side["c"].inc(v)  # type: ignore[attr-defined]
            side["g"].inc() if i % 3 else side["g"].dec(2)  # type: ignore[attr-defined]
        if i % 500 == 0:
            assert _exposed(mine) == _exposed(ref)  # read midway: folded, then counting on
    assert _exposed(mine) == _exposed(ref)
    assert _exposed(mine) == _exposed(ref)  # folding twice adds nothing
    assert mine.get_sample_value("t_seconds_count", {"k": "a"}) == len(values)


def test_a_counter_refuses_a_negative_amount_as_prometheus_client_does():
    hot = Hot(multiprocess=False)
    c = hot.counter(Counter("t_c", "h", registry=CollectorRegistry()))
    with pytest.raises(ValueError):
        c.inc(-1)


def test_with_workers_the_children_are_prometheus_clients_own():
    """With PROMETHEUS_MULTIPROC_DIR each update must reach the worker's file as it happens."""
    hot = Hot(multiprocess=True)
    child = Counter("t_c", "h", registry=CollectorRegistry())
    assert hot.counter(child) is child and not hot.enabled


def test_the_gateways_metrics_show_hot_updates_at_once():
    m = Metrics()
    m.stages["gateway"].observe(0.002)
    m.request_done("gpt-test", "a", "simple", "miss", 200)
    m.spend_of("t").inc(0.5)
    assert m.registry.get_sample_value("gateway_stage_seconds_count", {"stage": "gateway"}) == 1
    assert m.registry.get_sample_value(
        "gateway_requests_total", {"model": "gpt-test", "backend": "a", "class": "simple", "cache": "miss", "code": "200"}) == 1
    text = m.exposition().decode()
    assert 'gateway_spend_usd_total{tenant="t"} 0.5' in text
    assert 'gateway_stage_seconds_bucket{le="0.005",stage="gateway"} 1.0' in text
