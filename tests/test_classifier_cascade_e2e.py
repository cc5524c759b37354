"""The classifier cascade end to end: a gateway on loopback with the shipped encoder, the official
openai SDK as the client, explain, metrics and /readyz; the encoder off, too slow, flooded, and
absent (no torch)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import pytest

pytest.importorskip("torch")  # the `local` extra: `make test` installs it

from gateway.classify.classifier import Classifier  # noqa: E402
from gateway.web.keys import ENCODER, LIVE, METRICS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# Candidates for each kind of decision; the test picks those the shipped band puts where it needs
# them, so a retrained encoder does not break it.
PROMPTS = [
    "Hi!", "What is the capital of France?", "Thanks, that was helpful.",
    "What is RLHF?", "What is the tuple type in TypeScript?", "9.11 and 9.9, which is larger?",
    "Explain how a solar panel works as if I were five.", "Why is the sky blue?",
    "Give me three tips for sleeping better.", "Summarize the plot of Hamlet.",
    "What are the pros and cons of remote work?", "How do vaccines work?",
    "Suggest a name for my bakery.", "Who wrote Pride and Prejudice?",
    "Is a tomato a fruit or a vegetable?", "What's the difference between a virus and a bacterium?",
    "Write a haiku about autumn.", "How do I make my code run faster?", "Describe the water cycle.",
    "What should I do if I feel lonely?", "Can you recommend a good book about history?",
    "Translate 'good morning' into Spanish.", "What causes inflation?", "Tell me a joke about cats.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Prove that the square root of 2 is irrational.",
]


def _policy(up_small: Any, up_big: Any, **classifier: Any) -> dict[str, Any]:
    return {
        "version": 1,
        "backends": {"small": {"url": up_small.url, "models": ["m"]}, "big": {"url": up_big.url, "models": ["m"]}},
        "models": {"auto": {"simple": ["small"], "complex": ["big"]}},
        "classifier": classifier,
    }


async def _ready(gw: Any, http: aiohttp.ClientSession) -> dict[str, Any]:
    """/readyz once the encoder has loaded (it says 503 while it loads)."""
    for _ in range(300):
        async with http.get(gw.url + "/readyz") as r:
            body = await r.json()
            if r.status == 200:
                return body
            assert body.get("detail") == "the classifier's encoder is loading", body
        await asyncio.sleep(0.1)
    raise AssertionError(f"not ready: {body}")


async def _explain(gw: Any, http: aiohttp.ClientSession, content: str, **extra: Any) -> dict[str, Any]:
    async with http.post(gw.url + "/v1/route/explain",
                         json={"model": "auto", "messages": [{"role": "user", "content": content}], **extra}) as r:
        assert r.status == 200
        out: dict[str, Any] = await r.json()
        return out


def _uncertain(gw: Any) -> list[str]:
    """Candidates whose lexical score the live runtime's band holds."""
    rt = gw.app[LIVE].runtime
    band = rt.cascade.band
    assert band is not None
    lexical = Classifier.load()
    got = [p for p in PROMPTS if band.holds(lexical.classify({"messages": [{"role": "user", "content": p}]}).score)]
    assert got, "no candidate prompt falls in the band"
    return got


def _decisions(gw: Any, stage: str) -> float:
    return gw.app[METRICS].registry.get_sample_value("gateway_classifier_decisions_total", {"stage": stage}) or 0.0


async def test_uncertain_requests_go_to_the_encoder_and_say_so(upstream, gateway) -> None:
    small, big = await upstream("small"), await upstream("big")
    # what decided and what it reports: a deadline no busy CI machine reaches (the deadline's own
    # test is the flood below)
    gw = await gateway(_policy(small, big, encoder={"deadline_ms": 2000}))
    async with aiohttp.ClientSession() as http:
        ready = await _ready(gw, http)
        assert ready["classifier_encoder"] == "ready"
        band = gw.app[LIVE].runtime.cascade.band
        uncertain = _uncertain(gw)
        out = await _explain(gw, http, uncertain[0])
        assert out["stage"] == "encoder", out
        assert band.low <= out["lexical_score"] < band.high and 0.0 <= out["encoder_score"] <= 1.0
        assert out["threshold"] == pytest.approx(band.threshold, abs=1e-4)
        assert out["class"] == ("complex" if out["score"] >= out["threshold"] else "simple")
        assert out["chosen"] == ("big" if out["class"] == "complex" else "small")
        assert out["reasons"][0].startswith("encoder: ")
        sure = [p for p in PROMPTS if p not in uncertain]
        assert sure, "every candidate is uncertain: the band is wider than the test assumes"
        out = await _explain(gw, http, sure[0])
        assert out["stage"] == "lexical" and out["encoder_score"] is None
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        out = await _explain(gw, http, uncertain[0], tools=tools)
        assert out["stage"] == "rule" and out["class"] == "complex"
    assert _decisions(gw, "encoder") == 0  # explain counts nothing

    client = gw.client()
    asked = uncertain[:4] + sure[:4]
    for p in asked:  # one at a time
        raw = await client.chat.completions.with_raw_response.create(model="auto", messages=[{"role": "user", "content": p}])
        assert raw.headers["x-gateway-class"] in ("simple", "complex")
        assert raw.headers["x-gateway-backend"] == ("big" if raw.headers["x-gateway-class"] == "complex" else "small")
    used = {s: _decisions(gw, s) for s in ("rule", "lexical", "encoder", "deadline")}
    assert sum(used.values()) == 8 and used["lexical"] == len(asked) - len(uncertain[:4])
    assert used["encoder"] + used["deadline"] == len(uncertain[:4]) and used["encoder"] >= 1
    # the wait is the encoder's load: explain's one call counts there too
    waited = gw.app[METRICS].registry.get_sample_value("gateway_classifier_encoder_seconds_count")
    assert waited == used["encoder"] + used["deadline"] + 1


