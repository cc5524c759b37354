"""The `simple` class on a pool mixing a local model and a provider (routing.simple), and a
conversation that keeps its class across turns (routing.prefix_affinity.sticky_class), end to end:
fake upstreams on loopback, the gateway in process, the official openai SDK as the client."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import aiohttp
import pytest

from tests.test_classify import SIMPLE as CLASSIFIED_SIMPLE

# Simple by the shipped classifier (each checked through explain below), all different, as a new
# user's prompts would be (no prefix a backend already holds).
SIMPLE = ["What is the capital of France?", *CLASSIFIED_SIMPLE,
          "What is the capital of Italy?", "What is 2 + 2?", "What is the capital of Spain?"]
COMPLEX = [
    "Write a Python function that merges two sorted linked lists and explain its time complexity.",
    "Prove that the square root of 2 is irrational.",
    "Compare and contrast TCP and UDP, with examples of when to use each.",
    "Explain how vaccines train the immune system, in detail.",
    "Design the architecture of a URL shortener that handles 10,000 requests per second.",
    "Plan a 5-day itinerary for Kyoto on a budget of $1,500, including food and transport.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a Python function that parses ISO 8601 dates and explain the edge cases it handles.",
    "Write a C function that reverses a singly linked list in place and explain why it is O(n).",
    "Prove that there are infinitely many prime numbers.",
    "Compare and contrast quicksort and mergesort, with examples of when to use each.",
    "Explain how public-key cryptography works, in detail, with a worked RSA example.",
]
HARD = COMPLEX[0]


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _policy(local: Any, provider: Any, big: Any | None = None, *, routing: dict[str, Any] | None = None,
            local_extra: dict[str, Any] | None = None, complex_pool: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """`auto` splits by class: `simple` mixes the local model and a provider; `complex` is the big
    provider (or `complex_pool`)."""
    backends: dict[str, Any] = {
        local.name: {"url": local.url, "models": ["m"], "local": True, **(local_extra or {})},
        provider.name: {"url": provider.url, "models": ["m"]},
    }
    if big is not None:
        backends[big.name] = {"url": big.url, "models": ["m"]}
    policy: dict[str, Any] = {
        "backends": backends,
        "models": {"auto": {"simple": [local.name, provider.name],
                            "complex": complex_pool or [big.name if big is not None else provider.name]}},
        "reload": {"watch": False},
        "cache": {"enabled": False},  # every request reaches a backend
        # These tests are about where a class goes, so each prompt's class must not depend on this
        # machine's load: the lexical scorer alone (the cascade's encoder has a deadline, and its
        # own tests: test_classifier_cascade_e2e.py).
        "classifier": {"encoder": {"enabled": False}},
        **extra,
    }
    if routing is not None:
        policy["routing"] = routing
    return policy


async def _ask(client: Any, messages: list[dict[str, Any]], headers: dict[str, str] | None = None, **kw: Any) -> tuple[str, str, str]:
    """One streamed chat request: (backend, class, answer text)."""
    raw = await client.chat.completions.with_raw_response.create(
        model="auto", messages=messages, stream=True, extra_headers=headers or {}, **kw
    )
    text = "".join([ch.choices[0].delta.content or "" async for ch in raw.parse() if ch.choices])
    return raw.headers["x-gateway-backend"], raw.headers["x-gateway-class"], text


async def _explain(gw: Any, messages: list[dict[str, Any]], headers: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain", json={"model": "auto", "messages": messages, **kw},
                             headers=headers or {}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


# -- routing.simple: local_first (the default) and latency --------------------------------------


async def test_simple_prompts_go_to_the_local_model_though_a_provider_is_faster(upstream, gateway):
    local = await upstream("local", ttft_ms=40, tokens=2)
    prov = await upstream("prov", ttft_ms=5, tokens=2)
    big = await upstream("big", ttft_ms=5, tokens=2)
    gw = await gateway(_policy(local, prov, big))
    c = gw.client()
    for p in SIMPLE[:2]:  # warm-up: both measured, whatever the selector explores
        await _ask(c, user(p))
    before = prov.stats.requests
    seen = collections.Counter()
    for p in SIMPLE:
        backend, cls, _ = await _ask(c, user(p + " "))  # a fresh prompt each time
        assert cls == "simple", p
        seen[backend] += 1
    assert seen["local"] >= 11 and seen["big"] == 0, seen  # at most one exploration request elsewhere
    assert prov.stats.requests - before <= 1
    out = await _explain(gw, user("What is the capital of Germany?"))
    assert out["class"] == "simple"
    assert out["simple_routing"] == "local first: local", out["simple_routing"]
    assert out["chosen"] == "local"
    assert {x["backend"]: x["local"] for x in out["candidates"]} == {"local": True, "prov": False}


async def test_routing_simple_latency_ranks_the_simple_class_by_predicted_latency(upstream, gateway):
    # 300 ms vs 5 ms: clearly past prefix affinity's max_slowdown (3x), so a new prompt's rendezvous
    # home is never the local one even with loopback overhead on a loaded machine (80 ms was not:
    # the provider's first sample, a new connection on a busy 2-core machine, passed 27 ms).
    local = await upstream("local", ttft_ms=300, tokens=2)
    prov = await upstream("prov", ttft_ms=5, tokens=2)
    big = await upstream("big", ttft_ms=5, tokens=2)
    gw = await gateway(_policy(local, prov, big, routing={"simple": "latency"}))
    c = gw.client()
    for p in SIMPLE[:4]:  # warm-up: cold start measures both
        await _ask(c, user(p))
    assert local.stats.requests >= 1 and prov.stats.requests >= 1
    seen = collections.Counter()
    for p in SIMPLE:
        backend, cls, _ = await _ask(c, user(p + " "))
        assert cls == "simple", p
        seen[backend] += 1
    assert seen["prov"] >= 10 and seen["big"] == 0, seen
    out = await _explain(gw, user("What is the capital of Germany?"))
    assert out["class"] == "simple"
    assert out["simple_routing"].startswith("latency:"), out["simple_routing"]
    scores = {x["backend"]: x["score"] for x in out["candidates"]}
    assert scores["prov"] < scores["local"], out["candidates"]  # ranked by predicted latency
    # The pick is prov, unless local has been silent for the selector's explore_after_s (3 s: a
    # slow run of the loop above on a loaded machine), when it is owed one request by design.
    first = out["candidates"][0]
    assert out["chosen"] == "prov" or (first["backend"] == "local" and (first["note"] or "").startswith("explore:")), \
        out["candidates"]


async def test_simple_prompts_spill_to_the_provider_while_the_local_model_is_saturated(upstream, gateway):
    local = await upstream("local", ttft_ms=500, tokens=2)
    prov = await upstream("prov", ttft_ms=5, tokens=2)
    big = await upstream("big", ttft_ms=5, tokens=2)
    gw = await gateway(_policy(local, prov, big, local_extra={"max_concurrency": 1}))
    c = gw.client()
    tasks = [asyncio.create_task(_ask(c, user(p))) for p in SIMPLE[:4]]  # at once
    for _ in range(100):  # the local one is busy with one of them
        if local.stats.active:
            break
        await asyncio.sleep(0.01)
    out = await _explain(gw, user("What is the capital of Germany?"))
    assert out["class"] == "simple"
    assert out["simple_routing"].startswith("local first, spilled: "), out["simple_routing"]
    assert "local is saturated (1/1 in flight)" in out["simple_routing"], out["simple_routing"]
    assert out["chosen"] == "prov", out  # affinity chooses among the others, not the local it passed over
    got = await asyncio.gather(*tasks)
    seen = collections.Counter(b for b, _, _ in got)
    assert seen == {"local": 1, "prov": 3}, got
    assert local.stats.peak_active == 1 and local.stats.requests == 1  # nobody queued behind the busy slot
    # free again: local first once more
    out = await _explain(gw, user("What is the capital of Germany?"))
    assert out["simple_routing"] == "local first: local" and out["chosen"] == "local"


@pytest.mark.parametrize("fault", ["error_500", "stopped"])
async def test_simple_prompts_spill_to_the_provider_while_the_local_model_is_unhealthy(upstream, gateway, fault):
    local = await upstream("local", ttft_ms=5, tokens=2)
    prov = await upstream("prov", ttft_ms=5, tokens=2)
    big = await upstream("big", ttft_ms=5, tokens=2)
    gw = await gateway(_policy(local, prov, big, health={"failures_to_eject": 1, "eject_ms": 60000}))
    c = gw.client()
    assert (await _ask(c, user(SIMPLE[0])))[0] == "local"
    if fault == "stopped":
        await local.stop()
    else:
        local.set(mode=fault)
    # the first failure ejects it; the client still gets its answer, from the provider
    backend, cls, text = await _ask(c, user(SIMPLE[1]))
    assert (backend, cls, text) == ("prov", "simple", "w0 w1 ")
    out = await _explain(gw, user("What is the capital of Germany?"))
    assert out["simple_routing"] == "local first, spilled: local is ejected", out["simple_routing"]
    assert out["chosen"] == "prov"
    n = local.stats.requests
    for p in SIMPLE[2:8]:
        assert (await _ask(c, user(p)))[:2] == ("prov", "simple")
    assert local.stats.requests == n  # no request tried the ejected local model first


async def test_a_simple_prompt_spills_when_the_local_model_would_miss_its_deadline(upstream, gateway):
    local = await upstream("local", ttft_ms=600, tokens=2)
    prov = await upstream("prov", ttft_ms=5, tokens=2)
    big = await upstream("big", ttft_ms=5, tokens=2)
    gw = await gateway(_policy(local, prov, big))
    c = gw.client()
    for p in SIMPLE[:2]:  # without a deadline the slow local model answers: it is measured at ~600 ms
        assert (await _ask(c, user(p)))[0] == "local"
    tight = {"x-request-timeout-ms": "300"}
    out = await _explain(gw, user("What is the capital of Germany?"), headers=tight)
    why = out["simple_routing"]
    assert why.startswith("local first, spilled: local is predicted at ") and "ms left" in why, why
    assert out["chosen"] == "prov"
    n = local.stats.requests
    backend, cls, text = await _ask(c, user(SIMPLE[2]), headers=tight)
    assert (backend, cls, text) == ("prov", "simple", "w0 w1 ")
    assert local.stats.requests == n
    # a roomy deadline: the local model again
    out = await _explain(gw, user("What is the capital of Germany?"), headers={"x-request-timeout-ms": "5000"})
    assert out["simple_routing"] == "local first: local" and out["chosen"] == "local"


async def test_complex_prompts_are_not_pulled_to_the_local_model(upstream, gateway):
    # The complex pool mixes the (slower) local model and a provider: local_first is for `simple` only.
    # 300 ms vs 5 ms: past prefix affinity's max_slowdown (3x) even when the provider's first
    # sample is slow (as above).
    local = await upstream("local", ttft_ms=300, tokens=2)
    prov = await upstream("prov", ttft_ms=5, tokens=2)
    gw = await gateway(_policy(local, prov, complex_pool=["local", "prov"]))
    c = gw.client()
    for p in SIMPLE[:2] + COMPLEX[:2]:  # warm-up: both measured
        await _ask(c, user(p))
    seen = collections.Counter()
    for p in COMPLEX:
        backend, cls, _ = await _ask(c, user(p + " "))
        assert cls == "complex", p
        seen[backend] += 1
    assert seen["prov"] >= 11, seen  # exploration aside, the faster one
    out = await _explain(gw, user(HARD + " Also add tests."))
    assert out["class"] == "complex"
    assert out["simple_routing"] is None and out["chosen"] == "prov"
    # meanwhile the simple class on the same backends still goes local first
    assert (await _ask(c, user("What is the capital of Germany?")))[0] == "local"


# -- a conversation keeps its class (routing.prefix_affinity.sticky_class) ------------------------


def _split(small: Any, big: Any, sticky: bool | None = None) -> dict[str, Any]:
    policy: dict[str, Any] = {
        "backends": {small.name: {"url": small.url, "models": ["m"]}, big.name: {"url": big.url, "models": ["m"]}},
        "models": {"auto": {"simple": [small.name], "complex": [big.name]}},
        "reload": {"watch": False},
        "cache": {"enabled": False},
    }
    if sticky is not None:
        policy["routing"] = {"prefix_affinity": {"sticky_class": sticky}}
    return policy


async def _hard_then_small_talk(c: Any) -> list[dict[str, str]]:
    """A hard first turn, then small talk: three follow-ups the classifier still calls complex
    (a hard turn among the last three user turns), answered; returns the conversation so far."""
    msgs = user(HARD)
    for follow in ("thanks!", "ok", "great"):
        backend, cls, text = await _ask(c, msgs)
        assert (backend, cls) == ("big", "complex")
        msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": follow}]
    backend, cls, text = await _ask(c, msgs)
    assert (backend, cls) == ("big", "complex")
    return msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "cool, thanks"}]


@pytest.mark.parametrize("sticky", [None, False])
async def test_a_hard_conversation_stays_complex_when_the_classifier_forgets_the_hard_turn(upstream, gateway, sticky):
    small, big = await upstream("small", tokens=8), await upstream("big", tokens=8)
    gw = await gateway(_split(small, big, sticky))
    c = gw.client()
    msgs = await _hard_then_small_talk(c)
    out = await _explain(gw, msgs)
    if sticky is None:  # the default: on
        assert out["class"] == "complex" and out["rule"] == "sticky_class", out
        assert any(r.startswith("sticky:") for r in out["reasons"]), out["reasons"]
        assert out["chosen"] == "big"
        assert (await _ask(c, msgs))[:2] == ("big", "complex")
        assert small.stats.requests == 0
    else:  # off: the classifier's word (the hard turn is four user turns back now)
        assert out["class"] == "simple" and out["rule"] is None, out
        assert not any(r.startswith("sticky") for r in out["reasons"])
        assert (await _ask(c, msgs))[:2] == ("small", "simple")


async def test_a_trivial_follow_up_right_after_a_hard_turn_is_complex(upstream, gateway):
    # Turn 2 right after the hard turn: complex (the classifier itself reads the earlier turn).
    small, big = await upstream("small", tokens=8), await upstream("big", tokens=8)
    gw = await gateway(_split(small, big))
    c = gw.client()
    backend, cls, text = await _ask(c, user(HARD))
    assert (backend, cls) == ("big", "complex")
    msgs = user(HARD) + [{"role": "assistant", "content": text}, {"role": "user", "content": "thanks!"}]
    assert (await _ask(c, msgs))[:2] == ("big", "complex")
    assert small.stats.requests == 0


SYSTEM = [{"role": "system", "content": "You are a helpful assistant."}]
JSON_MODE = {"response_format": {"type": "json_object"}}


@pytest.mark.parametrize("sticky", [None, False])
async def test_a_conversation_whose_first_turn_was_forced_complex_stays_complex(upstream, gateway, sticky):
    # Turn 1 asks for JSON (complex by rule); turn 2 is small talk without it: simple to the
    # classifier, complex by stickiness (with a system prompt).
    small, big = await upstream("small", tokens=8), await upstream("big", tokens=8)
    gw = await gateway(_split(small, big, sticky))
    c = gw.client()
    first = SYSTEM + user("What is the capital of France?")
    backend, cls, text = await _ask(c, first, **JSON_MODE)
    assert (backend, cls) == ("big", "complex")
    msgs = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "thanks!"}]
    out = await _explain(gw, msgs)
    backend, cls, _ = await _ask(c, msgs)
    if sticky is None:
        assert (backend, cls) == ("big", "complex")
        assert out["class"] == "complex" and out["rule"] == "sticky_class", out
        assert out["reasons"][-1].startswith("sticky:"), out["reasons"]
    else:
        assert (backend, cls) == ("small", "simple")
        assert out["class"] == "simple"


async def test_without_a_system_prompt_turn_two_of_a_forced_complex_conversation_stays_complex(upstream, gateway):
    small, big = await upstream("small", tokens=8), await upstream("big", tokens=8)
    gw = await gateway(_split(small, big))
    c = gw.client()
    first = user("What is the capital of France?")
    backend, cls, text = await _ask(c, first, **JSON_MODE)
    assert (backend, cls) == ("big", "complex")
    msgs = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "thanks!"}]
    assert (await _ask(c, msgs))[:2] == ("big", "complex")


async def test_a_simple_conversation_goes_complex_when_a_hard_turn_comes(upstream, gateway):
    small, big = await upstream("small", tokens=8), await upstream("big", tokens=8)
    gw = await gateway(_split(small, big))
    c = gw.client()
    msgs = SYSTEM + user("What is the capital of France?")
    backend, cls, text = await _ask(c, msgs)
    assert (backend, cls) == ("small", "simple")
    msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": HARD}]
    backend, cls, text = await _ask(c, msgs)
    assert (backend, cls) == ("big", "complex")  # an upgrade is allowed
    # and from there the conversation is a complex one
    msgs = msgs + [{"role": "assistant", "content": text}, {"role": "user", "content": "thanks!"}]
    assert (await _ask(c, msgs))[:2] == ("big", "complex")


async def test_explain_learns_nothing_for_stickiness(upstream, gateway):
    small, big = await upstream("small", tokens=8), await upstream("big", tokens=8)
    gw = await gateway(_split(small, big))
    c = gw.client()
    first = SYSTEM + user("What is the capital of France?")
    out = await _explain(gw, first, **JSON_MODE)  # explained, never sent
    assert out["class"] == "complex" and out["rule"] == "response_format"
    msgs = first + [{"role": "assistant", "content": "w0 w1 "}, {"role": "user", "content": "thanks!"}]
    assert (await _ask(c, msgs))[:2] == ("small", "simple")
    assert big.stats.requests == 0


# -- local_first spills, then prefix affinity moves the rejected local model back in front -------


async def _conversation_held_by_local(c: Any) -> list[dict[str, str]]:
    """Turn 1 of a conversation answered by the local model (it holds the prefix), the provider
    measured by two complex prompts (its only pool there); returns turn 2."""
    turn1 = user("What is the capital of France?")
    backend, _, text = await _ask(c, turn1)
    assert backend == "local"
    for p in COMPLEX[:2]:
        assert (await _ask(c, user(p)))[:2] == ("prov", "complex")
    return turn1 + [{"role": "assistant", "content": text}, {"role": "user", "content": "thanks!"}]


async def test_a_deadline_spill_is_not_undone_by_prefix_affinity(upstream, gateway):
    local = await upstream("local", ttft_ms=300, tokens=2)
    prov = await upstream("prov", ttft_ms=150, tokens=2)  # within affinity's max_slowdown (3x) of local
    gw = await gateway(_policy(local, prov))  # complex: the provider alone
    c = gw.client()
    turn2 = await _conversation_held_by_local(c)
    tight = {"x-request-timeout-ms": "250"}
    out = await _explain(gw, turn2, headers=tight)
    assert out["simple_routing"].startswith("local first, spilled: local is predicted at "), out["simple_routing"]
    n = local.stats.requests
    # the provider (~150 ms) answers within 250 ms; the local model (~300 ms) cannot
    backend, cls, _ = await _ask(c, turn2, headers=tight)
    assert (backend, cls) == ("prov", "simple") and local.stats.requests == n
    assert out["chosen"] == "prov", out["prefix_affinity"]


async def test_explain_does_not_choose_the_saturated_local_model_it_spilled_from(upstream, gateway):
    local = await upstream("local", ttft_ms=300, tokens=2)
    prov = await upstream("prov", ttft_ms=150, tokens=2)
    gw = await gateway(_policy(local, prov, local_extra={"max_concurrency": 1}))  # complex: the provider alone
    c = gw.client()
    turn2 = await _conversation_held_by_local(c)
    busy = asyncio.create_task(_ask(c, user("What is 2 + 2?")))  # takes the local model's one slot
    for _ in range(100):
        if local.stats.active:
            break
        await asyncio.sleep(0.01)
    out = await _explain(gw, turn2)
    assert "local is saturated (1/1 in flight)" in out["simple_routing"], out["simple_routing"]
    backend, _, _ = await _ask(c, turn2)
    assert backend == "prov"  # the relay itself passes over the full local model
    assert (await busy)[0] == "local"
    assert out["chosen"] == "prov", out["prefix_affinity"]
