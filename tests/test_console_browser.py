"""The web console in a real headless Chromium (Playwright, Debian's /usr/bin/chromium) against a
real gateway and its /admin API: login, every view, keys made and revoked, a viewer's read-only
page, hostile names shown as text, log out. One gateway and one browser for the module; each test
gets a fresh browser context (no shared storage), and any console error, failed request, 4xx/5xx
answer or dialog fails it unless the test expects that one."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import aiohttp
import pytest
import pytest_asyncio
import yaml
from aiohttp import web

from gateway.tenants.auth import hash_key
from gateway.web.app import create_app
from gateway.web.edge import EdgeRunner
from tests.fake_upstream import Behaviour, FakeUpstream

pytestmark = [pytest.mark.browser, pytest.mark.asyncio(loop_scope="module")]

CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
ADMIN_KEY = "sk-admin-console-test"
VIEWER_KEY = "sk-viewer-console-test"
TENANT_KEY = "sk-acme-console-test"
XSS_MODEL = "<img src=x onerror=alert(1)>"
XSS_KEY_NAME = "<script>alert(2)</script>"
VIEWS = ("Overview", "Backends", "Tenants", "Keys", "Requests", "Policy")


def browser_missing(why: str) -> NoReturn:
    """No Chromium or no Playwright: a skip on a developer's machine, a failure under CI (`CI`
    set), where a green run must not hide the console's tests (as tests/procs.redis_missing)."""
    if os.environ.get("CI"):
        pytest.fail(f"{why}: the browser tests need it, and CI is set", pytrace=False)
    pytest.skip(why)


@dataclass
class Site:
    url: str
    upstream: FakeUpstream

    async def chat(self, model: str, key: str = TENANT_KEY) -> int:
        async with aiohttp.ClientSession() as http, http.post(
            f"{self.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
        ) as r:
            await r.read()
            return r.status

    async def admin(self, method: str, path: str, **kw: Any) -> Any:
        async with aiohttp.ClientSession() as http, http.request(
            method, self.url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, **kw
        ) as r:
            assert r.status < 300, (method, path, r.status, await r.text())
            return None if r.status == 204 else await r.json()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def site(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Site]:
    up = await FakeUpstream(Behaviour(tokens=3), name="fake").start()
    policy = {
        "version": 1,
        "backends": {"fake": {"url": up.url, "models": ["gpt-test"]}},
        "models": {"gpt-test": {"backends": ["fake"], "strategy": "ordered"}},
        "tenants": {"acme": {"key_sha256": [hash_key(TENANT_KEY)]}},
        "admin": {"key_sha256": [hash_key(ADMIN_KEY)], "viewer_key_sha256": [hash_key(VIEWER_KEY)]},
    }
    path = tmp_path_factory.mktemp("console") / "policy.yaml"
    path.write_text(yaml.safe_dump(policy))
    runner = EdgeRunner(create_app(path), handler_cancellation=True, access_log=None)
    await runner.setup()
    tcp = web.TCPSite(runner, "127.0.0.1", 0)
    await tcp.start()
    port = tcp._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield Site(f"http://127.0.0.1:{port}", up)
    finally:
        await runner.cleanup()
        await up.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Any]:
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        browser_missing("playwright is not installed (pip install -e '.[test]')")
    if not os.access(CHROMIUM, os.X_OK):
        browser_missing(f"no Chromium at {CHROMIUM} (`make browser` installs Debian's)")
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=str(CHROMIUM))
        try:
            yield b
        finally:
            await b.close()


@dataclass
class Watch:
    """What a page did that a clean run must not: console errors, uncaught exceptions, failed
    requests, error answers, dialogs; and every request it sent."""

    problems: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)

    def attach(self, page: Any) -> None:
        def console(m: Any) -> None:
            if m.type == "error":
                self.problems.append(f"console error: {m.text}")

        async def dialog(d: Any) -> None:
            self.dialogs.append(d.message)
            await d.dismiss()

        page.on("console", console)
        page.on("pageerror", lambda e: self.problems.append(f"uncaught: {e}"))
        page.on("requestfailed", lambda r: self.problems.append(f"failed: {r.method} {r.url} {r.failure}"))
        page.on("response", lambda r: r.status >= 400 and self.problems.append(f"{r.status}: {r.request.method} {r.url}"))
        page.on("dialog", dialog)
        page.on("request", lambda r: self.requests.append(r))

    def admin_calls(self) -> list[Any]:
        return [r for r in self.requests if "/admin/" in r.url]


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser: Any, site: Site) -> AsyncIterator[tuple[Any, Watch]]:
    context = await browser.new_context(base_url=site.url, accept_downloads=True)
    pg = await context.new_page()
    watch = Watch()
    watch.attach(pg)
    try:
        yield pg, watch
    finally:
        await context.close()