async def test_explicit_threshold_or_encoder_off_is_the_lexical_scorer_alone(upstream, gateway) -> None:
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway(_policy(small, big, encoder={"enabled": False}))
    async with aiohttp.ClientSession() as http:
        ready = await _ready(gw, http)
        assert ready["classifier_encoder"] == "off" and gw.app[ENCODER].state.value == "off"
        for p in PROMPTS[:6]:
            assert (await _explain(gw, http, p))["stage"] in ("lexical", "rule")
    gw2 = await gateway(_policy(small, big, threshold=0.3), name="threshold.yaml")
    async with aiohttp.ClientSession() as http:
        assert (await _ready(gw2, http))["classifier_encoder"] == "off"
        out = await _explain(gw2, http, PROMPTS[4])
        assert out["stage"] == "lexical" and out["threshold"] == 0.3


async def test_a_flood_of_uncertain_requests_is_bounded_and_answered(upstream, gateway) -> None:
    """More uncertain requests than may wait: the rest go to the big model at once (recall first),
    none fails, and the encoder keeps serving afterwards."""
    small, big = await upstream("small"), await upstream("big")
    gw = await gateway(_policy(small, big, encoder={"max_waiting": 2, "max_batch": 1, "deadline_ms": 50}))
    async with aiohttp.ClientSession() as http:
        await _ready(gw, http)
        uncertain = _uncertain(gw)
        long = uncertain[0] + " " + "and some more words to read " * 600  # a 4,000-token prompt: still a bounded window
        client = gw.client()
        bodies = [uncertain[i % len(uncertain)] for i in range(40)] + [long]
        answers = await asyncio.gather(*(client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": b}]) for b in bodies))
        assert len(answers) == 41
        assert _decisions(gw, "deadline") >= 30  # at most 2 waited at a time
        # the deadline's verdicts went to the big model
        assert all(a.headers["x-gateway-backend"] in ("small", "big") for a in answers)
        await asyncio.sleep(0.3)
        assert (await _explain(gw, http, uncertain[0]))["stage"] == "encoder"


def test_without_torch_the_lexical_scorer_decides_and_says_why(tmp_path: Path) -> None:
    """A gateway-only install (no torch): the gateway serves, /readyz says `unavailable`, every
    request is classified by the lexical scorer, and the log says so once."""
    script = textwrap.dedent("""
        import asyncio, json, logging, sys
        sys.modules["torch"] = None  # as if not installed: `import torch` raises ImportError
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        import aiohttp
        from aiohttp import web
        from gateway.web.app import create_app

        async def main():
            app = create_app(sys.argv[1])
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            url = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]
            async with aiohttp.ClientSession() as http:
                for _ in range(100):
                    async with http.get(url + "/readyz") as r:
                        ready = await r.json()
                    if r.status == 200:
                        break
                    await asyncio.sleep(0.05)
                async with http.post(url + "/v1/route/explain", json={"model": "auto",
                        "messages": [{"role": "user", "content": "What is the tuple type in TypeScript?"}]}) as r:
                    out = await r.json()
            await runner.cleanup()
            print(json.dumps({"ready": ready, "explain": out}))

        asyncio.run(main())
    """)
    policy = tmp_path / "p.yaml"
    policy.write_text(json.dumps({"version": 1, "backends": {
        "small": {"url": "http://127.0.0.1:9", "models": ["m"]}, "big": {"url": "http://127.0.0.1:9", "models": ["m"]}},
        "models": {"auto": {"simple": ["small"], "complex": ["big"]}}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", script, str(policy)], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["ready"]["classifier_encoder"] == "unavailable"
    assert got["explain"]["stage"] == "lexical" and got["explain"]["encoder_score"] is None
    assert got["explain"]["class"] in ("simple", "complex")
    lines = [ln for ln in run.stderr.splitlines() if "classifier encoder" in ln]
    assert len(lines) == 1 and "torch" in lines[0] and "lexical scorer decides alone" in lines[0]
