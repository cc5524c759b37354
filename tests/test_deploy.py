"""deploy/ as CI can check it here: the compose file against the compose schema, the Kubernetes
manifests against the Kubernetes schemas (both bundled by their PyPI packages: no network), every
policy they embed through `gateway check`, and the Grafana dashboard's queries against the metric
names a running gateway exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import pytest
import yaml

from gateway.__main__ import main as gateway_main
from tests.conftest import ROOT, simple_policy

DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))


def test_the_compose_file_matches_the_compose_schema():
    jsonschema = pytest.importorskip("jsonschema")
    from importlib.resources import files

    schema = json.loads((files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())
    doc = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())
    jsonschema.validate(doc, schema)
    gateways = [s for s in doc["services"].values() if s.get("environment", {}).get("GATEWAY_POLICY")]
    assert len(gateways) >= 2, "two gateway replicas"
    assert {"redis", "local", "prometheus", "grafana"} <= set(doc["services"])


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_each_kubernetes_manifest_validates_against_the_kubernetes_schemas(manifest):
    kv = pytest.importorskip("kubernetes_validate")
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    assert docs
    for doc in docs:
        kv.validate(doc, "1.37.0", strict=True)  # raises with the path of what is wrong


def test_the_kubernetes_gateway_has_probes_a_budget_and_secret_keys():
    docs = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "gateway.yaml").read_text()) if d}
    assert {"ConfigMap", "Secret", "Deployment", "PodDisruptionBudget", "Service"} <= set(docs)
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]["memory"]
    secret_refs = {e["name"] for e in container["env"] if "valueFrom" in e}
    policy = yaml.safe_load(docs["ConfigMap"]["data"]["policy.yaml"])
    assert policy["store"]["url"].startswith("redis://")
    for tenant in policy["tenants"].values():
        assert "key_sha256" not in tenant and tenant["key_sha256_env"] in secret_refs
    assert all(v == "" for v in docs["Secret"]["stringData"].values()), "no key material in the repository"
    gpu = next(yaml.safe_load_all((DEPLOY / "kubernetes" / "local-backend-gpu.yaml").read_text()))
    assert gpu["spec"]["template"]["spec"]["nodeSelector"]


def _embedded_policies() -> list[tuple[str, str]]:
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((DEPLOY / "policies").glob("*.yaml"))]
    for manifest in MANIFESTS:
        for doc in yaml.safe_load_all(manifest.read_text()):
            if doc and doc.get("kind") == "ConfigMap":
                for key, text in doc["data"].items():
                    out.append((f"{manifest.name}:{key}", text))
    return out


@pytest.mark.parametrize("name,text", _embedded_policies(), ids=lambda v: v if "/" in v or ":" in v else "")
def test_every_embedded_policy_passes_gateway_check(name, text, tmp_path, capsys):
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    assert gateway_main(["check", str(path)]) == 0, capsys.readouterr().err
    policy = yaml.safe_load(text)
    assert policy["store"]["url"].startswith("redis://"), "replicas share cache and quotas"
    assert policy["tenants"], "keys, not an open relay"
    for tenant in policy["tenants"].values():
        assert tenant.get("key_sha256_env") and not tenant.get("key_sha256"), "keys from the environment, never a digest in the file"


def _queried_metrics(dashboard: Path) -> set[str]:
    doc = json.loads(dashboard.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    assert exprs, f"{dashboard.name} has no queries"
    names = set()
    for e in exprs:
        names |= set(re.findall(r"\b(gateway_[a-z0-9_]+)\b", e))
    return names


async def test_every_metric_the_dashboard_queries_exists_after_a_short_run(gateway, upstream):
    up = await upstream("a", tokens=3)
    gw = await gateway(simple_policy(up, tenants={"t": {"key_sha256": ["a" * 64]}}))
    client = gw.client(key="unused")  # a wrong key: one 401 in the request counters
    with pytest.raises(Exception):
        await client.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "x"}])
    gw2 = await gateway(simple_policy(up), name="open.yaml")
    c = gw2.client()
    for i, stream in enumerate((False, True, False, True)):
        content = "hi" if i < 3 else "other"  # the third is a cache hit; the streams go upstream
        r = await c.chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": content}], stream=stream, temperature=0)
        if stream:
            async for _ in r:
                pass
    async with aiohttp.ClientSession() as http:
        async with http.get(gw2.url + "/metrics") as resp:
            text = await resp.text()
        async with http.get(gw.url + "/metrics") as resp:
            text += await resp.text()
    have = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert DASHBOARDS
    for dashboard in DASHBOARDS:
        missing = sorted(n for n in _queried_metrics(dashboard) if n not in have)
        assert not missing, f"{dashboard.name} queries metrics /metrics does not have: {missing}"
