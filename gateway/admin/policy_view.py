"""The policy on the admin plane: the one in force with its secrets redacted, and a pasted one
checked with the same path-named errors and warnings as `gateway check`."""

from __future__ import annotations

import os
from typing import Any

from ..config.policy import Policy, PolicyError, parse_policy, secret_problem
from ..store.target import hide_password
from ..tenants.auth import key_warnings

__all__ = ["redacted", "check_text", "env_warnings"]

_DIGEST_FIELDS = ("key_sha256", "viewer_key_sha256")


def redacted(policy: Policy) -> dict[str, Any]:
    """The policy as JSON, with key digests counted instead of shown, passwords in URLs
    (`redis://:secret@host`) replaced, and the values of backends' `headers` hidden (a
    provider's `api-key`, a proxy's `Helicone-Auth`: credentials a viewer must not read).
    Environment variable names stay: they are not secrets."""
    out = _walk(policy.model_dump(mode="json"))
    assert isinstance(out, dict)
    for backend in (out.get("backends") or {}).values():
        if isinstance(backend, dict) and backend.get("headers"):
            backend["headers"] = dict.fromkeys(backend["headers"], "<hidden>")
    return out


def _walk(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: (_digests(x) if k in _DIGEST_FIELDS else _walk(x)) for k, x in v.items()}
    if isinstance(v, list):
        return [_walk(x) for x in v]
    if isinstance(v, str):
        return hide_password(v)
    return v


def _digests(v: Any) -> Any:
    return f"<{len(v)} digest(s)>" if isinstance(v, list) else v


def env_warnings(policy: Policy) -> list[str]:
    """The environment variables the policy names that are not set here, and backends' secrets
    set here that `gateway serve` refuses (a key with a line break: secret_problem)."""
    secrets = [(f"backends.{name}.api_key_env", b.api_key_env) for name, b in policy.backends.items() if b.api_key_env]
    secrets += [(f"backends.{name}.headers_env.{header}", env) for name, b in policy.backends.items()
                for header, env in b.headers_env.items()]
    out: list[str] = []
    for path, env in secrets:
        value = os.environ.get(env)
        if not value:
            out.append(f"{path}: environment variable {env} is not set here")
        elif (problem := secret_problem(env, value)) is not None:
            out.append(f"{path}: {problem} (`gateway serve` refuses it)")
    holders = [(f"tenants.{n}", t.key_sha256_env) for n, t in policy.tenants.items()]
    if policy.admin is not None:
        holders += [("admin", policy.admin.key_sha256_env), ("admin.viewer", policy.admin.viewer_key_sha256_env)]
    holders.append(("metrics", policy.metrics.key_sha256_env))
    out += [f"{path}.key_sha256_env: environment variable {env} is not set here (the gateway refuses to start without it)"
            for path, env in holders if env and not os.environ.get(env)]
    return out


# A pasted policy's values, aliases expanded: hand-written policies hold a few thousand; a file
# on the host may hold more (`gateway check` allows config.policy.MAX_POLICY_NODES).
MAX_PASTED_NODES = 100_000


def check_text(text: str, *, environment: bool = True) -> dict[str, Any]:
    """{"ok", "errors", "warnings"} for a policy's text. The files it names (a classifier's
    weights) are not opened: that check is `gateway check`'s, on the host. `environment`: warn
    about the environment variables it names that are not set here (an admin's check: the
    answer tells which names the host's environment holds)."""
    try:
        policy = parse_policy(text, "<pasted>", max_nodes=MAX_PASTED_NODES)
    except PolicyError as exc:
        return {"ok": False, "errors": [str(p) for p in exc.problems], "warnings": []}
    return {"ok": True, "errors": [], "warnings": [*(env_warnings(policy) if environment else []), *key_warnings(policy)]}
