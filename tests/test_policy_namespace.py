"""A tenant's `cache_namespace` may be shared with tenants that name the same one (documented:
docs/cache.md), never another tenant's own default (`tenant:<name>`), which that tenant did not
opt into: refused by the policy check, by `gateway check` and by a reload."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from gateway.config.policy import PolicyError, parse_policy
from gateway.tenants.auth import Tenants, hash_key
from gateway.web.keys import LIVE
from tests.conftest import simple_policy
from tests.procs import ROOT

POLICY = """
version: 1
backends:
  a: {url: "http://127.0.0.1:9/v1", models: [m]}
tenants:
  ta: {key_sha256: ["%s"]%s}
  tb: {key_sha256: ["%s"]%s}
""" % ("a" * 64, "{ta}", "b" * 64, "{tb}")


def _policy(ta: str = "", tb: str = "") -> str:
    return POLICY.replace("{ta}", f", cache_namespace: {ta!r}" if ta else "").replace("{tb}", f", cache_namespace: {tb!r}" if tb else "")


def _problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as exc:
        parse_policy(text)
    return [str(p) for p in exc.value.problems]


def test_naming_another_tenants_default_namespace_is_refused_naming_both():
    (problem,) = _problems(_policy(tb="tenant:ta"))
    assert problem.startswith("tenants.tb.cache_namespace:") and "'ta'" in problem and "'tb'" in problem, problem


@pytest.mark.parametrize(("ta", "tb"), [
    ("shared", "shared"),  # both opt in: the documented sharing
    ("tenant:ta", "tenant:ta"),  # ta names its own default: it opted in too
])  # fmt: skip
def test_a_namespace_every_sharer_named_is_shared(ta: str, tb: str):
    t = Tenants(parse_policy(_policy(ta=ta, tb=tb)))
    a, b = t.tenant("ta"), t.tenant("tb")
    assert a is not None and b is not None and a.cache_namespace == b.cache_namespace == ta


def test_a_tenant_naming_its_own_default_or_a_free_name_is_fine():
    parse_policy(_policy(ta="tenant:ta", tb="tenant:ghost"))


def test_gateway_check_reports_it(tmp_path: Path):
    path = tmp_path / "policy.yaml"
    path.write_text(_policy(tb="tenant:ta"))
    run = subprocess.run([sys.executable, "-m", "gateway", "check", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "tenants.tb.cache_namespace" in run.stdout + run.stderr, run


async def test_a_reload_into_it_is_rejected_and_the_old_policy_stays(upstream, gateway):
    up = await upstream("a")
    p = simple_policy(up, reload={"watch": False}, tenants={"ta": {"key_sha256": ["a" * 64]}, "tb": {"key_sha256": ["b" * 64]}},
                      admin={"key_sha256": [hash_key("sk-admin")]})
    gw = await gateway(p)
    p["tenants"]["tb"]["cache_namespace"] = "tenant:ta"
    gw.write_policy(p)
    async with aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/admin/reload", headers={"Authorization": "Bearer sk-admin"}) as r:
            err = (await r.json())["error"]
    assert r.status == 400 and err["code"] == "invalid_policy" and "tenants.tb.cache_namespace" in err["message"], err
    assert gw.app[LIVE].runtime.generation == 1
