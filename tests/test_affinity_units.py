"""Prefix affinity without sockets: block keys, the learned map, the choice and the plan."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.config.policy import Policy
from gateway.config.runtime import build_runtime
from gateway.pipeline.call import Call
from gateway.relay.plan import plan
from gateway.routing.affinity import AffinityResult, Option, PrefixMap, choose
from gateway.routing.load import LoadSample
from gateway.routing.prefix import MAX_BLOCKS, prefix_keys
from gateway.wire.endpoints import ENDPOINTS
from tests.clock import Clock

SYS = "You are a careful assistant. " * 100  # ~2,900 chars: 3 blocks of 1,024


def conv(*turns: str, system: str = SYS) -> dict:
    msgs = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return {"messages": msgs}


# -- block keys ----------------------------------------------------------------------------------


def test_keys_chain_per_message_and_per_block() -> None:
    one = prefix_keys(conv("hi"), 1024)
    assert len(one) == 3 + 1  # the system prompt's 3 blocks, then the user message's
    two = prefix_keys(conv("hi", "hello", "more"), 1024)
    assert two[: len(one)] == one  # a next turn matches every key of the turn before
    other = prefix_keys(conv("ho"), 1024)
    assert other[:3] == one[:3] and other[3] != one[3]
    # A change early changes every later key: the keys are of whole prefixes.
    changed = prefix_keys(conv("hi", system="X" + SYS[1:]), 1024)
    assert not set(changed) & set(one)


def test_message_boundaries_matter() -> None:
    a = prefix_keys({"messages": [{"role": "user", "content": "ab"}, {"role": "user", "content": "c"}]}, 1024)
    b = prefix_keys({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "bc"}]}, 1024)
    assert a[-1] != b[-1]
    roles = prefix_keys({"messages": [{"role": "system", "content": "x"}]}, 1024)
    assert roles != prefix_keys({"messages": [{"role": "user", "content": "x"}]}, 1024)


def test_odd_bodies_and_bounds() -> None:
    assert prefix_keys({}, 1024) == ()
    assert prefix_keys({"prompt": ["a", "b"]}, 1024) == ()
    assert len(prefix_keys({"prompt": "x" * 5000}, 1024)) == 5
    parts = prefix_keys({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}, "junk", {"content": None}]}, 1024)
    assert len(parts) == 2
    assert len(prefix_keys({"prompt": "x" * (1024 * (MAX_BLOCKS + 50))}, 1024)) == MAX_BLOCKS


def test_keys_are_the_same_in_every_process() -> None:
    """Workers and replicas agree without talking: no per-process hash seed in the keys."""
    code = "from gateway.routing.prefix import prefix_keys; print(prefix_keys({'prompt': 'y' * 3000}, 1024)[-1].hex())"
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert outs == {prefix_keys({"prompt": "y" * 3000}, 1024)[-1].hex() + "\n"}


# -- the learned map -----------------------------------------------------------------------------


def test_map_learns_matches_deepest_and_forgets() -> None:
    clock = Clock()
    m = PrefixMap(max_entries=1000, ttl_s=60, clock=clock)
    k1 = prefix_keys(conv("q1"), 1024)
    m.learn(k1, "a", "simple")
    k2 = prefix_keys(conv("q1", "answer", "q2"), 1024)
    n, e = m.match(k2)
    assert n == len(k1) and e is not None and e.holders == ["a"]
    m.learn(k2, "b", "complex")
    assert m.match(k2)[1].holders == ["b"]  # type: ignore[union-attr]
    assert m.match(k1)[1].holders == ["b", "a"]  # type: ignore[union-attr]  # most recent first
    clock.t += 61
    assert m.match(k2) == (0, None)  # unused past the TTL
    assert m.footprint("a") == 0


def test_map_is_bounded() -> None:
    m = PrefixMap(max_entries=100, ttl_s=600)
    for i in range(300):
        m.learn(prefix_keys({"prompt": f"prompt {i}"}, 1024), "a", "simple")
    assert len(m) == 100
    # each backend's first blocks too (trimmed by age only, they held one per distinct prompt)
    assert m.footprint("a") == 100


def test_a_full_map_drops_the_keys_of_the_tenant_that_holds_the_most() -> None:
    """One table for everyone: 40 requests of 128 one-word messages emptied a 5,000-entry table
    of another tenant's conversation (review helper's repro). A full table drops the least
    recently learned keys of the namespace holding the most."""
    m = PrefixMap(max_entries=500, ttl_s=600)
    alice = prefix_keys(conv("hello", "hi there", "and then?", system="be brief"), 1024, "alice")
    m.learn(alice, "a", "none", "alice")
    for i in range(40):
        flood = prefix_keys({"messages": [{"role": "user", "content": f"w{i}-{j}"} for j in range(128)]}, 1024, "mallory")
        m.learn(flood, "b", "none", "mallory")
    assert len(m) == 500
    assert m.match(alice)[0] == len(alice)  # alice's conversation is still known whole
    keep = prefix_keys({"messages": [{"role": "user", "content": f"w39-{j}"} for j in range(128)]}, 1024, "mallory")
    assert m.match(keep)[0] == len(keep)  # and the flooder's newest


def test_footprint_counts_first_blocks() -> None:
    m = PrefixMap()
    for sys_prompt in ("one " * 300, "two " * 300):
        for q in ("x", "y"):
            m.learn(prefix_keys(conv(q, system=sys_prompt), 1024), "a", "simple")
    assert m.footprint("a") == 2 and m.footprint("b") == 0


def test_previous_class_is_this_conversations_not_the_system_prompts() -> None:
    m = PrefixMap()
    m.learn(prefix_keys(conv("hard question"), 1024), "a", "complex")
    assert m.previous_class(prefix_keys(conv("hard question", "answer", "thanks"), 1024)) == "complex"
    # Another conversation on the same system prompt shares only that: no class to keep.
    assert m.previous_class(prefix_keys(conv("easy one"), 1024)) is None
    assert m.previous_class(prefix_keys(conv("hard question"), 1024)) is None  # the same prompt again: not a later turn


# -- the choice ------------------------------------------------------------------------------------


def opts(*spec: tuple[str, float], skipped: dict[str, str] | None = None, scores: dict[str, float] | None = None) -> list[Option]:
    skipped, scores = skipped or {}, scores or {}
    return [Option(n, n not in skipped, skipped.get(n), load, scores.get(n, 0.1)) for n, load in spec]


def pick(options: list[Option], keys: tuple[bytes, ...], m: PrefixMap, **kw: float):
    return choose(options, keys, m, **{"max_imbalance": 2, "max_slowdown": 3.0, "max_share": 1.0, **kw})


def test_a_holder_within_bounds_is_a_hit() -> None:
    m = PrefixMap()
    k1 = prefix_keys(conv("q1"), 1024)
    m.learn(k1, "b", "none")
    k2 = prefix_keys(conv("q1", "a1", "q2"), 1024)
    d = pick(opts(("a", 0), ("b", 1), ("c", 0)), k2, m)
    assert (d.result, d.backend, d.matched_blocks, d.blocks) == (AffinityResult.HIT, "b", len(k1), len(k2))
    assert dict(d.loads) == {"a": 0, "b": 1, "c": 0}


def test_health_load_and_speed_bound_affinity() -> None:
    m = PrefixMap()
    k = prefix_keys(conv("q1"), 1024)
    m.learn(k, "b", "none")
    ejected = pick(opts(("a", 0), ("b", 0), skipped={"b": "ejected"}), k, m)
    assert ejected.result is AffinityResult.SPILL and ejected.backend == "a" and "ejected" in ejected.reason
    loaded = pick(opts(("a", 0), ("b", 3)), k, m)
    assert loaded.result is AffinityResult.SPILL and loaded.backend == "a" and "in flight" in loaded.reason
    slow = pick(opts(("a", 0), ("b", 0), scores={"a": 0.1, "b": 0.5}), k, m)
    assert slow.result is AffinityResult.SPILL and "predicted" in slow.reason
    assert pick(opts(("a", 0), ("b", 2)), k, m).result is AffinityResult.HIT  # at the bound: still its holder


def test_a_spilled_hot_prefix_spreads_over_its_holders() -> None:
    m = PrefixMap()
    k = prefix_keys(conv("q"), 1024)
    m.learn(k, "a", "none")
    m.learn(k, "b", "none")  # a spill taught b the prefix
    d = pick(opts(("a", 2), ("b", 0), ("c", 0)), k, m)
    assert (d.result, d.backend) == (AffinityResult.HIT, "b")


def test_a_deeper_holder_out_of_bounds_falls_back_to_a_shallower_one() -> None:
    m = PrefixMap()
    m.learn(prefix_keys(conv("other"), 1024), "a", "none")  # a holds the system prompt
    k = prefix_keys(conv("q1", "a1", "q2"), 1024)
    m.learn(prefix_keys(conv("q1"), 1024), "b", "none")  # b holds this conversation
    d = pick(opts(("a", 0), ("b", 5), ("c", 0)), k, m)
    assert (d.result, d.backend, d.matched_blocks) == (AffinityResult.HIT, "a", 3)
    assert "b spilled" in d.reason


def test_new_prefixes_go_home_by_rendezvous_and_spread() -> None:
    names = [("a", 0), ("b", 0), ("c", 0)]
    homes = []
    for i in range(9):
        k = prefix_keys(conv("q", system=f"prompt {i} " * 200), 1024)
        d1 = pick(opts(*names), k, PrefixMap())
        d2 = pick(opts(*reversed(names)), k, PrefixMap())  # another process, another ranking order
        assert d1.result is AffinityResult.MISS and d1.backend == d2.backend  # agree without talking
        homes.append(d1.backend)
    assert len(set(homes)) >= 2
    # One process learning them in turn balances its caches: at most its share of prefixes each.
    m = PrefixMap()
    for i in range(9):
        k = prefix_keys(conv("q", system=f"prompt {i} " * 200), 1024)
        m.learn(k, pick(opts(*names), k, m).backend or "", "none")
    assert sorted(m.footprint(n) for n, _ in names) == [3, 3, 3]


def test_a_leaving_backend_moves_only_its_prefixes() -> None:
    all3, two = opts(("a", 0), ("b", 0), ("c", 0)), opts(("a", 0), ("b", 0))
    moved = 0
    for i in range(30):
        k = prefix_keys({"prompt": f"p{i}"}, 1024)
        before, after = pick(all3, k, PrefixMap()).backend, pick(two, k, PrefixMap()).backend
        if before != "c":
            assert after == before
        else:
            moved += 1
    assert moved > 0


# -- the plan (selector ranking + local first + affinity) ------------------------------------------


def _runtime(simple: str = "local_first", **routing: object):
    policy = Policy.model_validate({
        "backends": {
            "local": {"url": "http://127.0.0.1:9/v1", "models": ["m"], "local": True, "max_concurrency": 1},
            "p1": {"url": "http://127.0.0.1:10/v1", "models": ["m"]},
            "p2": {"url": "http://127.0.0.1:11/v1", "models": ["m"]},
        },
        "models": {"auto": {"simple": ["local", "p1", "p2"], "complex": ["p1", "p2"]}},
        "routing": {"simple": simple, **routing},
    })
    rt = build_runtime(policy, {}, 1)
    rt.activate({}, {})
    return rt


def _call(rt, body: dict, cls: str = "simple") -> tuple[Call, object]:
    from gateway.classify.classifier import Verdict

    call = Call("r", ENDPOINTS["chat"], b"{}", None, 1e18)
    call.body, call.model = {"model": "auto", **body}, "auto"
    call.verdict = Verdict(cls, 0.1, 0.5, None, {"x": 1})
    route = rt.route("auto")
    call.prefix = prefix_keys(body, 1024)
    return call, route


def test_simple_prompts_go_local_first_and_spill_when_it_is_full() -> None:
    rt = _runtime()
    for b in ("p1", "p2"):  # the providers are measured faster
        rt.backends[b].tracker.observe_ttft(0.005, 10)
        rt.backends[b].tracker.observe_done(0.01, ok=True)
    rt.backends["local"].tracker.observe_ttft(0.05, 10)
    call, route = _call(rt, conv("hi"))
    pool = route.pool("simple")
    p = plan(call, route, pool)
    assert p.ranked[0].name == "local" and p.simple == "local first: local"
    assert p.affinity is not None and p.affinity.backend == "local"  # affinity chooses among the local ones
    assert rt.backends["local"].slots.try_acquire("default")
    try:
        p = plan(call, route, pool)
        assert p.ranked[0].name != "local" and "saturated" in (p.simple or "")
        assert p.ranked[-1].name == "local"  # still a failover candidate
    finally:
        rt.backends["local"].slots.release("default")
    for _ in range(3):  # ejected: health first, whatever the preferences
        pool.candidates[0].health.report_failure()
    p = plan(call, route, pool)
    assert p.ranked[0].name != "local" and "local is ejected" in (p.simple or "")


def test_latency_mode_and_complex_prompts_ignore_local_first() -> None:
    rt = _runtime("latency")
    call, route = _call(rt, conv("hi"))
    assert (plan(call, route, route.pool("simple")).simple or "").startswith("latency")
    rt2 = _runtime()
    call, route = _call(rt2, conv("hi"), cls="complex")
    p = plan(call, route, route.pool("complex"))
    assert p.simple is None and "local" not in [r.name for r in p.ranked]


def test_a_local_model_predicted_past_the_deadline_is_passed_over() -> None:
    import time

    rt = _runtime()
    rt.backends["local"].tracker.observe_ttft(2.0, 10)
    call, route = _call(rt, conv("hi"))
    call.deadline = time.monotonic() + 0.5
    p = plan(call, route, route.pool("simple"))
    assert p.ranked[0].name != "local" and "past the" in (p.simple or "")


def test_affinity_off_and_single_backend_pools_have_no_decision() -> None:
    rt = _runtime(prefix_affinity={"enabled": False})
    call, route = _call(rt, conv("hi"), cls="complex")
    assert plan(call, route, route.pool("complex")).affinity is None


@pytest.mark.parametrize("waiting", [0.0, 40.0])
def test_a_reported_queue_raises_the_score(waiting: float) -> None:
    import time

    rt = _runtime()
    for b in ("p1", "p2"):
        rt.backends[b].tracker.observe_ttft(0.01, 10)
    rt.backends["p2"].state.load.update(LoadSample(waiting, 1.0), time.monotonic())
    call, route = _call(rt, {"prompt": "x"}, cls="complex")
    call.prefix = None
    firsts = {plan(call, route, route.pool("complex")).ranked[0].name for _ in range(50)}
    assert firsts == ({"p1"} if waiting else {"p1", "p2"})


def test_our_local_backend_reports_what_the_gateway_reads() -> None:
    """The local model server's /metrics speaks vLLM's gauges, so a pool of local replicas gets
    load signals too; a launched backend's metrics_url defaults to its own /metrics."""
    from gateway.routing.load import parse_load
    from local_backend.stats import render_load

    text = render_load("m", {"batch_size": 3, "queue_depth": 5, "kv_cache_usage": 0.25, "kv_cache_bytes": 1}, None, {"mode": "x"})
    assert parse_load(text) == LoadSample(5.0, 3.0, 0.25)
    policy = Policy.model_validate({"backends": {
        "local": {"url": "http://127.0.0.1:8011/v1", "models": ["m"], "launch": {"model": "smollm2-135m-instruct"}},
        "remote": {"url": "http://127.0.0.1:9/v1", "models": ["m"]},
        "vllm": {"url": "http://127.0.0.1:10/v1", "models": ["m"], "metrics_url": "http://127.0.0.1:10/metrics/"},
    }})
    rt = build_runtime(policy, {}, 1)
    assert rt.backends["local"].metrics_url == "http://127.0.0.1:8011/metrics" and rt.backends["local"].local
    assert rt.backends["remote"].metrics_url is None and not rt.backends["remote"].local
    assert rt.backends["vllm"].metrics_url == "http://127.0.0.1:10/metrics"


def test_namespaces_never_share_keys() -> None:
    body = conv("same words")
    a, b = prefix_keys(body, 1024, "tenant:a"), prefix_keys(body, 1024, "tenant:b")
    assert len(a) == len(b) and not set(a) & set(b)
    assert prefix_keys(body, 1024, "tenant:a") == a


def test_a_full_map_drops_expired_blocks_before_anyone_s_fresh_ones() -> None:
    """Evicting from the namespace holding the most kept an idle tenant's expired blocks while an
    active tenant's fresh ones went (review of the change): expired blocks go first."""
    now = [0.0]
    m = PrefixMap(max_entries=100, ttl_s=600, clock=lambda: now[0])
    for i in range(60):
        m.learn([b"B%d" % i], "x", "none", "idle")
    now[0] = 3600.0
    fresh = [[b"A%d" % i] for i in range(70)]
    for keys in fresh:
        m.learn(keys, "x", "none", "active")
    assert all(m.match(keys)[0] == 1 for keys in fresh) and len(m) <= 100
