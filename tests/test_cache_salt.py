"""`backends.<name>.cache_salt`: requests carry their tenant's cache namespace as vLLM's
`cache_salt` (a model server's prefix cache then shared only within a tenant), by default only to
a launched model. The shipped deployments run the local model server on its own (no `launch:`),
shared by every tenant: a tenant could time another's cached prompt (review helper's repro)."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.policy import parse_policy
from gateway.tenants.auth import hash_key
from tests.conftest import simple_policy


@pytest.mark.parametrize(("salt", "sent"), [(True, True), (False, False), (None, False)])
async def test_a_backend_salted_by_the_policy_gets_each_tenants_namespace(upstream, gateway, salt, sent):
    up = await upstream("up", tokens=2)
    policy: dict[str, Any] = simple_policy(up, tenants={"a": {"key_sha256": [hash_key("sk-a")]},
                                                        "b": {"key_sha256": [hash_key("sk-b")]}})
    policy["cache"] = {"enabled": False}
    if salt is not None:
        policy["backends"]["up"]["cache_salt"] = salt
    gw = await gateway(policy)
    seen = []
    for key in ("sk-a", "sk-b"):
        # A client's own salt is overwritten where the gateway salts (it could name another tenant's).
        await gw.client(key).chat.completions.create(model="gpt-test", messages=[{"role": "user", "content": "hi"}],
                                                     extra_body={"cache_salt": "tenant:a"})
        seen.append(up.stats.last_body.get("cache_salt"))
    assert seen == (["tenant:a", "tenant:b"] if sent else ["tenant:a", "tenant:a"]), seen


def test_the_shipped_deployments_salt_their_shared_local_model():
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    compose = parse_policy((root / "deploy/policies/compose.yaml").read_text(), "compose")
    assert compose.backends["local"].cache_salt is True
    for doc in yaml.safe_load_all((root / "deploy/kubernetes/gateway.yaml").read_text()):
        if isinstance(doc, dict) and doc.get("kind") == "ConfigMap" and "policy.yaml" in doc.get("data", {}):
            assert parse_policy(doc["data"]["policy.yaml"], "k8s").backends["local"].cache_salt is True
            break
    else:
        raise AssertionError("no policy ConfigMap in deploy/kubernetes/gateway.yaml")
