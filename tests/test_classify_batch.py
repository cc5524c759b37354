"""A completions prompt list is a batch of prompts, each answered on its own, which the classifier
reads joined: one longer than it reads of a text (its cue windows) is complex (`unread_prompt`),
and no batch goes to the encoder (it reads only the first and last tokens). A hard prompt 81st of
121 short ones went to the small model (review helper's repro)."""

from __future__ import annotations

import aiohttp

TASK = ("Write a Python function that implements Dijkstra's shortest path algorithm with a binary heap, prove its "
        "correctness and explain its time complexity.")


def _policy(small, big) -> dict:
    return {"version": 1, "cache": {"enabled": False},
            "backends": {"small": {"url": small.url, "models": ["m"]}, "big": {"url": big.url, "models": ["m"]}},
            "models": {"auto": {"simple": ["small"], "complex": ["big"]}}}


async def _explain(gw, body: dict) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/route/explain", json=body) as r:
            return await r.json()


async def test_a_hard_prompt_in_the_middle_of_a_long_batch_makes_it_complex(upstream, gateway):
    gw = await gateway(_policy(await upstream("small"), await upstream("big")))
    c = gw.client()
    batch = ["Who wrote Hamlet?"] * 80 + [TASK] + ["Who wrote Hamlet?"] * 40
    mixed = await c.completions.with_raw_response.create(model="auto", prompt=batch, max_tokens=5)
    assert mixed.headers["x-gateway-class"] == "complex" and mixed.headers["x-gateway-backend"] == "big"
    why = await _explain(gw, {"model": "auto", "prompt": batch, "max_tokens": 5})
    assert why["class"] == "complex" and why["stage"] != "encoder", why  # lexical (complex) or the unread rule


async def test_a_long_batch_of_simple_prompts_is_complex_by_the_unread_rule(upstream, gateway):
    """What the classifier does not read of a batch could be anything: recall first."""
    policy = _policy(await upstream("small"), await upstream("big"))
    policy["models"]["auto"]["threshold"] = 0.999  # the lexical scorer says simple to (almost) anything
    gw = await gateway(policy)
    why = await _explain(gw, {"model": "auto", "prompt": ["Thanks!"] * 150, "max_tokens": 5})
    assert why["class"] == "complex" and why["rule"] == "unread_prompt" and why["stage"] == "rule", why
    assert any("batch of prompts" in r for r in why["reasons"]), why["reasons"]


async def test_a_short_batch_is_read_whole_and_a_single_prompt_list_as_one(upstream, gateway):
    gw = await gateway(_policy(await upstream("small"), await upstream("big")))
    short = await _explain(gw, {"model": "auto", "prompt": ["Who wrote Hamlet?", "What is 2+2?"], "max_tokens": 5})
    assert short["rule"] != "unread_prompt" and short["stage"] != "encoder", short
    one = await _explain(gw, {"model": "auto", "prompt": ["Who wrote Hamlet?"], "max_tokens": 5})
    assert one["rule"] != "unread_prompt", one
    hard = await _explain(gw, {"model": "auto", "prompt": ["Who wrote Hamlet?", TASK], "max_tokens": 5})
    assert hard["class"] == "complex", hard
