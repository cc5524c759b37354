"""Hot reload: file change, SIGHUP and POST /admin/reload; a bad policy never replaces a good one."""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import openai
import pytest
import yaml

from gateway.web.app import create_app
from gateway.tenants.auth import hash_key
from gateway.web.keys import ADMISSION, LIVE, RELOADER
from gateway.process.workers import WorkerInfo
from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]


async def _wait_generation(gw, gen: int, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while gw.app[LIVE].runtime.generation < gen:
        if loop.time() > end:
            raise AssertionError(f"policy generation {gen} not reached")
        await asyncio.sleep(0.02)


async def _backend_of(gw) -> str:
    raw = await gw.client().chat.completions.with_raw_response.create(model="gpt-test", messages=MSG)
    return raw.headers["x-gateway-backend"]


async def _metrics(gw) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            return await r.text()


async def test_a_good_edit_takes_effect_without_a_restart(upstream, gateway):
    a, b = await upstream("a"), await upstream("b")
    gw = await gateway(simple_policy(a, b, reload={"interval_ms": 50}))
    assert await _backend_of(gw) == "a"
    gw.write_policy(simple_policy(b, a, reload={"interval_ms": 50}))
    await _wait_generation(gw, 2)
    assert await _backend_of(gw) == "b"
    assert 'gateway_policy_reloads_total{result="ok"} 1.0' in await _metrics(gw)


async def test_a_bad_edit_keeps_the_old_policy(upstream, gateway, caplog):
    a = await upstream("a")
    gw = await gateway(simple_policy(a, reload={"interval_ms": 50}))
    gw.write_policy("backends:\n  a: {url: 'not a url', models: [gpt-test]}\n")
    loop = asyncio.get_running_loop()
    end = loop.time() + 5
    while 'gateway_policy_reloads_total{result="error"} 1.0' not in await _metrics(gw):
        assert loop.time() < end, "the bad policy was never noticed"
        await asyncio.sleep(0.05)
    assert gw.app[LIVE].runtime.generation == 1
    assert await _backend_of(gw) == "a"
    assert "backends.a.url" in caplog.text  # the log names the YAML path of the problem


async def test_a_save_during_a_reload_is_reloaded_too(upstream, gateway, monkeypatch):
    """The digest of the policy in force was taken by reading the file again after the build: a
    save landing in between was taken for the one in force and never loaded (review's repro). It
    is the digest of the bytes parsed now, so the watcher sees the later save."""
    import gateway.config.reload as reload_mod

    a, b, c = await upstream("a"), await upstream("b"), await upstream("c")
    gw = await gateway(simple_policy(a, reload={"interval_ms": 50}))
    real, saved = reload_mod.read_policy, []

    def read_then_save(path, source=None):
        out = real(path, source)
        if not saved:  # the operator's next save lands while the gateway builds the previous one
            saved.append(1)
            path.write_text(yaml.safe_dump(simple_policy(c, reload={"interval_ms": 50})))
        return out

    monkeypatch.setattr(reload_mod, "read_policy", read_then_save)
    gw.write_policy(simple_policy(b, reload={"interval_ms": 50}))
    await _wait_generation(gw, 3)
    assert sorted(gw.app[LIVE].runtime.backends) == ["c"]


async def test_sighup_reloads(upstream, gateway):
    a, b = await upstream("a"), await upstream("b")
    gw = await gateway(simple_policy(a, reload={"watch": False}))
    gw.write_policy(simple_policy(b, reload={"watch": False}))
    await asyncio.sleep(0.05)
    assert await _backend_of(gw) == "a"  # not watching: nothing changes by itself
    os.kill(os.getpid(), signal.SIGHUP)
    await _wait_generation(gw, 2)
    assert await _backend_of(gw) == "b"


async def test_admin_reload_needs_the_admin_key_and_reports_errors(upstream, gateway):
    a, b = await upstream("a"), await upstream("b")

    def policy(up, url=None):
        p = simple_policy(up, reload={"watch": False})
        p["admin"] = {"key_sha256": [hash_key("sk-admin")]}
        p["tenants"] = {"t": {"key_sha256": [hash_key("sk-test")]}}
        if url:
            p["backends"][up.name]["url"] = url
        return p

    gw = await gateway(policy(a))
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/admin/reload", headers={"Authorization": "Bearer sk-test"}) as r:
            assert r.status == 401
        gw.write_policy(policy(b, url="ftp://nope"))
        async with http.post(gw.url + "/admin/reload", headers={"Authorization": "Bearer sk-admin"}) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["code"] == "invalid_policy" and "backends.b.url" in err["message"]
        assert await _backend_of(gw) == "a"
        gw.write_policy(policy(b))
        async with http.post(gw.url + "/admin/reload", headers={"Authorization": "Bearer sk-admin"}) as r:
            assert r.status == 200 and (await r.json())["policy_generation"] == 2
    assert await _backend_of(gw) == "b"


async def test_requests_in_flight_finish_under_the_policy_they_started_with(upstream, gateway):
    a = await upstream("a", tokens=20, itl_ms=20)
    b = await upstream("b")
    gw = await gateway(simple_policy(a, reload={"interval_ms": 50}))
    client = gw.client()
    stream = await client.chat.completions.create(model="gpt-test", messages=MSG, stream=True)
    parts = []
    async for chunk in stream:
        parts.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
        if len(parts) == 3:
            gw.write_policy(simple_policy(b, model="other", reload={"interval_ms": 50}))  # gpt-test is gone
            await _wait_generation(gw, 2)
    assert "".join(parts) == "".join(f"w{i} " for i in range(20))
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="gpt-test", messages=MSG)


