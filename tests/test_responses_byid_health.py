"""A by-id call (the Conversations and Responses by-id endpoints) whose answer is over the size
limit is TOO_LARGE, as the relay says it (what was asked for, not the backend's fault), not a
disconnect of the backend's own; and one failure no caller is blamed for does not take the
probe's verification from a run one tenant caused (routing/health.py: run_unblamed).

Found by a review helper: one tenant, listing its own big conversation once and then sending two
by-id calls its backend answers 500, ejected the whole backend, every model, for every tenant."""

from __future__ import annotations

import aiohttp
import orjson
from aiohttp import web

import gateway.responses.passthrough as passthrough
from gateway.tenants.auth import hash_key
from gateway.web.keys import LIVE
from tests.servers import serve_app

MALLORY, ALICE, BOB = "sk-mallory", "sk-alice", "sk-bob"


async def _backend():
    """A faithful-enough Conversations API: items added are kept, and listed back."""
    convs: dict[str, list] = {}

    async def create(request: web.Request) -> web.Response:
        cid = f"conv_{len(convs) + 1}"
        convs[cid] = []
        return web.json_response({"id": cid, "object": "conversation", "created_at": 1, "metadata": {}})

    async def add(request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        convs[request.match_info["id"]].extend(body.get("items") or [])
        return web.json_response({"object": "list", "data": body.get("items") or []})

    async def items(request: web.Request) -> web.Response:
        if "POISON" in request.query_string:  # what one caller sends makes it fail (health.py's `asked` premise)
            return web.json_response({"error": {"message": "internal error", "type": "server_error"}}, status=500)
        return web.Response(body=orjson.dumps({"object": "list", "data": convs[request.match_info["id"]]}),
                            content_type="application/json")

    async def chat(request: web.Request) -> web.Response:
        return web.json_response({"id": "c", "object": "chat.completion", "created": 1, "model": "m",
                                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})

    async def completions(request: web.Request) -> web.Response:
        return web.json_response({"id": "p", "object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/conversations", create)
    app.router.add_post("/v1/conversations/{id}/items", add)
    app.router.add_get("/v1/conversations/{id}/items", items)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    return await serve_app(app)


async def test_one_tenant_listing_its_own_big_conversation_does_not_eject_the_backend(gateway, monkeypatch):
    """Mallory fills its own conversation (each POST within max_body_bytes), lists it once (over
    the answer size limit), then sends two by-id calls its backend answers 500. Scaled down:
    MAX_BODY_BYTES patched to 1 MiB (the real 64 MiB takes 17 POSTs of 4 MiB items)."""
    monkeypatch.setattr(passthrough, "MAX_BODY_BYTES", 1024 * 1024)
    runner, port = await _backend()
    runner_b, port_b = await _backend()
    try:
        gw = await gateway({
            "backends": {"a": {"url": f"http://127.0.0.1:{port}/v1", "models": ["m"]},
                         "b": {"url": f"http://127.0.0.1:{port_b}/v1", "models": ["m"]}},
            "models": {"m": {"backends": ["a", "b"], "strategy": "ordered"}},
            "cache": {"enabled": False}, "reload": {"watch": False},
            "tenants": {n: {"key_sha256": [hash_key(k)]} for n, k in (("mallory", MALLORY), ("alice", ALICE), ("bob", BOB))},
        })
        a = gw.app[LIVE].runtime.backends["a"]
        h = {"Authorization": f"Bearer {MALLORY}"}
        async with aiohttp.ClientSession() as http:
            async with http.post(gw.url + "/v1/conversations", headers=h, json={"model": "m"}) as r:
                assert r.status == 200, await r.text()
                cid = (await r.json())["id"]
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "x" * 600_000}]}
            for _ in range(2):
                async with http.post(gw.url + f"/v1/conversations/{cid}/items", headers=h, json={"items": [item]}) as r:
                    assert r.status == 200, await r.text()
            # one answer over the size limit: DISCONNECT, the backend's own kind -> the run is "mixed"
            async with http.get(gw.url + f"/v1/conversations/{cid}/items?limit=100", headers=h) as r:
                assert r.status == 502 and "size limit" in await r.text()
            # then two of mallory's own poisoned by-id calls (500, `asked`): corroboration would
            # forgive three of these, but the run is mixed now
            for i in range(2):
                async with http.get(gw.url + f"/v1/conversations/{cid}/items?order=POISON", headers=h) as r:
                    assert r.status == 500
            state = (a.health.state(), a.health.verifying, a.health_for("m").state())
            async with http.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {ALICE}"},
                                 json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 200 and r.headers.get("x-gateway-backend") == "a"
        assert state == ("healthy", False, "healthy"), f"(backend a, verifying, model m) = {state}"
    finally:
        await runner.cleanup()
        await runner_b.cleanup()


def test_an_answer_over_the_limit_is_too_large_whether_or_not_headers_came():
    from gateway.routing.health import Kind
    from gateway.upstream.client import UpstreamTooLarge

    exc = UpstreamTooLarge("answer over the size limit", limit=1)
    assert passthrough._lost(exc, answered=True) is Kind.TOO_LARGE
    assert passthrough._lost(exc, answered=False) is Kind.TOO_LARGE
