"""A completions prompt the classifier cannot read (token ids, a suffix) and embeddings input given
as token ids: their tokens count in the prompt estimate (quota reservation, the charge of a
request without usage), such a completion goes to complex, a prompt list counts in
server.max_items (a flat token array as one item). Real sockets, the fake upstream."""

from __future__ import annotations

import hashlib
import secrets

import aiohttp
import orjson
import pytest

KEY = "sk-acme-" + secrets.token_hex(16)
N_TOKENS = 30_000
TOKENS = [1000 + i % 5000 for i in range(N_TOKENS)]
TEXT = "word " * N_TOKENS


def _policy(small, big, quota=None, **extra) -> dict:
    return {
        "version": 1, "cache": {"enabled": False},
        "backends": {"small": {"url": small.url, "models": ["tiny"]}, "big": {"url": big.url, "models": ["large"]}},
        "models": {"auto": {"simple": ["small"], "complex": ["big"]}},
        "tenants": {"acme": {"key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()], **({"quota": quota} if quota else {})}},
        **extra,
    }


async def _post(gw, path: str, body: dict) -> tuple[int, dict, bytes]:
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + path, data=orjson.dumps(body),
                             headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}) as r:
            return r.status, dict(r.headers), await r.read()


@pytest.mark.parametrize("prompt", [{"prompt": TOKENS}, {"prompt": [TOKENS]}, {"prompt": "def f():", "suffix": TEXT}],
                         ids=["token ids", "a list of token arrays", "a long suffix"])
async def test_a_prompt_the_classifier_cannot_read_goes_complex_and_reserves_its_tokens(upstream, gateway, prompt):
    """30,000 token ids read as empty text: "simple", sent to the small model, reserving 5 tokens
    (only max_tokens), and a stream left early charged 1 (review helper's repro; ten such requests
    went through a tpm of 40,000 with ~375,000 tokens)."""
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway(_policy(small, big, {"tpm": 1_000_000}))
    status, headers, _ = await _post(gw, "/v1/completions", {"model": "auto", "max_tokens": 5, **prompt})
    assert status == 200 and headers["x-gateway-class"] == "complex" and headers["x-gateway-backend"] == "big"
    reserved = 1_000_000 - int(headers["x-ratelimit-remaining-tokens"])
    assert reserved >= N_TOKENS * 0.9, reserved
    async with aiohttp.ClientSession() as http:  # explain reads a completions body too
        explain = {"model": "auto", "max_tokens": 5, **prompt}
        async with http.post(gw.url + "/v1/route/explain", json=explain, headers={"Authorization": f"Bearer {KEY}"}) as r:
            why = await r.json()
    assert why["endpoint"] == "completions" and why["rule"] == "unread_prompt" and why["class"] == "complex", why
    assert why["prompt_tokens"] >= N_TOKENS * 0.9


async def test_token_ids_count_one_by_one_and_a_flat_array_is_one_item(upstream, gateway):
    """Embeddings input of small token ids ("7," is 2 bytes a token) reserved half its tokens
    (the body's size / 4); a flat array of 25,000 ids was a 400 for server.max_items, the same
    ids in a nested array a 200; a completions prompt list was not counted at all."""
    small, big = await upstream("small"), await upstream("big")
    policy = _policy(small, big, {"tpm": 1_000_000}, server={"max_items": 20_000})
    policy["backends"]["small"]["endpoints"] = ["chat", "completions", "embeddings"]
    gw = await gateway(policy)
    status, headers, body = await _post(gw, "/v1/embeddings", {"model": "tiny", "input": [[7] * 5000] * 4})
    assert status == 200, body
    assert 1_000_000 - int(headers["x-ratelimit-remaining-tokens"]) >= 20_000
    status, _, body = await _post(gw, "/v1/embeddings", {"model": "tiny", "input": list(range(25_000))})
    assert status == 200, body
    status, _, body = await _post(gw, "/v1/completions", {"model": "tiny", "prompt": ["x"] * 20_001, "max_tokens": 1})
    assert status == 400 and b"server.max_items" in body and orjson.loads(body)["error"]["param"] == "prompt"