async def test_a_reload_does_not_change_the_settings_of_a_request_in_flight(upstream, gateway):
    a = await upstream("a", tokens=3, ttft_ms=400)
    gw = await gateway(simple_policy(a, reload={"watch": False}))
    client = gw.client()
    slow = asyncio.create_task(client.chat.completions.create(model="gpt-test", messages=MSG))
    await asyncio.sleep(0.1)
    stricter = simple_policy(a, reload={"watch": False})
    stricter["backends"]["a"]["timeouts"] = {"first_token_ms": 50, "total_ms": 50}
    gw.write_policy(stricter)
    ok, _ = await gw.app[RELOADER].reload("test")
    assert ok
    r = await slow  # started under the old policy: its 600 s deadline, not the new 50 ms
    assert r.choices[0].message.content == "w0 w1 w2 "
    with pytest.raises(openai.APIStatusError):
        await client.chat.completions.create(model="gpt-test", messages=MSG)  # the new policy applies to new requests


def _limits(gw) -> tuple[object, ...]:
    rt = gw.app[LIVE].runtime
    b = rt.backends["a"]
    hs = (b.health, *b.state.models.values())
    return (
        b.slots.limit, b.slots.reserve, b.slots.queue.starvation_share, gw.app[ADMISSION].gate.limit,
        {(h.failures_to_eject, h.eject_s, h.max_eject_s) for h in hs},
    )  # fmt: skip


def _stricter(up, **extra):
    p = simple_policy(up, reload={"watch": False}, **extra)
    p["backends"]["a"]["max_concurrency"] = 7
    p["health"] = {"failures_to_eject": 9, "eject_ms": 1234, "max_eject_ms": 5678}
    p["admission"] = {"max_inflight": 5, "starvation_share": 0.4, "priority_reserve_pct": 30}
    return p


async def test_a_policy_that_fails_late_in_its_build_leaves_every_live_limit(upstream, gateway, monkeypatch):
    a = await upstream("a")
    gw = await gateway(simple_policy(a, reload={"watch": False}))
    await _backend_of(gw)  # a model health to carry, too
    before, state = _limits(gw), gw.app[LIVE].runtime.backends["a"].state
    monkeypatch.delenv("GATEWAY_TEST_KEYS_NOT_SET", raising=False)
    # valid YAML with new limits; the build fails after the backends: a tenant's keys are missing
    gw.write_policy(_stricter(a, tenants={"t": {"key_sha256_env": "GATEWAY_TEST_KEYS_NOT_SET"}}))
    ok, why = await gw.app[RELOADER].reload("test")
    assert not ok and "GATEWAY_TEST_KEYS_NOT_SET" in why
    assert gw.app[LIVE].runtime.generation == 1
    assert _limits(gw) == before and gw.app[LIVE].runtime.backends["a"].state is state
    assert await _backend_of(gw) == "a"


