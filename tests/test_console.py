"""The web console's files as served (headers, no key needed, revalidation) and the contract its
Content-Security-Policy relies on, read from the files themselves: no inline script or style, no
handler attributes, no other origin, no markup built from strings. The browser drives it in
tests/test_console_browser.py."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from html.parser import HTMLParser
from pathlib import Path

import aiohttp
import pytest

from gateway.console.routes import HEADERS
from gateway.tenants.auth import hash_key
from tests.conftest import ROOT, simple_policy

CONSOLE = ROOT / "gateway" / "console"
PATHS = {
    "/console": "text/html",
    "/console/app.js": "text/javascript",
    "/console/app.css": "text/css",
    "/favicon.ico": "image/x-icon",
}


@pytest.fixture
async def console_gateway(upstream, gateway):
    up = await upstream("fake")
    policy = simple_policy(up, tenants={"acme": {"key_sha256": [hash_key("sk-acme")]}},
                           admin={"key_sha256": [hash_key("sk-admin")]})
    return await gateway(policy)


@pytest.mark.parametrize("path", PATHS)
async def test_each_file_is_served_without_a_key_with_the_security_headers(console_gateway, path):
    async with aiohttp.ClientSession() as http, http.get(console_gateway.url + path) as r:
        body = await r.read()
        assert r.status == 200
        assert r.content_type == PATHS[path]
        for name, value in HEADERS.items():
            assert r.headers[name] == value, name
    assert body == (CONSOLE / ("index.html" if path == "/console" else path.rsplit("/", 1)[1])).read_bytes()


async def test_an_unchanged_file_is_revalidated_with_its_etag(console_gateway):
    async with aiohttp.ClientSession() as http:
        async with http.get(console_gateway.url + "/console/app.js") as r:
            etag = r.headers["ETag"]
        async with http.get(console_gateway.url + "/console/app.js", headers={"If-None-Match": etag}) as r:
            assert r.status == 304
            assert r.headers["Content-Security-Policy"] == "default-src 'self'"
            assert await r.read() == b""


async def test_console_with_a_slash_leads_to_the_console(console_gateway):
    async with aiohttp.ClientSession() as http, http.get(console_gateway.url + "/console/", allow_redirects=False) as r:
        assert r.status == 302
        assert r.headers["Location"] == "/console"
        assert r.headers["X-Frame-Options"] == "DENY"


async def test_other_console_paths_are_the_gateways_404(console_gateway):
    async with aiohttp.ClientSession() as http, http.get(console_gateway.url + "/console/nope.js") as r:
        assert r.status == 404
        assert (await r.json())["error"]["message"] == "unknown path GET /console/nope.js"


class _Markup(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.script_text: list[str] = []
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in = tag

    def handle_endtag(self, tag: str) -> None:
        self._in = None

    def handle_data(self, data: str) -> None:
        if self._in == "script" and data.strip():
            self.script_text.append(data)


def test_the_page_has_no_inline_script_style_or_handler_and_loads_only_its_own_files():
    html = (CONSOLE / "index.html").read_text()
    page = _Markup()
    page.feed(html)
    assert page.script_text == []
    assert {tag for tag, _ in page.tags} >= {"script", "link", "form", "input"}
    assert "style" not in {tag for tag, _ in page.tags}
    for tag, attrs in page.tags:
        assert "style" not in attrs, tag
        assert not [a for a in attrs if a.startswith("on")], (tag, attrs)
        for a in ("src", "href", "action"):
            if attrs.get(a):
                assert attrs[a] in ("/console/app.js", "/console/app.css", "/favicon.ico"), (tag, a, attrs[a])
    assert ("input", {"type": "password", "name": "key", "autocomplete": "current-password", "required": None}) in page.tags
    assert [attrs["data-view"] for tag, attrs in page.tags if "data-view" in attrs] == [
        "Overview", "Backends", "Tenants", "Keys", "Requests", "Policy"]


def test_the_script_builds_no_markup_from_strings_and_keeps_the_key_out_of_storage():
    js = (CONSOLE / "app.js").read_text()
    code = re.sub(r"^\s*//.*$", "", js, flags=re.M)  # the comments may name what the code avoids
    for banned in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                   "localStorage", "sessionStorage", "document.cookie", "setAttribute(\"on", "setAttribute(\"style",
                   "window.confirm", "confirm(", "alert(", "prompt("):
        assert banned not in code, banned
    assert not re.search(r"set(Timeout|Interval)\(\s*[\"'`]", code)  # a string timer is an eval
    assert "Authorization: `Bearer ${" in code


def test_no_file_names_another_origin():
    for name in ("index.html", "app.js", "app.css"):
        text = (CONSOLE / name).read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, flags=re.I), name
        assert "@import" not in text and "url(" not in text, name


def test_the_icon_is_an_ico_file():
    data = (CONSOLE / "favicon.ico").read_bytes()
    assert data[:4] == b"\0\0\1\0" and int.from_bytes(data[4:6], "little") >= 1


def test_a_wheel_carries_every_console_file():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gateway"]
    files = [p.relative_to(ROOT / "gateway").as_posix() for p in CONSOLE.iterdir() if p.suffix != ".py" and p.is_file()]
    assert {"console/index.html", "console/app.js", "console/app.css", "console/favicon.ico"} <= set(files)
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) for pat in patterns), f


def test_every_file_the_routes_serve_exists():
    from gateway.console.routes import _FILES

    assert {Path(name).name for name, _ in _FILES.values()} == {"index.html", "app.js", "app.css", "favicon.ico"}
