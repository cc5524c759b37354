"""Policies that validated, then failed at run time: each is now refused where it is loaded
(`serve`, `check`, a reload), naming the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from gateway.config.policy import MAX_DURATION_S, PolicyError, parse_policy
from gateway.config.runtime import build_runtime
from gateway.tenants.auth import hash_key
from gateway.web.keys import LIVE
from tests.procs import redis_server

ROOT = Path(__file__).resolve().parents[1]
BACKEND = "backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m]}}\n"
MSG = [{"role": "user", "content": "hi"}]


def _problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as exc:
        parse_policy(text)
    return [str(p) for p in exc.value.problems]


def _check(path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", "check", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})


async def _chat(gw, key: str = "sk-test") -> int:
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/v1/chat/completions", json={"model": "gpt-test", "messages": MSG},
                             headers={"Authorization": f"Bearer {key}"}) as r:
            return r.status


async def _reload(gw) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/admin/reload", headers={"Authorization": "Bearer sk-admin"}) as r:
            return r.status, await r.text()


# An API key from a file (`kubectl create secret --from-file`) ends in a newline: aiohttp refused
# it on every request (500s, no failover), while `check` and /readyz said all was well.


async def test_an_api_key_with_a_line_break_is_refused_at_start_and_on_reload(upstream, gateway, monkeypatch):
    up = await upstream("a", tokens=2)
    policy = {"backends": {"a": {"url": up.url, "models": ["gpt-test"], "api_key_env": "CHECKS_UPSTREAM_KEY"}},
              "admin": {"key_sha256": [hash_key("sk-admin")]}, "tenants": {"t": {"key_sha256": [hash_key("sk-test")]}},
              "reload": {"watch": False}}
    monkeypatch.setenv("CHECKS_UPSTREAM_KEY", "sk-upstream\n")
    with pytest.raises(ValueError, match=r"backends\.a\.api_key_env: the value of CHECKS_UPSTREAM_KEY holds a line break"):
        await gateway(policy)
    monkeypatch.setenv("CHECKS_UPSTREAM_KEY", "sk-upstream")
    gw = await gateway(policy, name="good.yaml")
    assert await _chat(gw) == 200
    monkeypatch.setenv("CHECKS_UPSTREAM_KEY", "sk-rotated\r\n")  # a reload reads the variable again
    status, body = await _reload(gw)
    assert status == 400 and "backends.a.api_key_env" in body and "line break" in body
    assert gw.app[LIVE].runtime.generation == 1 and await _chat(gw) == 200 and up.stats.requests == 2


def test_check_warns_about_an_api_key_with_a_line_break(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m], api_key_env: CHECKS_KEY, "
                    "headers_env: {api-key: CHECKS_HEADER}}}\n")
    r = _check(path, CHECKS_KEY="sk-1\n", CHECKS_HEADER="h\n")
    assert f"{path}: warning: backends.a.api_key_env: the value of CHECKS_KEY holds a line break" in r.stderr, r.stderr
    assert "backends.a.headers_env.api-key: the value of CHECKS_HEADER holds a line break" in r.stderr
    assert "`gateway serve` refuses it" in r.stderr


# `ttl_s: .inf` validated, then with Redis every cacheable request was a 500 once the upstream had
# answered (round(inf * 1000)); past 2**63 ms Redis refused the expiry and nothing was stored.


@pytest.mark.parametrize("section, path", [
    ("cache: {ttl_s: %s}", "cache.ttl_s"),
    ("models: {m: {backends: [a], cache: {ttl_s: %s}}}", "models.m.cache.ttl_s"),
    (f"tenants: {{t: {{key_sha256: ['{'a' * 64}'], cache: {{ttl_s: %s}}}}}}", "tenants.t.cache.ttl_s"),
    ("responses: {affinity_ttl_s: %s}", "responses.affinity_ttl_s"),
    ("routing: {prefix_affinity: {prefix_ttl_s: %s}}", "routing.prefix_affinity.prefix_ttl_s"),
    ("admin: {key_sha256: ['" + "b" * 64 + "'], keys: {keep_revoked_s: %s}}", "admin.keys.keep_revoked_s"),
])
@pytest.mark.parametrize("value, says", [(".inf", "finite number"), (".nan", "finite number"), ("1.0e+16", "at most 315,360,000 s")])
def test_a_ttl_is_finite_and_at_most_ten_years(section, path, value, says):
    problems = _problems(BACKEND + section % value + "\n")
    assert any(p.startswith(f"{path}: ") and says in p for p in problems), problems
    parse_policy(BACKEND + section % MAX_DURATION_S + "\n")  # 10 years: accepted


@pytest.mark.parametrize("section, path", [
    ("cache: {lock_ms: %s}", "cache.lock_ms"),
    ("server: {request_timeout_ms: %s}", "server.request_timeout_ms"),
    ("admission: {deadline_ms: {flex: %s}}", "admission.deadline_ms.flex"),
    ("backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m], timeouts: {total_ms: %s}}}", "backends.a.timeouts.total_ms"),
])
def test_a_duration_in_milliseconds_is_at_most_ten_years(section, path):
    text = section % 10**20 + "\n"
    problems = _problems(text if text.startswith("backends") else BACKEND + text)
    assert any(p.startswith(f"{path}: ") and "315360000000" in p.replace(",", "") for p in problems), problems


@pytest.mark.parametrize("field", ["weight: .inf", "cost: .nan", "price: {input_per_mtok: .inf}"])
def test_no_infinity_or_nan_anywhere(field):
    problems = _problems("backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m], %s}}\n" % field)
    assert any(p.startswith("backends.a.") and "finite number" in p for p in problems), problems


@pytest.mark.parametrize("value", ['!!int "x"', "9" * 5000, "2001-13-45"])
def test_a_value_yaml_cannot_build_is_a_policy_problem_not_a_crash(value):
    """PyYAML's constructor raises ValueError for these, not a YAMLError: `gateway check` printed
    a traceback and /admin/policy/check answered 503 "try again" (review helper's repro)."""
    problems = _problems(BACKEND + f"server: {{max_body_bytes: {value}}}\n")
    assert any("not valid YAML: a value cannot be read" in p for p in problems), problems


async def test_the_longest_ttl_is_stored_in_redis(upstream, gateway):
    """The bound is one Redis takes: an answer cached for 10 years is a hit the second time."""
    up = await upstream("a", tokens=2)
    async with redis_server() as url:
        gw = await gateway({"backends": {"a": {"url": up.url, "models": ["gpt-test"]}}, "store": {"url": url},
                            "cache": {"ttl_s": MAX_DURATION_S}})
        for _ in range(2):
            async with aiohttp.ClientSession() as http:
                async with http.post(gw.url + "/v1/chat/completions",
                                     json={"model": "gpt-test", "temperature": 0, "messages": MSG}) as r:
                    assert r.status == 200
        assert up.stats.requests == 1


# A backend URL with a query (an Azure-style `?api-version=`) or fragment validated, then every
# endpoint's path was appended after it.


@pytest.mark.parametrize("url", ["https://example.com/openai?api-version=2024-02-01", "https://example.com/v1#x",
                                 "https://example.com/v1?"])
def test_a_backend_url_with_a_query_or_fragment_is_refused(url):
    problems = _problems(f"backends: {{a: {{url: '{url}', models: [m]}}}}\n")
    assert any(p.startswith("backends.a.url: must not hold a query (?) or fragment (#)") and "`headers`" in p
               for p in problems), problems


def test_a_metrics_url_may_hold_a_query_but_no_fragment():
    """metrics_url is fetched as written: a query reaches the exporter; a fragment never would."""
    ok = parse_policy("backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m], metrics_url: 'http://h:9/metrics?x=1'}}\n")
    assert ok.backends["a"].metrics_url == "http://h:9/metrics?x=1"
    problems = _problems("backends: {a: {url: 'http://127.0.0.1:9/v1', models: [m], metrics_url: 'http://h:9/metrics#x'}}\n")
    assert any(p.startswith("backends.a.metrics_url: must not hold a fragment") for p in problems), problems


async def test_a_gateway_with_a_query_in_a_backend_url_does_not_start(upstream, gateway):
    up = await upstream("a", tokens=2)
    with pytest.raises(PolicyError, match=r"backends\.a\.url: must not hold a query"):
        await gateway({"backends": {"a": {"url": up.url + "?api-version=2024-02-01", "models": ["gpt-test"]}}})


@pytest.mark.parametrize("field, value, path", [
    ("url", "http://127.0.0.1:99999/v1", "backends.a.url"),
    ("url", "http://127.0.0.1:0/v1", "backends.a.url"),
    ("url", "http://127.0.0.1:x/v1", "backends.a.url"),
    ("metrics_url", "http://127.0.0.1:70000/metrics", "backends.a.metrics_url"),
])
def test_a_backend_port_out_of_range_is_refused(field, value, path):
    base = {"url": "http://127.0.0.1:9/v1", "models": ["m"]}
    problems = _problems(yaml.safe_dump({"backends": {"a": {**base, field: value}}}))
    assert any(p.startswith(f"{path}: the port must be a number from 1 to 65535") for p in problems), problems


@pytest.mark.parametrize("url", ["redis://127.0.0.1:70000/0", "rediss://h:0/0", "redis://h:port/0",
                                 "redis+cluster://h:6379,h:70000", "redis+sentinel://h:99999/mymaster"])
def test_a_store_port_out_of_range_is_refused(url):
    problems = _problems(BACKEND + f"store: {{url: '{url}'}}\n")
    assert any(p.startswith("store.url: ") and "65535" in p for p in problems), problems


# A key digest given to two tenants through `key_sha256_env`: only the inline lists were
# compared, and team-a's key authenticated as team-b.


def test_a_digest_in_two_tenants_through_a_variable_is_refused(monkeypatch):
    digest = hash_key("sk-team-a")
    monkeypatch.setenv("CHECKS_TEAM_B", digest)
    policy = parse_policy(BACKEND + f"tenants:\n  team-a: {{key_sha256: ['{digest}']}}\n"
                                    "  team-b: {key_sha256_env: CHECKS_TEAM_B}\n")
    with pytest.raises(ValueError, match=r"tenants\.team-b\.key_sha256_env: CHECKS_TEAM_B holds a key digest "
                                         r"that also belongs to tenant 'team-a'"):
        build_runtime(policy, {}, 0)
    # The variable first, the list after: the variable's tenant is still the one named.
    policy = parse_policy(BACKEND + "tenants:\n  team-b: {key_sha256_env: CHECKS_TEAM_B}\n"
                                    f"  team-a: {{key_sha256: ['{digest}']}}\n")
    with pytest.raises(ValueError, match=r"tenants\.team-b\.key_sha256_env: .* tenant 'team-a'"):
        build_runtime(policy, {}, 0)
    monkeypatch.setenv("CHECKS_TEAM_A", digest)
    policy = parse_policy(BACKEND + "tenants:\n  team-a: {key_sha256_env: CHECKS_TEAM_A}\n"
                                    "  team-b: {key_sha256_env: CHECKS_TEAM_B}\n")
    with pytest.raises(ValueError, match=r"tenants\.team-b\.key_sha256_env: .* tenant 'team-a'"):
        build_runtime(policy, {}, 0)


async def test_a_reload_giving_a_tenants_key_to_another_is_refused(upstream, gateway, monkeypatch):
    up = await upstream("a", tokens=2)
    monkeypatch.setenv("CHECKS_TEAM_B", hash_key("sk-team-b"))
    gw = await gateway({
        "backends": {"a": {"url": up.url, "models": ["gpt-test"]}}, "reload": {"watch": False},
        "admin": {"key_sha256": [hash_key("sk-admin")]},
        "tenants": {"team-a": {"key_sha256": [hash_key("sk-team-a")]}, "team-b": {"key_sha256_env": "CHECKS_TEAM_B"}},
    })
    monkeypatch.setenv("CHECKS_TEAM_B", hash_key("sk-team-a"))  # team-a's digest pasted into team-b's Secret
    status, body = await _reload(gw)
    assert status == 400 and "tenants.team-b.key_sha256_env" in body and "team-a" in body
    rt = gw.app[LIVE].runtime
    assert rt.generation == 1 and rt.tenants.authenticate("sk-team-a").name == "team-a"
    assert await _chat(gw, "sk-team-b") == 200


# Duplicate YAML keys: PyYAML keeps the last, so a second `team-a:` or `tenants:` dropped the first.


def test_a_duplicate_key_is_refused_with_its_path_and_lines():
    problems = _problems(BACKEND + "tenants:\n"
                         f"  team-a: {{key_sha256: ['{'a' * 64}'], quota: {{rpm: 10}}}}\n"
                         f"  team-b: {{key_sha256: ['{'c' * 64}']}}\n"
                         f"  team-a: {{key_sha256: ['{'b' * 64}']}}\n")
    assert problems == ["tenants.team-a: defined again (first at line 3): YAML keeps only the last one; "
                        "remove or merge one (line 5)"]


def test_a_duplicate_section_and_field_are_refused():
    problems = _problems(BACKEND + "server: {open_access: true}\nreload: {watch: false}\nserver: {max_attempts: 2}\n"
                         "models:\n  m: {backends: [a], strategy: ordered, strategy: latency}\n")
    assert [p.split(":")[0] for p in problems] == ["server", "models.m.strategy"], problems
    assert problems[0].endswith("(first at line 2): YAML keeps only the last one; remove or merge one (line 4)")


def test_a_merge_key_is_not_a_duplicate():
    p = parse_policy("backends:\n"
                     "  a: &b {url: 'http://127.0.0.1:9/v1', models: [m]}\n"
                     "  c: {<<: *b, url: 'http://127.0.0.1:10/v1'}\n")
    assert p.backends["c"].url == "http://127.0.0.1:10/v1" and p.backends["c"].models == ("m",)


def test_check_refuses_a_duplicate_key(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(BACKEND + "tenants:\n  t: {key_sha256: ['" + "a" * 64 + "']}\ntenants:\n  u: {key_sha256: ['" + "b" * 64 + "']}\n")
    r = _check(path)
    assert r.returncode == 1
    assert f"{path}: tenants: defined again (first at line 2)" in r.stderr and "(line 4)" in r.stderr


async def test_a_reload_with_a_duplicate_key_keeps_the_policy(upstream, gateway):
    up = await upstream("a", tokens=2)
    base = f"backends: {{a: {{url: '{up.url}', models: [gpt-test]}}}}\nadmin: {{key_sha256: ['{hash_key('sk-admin')}']}}\n"
    tenants = f"tenants:\n  t: {{key_sha256: ['{hash_key('sk-test')}']}}\n"
    gw = await gateway(base + tenants + "reload: {watch: false}\n")
    gw.write_policy(base + tenants + "reload: {watch: false}\n" + f"tenants:\n  u: {{key_sha256: ['{hash_key('sk-u')}']}}\n")
    status, body = await _reload(gw)
    assert status == 400 and "tenants: defined again" in body
    assert gw.app[LIVE].runtime.generation == 1 and await _chat(gw) == 200
