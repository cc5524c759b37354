"""web/origin.py: which requests are this machine's programs' and which a browser sent for a
page of another site (loopback open mode refuses those: tests/test_admin_hostile.py)."""

from __future__ import annotations

import pytest

from gateway.web.origin import foreign, host_name


@pytest.mark.parametrize(("host", "name"), [
    ("127.0.0.1:8080", "127.0.0.1"), ("localhost", "localhost"), ("[::1]:8080", "::1"), ("[::1]", "::1"),
    ("evil.example:80", "evil.example"), ("::1", "::1"), ("a:b:c", "a:b:c"), ("x:²", "x:²"),
])  # fmt: skip
def test_host_name_drops_the_port(host, name):
    assert host_name(host) == name


@pytest.mark.parametrize("headers", [
    {},  # curl, an SDK, HTTP/1.0: no Origin, maybe no Host
    {"Host": "127.0.0.1:8080"}, {"Host": "localhost:8080"}, {"Host": "LOCALHOST"}, {"Host": "localhost.:8080"},
    {"Host": "[::1]:8080"}, {"Host": "127.0.0.2"},
    {"Host": "127.0.0.1:8080", "Origin": "http://127.0.0.1:8080"},  # the console, same origin
    {"Host": "127.0.0.1:8080", "Origin": "http://localhost:3000"},  # a page served on this machine
])  # fmt: skip
def test_this_machines_requests(headers):
    assert foreign(headers) is None


@pytest.mark.parametrize(("headers", "why"), [
    ({"Host": "attacker.example:8080"}, "Host header"),  # DNS rebinding
    ({"Host": "localhost.attacker.example"}, "Host header"),
    ({"Host": "127.0.0.1.nip.io"}, "Host header"),
    ({"Host": "0.0.0.0:8080"}, "Host header"),
    ({"Host": ""}, "Host header"),
    ({"Host": "127.0.0.1", "Origin": "https://evil.example"}, "another site"),  # a cross-site form or fetch
    ({"Host": "127.0.0.1", "Origin": "null"}, "another site"),  # a sandboxed frame, a data: URL
    ({"Host": "127.0.0.1", "Origin": "http://[::1"}, "another site"),  # unparsable
    ({"Host": "127.0.0.1", "Origin": "http://127.0.0.1.evil.example"}, "another site"),
])  # fmt: skip
def test_a_browsers_request_for_another_site(headers, why):
    assert why in (foreign(headers) or "")