async def login(pg: Any, key: str) -> None:
    await pg.goto("/console")
    field_ = pg.locator("input[name=key]")
    await field_.fill(key)
    await field_.press("Enter")


def expect(locator: Any) -> Any:
    from playwright.async_api import expect as pw_expect

    return pw_expect(locator)


def row(pg: Any, text: str) -> Any:
    return pg.locator("tbody tr").filter(has_text=text)


async def test_login_with_the_admin_key_lands_on_the_backends_and_their_health(page, site):
    pg, watch = page
    await pg.goto("/console")
    await expect(pg.locator("input[type=password][name=key]")).to_be_visible()
    assert watch.admin_calls() == []  # nothing is asked before a key is given
    await pg.locator("input[name=key]").fill(ADMIN_KEY)
    await pg.locator("input[name=key]").press("Enter")
    fake = row(pg, "fake")
    await expect(fake).to_be_visible()
    await expect(fake.locator(".health")).to_have_text("healthy")
    await expect(pg.get_by_text("Signed in as admin")).to_be_visible()
    for name in (*VIEWS, "Log out"):
        await expect(pg.get_by_role("button", name=name, exact=True)).to_be_visible()
    calls = watch.admin_calls()
    assert {r.url.split("?")[0].removeprefix(site.url) for r in calls} >= {"/admin/whoami", "/admin/overview", "/admin/backends"}
    for r in calls:
        assert (await r.all_headers())["authorization"] == f"Bearer {ADMIN_KEY}"
    assert not [r.url for r in watch.requests if ADMIN_KEY in r.url]
    assert await pg.locator("input[name=key]").input_value() == ""  # not left in the page
    assert watch.problems == [] and watch.dialogs == []


async def test_every_view_opens_without_an_error(page, site):
    pg, watch = page
    await site.chat("gpt-test")  # a logged request for the Requests view
    await login(pg, ADMIN_KEY)
    await expect(row(pg, "fake")).to_be_visible()
    shows = {
        "Overview": row(pg, "fake"),
        "Backends": row(pg, site.upstream.url),
        "Tenants": row(pg, "acme"),
        "Keys": pg.locator("#view table").or_(pg.get_by_text("No keys.")),
        "Requests": row(pg, "gpt-test").first,
        "Policy": pg.locator("pre.policy", has_text='"backends"'),
    }
    for name, loaded in shows.items():
        await pg.get_by_role("button", name=name, exact=True).click()
        await expect(pg.get_by_role("heading", level=2)).to_have_text(name)
        await expect(loaded).to_be_visible()
    assert watch.problems == [] and watch.dialogs == []


async def test_overview_refreshes_every_5_s_while_shown_and_not_after(page, site):
    pg, watch = page
    await pg.clock.install()
    await login(pg, ADMIN_KEY)
    await expect(row(pg, "fake")).to_be_visible()

    def overviews() -> int:
        return sum(1 for r in watch.requests if r.url.endswith("/admin/overview"))

    assert overviews() == 1
    await pg.clock.run_for(5_500)
    await _until(lambda: overviews() == 2)
    await pg.get_by_role("button", name="Tenants", exact=True).click()
    await expect(row(pg, "acme")).to_be_visible()
    await pg.clock.run_for(20_000)
    await asyncio.sleep(0.3)
    assert overviews() == 2
    assert watch.problems == []


