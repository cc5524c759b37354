"""The policy file: one frozen pydantic model per section, loaded with cross-checks.

Every error names its YAML path (and line, when known), e.g.
`models.auto.complex[1]: unknown backend 'b9' (line 14)`, so `gateway check` can print all of them.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ..store.target import parse_target

__all__ = [
    "read_policy",
    "Policy",
    "PolicyError",
    "BackendPolicy",
    "ModelRoute",
    "TenantPolicy",
    "RetryPolicy",
    "MetricsPolicy",
    "load_policy",
    "parse_policy",
]

Priority = Literal["priority", "default", "flex"]
Endpoint = Literal["chat", "completions", "embeddings", "responses", "messages"]
_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]*\Z"  # \Z: `$` also matched before a trailing newline


# The longest duration any setting may name: 10 years. Durations reach Redis as milliseconds
# (SET PX), which refuses an expiry past 2**63 ms from now; and `.inf` (YAML's infinity) cannot be
# rounded to milliseconds at all.
MAX_DURATION_S = 10 * 365 * 86400


class _Section(BaseModel):
    # No `.inf` or `.nan` anywhere: every number of the policy is a finite amount.
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _bounded_duration(cls, v: Any, info: ValidationInfo) -> Any:
        """A duration (a field named `*_s` or `*_ms`) of at most MAX_DURATION_S."""
        name = info.field_name or ""
        if isinstance(v, (int, float)) and not isinstance(v, bool) and name.endswith(("_s", "_ms")):
            unit = "ms" if name.endswith("_ms") else "s"
            top = MAX_DURATION_S * (1000 if unit == "ms" else 1)
            if v > top:
                raise ValueError(f"must be at most {top:,} {unit} (10 years)")
        return v


class TimeoutsPolicy(_Section):
    """Per-backend deadlines. A first-token deadline fails over like an error: nothing reached
    the client yet."""

    connect_ms: int = Field(2_000, gt=0)
    first_token_ms: int = Field(30_000, gt=0)  # headers, and the first content token of a stream
    # Between two chunks of a stream. While another backend could continue the answer, a stall is
    # detected sooner, from live inter-token data (routing.idle_p99_multiplier); this is the cap.
    idle_ms: int = Field(60_000, gt=0)
    total_ms: int = Field(600_000, gt=0)  # a whole non-streamed answer


class LaunchPolicy(_Section):
    """The gateway starts this backend itself: `python -m local_backend serve ...`."""

    model: str
    quantize: Literal["auto", "none", "int8", "w8a16", "w8a8", "int4"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(None, gt=0)
    startup_timeout_s: float = Field(300.0, gt=0)
    # The temperature the model server samples at when a request names none (0: greedy). Passed
    # to it as --default-temperature, so the server and the gateway's cache read one value.
    default_temperature: float = Field(0.0, ge=0, le=2)
    # The local server's memory (None: its defaults, 1024 and 256 MB) and its int8 kernel build on CPU.
    kv_cache_mb: int | None = Field(None, gt=0)
    prefix_cache_mb: int | None = Field(None, ge=0)
    # The most tokens one answer may ask for (None: the server's 2048): a larger max_tokens is
    # cut to it, so that one request cannot reserve the whole KV cache.
    max_tokens_cap: int | None = Field(None, gt=0)
    kernel: Literal["auto", "avx512_vnni", "avx2"] = "auto"
    extra_args: tuple[str, ...] = ()

    def server_args(self) -> tuple[str, ...]:
        """The flags for the settings above that differ from the server's own defaults."""
        out: list[str] = []
        if self.kv_cache_mb is not None:
            out += ["--kv-cache-mb", str(self.kv_cache_mb)]
        if self.prefix_cache_mb is not None:
            out += ["--prefix-cache-mb", str(self.prefix_cache_mb)]
        if self.max_tokens_cap is not None:
            out += ["--max-tokens-cap", str(self.max_tokens_cap)]
        if self.kernel != "auto":
            out += ["--kernel", self.kernel]
        return tuple(out)

    @field_validator("extra_args")
    @classmethod
    def _no_default_temperature(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(a == "--default-temperature" or a.startswith("--default-temperature=") for a in v):
            raise ValueError("set `default_temperature` in `launch` instead: the gateway's cache must know it too")
        return v


class PricePolicy(_Section):
    """What a backend charges, in USD per million tokens."""

    input_per_mtok: float = Field(0.0, ge=0)
    output_per_mtok: float = Field(0.0, ge=0)

    def usd(self, prompt_tokens: int, completion_tokens: int) -> float:
        return (prompt_tokens * self.input_per_mtok + completion_tokens * self.output_per_mtok) / 1e6


# Headers a backend's `headers:` may not set: the gateway's own (its key, the body's framing, the request's id).
RESERVED_HEADERS = frozenset({
    "authorization", "x-api-key", "content-type", "content-length", "transfer-encoding", "host", "connection",
    "accept-encoding", "x-request-id", "anthropic-version", "proxy-authorization", "te", "upgrade", "expect", "keep-alive",
})


def header_value_ok(value: str) -> bool:
    """Whether a backend header's value may be sent: one line of at most 4,096 characters."""
    return len(value) <= 4096 and not any(c in value for c in "\r\n\0")


def secret_problem(env: str, value: str) -> str | None:
    """What keeps the value of the environment variable `env` (a backend's key, a header's
    secret) from being sent in a header, or None. A line break gets its own words: a Secret made
    from a file (`kubectl create secret --from-file`, `echo KEY > file`) ends in one, and aiohttp
    refuses it on every request. Not stripped: a key is sent as it is, or not at all."""
    if "\n" in value or "\r" in value:
        return (f"the value of {env} holds a line break (a Secret made from a file that ends in a newline?); "
                "store it without one (`printf %s KEY`, `kubectl create secret generic ... --from-literal`)")
    if not header_value_ok(value):
        return f"the value of {env} must be one line of at most 4,096 characters"
    return None


class BackendPolicy(_Section):
    url: str
    # The API it speaks: OpenAI's (chat, completions, embeddings, responses) or Anthropic's Messages
    # API (`POST {url}/messages`, `x-api-key`, `anthropic-version`). Each serves the other's clients
    # through translation (chat <-> messages).
    kind: Literal["openai", "anthropic"] = "openai"
    api_key_env: str | None = None  # secrets come from the environment, never the file
    # Public model names this backend serves, or a map public name -> upstream name.
    models: tuple[str, ...] | dict[str, str] = Field(min_length=1)
    max_concurrency: int = Field(64, gt=0)
    timeouts: TimeoutsPolicy = TimeoutsPolicy()
    launch: LaunchPolicy | None = None
    weight: float = Field(1.0, gt=0)  # share of traffic under the `weighted` strategy
    cost: float = Field(0.0, ge=0)  # relative price; traded against latency by routing.cost_weight_s
    price: PricePolicy | None = None  # USD per million tokens: spend quotas and gateway_spend_usd_total
    # The OpenAI endpoints this backend serves; embeddings are opt-in (most chat servers lack them).
    # Unset: chat, completions and responses; a `launch:` backend (our local model server, which
    # has no Responses API) chat and completions.
    endpoints: tuple[Endpoint, ...] = Field(("chat", "completions", "responses"), min_length=1)
    # Whether it continues a trailing assistant message (an assistant prefill) instead of starting a
    # new turn: how a stream cut elsewhere is continued here. None: the default for its kind (true
    # for a launched local backend and for `kind: anthropic`, false otherwise: OpenAI's own API
    # starts a new message).
    prefill: bool | None = None
    # The temperature this backend samples at when a request names none: a request without
    # temperature or seed is cached only when every backend that may answer it says 0 (greedy).
    # None: OpenAI's 1.0, or for a launched backend its `launch.default_temperature` (default 0).
    default_temperature: float | None = Field(None, ge=0, le=2)
    # The most tokens its model generates in one answer: the largest limit its provider accepts
    # (OpenAI refuses a larger max_tokens with a 400, as vLLM does past its context). Known for
    # every backend that may answer, a tenant's tpm bounds an answer that sets no limit by
    # writing one (below this); unknown, the gateway writes none (tenants.md#quotas).
    max_output_tokens: int | None = Field(None, gt=0)
    # A Prometheus endpoint of the model server (vLLM, SGLang, TGI, our local backend): its queue
    # depth and KV-cache use, scraped off the request path (routing.load_signals), enter routing.
    # None: none, except a `launch:` backend, whose own /metrics is used.
    metrics_url: str | None = None
    # Whether this is a local model (cost first for the `simple` class, routing.simple): None means
    # true for a `launch:` backend and false otherwise.
    local: bool | None = None
    # Whether requests carry the tenant's `cache_salt` (vLLM's per-request prefix-cache isolation,
    # which our local model server honours too): a prefix cached for one tenant then answers no
    # other tenant's prompt faster (a timing leak of what others asked). None: true for a `launch:`
    # backend and false otherwise (set it for a shared vLLM or a local_backend run on its own).
    cache_salt: bool | None = None
    # Headers sent with every request to it (an `anthropic-beta`, OpenRouter's `HTTP-Referer`, a
    # routing header of a provider's proxy, an `api-key` of its own). Not the ones the gateway
    # sets itself (its key, the body's type and length). Their values are never shown on the
    # admin plane (/admin/policy shows `<hidden>`).
    headers: dict[str, str] = Field(default_factory=dict)
    # Headers whose values are secrets (a provider's `api-key`, a proxy's `Helicone-Auth`): header
    # name -> the environment variable that holds the value, read at start like api_key_env.
    headers_env: dict[str, str] = Field(default_factory=dict)

    @field_validator("headers", "headers_env")
    @classmethod
    def _headers(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,100}", name):
                raise ValueError(f"{name[:100]!r} is not a header name")
            if name.lower() in RESERVED_HEADERS:
                raise ValueError(f"{name!r} is set by the gateway itself (the backend's key: api_key_env)")
            if not header_value_ok(value):
                raise ValueError(f"the value of header {name!r} must be one line of at most 4,096 characters")
        return {name.lower(): value for name, value in v.items()}

    @field_validator("headers_env")
    @classmethod
    def _header_envs(cls, v: dict[str, str]) -> dict[str, str]:
        for name, env in v.items():
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", env):
                raise ValueError(f"{name}: must name an environment variable (the value itself goes there), got {env!r}")
        return v

    @field_validator("url", "metrics_url")
    @classmethod
    def _http_url(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return None
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"must be an http:// or https:// URL, got {v!r}")
        if info.field_name == "url" and any(c in v for c in "?#"):
            # The endpoint's path is appended to `url` (`{url}/chat/completions`): after a query
            # it would land in the query's value, and every request would miss its path.
            raise ValueError(
                f"must not hold a query (?) or fragment (#), got {v!r}: the gateway appends each endpoint's path "
                "to it; send what a provider wants besides the path in `headers` (a secret: `headers_env`), or "
                "its model name in `models`"
            )
        if "#" in v:
            raise ValueError(f"must not hold a fragment (#...), got {v!r}: it is never sent")
        try:
            port = urlsplit(v).port
        except ValueError:  # not a number, or past 65535
            port = 0
        if port == 0:
            raise ValueError(f"the port must be a number from 1 to 65535, got {v!r}")
        return v.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", v):
            raise ValueError(f"must name an environment variable (the key itself never goes here), got {v!r}")
        return v

    @model_validator(mode="after")
    def _launched_default_endpoints(self) -> "BackendPolicy":
        if self.launch is not None and "endpoints" not in self.model_fields_set:
            object.__setattr__(self, "endpoints", ("chat", "completions"))
        return self

    @model_validator(mode="after")
    def _endpoints_of_its_kind(self) -> "BackendPolicy":
        """An Anthropic backend serves the Messages API (and chat clients through it); an OpenAI
        one never lists `messages` (Messages clients reach it through its chat endpoint)."""
        if self.kind == "anthropic":
            if "endpoints" not in self.model_fields_set:
                object.__setattr__(self, "endpoints", ("messages",))
            elif set(self.endpoints) != {"messages"}:
                raise ValueError("a `kind: anthropic` backend serves `endpoints: [messages]` (chat clients reach it through translation)")
            if self.launch is not None:
                raise ValueError("`launch` starts our own OpenAI-compatible server: not a `kind: anthropic` backend")
        elif "messages" in self.endpoints:
            raise ValueError("`messages` is the Anthropic API: set `kind: anthropic` for a backend that speaks it")
        return self

    @model_validator(mode="after")
    def _one_default_temperature(self) -> "BackendPolicy":
        lt = None if self.launch is None else self.launch.default_temperature
        if lt is not None and self.default_temperature is not None and self.default_temperature != lt:
            raise ValueError(
                f"default_temperature {self.default_temperature:g} differs from launch.default_temperature {lt:g}: "
                "set it in `launch` only (the launcher passes that one to the model server)"
            )
        return self

    @property
    def sampling_default_temperature(self) -> float:
        """The temperature this backend answers a request without one at (see `default_temperature`)."""
        if self.default_temperature is not None:
            return self.default_temperature
        return 1.0 if self.launch is None else self.launch.default_temperature

    @property
    def model_map(self) -> dict[str, str]:
        """Public model name -> the name this backend knows it by."""
        if isinstance(self.models, dict):
            return dict(self.models)
        return {m: m for m in self.models}


class CacheOverride(_Section):
    """Per model or per tenant: widen or narrow what the cache keeps (unset: inherit)."""

    enabled: bool | None = None
    include_sampled: bool | None = None
    ttl_s: float | None = Field(None, gt=0)


class HedgePolicy(_Section):
    """Start the same request on the next best backend when the first token is late."""

    max_extra_pct: float = Field(5.0, gt=0, le=100)  # hedges as a share of this model's requests
    min_delay_ms: int = Field(50, ge=0)  # never hedge sooner than this
    default_delay_ms: int = Field(2_000, gt=0)  # before the backend has a live P95


RetryOn = int | Literal["reset", "connect", "timeout"]


class RetryPolicy(_Section):
    """Same-backend retries before failing over (routes whose order is a preference). Each try
    counts within server.max_attempts and the request's deadline."""

    attempts: int = Field(2, ge=1, le=10)  # tries on one backend, the first included
    # HTTP statuses, and `reset` (connection lost before the first token), `connect` (refused),
    # `timeout` (no first token in time).
    on: tuple[RetryOn, ...] = (429, 500, 502, 503, "reset")
    max_wait_ms: int = Field(2_000, ge=0)  # a longer Retry-After (or back-off) fails over instead
    backoff_ms: int = Field(250, gt=0)  # the pause without a Retry-After; doubles per retry, jittered

    @model_validator(mode="before")
    @classmethod
    def _yaml_on(cls, data: Any) -> Any:
        # YAML 1.1 reads a bare `on:` key as the boolean true.
        if isinstance(data, dict) and True in data and "on" not in data:
            data = {("on" if k is True else k): v for k, v in data.items()}
        return data

    @field_validator("on")
    @classmethod
    def _statuses(cls, v: tuple[RetryOn, ...]) -> tuple[RetryOn, ...]:
        for s in v:
            if isinstance(s, int) and not (400 <= s <= 599 and s not in (400, 404, 413, 422)):
                raise ValueError(f"{s} is not a retryable HTTP status (4xx about the request is never retried)")
        return v


class ModelRoute(_Section):
    """Candidates for one public model: an ordered list, or one list per request class."""

    backends: tuple[str, ...] | None = None
    simple: tuple[str, ...] | None = None
    complex: tuple[str, ...] | None = None
    threshold: float | None = Field(None, ge=0, le=1)  # classifier score above which a request is complex
    hedge: HedgePolicy | None = None  # opt-in
    cache: CacheOverride | None = None
    strategy: Literal["latency", "round_robin", "least_inflight", "weighted", "ordered"] | None = None  # None: routing.strategy
    retry: RetryPolicy | None = None  # None: no same-backend retries, fail over at once
    # Backends with a larger context window, tried (in order) when a candidate answers
    # 400 context_length_exceeded; their `models:` map may name a larger upstream model.
    context_fallbacks: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _one_style(self) -> "ModelRoute":
        split = self.simple is not None or self.complex is not None
        if self.backends is not None and split:
            raise ValueError("give either `backends` or `simple`/`complex`, not both")
        if self.backends is None and not (self.simple and self.complex):
            raise ValueError("needs `backends`, or both `simple` and `complex` candidate lists")
        for field in ("backends", "simple", "complex"):
            names = getattr(self, field)
            if names is not None and len(names) == 0:
                raise ValueError(f"`{field}` must list at least one backend")
        if self.threshold is not None and not split:
            raise ValueError("`threshold` only applies to routes with `simple`/`complex` lists")
        return self


class ClassifierRulesPolicy(_Section):
    """Rules that force `complex` whatever the score; null turns a limit off."""

    complex_over_prompt_tokens: int | None = Field(1500, gt=0)
    tools_complex: bool = True
    # A response_format other than text (json_object, json_schema) goes to `complex`: the local
    # model refuses it (400 unsupported_parameter).
    response_format_complex: bool = True
    complex_over_max_tokens: int | None = Field(None, gt=0)


class EncoderPolicy(_Section):
    """The classifier cascade's second stage (gateway/classify/cascade.py): a small encoder that
    decides the requests the lexical scorer is unsure of. Loaded once per process, at start (a
    change here takes a restart); `deadline_ms` applies on reload."""

    # None ("auto"): on when torch, tokenizers and safetensors are installed (the `local` extra),
    # else the lexical scorer alone and a log line; true: a missing install or bad weights is
    # logged as an error (the lexical scorer still decides); false: never loaded.
    enabled: bool | None = None
    weights_dir: str | None = None  # None: the shipped encoder (gateway/classify/encoder/)
    # An uncertain request the encoder has not scored by then goes to `complex` (recall first).
    deadline_ms: float = Field(12.0, gt=0, le=10_000)
    max_batch: int = Field(8, ge=1, le=256)  # requests scored together (one forward pass)
    max_waiting: int = Field(64, ge=1, le=100_000)  # more waiting: `complex` at once, not queued
    # With two tenants or more: one tenant's requests waiting at most (more: `complex` at once), so
    # that its flood cannot make everyone else's uncertain requests late. None: half of max_batch.
    max_waiting_per_tenant: int | None = Field(None, ge=1, le=100_000)
    threads: int = Field(1, ge=1, le=256)  # torch's threads for the encoder (CPU)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: the GPU when torch sees one


class ClassifierPolicy(_Section):
    # The complex recall to aim for: the threshold is the one the weights file tabulates for it,
    # measured on leave-one-source-out scores (so on sources the model never saw). Recall first:
    # an uncertain request goes to the big model.
    complex_recall_target: float = Field(0.97, ge=0.8, le=1)
    threshold: float | None = Field(None, ge=0, le=1)  # set: overrides complex_recall_target
    weights_file: str | None = None  # None: the shipped weights
    rules: ClassifierRulesPolicy = ClassifierRulesPolicy()
    classify_all: bool = False  # also classify models that do not route by class (for metrics/headers)
    encoder: EncoderPolicy = EncoderPolicy()


class LimitsPolicy(_Section):
    """Per-tenant limits; any subset (unset: no limit). Exact across replicas that share a Redis."""

    rpm: int | None = Field(None, gt=0)  # requests in any 60-second window
    tpm: int | None = Field(None, gt=0)  # tokens (prompt + completion) in any 60-second window
    concurrency: int | None = Field(None, gt=0)  # requests in flight at once
    tokens_per_day: int | None = Field(None, gt=0)  # tokens per UTC day
    spend_per_day_usd: float | None = Field(None, gt=0)  # spend per UTC day, from the backends' `price`

    def any(self) -> bool:
        return any(v is not None for v in self.model_dump().values())


class QuotaPolicy(LimitsPolicy):
    """A tenant's limits, plus per-model limits checked on top of them for requests to that model."""

    models: dict[str, LimitsPolicy] = {}
    default_max_tokens: int = Field(1024, gt=0)  # reserved for a request without max_tokens

    def any(self) -> bool:
        return super().any() or any(m.any() for m in self.models.values())


class _Keys(_Section):
    """The keys a section admits (a tenant's, the admin's, the scrapers'), as sha256 digests."""

    key_sha256: tuple[str, ...] = ()
    # The name of an environment variable holding more digests (comma- or space-separated), e.g.
    # from a Kubernetes Secret: the policy file then carries no key material at all.
    key_sha256_env: str | None = None

    @field_validator("key_sha256")
    @classmethod
    def _hex_digests(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _digests(v)


def _digests(v: tuple[str, ...]) -> tuple[str, ...]:
    for digest in v:
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ValueError("each entry must be a lowercase hex sha256 of a key (`gateway hash-key --new`, or `gateway hash-key` with the key on stdin)")
    return v


class _KeysRequired(_Keys):
    """Keys that must be given, in the list or through the variable."""

    @model_validator(mode="after")
    def _some_key(self) -> Self:
        if not self.key_sha256 and not self.key_sha256_env:
            raise ValueError("needs `key_sha256` (a list of digests) or `key_sha256_env` (a variable holding them)")
        return self


class TenantPolicy(_Keys):
    """A tenant: its keys (from the policy, and any number of virtual keys issued through
    /admin/keys: a tenant may have only those), its priority, models, cache, quota."""

    # A ceiling: the highest band a request may ask for (x-priority, service_tier); an ask above it
    # is clamped, and a service_tier above it is not sent upstream (tenants/priority.py).
    priority: Priority = "default"
    default_priority: Priority | None = None  # the band of a request that asks for none; None: `priority`
    models: tuple[str, ...] | None = None  # None: every public model
    cache_namespace: str | None = None  # tenants naming the same namespace share cached answers
    cache: CacheOverride | None = None
    quota: QuotaPolicy | None = None
    weight: float = Field(1.0, gt=0)  # share of dispatches among tenants waiting in the same band
    log_payloads: bool = False  # the request log (/admin/requests) keeps this tenant's prompts and answers

    @field_validator("default_priority")
    @classmethod
    def _within_ceiling(cls, v: str | None, info: ValidationInfo) -> str | None:
        ceiling = info.data.get("priority")
        order = typing.get_args(Priority)
        if v is not None and ceiling in order and order.index(v) < order.index(ceiling):
            raise ValueError(f"{v!r} is above the tenant's `priority` {ceiling!r}, the most its requests may ask for")
        return v


class VirtualKeysPolicy(_Section):
    """Keys issued through /admin/keys (admin/keys.py), kept hashed in the store."""

    # How often each process asks the store whether the keys changed (a version number): a revoked
    # key is refused everywhere within this (plus one store round trip).
    poll_ms: int = Field(500, ge=50, le=60_000)
    max_keys: int = Field(10_000, gt=0)  # live, revoked and expired ones; those are forgotten `keep_revoked_s` after they ended
    keep_revoked_s: float = Field(7 * 86400.0, ge=0)
    max_grace_s: float = Field(7 * 86400.0, ge=0)  # the most a rotation may keep the old secret working


class AdminPolicy(_KeysRequired):
    """Admin keys (key_sha256, key_sha256_env, as in a tenant): the admin endpoints need one.
    Viewer keys (`viewer_key_sha256`, `viewer_key_sha256_env`) read them (GET) and the console."""

    viewer_key_sha256: tuple[str, ...] = ()
    viewer_key_sha256_env: str | None = None
    keys: VirtualKeysPolicy = VirtualKeysPolicy()

    @field_validator("viewer_key_sha256")
    @classmethod
    def _viewer_digests(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        return _digests(v)


class RequestLogPolicy(_Section):
    """The request log (/admin/requests): each API request's metadata, newest first, in the store
    (shared by every replica on a Redis store), written off the request path."""

    enabled: bool = True
    size: int = Field(100_000, gt=0, le=10_000_000)  # entries kept; the oldest go first
    queue: int = Field(10_000, gt=0)  # entries waiting to be written; more are dropped and counted
    flush_ms: int = Field(200, gt=0, le=10_000)  # how often the writer writes what came
    write_timeout_ms: float = Field(1_000.0, gt=0)  # one batch's write; past it the batch is dropped and counted
    # A `log_payloads` tenant's prompt and answer are each kept up to this many characters (JSON);
    # longer ones are cut and marked (`prompt_truncated`, `answer_truncated`).
    max_payload_chars: int = Field(8_192, ge=0, le=1_048_576)
    # The in-memory log (no `store.url`) is also bounded by its bytes: the oldest entries go first.
    memory_max_bytes: int = Field(64 * 1024 * 1024, gt=0)


class MetricsPolicy(_Keys):
    """Who may scrape /metrics, and what its labels reveal.

    Scrape keys (key_sha256, key_sha256_env, as in a tenant): /metrics then needs one of these or
    an admin key. Without any, /metrics is open on a loopback address only; listening beyond
    loopback it needs an admin key unless `open`."""

    open: bool = False  # no scrape key: serve /metrics (tenant names, tokens, spend) to anyone who reaches it
    tenant_label: bool = True  # False: tenant names never appear as label values

    @field_validator("open")
    @classmethod
    def _open_or_keys(cls, v: bool, info: ValidationInfo) -> bool:
        if v and (info.data.get("key_sha256") or info.data.get("key_sha256_env")):
            raise ValueError("a /metrics with scrape keys is not open; remove `open` or the keys")
        return v


class ServerPolicy(_Section):
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    # What one body may hold: its messages (Responses: input items), their content parts and its
    # tools, together. Validating and classifying costs the event loop per item (~2-5 us): a 4 MiB
    # body of 145,000 empty messages took ~0.5 s of it, where 4 MiB of text takes ~40 ms.
    max_items: int = Field(20_000, gt=0)
    request_timeout_ms: int = Field(600_000, gt=0)  # default deadline; x-request-timeout-ms may shorten it
    max_attempts: int = Field(3, ge=1, le=10)  # backends tried before the first byte
    heartbeat_after_ms: int = Field(5_000, gt=0)  # SSE comment heartbeats while a stream waits
    heartbeat_interval_ms: int = Field(5_000, gt=0)
    # Graceful shutdown (SIGTERM): /readyz answers 503 for `drain_delay_ms` while the port still
    # takes connections (a load balancer's readiness check notices), then the port closes and the
    # requests in flight (streams included) get up to `shutdown_timeout_ms` to finish.
    drain_delay_ms: int = Field(1_000, ge=0)
    shutdown_timeout_ms: int = Field(30_000, ge=0)
    # A policy without tenants serves anyone. That is allowed on a loopback address only, unless
    # this says so: the operator states that an open gateway on the network is intended.
    open_access: bool = False
    # The HTTP edge (web/edge.py), read by each connection as it opens. A request head must be complete
    # this long after the connection opens or after its first byte (else 408 and closed); an idle
    # keep-alive connection is closed after `keepalive_timeout_ms` (above common load balancers' 60 s).
    header_timeout_ms: int = Field(10_000, gt=0)
    keepalive_timeout_ms: int = Field(75_000, gt=0)
    body_timeout_ms: int = Field(60_000, gt=0)  # the whole body, from when the handler starts reading it: else 408
    # Bytes of request bodies still arriving that a process holds at once (read after authentication,
    # before any quota): past it, a caller holding more than its share of them gets a 503 (a tenant
    # whose `concurrency` is 1 held 1,024 connections x 4 MiB per address while they trickled in).
    body_read_budget_bytes: int = Field(256 * 1024 * 1024, gt=0)
    max_header_bytes: int = Field(32_768, ge=1024)  # request line + headers; more: 431 (each line also <= 8190)
    # Open connections per client IP address and process; one more gets a 429 and is closed. Behind a
    # load balancer or proxy every connection has its address: raise this there, or 0 (no cap).
    max_connections_per_client: int = Field(1024, ge=0)


class PrefixAffinityPolicy(_Section):
    """Send a prompt to the backend that most likely holds its prefix in a KV (or provider prompt)
    cache, within a load bound (routing/affinity.py)."""

    enabled: bool | None = None  # None: on for pools of two or more backends; false: off
    block_chars: int = Field(1024, ge=64, le=65_536)  # a long message is hashed in blocks of this many characters
    # Stay with the backend that holds the prefix while it has at most this many more requests on
    # it (ours in flight, or running + waiting by its metrics_url when more) than the least loaded...
    max_imbalance: int = Field(2, ge=0)
    # ...and while its predicted TTFT is at most this many times the best candidate's: "clearly
    # slower" only. Predictions mix cached and uncached prefills (a miss can cost 10x a hit, and
    # the holder just paid one), so a tighter bound would chase the prefix from replica to replica.
    max_slowdown: float = Field(10.0, ge=1)
    # A new prefix goes to its rendezvous-hash home unless that backend already holds this many
    # times its fair share of the prefixes seen in the last `prefix_ttl_s`.
    max_share: float = Field(1.0, ge=1)
    prefix_ttl_s: float = Field(600.0, gt=0)  # how long a learned prefix -> backend entry lives unused
    max_entries: int = Field(100_000, ge=100)  # learned prefix blocks kept per process (LRU)
    sticky_class: bool = True  # a conversation that went to `complex` stays there for later turns


class LoadSignalsPolicy(_Section):
    """Scraping backends' `metrics_url` (off the request path)."""

    interval_ms: int = Field(1_000, ge=100)
    timeout_ms: int = Field(500, gt=0)
    stale_ms: int = Field(5_000, gt=0)  # an older sample is ignored: routing falls back to its own view


class RoutingPolicy(_Section):
    strategy: Literal["latency", "round_robin", "least_inflight", "weighted", "ordered"] = "latency"
    tie_pct: float = Field(5.0, ge=0, le=100)  # backends this close to the best share traffic at random
    cost_weight_s: float = Field(0.0, ge=0)  # seconds of predicted TTFT one unit of backend `cost` is worth
    # The first-token deadline of a backend follows its live P95: max(multiplier x P95, floor),
    # capped by its timeouts.first_token_ms (which also applies until enough samples exist).
    deadline_p95_multiplier: float = Field(2.0, ge=1)
    deadline_floor_ms: int = Field(2_000, gt=0)
    # A backend without enough samples, while another could take over: the alternatives' live
    # deadline (multiplier x their P95), else this.
    cold_first_token_ms: int = Field(10_000, gt=0)
    # A stall mid-stream, while another backend could continue the answer: multiplier x the
    # backend's live inter-token P99, at least idle_floor_ms (cold_idle_ms before 20 samples),
    # at most its timeouts.idle_ms.
    idle_p99_multiplier: float = Field(20.0, ge=1)
    idle_floor_ms: int = Field(3_000, gt=0)
    cold_idle_ms: int = Field(10_000, gt=0)
    continuation: bool = True  # false: a stream cut mid-answer ends with an error event (no rescue)
    prefix_affinity: PrefixAffinityPolicy = PrefixAffinityPolicy()
    load_signals: LoadSignalsPolicy = LoadSignalsPolicy()
    # The `simple` class: `local_first` answers from local models (cost first) and spills to the
    # other candidates only when they are unhealthy, saturated or predicted to miss the deadline;
    # `latency` ranks every candidate by predicted latency alone.
    simple: Literal["local_first", "latency"] = "local_first"


class HealthPolicy(_Section):
    failures_to_eject: int = Field(3, ge=1)  # consecutive failures or timeouts
    eject_ms: int = Field(10_000, gt=0)  # first ejection; doubles while it keeps failing
    # Caps the back-off: how often a user request is the trial while a backend stays down, and how
    # long a recovery goes unnoticed when request probes are off or inconclusive.
    max_eject_ms: int = Field(30_000, gt=0)
    probe_interval_ms: int = Field(5_000, gt=0)  # model-list probes to ejected and idle backends
    probe_timeout_ms: int = Field(2_000, gt=0)  # both kinds of probe
    # A one-token request to each ejected (backend, model) this often; a good one ends
    # the ejection, so a recovery is seen within about this long. 0: off.
    recovery_probe_interval_ms: int = Field(1_000, ge=0)
    # An ejection by failures that may be the request's doing (a 500, an answer that is no answer,
    # an error event) that one tenant's requests alone met is undone when a request probe is
    # answered: one tenant cannot eject a backend for the others. Needs request probes and tenants.
    corroborate: bool = True


class StoreTlsPolicy(_Section):
    """TLS to Redis (`rediss://`, `rediss+sentinel://`, `rediss+cluster://`): the CA that signed
    the server's certificate and, for mutual TLS, this gateway's certificate and key (PEM files)."""

    ca_file: str | None = None  # omitted: the system's CAs
    cert_file: str | None = None
    key_file: str | None = None
    check_hostname: bool = True

    @model_validator(mode="after")
    def _pair(self) -> Self:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together (a client certificate and its key)")
        return self


class StorePolicy(_Section):
    """Where the cache and the quota counters live: Redis shared by every replica, or (url omitted)
    this process's memory. docs/policy.md has an example of each kind of `url`."""

    # redis://host:port/db, rediss://..., unix:///path.sock, a master through Sentinel
    # (redis+sentinel://host:26379,host:26379/service[/db]) or a Cluster
    # (redis+cluster://host:port,host:port: seed nodes); rediss+sentinel / rediss+cluster for TLS.
    url: str | None = None
    tls: StoreTlsPolicy | None = None
    timeout_ms: float = Field(10.0, gt=0)  # a slow store is a miss, not a wait
    quota_timeout_ms: float = Field(250.0, gt=0)  # past this, quotas fall back to per-replica counters
    # Connections per pool (cache, quotas, Responses records: three per process), per Redis node.
    # replicas x (workers x (3 x max_connections + 4) + 3) must stay under the server's
    # maxclients (a Cluster: a few more, store/connect.budget); the start-up log warns when it
    # does not (docs/operations.md, connection budget).
    max_connections: int = Field(64, gt=0)
    # How many gateway replicas share this store, for the connection budget's warning only.
    replicas: int = Field(1, ge=1)
    memory_max_bytes: int = Field(256 * 1024 * 1024, gt=0)  # the in-memory store's size

    @field_validator("url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None:
            parse_target(v)  # ValueError: what is wrong with it
        return v

    @model_validator(mode="after")
    def _tls_needs_rediss(self) -> Self:
        if self.tls is not None and (self.url is None or not parse_target(self.url).tls):
            raise ValueError("`tls` applies to a rediss://, rediss+sentinel:// or rediss+cluster:// url")
        return self


class CachePolicy(_Section):
    enabled: bool = True
    ttl_s: float = Field(3600.0, gt=0)
    # With a shared (Redis) store: a miss holds a lock this long at most while it calls upstream;
    # the same request on another process waits (up to this, and its deadline) for the stored answer.
    lock_ms: int = Field(30_000, gt=0)
    max_entry_bytes: int = Field(256 * 1024, gt=0)
    # Also serve and store sampled answers (temperature > 0 without a seed): callers asking for
    # variety would get the same text again. Off: only temperature 0 or seeded requests (n = 1).
    include_sampled: bool = False
    # The cache's own store (null: `store`): a Redis that may evict its least recently used keys
    # (maxmemory with allkeys-lru), next to a `store` that must not (quota counters and Responses
    # records have TTLs too, and went with the cache's entries under volatile-lru).
    store: StorePolicy | None = None


class BandDeadlines(_Section):
    """Default deadline per priority band when a request sends no x-request-timeout-ms (null:
    server.request_timeout_ms)."""

    priority: int | None = Field(None, gt=0, le=MAX_DURATION_S * 1000)
    default: int | None = Field(None, gt=0, le=MAX_DURATION_S * 1000)
    flex: int | None = Field(None, gt=0, le=MAX_DURATION_S * 1000)


class AdmissionPolicy(_Section):
    """The admission stage: requests relayed at once across the process, and waiting beyond that."""

    enabled: bool = True  # false: no global bound, and a full backend's queue is first come, first served
    max_inflight: int = Field(1024, gt=0)
    max_queue: int = Field(4096, ge=0)
    starvation_share: float = Field(0.1, ge=0, lt=1)  # dispatches kept for a waiting lower band
    # Share of each bound (admission and every backend's max_concurrency) that lower bands leave
    # free while `priority` traffic has been seen in the last 10 s.
    priority_reserve_pct: float = Field(10.0, ge=0, lt=100)
    # A queue whose every dispatch has waited longer than this for standing_interval_ms is standing:
    # its newest waiter of the lowest band is shed each interval (CoDel-style). null: off.
    standing_target_ms: int | None = Field(5_000, gt=0)
    standing_interval_ms: int = Field(5_000, gt=0)

    def standing(self) -> tuple[float | None, float]:
        """(target, interval) in seconds for the gates."""
        t = self.standing_target_ms
        return (None if t is None else t / 1000, self.standing_interval_ms / 1000)
    deadline_ms: BandDeadlines = BandDeadlines()


class ResponsesPolicy(_Section):
    """The Responses API (/v1/responses, /v1/conversations): the record of which backend holds
    each response and conversation id and whose it is (follow-ups and the by-id endpoints)."""

    affinity_ttl_s: float = Field(30 * 86400.0, gt=0)  # OpenAI keeps stored responses 30 days
    # The record that makes an answer followable: each try of its write (and of a lookup) is
    # bounded by this, not by store.timeout_ms (a slow cache is a miss; a lost record is an id
    # nobody owns); after record_attempts tries the answer is not released (503).
    record_timeout_ms: float = Field(250.0, gt=0)
    record_attempts: int = Field(3, ge=1, le=10)
    # With Redis replicas (Sentinel, a Cluster, or one server's): a record counts as written once
    # this many replicas hold it too (Redis WAIT), so a failover cannot lose an id a client was
    # given. While fewer replicas than this are attached, stateful answers get 503 + Retry-After
    # (docs/operations.md). 0: the master's word (replication is asynchronous: a failover may
    # lose the last records).
    record_replicas: int = Field(0, ge=0, le=5)
    # The migration mode: an id the gateway has no record of is searched for on the backends and
    # recorded as the first asking tenant's. Off: such ids are 404s, never adopted.
    adopt_unknown_ids: bool = False


class ReloadPolicy(_Section):
    watch: bool = True
    interval_ms: int = Field(1_000, gt=0)
    # With a Redis `store`: a reload through /admin/reload is announced on this pub/sub channel,
    # and every replica on the same Redis reloads its own policy file (null: no announcement).
    channel: str | None = "gateway:reload"


class LogPolicy(_Section):
    """The structured access log: one JSON line per API request on stdout."""

    access: bool = False  # `gateway serve --access-log` turns it on too
    prompts: bool = False  # also log the request's messages / prompt (off: prompts are private)


class TracingPolicy(_Section):
    """OpenTelemetry trace export (needs the `otel` extra): one span per API request."""

    otlp_endpoint: str  # e.g. http://otel-collector:4318/v1/traces (OTLP over HTTP, protobuf)
    service_name: str = "llm-gateway"
    sample_ratio: float = Field(1.0, ge=0, le=1)


class Policy(_Section):
    version: Literal[1] = 1
    server: ServerPolicy = ServerPolicy()
    routing: RoutingPolicy = RoutingPolicy()
    store: StorePolicy = StorePolicy()
    cache: CachePolicy = CachePolicy()
    health: HealthPolicy = HealthPolicy()
    reload: ReloadPolicy = ReloadPolicy()
    admission: AdmissionPolicy = AdmissionPolicy()
    backends: dict[str, BackendPolicy] = Field(min_length=1)
    models: dict[str, ModelRoute] = {}
    tenants: dict[str, TenantPolicy] = {}
    admin: AdminPolicy | None = None
    metrics: MetricsPolicy = MetricsPolicy()
    classifier: ClassifierPolicy = ClassifierPolicy()
    log: LogPolicy = LogPolicy()
    request_log: RequestLogPolicy = RequestLogPolicy()
    tracing: TracingPolicy | None = None
    responses: ResponsesPolicy = ResponsesPolicy()

    @field_validator("backends", "models", "tenants")
    @classmethod
    def _names(cls, v: dict[str, Any]) -> dict[str, Any]:
        for name in v:
            if not re.match(_NAME, name):
                raise ValueError(f"bad name {name!r}: use letters, digits and . _ : / -")
        return v

    def served_models(self) -> dict[str, tuple[str, ...]]:
        """Every public model -> its candidate backends when it has no explicit route."""
        out: dict[str, list[str]] = {}
        for bname, backend in self.backends.items():
            for public in backend.model_map:
                out.setdefault(public, []).append(bname)
        return {m: tuple(b) for m, b in out.items()}

    @property
    def open(self) -> bool:
        """No tenants: every caller is let in, without a key."""
        return not self.tenants

    @property
    def shared(self) -> bool:
        """Two tenants or more: one tenant's requests must not cost the others shared things (a
        backend's health, the classifier encoder's queue)."""
        return len(self.tenants) > 1

    def public_models(self) -> list[str]:
        names = dict.fromkeys(self.models)
        names.update(dict.fromkeys(self.served_models()))
        return list(names)


@dataclass(frozen=True)
class Problem:
    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        return f"{self.path or '<root>'}: {self.message}{where}"


class PolicyError(ValueError):
    """A policy that does not load; `problems` lists every error found."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


def _path(loc: tuple[Any, ...]) -> tuple[str, list[Any]]:
    text, parts = "", []
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
        parts.append(part)
    return text, parts


def _line_of(node: yaml.Node | None, parts: list[Any]) -> int | None:
    """The 1-based line of a path in the composed YAML, or of its nearest known ancestor."""
    line = node.start_mark.line + 1 if node is not None else None
    for part in parts:
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if k.value == str(part)), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            node = None
        if node is None:
            break
        line = node.start_mark.line + 1
    return line


def _as_dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def _as_names(v: Any) -> list[Any]:
    return list(v) if isinstance(v, (list, tuple)) else []


def _served(backend: Any) -> set[str]:
    """Public model names a raw backend entry lists (a list, or the keys of a map)."""
    models = _as_dict(backend).get("models")
    return {str(m) for m in (models if isinstance(models, (list, dict)) else [])}


def _cross_check(data: dict[str, Any]) -> list[tuple[tuple[Any, ...], str]]:
    """References between sections, checked on the raw YAML data.

    Raw data, not the validated model: `gateway check` then reports a route naming an unknown
    backend in the same pass as a schema error elsewhere. Entries of the wrong shape are skipped
    (the schema check reports them)."""
    problems: list[tuple[tuple[Any, ...], str]] = []
    backends = _as_dict(data.get("backends"))
    models = _as_dict(data.get("models"))
    tenants = _as_dict(data.get("tenants"))
    served = {name: _served(b) for name, b in backends.items()}  # once each: aliases can repeat a long list
    for mname, route in models.items():
        for field in ("backends", "simple", "complex", "context_fallbacks"):
            for i, bname in enumerate(_as_names(_as_dict(route).get(field))):
                loc = ("models", mname, field, i)
                if not isinstance(bname, str):
                    continue
                if bname not in backends:
                    problems.append((loc, f"unknown backend {bname!r}"))
                elif field in ("backends", "context_fallbacks") and str(mname) not in served[bname]:
                    problems.append((loc, f"backend {bname!r} does not serve model {mname!r} (add it to its `models`)"))
    known = {str(m) for m in models}.union(*served.values())
    for tname, tenant in tenants.items():
        for i, m in enumerate(_as_names(_as_dict(tenant).get("models"))):
            if isinstance(m, str) and m not in known:
                problems.append((("tenants", tname, "models", i), f"unknown model {m!r}"))
        quota = _as_dict(_as_dict(tenant).get("quota"))
        for m in _as_dict(quota.get("models")):
            if str(m) not in known:
                problems.append((("tenants", tname, "quota", "models", m), f"unknown model {m!r}"))
        if quota.get("spend_per_day_usd") is not None or any(
            _as_dict(q).get("spend_per_day_usd") is not None for q in _as_dict(quota.get("models")).values()
        ):
            unpriced = [str(b) for b, bp in backends.items() if _as_dict(bp).get("price") is None]
            if unpriced:
                problems.append(
                    (("tenants", tname, "quota", "spend_per_day_usd"), f"needs a `price` on every backend (none on: {', '.join(unpriced)})")
                )
    seen: dict[str, str] = {}
    for tname, tenant in tenants.items():
        for i, digest in enumerate(_as_names(_as_dict(tenant).get("key_sha256"))):
            if not isinstance(digest, str):
                continue
            if digest in seen and seen[digest] != tname:
                problems.append((("tenants", tname, "key_sha256", i), f"key also belongs to tenant {seen[digest]!r}"))
            seen[digest] = tname
    # Tenants that name the same `cache_namespace` share answers and stored Responses on purpose;
    # naming another tenant's own (`tenant:<name>`, which it never opted into) would share its.
    own = {f"tenant:{t}": str(t) for t, tenant in tenants.items() if not _as_dict(tenant).get("cache_namespace")}
    for tname, tenant in tenants.items():
        ns = str(_as_dict(tenant).get("cache_namespace"))
        other = own.get(ns)
        if other is not None and other != str(tname):
            problems.append((
                ("tenants", tname, "cache_namespace"),
                f"{ns!r} is the default namespace of tenant {other!r}: tenant {tname!r} would share its cached answers "
                f"and stored Responses without {other!r} opting in; to share, give both tenants the same `cache_namespace`",
            ))  # fmt: skip
    ports: dict[int, str] = {}
    for bname, backend in backends.items():
        b = _as_dict(backend)
        url = b.get("url")
        if b.get("launch") is None or not isinstance(url, str):
            continue
        port = _launch_port(url)
        if port is None:
            problems.append((("backends", bname, "url"), _LAUNCH_URL))
            continue
        # By port, not URL: every loopback name is this machine, so two children would collide.
        if port in ports:
            problems.append((("backends", bname, "url"), f"same port ({port}) as launched backend {ports[port]!r}"))
        ports[port] = bname
    if _as_dict(data.get("server")).get("open_access") is True and tenants:
        problems.append((("server", "open_access"), "a policy with tenants is never open; remove `open_access`"))
    return problems


_LAUNCH_URL = ("a launched backend needs an explicit loopback host:port URL (http://127.0.0.1:PORT/v1, or localhost, "
               "[::1]; no user, query or fragment)")


def _launch_port(url: str) -> int | None:
    """The port of a launched backend's URL, or None unless it is plain http on a loopback name
    with an explicit port. Parsed as the launcher parses it (urlsplit), not matched as text: the
    child listens on this URL's host, so `http://127.0.0.1:1@0.0.0.0:2/v1` (userinfo: the host is
    0.0.0.0) must not pass."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        return None
    plain = parts.scheme == "http" and "@" not in parts.netloc and not any(c in url for c in "?#")
    if not plain or parts.hostname not in ("127.0.0.1", "localhost", "::1") or not port:
        return None
    return port


def _section_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The policy section class that a (pydantic) error location points into, if it resolves."""
    node: Any = Policy
    for part in loc:
        model = _model_in(node)
        if model is not None and isinstance(part, str) and part in model.model_fields:
            node = model.model_fields[part].annotation
        elif typing.get_origin(_unwrap(node)) is dict:
            node = typing.get_args(_unwrap(node))[1]  # `part` is a name chosen by the operator
        else:
            return None
    return _model_in(node)


def _unwrap(tp: Any) -> Any:
    """`X | None` -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _model_in(tp: Any) -> type[BaseModel] | None:
    tp = _unwrap(tp)
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _unknown_field(loc: tuple[Any, ...]) -> str:
    """'unknown field', with the closest valid name of that section when one is close."""
    section = _section_at(loc[:-1])
    if section is None or not isinstance(loc[-1], str):
        return "unknown field"
    close = difflib.get_close_matches(loc[-1], list(section.model_fields), n=1, cutoff=0.75)
    return f"unknown field; did you mean `{close[0]}`?" if close else "unknown field"


MAX_POLICY_NODES = 1_000_000  # YAML nodes in a policy, aliases expanded (see _read_yaml)


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def expanded_nodes(root: yaml.Node, limit: int) -> int:
    """How many nodes `root` holds with every alias expanded (a node an alias names counts once
    per reference), or `limit + 1` once past `limit` or for an alias inside itself. Linear in the
    nodes as written: each is sized once, then reused."""
    size: dict[int, int] = {}
    entered: set[int] = set()  # the nodes on the path from the root (an alias to one is a cycle)
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            entered.discard(key)
            size[key] = min(limit + 1, 1 + sum(size[id(c)] for c in _yaml_children(node)))
            continue
        if key in size:
            continue
        if key in entered:
            return limit + 1
        entered.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _yaml_children(node) if id(c) not in size)
    return size[id(root)]


_MERGE = "tag:yaml.org,2002:merge"


def duplicate_keys(root: yaml.Node | None) -> list[Problem]:
    """A problem for each key a YAML mapping holds twice: PyYAML keeps the last one, so a second
    `team-a:` (or a second `tenants:`) would drop the first without a word. Each node is visited
    once (an alias's target is reported at its first path)."""
    out: list[Problem] = []
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, tuple[Any, ...]]] = [(root, ())] if root is not None else []
    while stack:
        node, loc = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, (*loc, i)) for i, child in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE:  # `<<: *base` merges, then keys override
                    stack.append((value, loc))
                    continue
                line = key.start_mark.line + 1
                if (key.tag, key.value) in first:
                    out.append(Problem(_path((*loc, key.value))[0], f"defined again (first at line "
                                       f"{first[key.tag, key.value]}): YAML keeps only the last one; remove or merge one", line))
                else:
                    first[key.tag, key.value] = line
                stack.append((value, (*loc, key.value)))
    return sorted(out, key=lambda p: p.line or 0)


