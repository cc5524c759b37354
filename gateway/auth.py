"""API key -> tenant. Keys are stored as sha256 digests; the file never holds a key."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from .errors import Forbidden, Unauthorized
from .policy import CacheOverride, Policy

__all__ = ["Tenant", "Tenants", "hash_key"]


def hash_key(key: str) -> str:
    """The digest to put in a policy's `key_sha256` list."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    priority: str
    models: frozenset[str] | None  # None: every public model
    cache_namespace: str = "default"  # whose cached answers this tenant may receive
    cache: CacheOverride | None = None

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


OPEN_TENANT = Tenant("default", "default", None)


class Tenants:
    """Authenticates callers. A policy without tenants runs open (local development)."""

    def __init__(self, policy: Policy) -> None:
        self._by_digest: dict[str, Tenant] = {}
        for name, tp in policy.tenants.items():
            tenant = Tenant(
                name,
                tp.priority,
                frozenset(tp.models) if tp.models is not None else None,
                cache_namespace=tp.cache_namespace or f"tenant:{name}",
                cache=tp.cache,
            )
            for digest in tp.key_sha256:
                self._by_digest[digest] = tenant
        self._admin = set(policy.admin.key_sha256) if policy.admin else set()
        self.open = not self._by_digest

    def authenticate(self, api_key: str | None) -> Tenant:
        """The tenant for a bearer key; Unauthorized for a missing or unknown key."""
        if self.open:
            return OPEN_TENANT
        if not api_key:
            raise Unauthorized("missing API key: send `Authorization: Bearer <key>`")
        # The dict lookup is on a digest of the key, so timing reveals nothing about valid keys.
        tenant = self._by_digest.get(hash_key(api_key))
        if tenant is None:
            raise Unauthorized("invalid API key")
        return tenant

    def authorize(self, tenant: Tenant, model: str) -> None:
        if not tenant.may_use(model):
            raise Forbidden(f"tenant {tenant.name!r} may not use model {model!r}", param="model")

    def is_admin(self, api_key: str | None) -> bool:
        """Admin endpoints: an admin key when the policy lists some; open only when the whole policy is."""
        if not self._admin:
            return self.open
        return bool(api_key) and any(hmac.compare_digest(hash_key(api_key), d) for d in self._admin)
