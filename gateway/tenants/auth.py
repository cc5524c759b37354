"""API key -> tenant. Keys are stored as sha256 digests; the file never holds a key."""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Protocol

from ..config.policy import CacheOverride, Policy
from ..errors import Forbidden, Unauthorized, shown

__all__ = [
    "Role",
    "Tenant",
    "Tenants",
    "hash_key",
    "is_loopback",
    "is_placeholder",
    "key_warnings",
    "open_mode_problem",
    "NEW_KEY_COMMAND",
]

VIRTUAL_KEY_PREFIX = "sk-gw-"  # the secrets of keys made through /admin/keys (admin/keys.py)

# The one command that makes a real key: it prints the key (give it to the tenant) and its digest.
NEW_KEY_COMMAND = "gateway hash-key --new"


def hash_key(key: str) -> str:
    """The digest to put in a policy's `key_sha256` list. Of the bytes as sent: aiohttp reads a
    header's bytes that are not UTF-8 as surrogates, which plain UTF-8 cannot encode (a key of
    such bytes was a 500 before authentication on every endpoint; now, the 401 of any wrong key)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


# Keys an attacker tries first; `gateway check` warns when a digest is one of theirs.
_GUESSABLE = (
    "", "0", "1", "2", "3", "123", "1234", "12345", "123456", "password", "secret", "admin", "changeme",
    "test", "key", "apikey", "api-key", "sk-test", "sk-1", "sk-admin", "letmein", "qwerty",
)  # fmt: skip


def is_placeholder(digest: str) -> bool:
    """A digest no key can match, as the shipped examples carry (32 leading zero hex digits: the
    chance that a real key's sha256 starts so is 2**-128)."""
    return digest.startswith("0" * 32)


def key_warnings(policy: Policy) -> list[str]:
    """What `gateway check` warns about in the policy's keys: placeholders that no caller can
    match yet, and digests of guessable keys."""
    weak = {hash_key(k): k for k in _GUESSABLE}
    lists = [(f"tenants.{n}.key_sha256", t.key_sha256) for n, t in policy.tenants.items()]
    if policy.admin is not None:
        lists.append(("admin.key_sha256", policy.admin.key_sha256))
        lists.append(("admin.viewer_key_sha256", policy.admin.viewer_key_sha256))
    lists.append(("metrics.key_sha256", policy.metrics.key_sha256))
    out: list[str] = []
    for path, digests in lists:
        for i, digest in enumerate(digests):
            if is_placeholder(digest):
                out.append(f"{path}[{i}]: a placeholder no key matches; make a real key with `{NEW_KEY_COMMAND}`")
            elif digest in weak:
                out.append(f"{path}[{i}]: the digest of the guessable key {weak[digest]!r}; make a real one with `{NEW_KEY_COMMAND}`")
    for name, t in policy.tenants.items():
        if not t.key_sha256 and not t.key_sha256_env and policy.admin is None:
            out.append(f"tenants.{name}: no keys, and without an `admin` section no virtual key can be issued for it: "
                       "no caller can reach it")
    if policy.open and not policy.server.open_access:
        out.append("tenants: none, so anyone may call; `gateway serve` allows that on a loopback address only")
    return out


def is_loopback(host: str | None) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost).

    None means "not bound by `gateway serve`" (an app built in a test or embedded): loopback.
    Any other name counts as reachable from the network, since it may resolve to anything."""
    if host is None or host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_mode_problem(policy: Policy, host: str | None) -> str | None:
    """Why this policy must not be served on `host`, or None when it may.

    A policy without tenants lets anyone in (spending the backends' API keys, reading /admin):
    fine on loopback, refused on any other address unless `server.open_access: true` says so."""
    if not policy.open or policy.server.open_access or is_loopback(host):
        return None
    return (
        f"refusing to serve a policy without tenants on {host}: anyone who can reach it could use "
        "the backends (and their API keys). Either give callers keys: run "
        f"`{NEW_KEY_COMMAND}` (or `gateway hash-key` with the key on stdin) and add the digest "
        "under `tenants: {NAME: {key_sha256: [DIGEST]}}`; or, to serve it open on purpose, set "
        "`server: {open_access: true}` in the policy; or bind to 127.0.0.1."
    )


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    priority: str  # the highest band its requests may ask for (a ceiling: priority.py)
    models: frozenset[str] | None  # None: every public model
    cache_namespace: str = "default"  # whose cached answers this tenant may receive
    cache: CacheOverride | None = None
    default_priority: str | None = None  # the band of a request that asks for none; None: `priority`
    key_id: str | None = None  # the virtual key (admin/keys.py) the caller used; None: a key from the policy
    log_payloads: bool = False  # the request log keeps its prompts and answers
    # A virtual key's: whether it still works (not revoked, rotated away or expired since the
    # request came): asked before each upstream attempt and on each read of a stream.
    live: Callable[[], bool] | None = field(default=None, compare=False, repr=False)

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


# Open mode has no one to tell apart: a caller may ask for any band, and gets `default` otherwise.
OPEN_TENANT = Tenant("default", "priority", None, default_priority="default")


def env_digests(digests: tuple[str, ...], env: str | None, path: str) -> tuple[str, ...]:
    """`digests` plus those in the environment variable `env` (comma- or space-separated).

    ValueError when the variable is unset, empty or holds something else than digests: a tenant
    whose keys did not arrive must fail the start (or the reload), never run without keys."""
    if env is None:
        return digests
    raw = os.environ.get(env, "")
    extra = tuple(d for d in raw.replace(",", " ").split() if d)
    if not extra:
        raise ValueError(f"{path}.key_sha256_env: environment variable {env} is not set or empty")
    for d in extra:
        if not re.fullmatch(r"[0-9a-f]{64}", d):
            raise ValueError(f"{path}.key_sha256_env: {env} must hold lowercase hex sha256 digests (`gateway hash-key`), comma-separated")
    return digests + extra


def _shared_key(policy: Policy, first: str, second: str, digest: str) -> str:
    """Why a key digest given to two tenants is refused, naming where it came from: the variable
    (`key_sha256_env`) of the tenant that got it there, the later one's when both did. The policy's
    check compares the inline lists only; a variable's digests are known at start or reload."""
    holder = second if digest not in policy.tenants[second].key_sha256 else first
    other = first if holder == second else second
    env = policy.tenants[holder].key_sha256_env
    from_env = env is not None and digest not in policy.tenants[holder].key_sha256
    where = f"tenants.{holder}.key_sha256_env: {env}" if from_env else f"tenants.{holder}.key_sha256"
    return (f"{where} holds a key digest that also belongs to tenant {other!r}: one of them would answer "
            "as the other; give each tenant its own keys")


class IssuedKey(Protocol):
    """A virtual key as authentication reads it (admin/keys.py's VirtualKey)."""

    @property
    def id(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def models(self) -> frozenset[str] | None: ...


class IssuedKeys(Protocol):
    """The virtual keys (admin/keys.py's KeyBook): a lookup by digest, and a catch-up with the store."""

    def lookup(self, digest: str) -> IssuedKey | None: ...
    async def catch_up(self) -> None: ...


def _still_live(keys: IssuedKeys, digest: str) -> bool:
    return keys.lookup(digest) is not None


class Role(Enum):
    """What a key may do on the admin plane."""

    ADMIN = "admin"  # read and write (admin.key_sha256)
    VIEWER = "viewer"  # read only: GET endpoints and the console's views (admin.viewer_key_sha256)
    NONE = "none"


class Tenants:
    """Authenticates callers: keys from the policy, then virtual keys (admin/keys.py). A policy
    without tenants runs open: on a loopback address (local development), or elsewhere only with
    `server.open_access` (see `open_mode_problem`)."""

    def __init__(self, policy: Policy, keys: IssuedKeys | None = None) -> None:
        self._by_digest: dict[str, Tenant] = {}
        self._by_name: dict[str, Tenant] = {}
        self.keys = keys
        for name, tp in policy.tenants.items():
            tenant = Tenant(
                name,
                tp.priority,
                frozenset(tp.models) if tp.models is not None else None,
                cache_namespace=tp.cache_namespace or f"tenant:{name}",
                cache=tp.cache,
                default_priority=tp.default_priority,
                log_payloads=tp.log_payloads,
            )
            self._by_name[name] = tenant
            for digest in env_digests(tp.key_sha256, tp.key_sha256_env, f"tenants.{name}"):
                other = self._by_digest.setdefault(digest, tenant)
                if other is not tenant:
                    raise ValueError(_shared_key(policy, other.name, name, digest))
        a = policy.admin
        self._admin = set(env_digests(a.key_sha256, a.key_sha256_env, "admin")) if a else set()
        self._viewer = set(env_digests(a.viewer_key_sha256, a.viewer_key_sha256_env, "admin.viewer")) if a and (
            a.viewer_key_sha256 or a.viewer_key_sha256_env) else set()
        self._metrics = set(env_digests(policy.metrics.key_sha256, policy.metrics.key_sha256_env, "metrics"))
        self._metrics_open = policy.metrics.open
        self.open = policy.open  # no tenants (a tenant reached by virtual keys only still closes the doors)
        self.tenant_label = policy.metrics.tenant_label
        self._weights = {name: tp.weight for name, tp in policy.tenants.items()}

    def authenticate(self, api_key: str | None) -> Tenant:
        """The tenant for a bearer key; Unauthorized for a missing or unknown key."""
        if self.open:
            return OPEN_TENANT
        if not api_key:
            raise Unauthorized("missing API key: send `Authorization: Bearer <key>`")
        # The dict lookup is on a digest of the key, so timing reveals nothing about valid keys.
        digest = hash_key(api_key)
        tenant = self._by_digest.get(digest)
        if tenant is None:
            tenant = self._virtual(digest)
            if tenant is None:
                raise Unauthorized("invalid API key")
        return tenant

    async def catch_up(self, api_key: str | None) -> None:
        """Before `authenticate`: a virtual key this process does not know yet (made on another
        replica since the last poll) is looked for in the store. Costs nothing for a known key."""
        if self.keys is None or not api_key or not api_key.startswith(VIRTUAL_KEY_PREFIX):
            return
        digest = hash_key(api_key)
        if digest not in self._by_digest and self.keys.lookup(digest) is None:
            await self.keys.catch_up()

    def _virtual(self, digest: str) -> Tenant | None:
        """The tenant a live virtual key acts as (its models narrowed by the key's), or None."""
        keys = self.keys
        key = None if keys is None else keys.lookup(digest)
        tenant = None if key is None else self._by_name.get(key.tenant)
        if keys is None or key is None or tenant is None:  # unknown, revoked, expired; or its tenant left the policy
            return None
        models = key.models if tenant.models is None or key.models is None else key.models & tenant.models
        return replace(tenant, key_id=key.id, models=tenant.models if key.models is None else models,
                       live=functools.partial(_still_live, keys, digest))

    def tenant(self, name: str) -> Tenant | None:
        """The policy's tenant of that name (None: the policy has none)."""
        return self._by_name.get(name)

    def authorize(self, tenant: Tenant, model: str) -> None:
        if not tenant.may_use(model):
            raise Forbidden(f"tenant {tenant.name!r} may not use model {shown(model)}", param="model")

    def is_admin(self, api_key: str | None, *, loopback: bool = True) -> bool:
        """Admin endpoints need an admin key. A policy that lists none leaves them open only in
        loopback open mode: no tenants, served on a loopback address (local development)."""
        return self.role(api_key, loopback=loopback) is Role.ADMIN

    def role(self, api_key: str | None, *, loopback: bool = True) -> Role:
        """What `api_key` may do on the admin plane: an admin key reads and writes, a viewer key
        reads. Without admin keys, loopback open mode gives everyone ADMIN (local development)."""
        if self._admin:
            if _matches(api_key, self._admin):
                return Role.ADMIN
            return Role.VIEWER if _matches(api_key, self._viewer) else Role.NONE
        return Role.ADMIN if self.open and loopback else Role.NONE

    def may_scrape(self, api_key: str | None, *, loopback: bool = True) -> bool:
        """/metrics (per-tenant names, tokens and spend): with scrape keys (`metrics.key_sha256`,
        `metrics.key_sha256_env`), one of those or an admin key; without, open when the gateway
        listens on a loopback address only or `metrics.open` says so, else an admin key."""
        if self._metrics:
            return _matches(api_key, self._metrics) or _matches(api_key, self._admin)
        if loopback or self._metrics_open:
            return True
        return _matches(api_key, self._admin)

    def scrape_refusal(self) -> str:
        """What a refused /metrics request is told: which key it needs, or how to open it."""
        if self._metrics:
            return "/metrics needs a key from `metrics.key_sha256` (or `metrics.key_sha256_env`) or an admin key"
        return (
            "/metrics needs an admin key: this gateway listens beyond loopback and its policy has no scrape "
            "key; set `metrics.key_sha256` (a key for Prometheus) or, to serve it to anyone, `metrics.open: true`"
        )

    def weight(self, tenant: str) -> float:
        """The tenant's share of dispatches among tenants waiting in the same band."""
        return self._weights.get(tenant, 1.0)

    def metric_label(self, tenant: str) -> str:
        """The tenant's label value in metrics: its name, or `tenant` when `metrics.tenant_label`
        is false (names of customers are not for every dashboard)."""
        return tenant if self.tenant_label else "tenant"


def _matches(api_key: str | None, digests: set[str]) -> bool:
    """Whether the key's digest is one of `digests`, compared in constant time."""
    if not api_key or not digests:
        return False
    digest = hash_key(api_key)
    return any(hmac.compare_digest(digest, d) for d in digests)