def _read_yaml(text: str, source: str, max_nodes: int) -> tuple[yaml.Node | None, Any, list[Problem]]:
    """The composed YAML (for line numbers), its data, parsed once (LibYAML's parser when PyYAML
    has it), and its duplicate keys (duplicate_keys). Refused past `max_nodes` with aliases
    expanded: a few hundred bytes of nested aliases ("billion laughs") would otherwise make
    validation run for hours."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
    try:
        root = loader.get_single_node()
        if root is not None and expanded_nodes(root, max_nodes) > max_nodes:
            raise PolicyError(source, [Problem("", f"the YAML holds more than {max_nodes:,} values with its aliases "
                                                   "expanded (or an alias inside itself)")])
        # Before the construction, which writes the keys of a merge (`<<: *base`) into the mapping.
        duplicates = duplicate_keys(root)
        return root, None if root is None else loader.construct_document(root), duplicates
    finally:
        loader.dispose()


def parse_policy(text: str, source: str = "<policy>", *, max_nodes: int = MAX_POLICY_NODES) -> Policy:
    """Parse and validate policy YAML text; raise PolicyError listing every problem.

    Schema errors and cross-reference errors are reported together, in one pass. `max_nodes`:
    the most values the YAML may hold, aliases expanded."""
    try:
        root, data, duplicates = _read_yaml(text, source, max_nodes)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        raise PolicyError(source, [Problem("", f"not valid YAML: {getattr(exc, 'problem', exc)}", line)]) from None
    except (ValueError, OverflowError) as exc:
        # A scalar its tag cannot build (`!!int "x"`, a date 2001-13-45, a number past what int()
        # takes): PyYAML raises these from the constructor, not as a YAMLError.
        raise PolicyError(source, [Problem("", f"not valid YAML: a value cannot be read: {str(exc)[:200]}")]) from None
    if not isinstance(data, dict):
        raise PolicyError(source, [Problem("", "the policy must be a YAML mapping")])
    problems: list[Problem] = []
    policy: Policy | None = None
    try:
        policy = Policy.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            raw_loc = err["loc"]
            loc = tuple(
                p for i, p in enumerate(raw_loc)
                if not (isinstance(p, str) and ("[" in p or p in ("tuple", "dict")
                                                or (p in ("int", "str") and i and isinstance(raw_loc[i - 1], int))))
            )
            text_path, parts = _path(loc)
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = _unknown_field(loc)
            problems.append(Problem(text_path, msg, _line_of(root, parts)))
    cross = [(*_path(loc), msg) for loc, msg in _cross_check(data)]
    # One complaint per place: the schema's, but for a launched backend's URL the cross-check's
    # (it says all that such a URL must be, where the schema names one thing wrong with it).
    launch_urls = {text_path for text_path, _, msg in cross if msg == _LAUNCH_URL}
    problems = [p for p in problems if p.path not in launch_urls]
    schema_paths = {p.path for p in problems}
    for text_path, parts, msg in cross:
        if text_path not in schema_paths:
            problems.append(Problem(text_path, msg, _line_of(root, parts)))
    problems = duplicates + problems  # first: a duplicate may explain the others (its first half is gone)
    if problems or policy is None:
        # A union (list-or-map) reports once per branch; keep each message once.
        raise PolicyError(source, list(dict.fromkeys(problems)))
    return policy


def load_policy(path: str | Path, source: str | None = None) -> Policy:
    """Read and validate a policy file (`source`: the name its errors give it, else its path)."""
    return read_policy(path, source)[0]


def read_policy(path: str | Path, source: str | None = None) -> tuple[Policy, bytes]:
    """Read a policy file once: the policy and the very bytes it was parsed from (a reload hashes
    and keeps those, not a second read that may see a later save). Raises PolicyError."""
    p = Path(path)
    name = source or str(p)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise PolicyError(name, [Problem("", f"cannot read: {exc.strerror or exc}")]) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(name, [Problem("", f"not UTF-8: {exc.reason} at byte {exc.start}")]) from None
    return parse_policy(text, name), data