async def _until(cond: Any, timeout_s: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < end, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_an_admin_makes_a_key_sees_its_secret_once_rotates_and_revokes_it(page, site):
    pg, watch = page
    await login(pg, ADMIN_KEY)
    await pg.get_by_role("button", name="Keys", exact=True).click()
    form = pg.locator("form.create")
    await expect(form.locator("select[name=tenant]")).to_have_value("acme")
    await form.locator("input[name=name]").fill("console-made")
    await form.locator("input[name=name]").press("Enter")
    secret_box = pg.locator(".secret")
    await expect(secret_box).to_contain_text("will not be shown again")
    secret = await secret_box.locator("code").inner_text()
    assert len(secret) >= 20
    assert await site.chat("gpt-test", key=secret) == 200  # the key it shows works
    await secret_box.get_by_role("button", name="Copy").click()
    await expect(secret_box.get_by_role("button", name=re.compile(r"^(Copied|Copy failed)"))).to_be_visible()
    made = row(pg, "console-made")
    await expect(made.locator(".status")).to_have_text("active")

    await pg.get_by_role("button", name="Overview", exact=True).click()
    await expect(row(pg, "fake")).to_be_visible()
    await pg.get_by_role("button", name="Keys", exact=True).click()
    await expect(made).to_be_visible()
    assert secret not in await pg.content()  # shown once: gone once the view was left

    await made.get_by_role("button", name="Rotate").click()
    await made.get_by_role("button", name="Confirm").click()  # a rotation is confirmed like a revoke
    await expect(secret_box).to_contain_text("Rotated key console-made")
    rotated = await secret_box.locator("code").inner_text()
    assert rotated != secret and len(rotated) >= 20
    key_id = re.search(r"\bid (\S+),", await secret_box.inner_text())[1]  # type: ignore[index]
    live = pg.locator(f"tbody tr[data-key='{key_id}']")
    await expect(live.locator(".status")).to_have_text("active")
    await live.get_by_role("button", name="Rotate").click()
    await live.get_by_role("button", name="In 1 hour").click()  # the secret it replaces works an hour more: shown
    await expect(live.locator(".status")).to_contain_text("active (previous secret until ")
    assert await site.chat("gpt-test", key=rotated) == 200
    await live.get_by_role("button", name="Revoke").click()
    await expect(live.get_by_text("Revoke it?")).to_be_visible()  # a second click, inline: no dialog
    await live.get_by_role("button", name="Confirm", exact=True).click()
    await expect(live.locator(".status")).to_have_text("revoked")
    await expect(live.get_by_role("button")).to_have_count(0)
    await _eventually_refused(site, rotated)
    assert watch.problems == [] and watch.dialogs == []


async def _eventually_refused(site: Site, key: str) -> None:
    for _ in range(40):
        if await site.chat("gpt-test", key=key) == 401:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the revoked key still works")


async def test_a_viewer_sees_the_keys_but_no_control_to_change_them(page, site):
    pg, watch = page
    await site.admin("POST", "/admin/keys", json={"tenant": "acme", "name": "seen-by-viewer"})
    await login(pg, VIEWER_KEY)
    await expect(pg.get_by_text("Signed in as viewer")).to_be_visible()
    await pg.get_by_role("button", name="Keys", exact=True).click()
    await expect(row(pg, "seen-by-viewer")).to_be_visible()
    await expect(pg.locator("form.create")).to_have_count(0)
    for name in ("Rotate", "Revoke", "Confirm", "Create key"):
        await expect(pg.get_by_role("button", name=name)).to_have_count(0)
    assert watch.problems == [] and watch.dialogs == []


async def test_hostile_names_are_shown_as_text(page, site):
    pg, watch = page
    assert await site.chat(XSS_MODEL) == 404
    await site.admin("POST", "/admin/keys", json={"tenant": "acme", "name": XSS_KEY_NAME})
    await login(pg, ADMIN_KEY)
    await pg.get_by_role("button", name="Requests", exact=True).click()
    hostile = pg.get_by_role("cell", name=XSS_MODEL, exact=True)
    await expect(hostile.first).to_be_visible()
    await hostile.first.click()
    await expect(pg.locator(".details")).to_contain_text(XSS_MODEL)
    await pg.get_by_role("button", name="Keys", exact=True).click()
    await expect(pg.get_by_role("cell", name=XSS_KEY_NAME, exact=True)).to_be_visible()
    assert await pg.locator("img").count() == 0
    assert await pg.locator("main script").count() == 0
    assert watch.dialogs == [] and watch.problems == []


async def test_the_requests_view_filters_pages_and_exports(page, site):
    pg, watch = page
    statuses = await asyncio.gather(*(site.chat("gpt-test") for _ in range(55)))
    assert set(statuses) == {200}
    await login(pg, ADMIN_KEY)
    await pg.get_by_role("button", name="Requests", exact=True).click()
    await pg.locator("form.filters input[name=model]").fill("gpt-test")
    await pg.locator("form.filters input[name=status]").fill("200")
    await pg.locator("form.filters input[name=status]").press("Enter")
    rows = pg.locator("tbody tr")
    await expect(rows).to_have_count(50)
    first_page = await rows.first.locator("td.id").inner_text()
    await expect(pg.get_by_role("button", name="Newer")).to_be_disabled()
    await pg.get_by_role("button", name="Next page").click()
    await expect(rows.first.locator("td.id")).not_to_have_text(first_page)
    await pg.get_by_role("button", name="Newer").click()
    await expect(rows.first.locator("td.id")).to_have_text(first_page)

    await rows.first.click()
    details = pg.locator(".details")
    await expect(details.get_by_role("heading", name="Route explanation")).to_be_visible()
    await expect(details).to_contain_text(first_page)

    async with pg.expect_download() as info:
        await pg.get_by_role("button", name="Export").click()
    download = await info.value
    entries = [json.loads(ln) for ln in Path(await download.path()).read_text().splitlines()]
    assert len(entries) >= 55 and {(e["model"], e["status"]) for e in entries} == {("gpt-test", 200)}
    assert watch.problems == [] and watch.dialogs == []


async def test_the_policy_view_checks_a_pasted_policy(page, site):
    pg, watch = page
    await login(pg, ADMIN_KEY)
    await pg.get_by_role("button", name="Policy", exact=True).click()
    await expect(pg.locator("pre.policy")).to_contain_text('"gpt-test"')
    await pg.locator("textarea[name=policy]").fill("version: 1\nbackends: {b: {url: 'not a url'}}\n")
    await pg.get_by_role("button", name="Check", exact=True).click()
    await expect(pg.get_by_text("The policy is rejected.")).to_be_visible()
    await expect(pg.locator(".check li").first).to_be_visible()
    assert watch.problems == [] and watch.dialogs == []


async def test_a_wrong_key_is_refused_with_a_message(page, site):
    pg, watch = page
    await login(pg, "sk-not-a-key")
    await expect(pg.locator("#login-error")).to_contain_text("Key not accepted")
    await expect(pg.locator("#nav")).to_be_hidden()
    # the one 401 (and Chromium's console line for it) is the refused whoami
    assert all("/admin/whoami" in p or "401" in p for p in watch.problems), watch.problems
    assert [r.url.removeprefix(site.url) for r in watch.admin_calls()] == ["/admin/whoami"]


async def test_log_out_forgets_the_key(page, site):
    pg, watch = page
    await pg.clock.install()
    await login(pg, ADMIN_KEY)
    await expect(row(pg, "fake")).to_be_visible()
    await pg.get_by_role("button", name="Log out", exact=True).click()
    await expect(pg.locator("input[name=key]")).to_be_visible()
    await expect(pg.locator("#nav")).to_be_hidden()
    await expect(pg.locator("#view")).to_be_empty()
    assert await pg.locator("input[name=key]").input_value() == ""
    assert await pg.evaluate("localStorage.length + sessionStorage.length + document.cookie.length") == 0
    assert await pg.context.cookies() == []
    sent = len(watch.admin_calls())
    await pg.clock.run_for(30_000)  # no refresh goes on after it
    await asyncio.sleep(0.3)
    assert len(watch.admin_calls()) == sent
    await pg.reload()  # and a reload does not log back in
    await expect(pg.locator("input[name=key]")).to_be_visible()
    await expect(pg.locator("#nav")).to_be_hidden()
    assert len(watch.admin_calls()) == sent
    assert watch.problems == [] and watch.dialogs == []


async def test_the_keys_view_pages_through_many_keys(page, site):
    """The keys view showed every key from one answer; it shows pages of 100, as the request log."""
    pg, watch = page
    made = await asyncio.gather(*(site.admin("POST", "/admin/keys", json={"tenant": "acme", "name": f"many-{i}"}) for i in range(105)))
    assert len(made) == 105
    total = len((await site.admin("GET", "/admin/keys?limit=1000"))["data"])  # with the other tests' keys
    assert 105 <= total < 200
    await login(pg, ADMIN_KEY)
    await pg.get_by_role("button", name="Keys", exact=True).click()
    rows = pg.locator("#view tbody tr")
    await expect(rows).to_have_count(100)
    await expect(pg.get_by_role("button", name="Newer")).to_be_disabled()
    await pg.get_by_role("button", name="Next page").click()
    await expect(rows).to_have_count(total - 100)
    await expect(pg.get_by_role("button", name="Next page")).to_be_disabled()
    await pg.get_by_role("button", name="Newer").click()
    await expect(rows).to_have_count(100)
    assert watch.problems == [] and watch.dialogs == []