async def test_a_reload_puts_the_new_limits_in_force_at_the_swap(upstream, gateway):
    a = await upstream("a")
    gw = await gateway(simple_policy(a, reload={"watch": False}))
    await _backend_of(gw)
    state = gw.app[LIVE].runtime.backends["a"].state
    gw.write_policy(_stricter(a))
    ok, _ = await gw.app[RELOADER].reload("test")
    assert ok and gw.app[LIVE].runtime.generation == 2
    assert _limits(gw) == (7, 2, 0.4, 5, {(9, 1.234, 5.678)})
    assert gw.app[LIVE].runtime.backends["a"].state is state  # measurements carry over by name
    assert state.tracker.snapshot()["requests"] == 1  # with what was measured before


async def test_a_worker_holds_its_share_of_max_concurrency_across_reloads(tmp_path):
    path = tmp_path / "policy.yaml"
    policy = {"backends": {"a": {"url": "http://127.0.0.1:9/v1", "models": ["m"], "max_concurrency": 5}}, "reload": {"watch": False}}
    path.write_text(yaml.safe_dump(policy))
    app = create_app(path, worker=WorkerInfo(1, 2, tmp_path))  # not started: no sockets needed
    slots = app[LIVE].runtime.backends["a"].slots
    assert slots.limit == 2  # 5 across 2 workers: 3 + 2
    policy["backends"]["a"]["max_concurrency"] = 9
    path.write_text(yaml.safe_dump(policy))
    ok, _ = await app[RELOADER].reload("test")
    assert ok and app[LIVE].runtime.backends["a"].slots is slots and slots.limit == 4


async def test_a_worker_that_does_not_answer_a_reload_is_no_verdict_on_the_policy(tmp_path):
    """A worker restarting (or stuck) when a reload fans out: its control socket cannot answer.
    That is a 503 reload_incomplete, not the 400 invalid_policy of a policy some process refused."""
    from gateway.process import control
    from gateway.web.api import reload_failure

    results = await control.ask_all([tmp_path / "worker-1.sock"], "POST", "/reload", 0.5)
    assert results[0]["ok"] is False and results[0]["unreachable"] is True and results[0]["socket"] == "worker-1.sock"
    answered = {"ok": True, "worker": 0}
    err = reload_failure({"ok": True}, [answered, results[0]], str(results[0]["error"]))
    assert (err.status, err.code) == (503, "reload_incomplete") and "worker-1.sock did not answer" in err.message
    rejected = {"ok": False, "worker": 0, "error": "backends.b.url: bad"}
    for sup, workers in (({"ok": True}, [rejected, results[0]]), ({"ok": False, "error": "bad"}, [results[0]]),
                         ({}, [rejected])):
        err = reload_failure(sup, workers, "backends.b.url: bad")
        assert (err.status, err.code) == (400, "invalid_policy")


async def test_a_reload_that_turns_watching_off_stops_the_watcher(upstream, gateway):
    """The single process reads the policy in force's `reload` section each poll, as the
    supervisor of `--workers N` does: `watch: false` put in force by a reload is obeyed."""
    a, b = await upstream("a"), await upstream("b")
    gw = await gateway(simple_policy(a, b, reload={"interval_ms": 50}))
    gw.write_policy(simple_policy(a, b, reload={"watch": False, "interval_ms": 50}))
    await _wait_generation(gw, 2)
    gw.write_policy(simple_policy(b, a, reload={"watch": False, "interval_ms": 50}))
    await asyncio.sleep(1.0)  # 20 polls of the old pace
    assert gw.app[LIVE].runtime.generation == 2 and await _backend_of(gw) == "a"
    os.kill(os.getpid(), signal.SIGHUP)  # an explicit reload still works
    await _wait_generation(gw, 3)
    assert await _backend_of(gw) == "b"


async def test_a_reload_that_slows_the_watcher_sets_its_pace(upstream, gateway):
    a, b = await upstream("a"), await upstream("b")
    gw = await gateway(simple_policy(a, b, reload={"interval_ms": 50}))
    gw.write_policy(simple_policy(a, b, reload={"interval_ms": 600_000}))
    await _wait_generation(gw, 2)
    gw.write_policy(simple_policy(b, a, reload={"interval_ms": 600_000}))
    await asyncio.sleep(1.0)
    assert gw.app[LIVE].runtime.generation == 2 and await _backend_of(gw) == "a"
