"""What a hostile viewer, or a web page in the operator's browser, can do to the admin plane and
to a keyless gateway on loopback: nothing that stalls, leaks or changes it. Real gateways on
loopback (the runner `gateway serve` uses), the fake upstream, aiohttp as the client."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from gateway.tenants.auth import hash_key
from gateway.web.keys import LIVE, POLICY_CHECK
from tests.conftest import simple_policy
from tests.rawhttp import exchange, json_error

ADMIN, VIEWER, TENANT = "sk-admin-hostile", "sk-viewer-hostile", "sk-tenant-hostile"
A = {"Authorization": f"Bearer {ADMIN}"}
V = {"Authorization": f"Bearer {VIEWER}"}
CHAT = {"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}]}
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))  # 10^9 values


async def _call(method: str, url: str, headers: dict[str, str] | None = None, **kw: Any) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession() as http, http.request(method, url, headers=headers or {}, **kw) as r:
        return r.status, await r.json(content_type=None), r.headers


@pytest.fixture
async def keyed(upstream, gateway):
    up = await upstream("fake")
    policy = simple_policy(up, tenants={"acme": {"key_sha256": [hash_key(TENANT)]}},
                           admin={"key_sha256": [hash_key(ADMIN)], "viewer_key_sha256": [hash_key(VIEWER)]})
    # With credentials, the password holding a raw '@': yarl, aiohttp and redis-py split at the last one
    policy["backends"]["fake"]["url"] = up.url.replace("http://", "http://svc-user:s3cr3t@pass-tail@")
    return await gateway(policy)


@pytest.fixture
async def open_mode(upstream, gateway):
    up = await upstream("fake")
    return up, await gateway(simple_policy(up))


# ---- a viewer ---------------------------------------------------------------------------------------


async def test_a_viewers_alias_bomb_is_refused_and_the_gateway_keeps_answering(keyed):
    check = asyncio.ensure_future(_call("POST", keyed.url + "/admin/policy/check", V, data=LAUGHS))
    status, body, _ = await _call("GET", keyed.url + "/healthz")
    assert status == 200
    status, body, _ = await check
    assert status == 200 and body["ok"] is False
    assert "more than 100,000 values with its aliases expanded" in body["errors"][0]


async def test_one_policy_check_at_a_time(keyed):
    async with keyed.app[POLICY_CHECK]:  # another check in progress
        status, body, headers = await _call("POST", keyed.url + "/admin/policy/check", V, data="version: 1\n")
    assert status == 429 and headers["Retry-After"] == "1"
    assert "another policy check is running" in body["error"]["message"]
    status, body, _ = await _call("POST", keyed.url + "/admin/policy/check", V, data="version: 1\n")
    assert status == 200


async def test_a_few_exports_at_a_time_and_a_filter_reads_past_entries_without_decoding_them(keyed):
    """Six viewer exports at once, each filtered on a model that matches nothing, read the whole
    log a 20,000-entry page at a time on the event loop: every other request waited up to 1.6 s
    (review helper's repro). Now two at a time per process (a third is a 429), and an entry
    without the filter's model or status bytes is passed over undecoded."""
    from gateway.admin.log_store import Filter
    from gateway.web.keys import EXPORTS, REQUEST_LOG

    exporting = keyed.app[EXPORTS]
    async with exporting, exporting:  # two exports in progress
        async with aiohttp.ClientSession() as http, http.get(keyed.url + "/admin/requests/export", headers=V) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "5"
            assert "exports of the request log are running" in (await r.json())["error"]["message"]
    async with aiohttp.ClientSession() as http, http.get(keyed.url + "/admin/requests/export", headers=V) as r:
        assert r.status == 200
    rows = [(1_700_000_000_000_000 + i, "acme", orjson.dumps([1, f"r{i}", 1.0, "acme", None, "chat", "gpt-test"]))
            for i in range(3)]
    rows.append((1_700_000_000_000_009, "acme", orjson.dumps({"id": "old-shape", "model": "gpt-test", "status": 429})))
    store = keyed.app[REQUEST_LOG].store
    await store.append(rows)
    decoded: list[bytes] = []
    import gateway.admin.log_store as log_store

    real = log_store.decode
    log_store.decode = lambda raw: decoded.append(raw) or real(raw)  # type: ignore[func-returns-value]
    try:
        page = await store.page(Filter(model="no-such-model"), 10, None)
        assert page.entries == [] and decoded == []
        page = await store.page(Filter(model="gpt-test", status=429), 10, None)
        assert [e["id"] for e in page.entries] == ["old-shape"] and len(decoded) == 1
    finally:
        log_store.decode = real


async def test_a_policy_check_runs_in_a_process_of_its_own_within_a_time_limit(keyed, monkeypatch):
    """A 700 KB policy held the interpreter's lock ~220 ms in a thread of the gateway (LibYAML's
    compose is one C call): every request paused, once per check a viewer sent (review helper's
    repro). The check runs in a child process now: this process's check_text never runs; a
    check past its time is stopped (503), its child killed."""
    import gateway.admin.api as admin_api
    import gateway.admin.policy_view as policy_view

    def not_here(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the check ran in the gateway's own process")

    monkeypatch.setattr(policy_view, "check_text", not_here)
    status, body, _ = await _call("POST", keyed.url + "/admin/policy/check", V, data="version: 1\n")
    assert status == 200 and body["ok"] is False and "backends" in body["errors"][0]
    monkeypatch.setattr(admin_api, "_CHECK_TIMEOUT_S", 0.001)
    status, body, headers = await _call("POST", keyed.url + "/admin/policy/check", V, data="version: 1\n")
    assert status == 503 and "was stopped" in body["error"]["message"] and headers["Retry-After"] == "5"
    status, _, _ = await _call("POST", keyed.url + "/admin/policy/check", V, data="version: 1\n")
    assert status == 503  # the lock was given back


async def test_only_an_admin_learns_which_environment_variables_the_host_has(keyed, monkeypatch):
    monkeypatch.delenv("GW_TEST_NOT_SET_HERE", raising=False)
    policy = "version: 1\nbackends: {b: {url: 'http://127.0.0.1:1/v1', models: [m], api_key_env: GW_TEST_NOT_SET_HERE}}\n"
    _, as_admin, _ = await _call("POST", keyed.url + "/admin/policy/check", A, data=policy)
    _, as_viewer, _ = await _call("POST", keyed.url + "/admin/policy/check", V, data=policy)
    assert any("GW_TEST_NOT_SET_HERE is not set here" in w for w in as_admin["warnings"])
    assert as_viewer["ok"] is True and not any("GW_TEST_NOT_SET_HERE" in w for w in as_viewer["warnings"])


async def test_backends_view_shows_no_credentials(keyed):
    # A password with an '@' showed its part after the first one ("http://<redacted>@pass-tail@...").
    for path in ("/admin/backends", "/admin/policy"):
        status, body, _ = await _call("GET", keyed.url + path, V)
        assert status == 200
        assert "s3cr3t" not in str(body) and "pass-tail" not in str(body), path
    status, body, _ = await _call("GET", keyed.url + "/admin/backends", V)
    assert body["backends"]["fake"]["url"].startswith("http://<redacted>@127.0.0.1:")


async def test_no_cache_keeps_what_the_admin_plane_answers(keyed):
    for path in ("/admin/backends", "/admin/policy", "/admin/requests", "/admin/keys", "/admin/tenants", "/admin/overview"):
        status, _, headers = await _call("GET", keyed.url + path, V)
        assert status == 200 and headers.get("Cache-Control") == "no-store", (path, status, headers.get("Cache-Control"))
    async with aiohttp.ClientSession() as http, http.get(keyed.url + "/admin/requests/export", headers=V) as r:
        assert r.status == 200 and r.headers.get("Cache-Control") == "no-store"


@pytest.mark.parametrize(("query", "paths"), [
    ("before=%C2%B2", ["/admin/requests"]), ("limit=%C2%B9", ["/admin/requests"]), ("limit=%D9%A3", ["/admin/requests"]),
    ("status=%C2%B2%C2%B2%C2%B2", ["/admin/requests", "/admin/requests/export"]),
    ("limit=" + "1" * 5000, ["/admin/requests"]), ("before=" + "1" * 5000, ["/admin/requests"]),
])  # fmt: skip
async def test_digits_other_than_ascii_are_a_400_not_a_500(keyed, query, paths):
    # '²' passes str.isdigit(), not int(); nor do 5,000 digits (past Python's 4,300 for int())
    for path in paths:
        status, body, _ = await _call("GET", f"{keyed.url}{path}?{query}", V)
        assert status == 400, (path, body)
        assert body["error"]["type"] == "invalid_request_error"


# ---- a web page in the browser, against loopback's trust ------------------------------------------------


@pytest.mark.parametrize("headers", [
    {"Host": "attacker.example"},  # DNS rebinding: the page reads the answers as its own
    {"Origin": "https://evil.example", "Content-Type": "text/plain"},  # a cross-site "simple" request
    {"Origin": "null"},  # a sandboxed frame
])  # fmt: skip
async def test_open_mode_refuses_a_browsers_request_for_another_site(open_mode, headers):
    up, gw = open_mode
    generation = gw.app[LIVE].runtime.generation
    for method, path in (("POST", "/v1/chat/completions"), ("POST", "/admin/reload"), ("GET", "/admin/whoami"),
                         ("GET", "/admin/requests"), ("GET", "/metrics")):
        status, body, _ = await _call(method, gw.url + path, headers, data=b'{"model": "gpt-test", "messages": []}')
        assert status == 403, (path, body)
        assert body["error"]["code"] == "cross_site_request"
        assert "loopback open mode" in body["error"]["message"]
    status, body, _ = await _call("POST", gw.url + "/v1/messages", headers, json={"model": "gpt-test"})
    assert status == 403 and body["type"] == "error"  # the Messages API's own shape
    assert body["error"]["type"] == "permission_error"
    assert up.stats.requests == 0  # nothing reached the backend
    assert gw.app[LIVE].runtime.generation == generation  # nothing reloaded


async def test_open_mode_still_serves_this_machine(open_mode):
    up, gw = open_mode
    port = gw.url.rsplit(":", 1)[1]
    for headers in ({}, {"Host": f"localhost:{port}"}, {"Origin": gw.url}, {"Origin": "http://localhost:3000"}):
        status, body, _ = await _call("POST", gw.url + "/v1/chat/completions", headers, json=CHAT)
        assert status == 200, (headers, body)
        assert (await _call("GET", gw.url + "/admin/whoami", headers))[1] == {"role": "admin"}


async def test_a_key_is_not_affected_but_loopbacks_open_metrics_are(keyed):
    tenant = {"Authorization": f"Bearer {TENANT}", "Origin": "https://app.example", "Host": "gateway.example"}
    status, _, _ = await _call("POST", keyed.url + "/v1/chat/completions", tenant, json=CHAT)
    assert status == 200  # a browser app with a tenant's key: no loopback trust involved
    assert (await _call("GET", keyed.url + "/admin/whoami", {**V, "Host": "gateway.example"}))[1] == {"role": "viewer"}
    async with aiohttp.ClientSession() as http:
        async with http.get(keyed.url + "/metrics") as r:
            assert r.status == 200  # open on loopback to this machine's programs
        async with http.get(keyed.url + "/metrics", headers={"Host": "attacker.example"}) as r:
            assert r.status == 401
            assert "refused: its Host header" in (await r.json())["error"]["message"]
        async with http.get(keyed.url + "/metrics", headers={**A, "Host": "attacker.example"}) as r:
            assert r.status == 200  # an admin key reads it from anywhere


async def test_a_viewer_sending_its_policy_slowly_does_not_hold_the_others_checks(keyed):
    # The body was read under the one-check-at-a-time lock: for up to the body timeout (60 s)
    # every other check, an admin's included, was a 429.
    reader, writer = await asyncio.open_connection("127.0.0.1", keyed.port)
    try:
        writer.write(f"POST /admin/policy/check HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {VIEWER}\r\n"
                     "Content-Length: 1000\r\n\r\nversion: 1\n".encode())  # and the rest never comes
        await writer.drain()
        await asyncio.sleep(0.3)
        status, body, _ = await _call("POST", keyed.url + "/admin/policy/check", A, data="version: 1\n")
        assert status == 200, body
    finally:
        writer.close()


async def test_a_password_in_the_store_urls_query_is_not_shown(keyed):
    # redis-py reads `?password=` (and `username=`) as credentials: the viewer's view of the
    # policy showed them as they were.
    from gateway.admin.policy_view import redacted
    from gateway.config.policy import parse_policy

    text = ("version: 1\nbackends: {b: {url: 'http://127.0.0.1:9/v1', models: [m]}}\n"
            "store: {url: 'redis://127.0.0.1:1/15?password=S3CRET-pass&username=gw&db=2'}\n")
    shown = redacted(parse_policy(text, "<test>"))["store"]["url"]
    assert shown == "redis://127.0.0.1:1/15?password=<redacted>&username=<redacted>&db=2"
    text = text.replace("redis://127.0.0.1:1/15", "redis://:hunter2@tail@127.0.0.1:1/15")  # redis-py: password "hunter2@tail"
    shown = redacted(parse_policy(text, "<test>"))["store"]["url"]
    assert shown.startswith("redis://<redacted>@127.0.0.1:1/15?") and "tail" not in shown
    # Other URLs a policy holds may carry a token or a key in their query, as a Redis URL may an ssl_password.
    text = ("version: 1\nbackends: {b: {url: 'http://127.0.0.1:9/v1', models: [m],"
            " metrics_url: 'http://127.0.0.1:9/metrics?token=T0K&api_key=K3Y&format=prom'}}\n"
            "store: {url: 'rediss://127.0.0.1:1/0?ssl_password=P4SS'}\n")
    view = redacted(parse_policy(text, "<test>"))
    assert view["backends"]["b"]["metrics_url"] == "http://127.0.0.1:9/metrics?token=<redacted>&api_key=<redacted>&format=prom"
    assert view["store"]["url"] == "rediss://127.0.0.1:1/0?ssl_password=<redacted>"


def test_a_name_with_a_trailing_line_break_is_refused():
    from gateway.config.policy import PolicyError, parse_policy

    # `$` matched before a final newline: a tenant "acme\n" broke the Redis request log's lines.
    with pytest.raises(PolicyError, match="bad name"):
        parse_policy('backends: {b: {url: "http://127.0.0.1:9/v1", models: [m]}}\ntenants: {"acme\\n": {}}\n', "<test>")


@pytest.mark.parametrize("method,path", [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/route/explain"), ("GET", "/v1/models"),
    ("GET", "/admin/whoami"), ("GET", "/admin/keys"),
])  # fmt: skip
@pytest.mark.parametrize("header", [b"Authorization: Bearer sk-\xff\xfe", b"x-api-key: \xc3\x28", b"api-key: sk-gw-\xff"])
async def test_a_key_that_is_not_utf8_is_a_401_not_a_500(keyed, method, path, header):
    # HTTP allows such bytes; aiohttp reads them as surrogates, which the key's hash could not
    # encode: a 500 and a logged traceback before authentication, on every endpoint.
    body = orjson.dumps(CHAT) if method == "POST" else b""
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode() + header + b"\r\n\r\n" + body
    ans = await asyncio.to_thread(exchange, keyed.port, head, timeout=10)
    assert ans.status == 401, (ans.status, ans.body[:300])
    err = json_error(ans.body)
    assert err is not None and err["code"] == "invalid_api_key", ans.body
