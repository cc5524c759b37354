"""Policy parsing: every error names its YAML path and line; cross-references are checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.config.policy import LaunchPolicy, PolicyError, parse_policy
from gateway.errors import Unauthorized
from gateway.tenants.auth import Tenants, key_warnings

GOOD = """
version: 1
backends:
  fast-a:
    url: http://127.0.0.1:9001/v1/
    api_key_env: FAST_A_KEY
    models: [gpt-4o-mini]
  big:
    url: https://api.example.com/v1
    models: {gpt-4o: gpt-4o-2024-08-06}
    timeouts: {first_token_ms: 5000}
models:
  auto: {simple: [fast-a], complex: [big, fast-a]}
  gpt-4o-mini: {backends: [fast-a]}
tenants:
  acme:
    key_sha256: ["%s"]
    priority: priority
    models: [auto, gpt-4o]
""" % ("a" * 64)


def _problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as exc:
        parse_policy(text)
    return [str(p) for p in exc.value.problems]


def test_a_good_policy_loads_with_defaults_filled_in():
    p = parse_policy(GOOD)
    assert p.backends["fast-a"].url == "http://127.0.0.1:9001/v1"  # trailing slash dropped
    assert p.backends["big"].model_map == {"gpt-4o": "gpt-4o-2024-08-06"}
    assert p.backends["big"].timeouts.first_token_ms == 5000 and p.backends["big"].timeouts.idle_ms == 60000
    assert p.public_models() == ["auto", "gpt-4o-mini", "gpt-4o"]
    assert p.tenants["acme"].priority == "priority"


def test_policies_are_frozen():
    p = parse_policy(GOOD)
    with pytest.raises(Exception):
        p.backends["big"].max_concurrency = 3  # type: ignore[misc]


def test_every_structural_error_is_reported_with_path_and_line():
    text = GOOD.replace("    api_key_env: FAST_A_KEY\n", "    api_key_env: sk-live-123\n    colour: blue\n").replace(
        "priority: priority", "priority: urgent"
    )
    problems = _problems(text)
    assert any(p.startswith("backends.fast-a.api_key_env: must name an environment variable") for p in problems)
    assert "backends.fast-a.colour: unknown field (line 7)" in problems
    assert any(p.startswith("tenants.acme.priority:") for p in problems)


def test_cross_references_are_checked():
    text = GOOD.replace("complex: [big, fast-a]", "complex: [big, b9]").replace(
        "gpt-4o-mini: {backends: [fast-a]}", "gpt-4o-mini: {backends: [big]}"
    ).replace("models: [auto, gpt-4o]", "models: [auto, gpt-5]")
    problems = _problems(text)
    assert "models.auto.complex[1]: unknown backend 'b9' (line 13)" in problems
    assert any(p.startswith("models.gpt-4o-mini.backends[0]: backend 'big' does not serve model 'gpt-4o-mini'") for p in problems)
    assert any(p.startswith("tenants.acme.models[1]: unknown model 'gpt-5'") for p in problems)


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ("auto: {backends: [big], simple: [big]}", "either `backends` or `simple`/`complex`"),
        ("auto: {simple: [fast-a]}", "both `simple` and `complex`"),
        ("auto: {backends: []}", "at least one backend"),
    ],
)
def test_model_routes_need_one_clear_shape(snippet, expected):
    text = GOOD.replace("auto: {simple: [fast-a], complex: [big, fast-a]}", snippet)
    assert any(expected in p and p.startswith("models.auto") for p in _problems(text))


def test_yaml_syntax_errors_have_a_line():
    problems = _problems("backends:\n  a: {url: [\n")
    assert problems[0].startswith("<root>: not valid YAML") and "(line" in problems[0]


def test_the_policy_must_be_a_mapping_with_backends():
    assert _problems("- a\n- b\n") == ["<root>: the policy must be a YAML mapping"]
    assert any(p.startswith("backends:") for p in _problems("version: 1\n"))


def test_a_key_shared_by_two_tenants_is_rejected():
    text = GOOD + '  other:\n    key_sha256: ["%s"]\n' % ("a" * 64)
    assert any("key also belongs to tenant 'acme'" in p for p in _problems(text))


def test_launched_backends_need_a_loopback_url():
    text = GOOD.replace(
        "    models: [gpt-4o-mini]\n", "    models: [gpt-4o-mini]\n    launch: {model: tiny-random}\n", 1
    ).replace("http://127.0.0.1:9001/v1/", "http://10.0.0.5:9001/v1")
    assert any("loopback" in p for p in _problems(text))


def test_launch_settings_become_the_local_servers_flags():
    assert LaunchPolicy(model="tiny-random").server_args() == ()
    args = LaunchPolicy(model="tiny-random", kv_cache_mb=2048, max_tokens_cap=8192, kernel="avx2").server_args()
    assert args == ("--kv-cache-mb", "2048", "--max-tokens-cap", "8192", "--kernel", "avx2")
    out = subprocess.run(  # the flags exist in the real CLI
        [sys.executable, "-m", "local_backend", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert all(flag in out.stdout for flag in args[::2])


def test_the_shipped_policies_are_valid():
    from pathlib import Path

    from gateway.config.policy import load_policy

    root = Path(__file__).resolve().parents[1]
    files = sorted([*(root / "policies").rglob("*.yaml"), *(root / "deploy" / "policies").rglob("*.yaml")])
    assert files, "no policies shipped"
    for f in files:
        load_policy(f)


def test_a_misspelt_key_gets_a_did_you_mean():
    problems = _problems(GOOD.replace("    models: [gpt-4o-mini]\n", "    models: [gpt-4o-mini]\n    max_concurency: 4\n", 1))
    assert "backends.fast-a.max_concurency: unknown field; did you mean `max_concurrency`? (line 8)" in problems
    problems = _problems(GOOD + "cache: {include_sampeld: true}\nserver: {open_acess: true}\n")
    assert any(p.startswith("cache.include_sampeld: unknown field; did you mean `include_sampled`?") for p in problems)
    assert any(p.startswith("server.open_acess: unknown field; did you mean `open_access`?") for p in problems)
    assert any(p.startswith("backends.fast-a.colour: unknown field (") for p in _problems(GOOD.replace(
        "    api_key_env: FAST_A_KEY\n", "    api_key_env: FAST_A_KEY\n    colour: blue\n")))  # nothing close


def test_schema_and_cross_reference_errors_come_in_one_pass():
    text = GOOD.replace("complex: [big, fast-a]", "complex: [big, b9]").replace("priority: priority", "priority: urgent")
    problems = _problems(text)
    assert any(p.startswith("tenants.acme.priority:") for p in problems)
    assert "models.auto.complex[1]: unknown backend 'b9' (line 13)" in problems


def test_backends_say_which_endpoints_they_serve():
    p = parse_policy(GOOD)
    assert p.backends["fast-a"].endpoints == ("chat", "completions", "responses")  # embeddings are opt-in
    p = parse_policy(GOOD.replace("    models: [gpt-4o-mini]\n", "    models: [gpt-4o-mini]\n    endpoints: [embeddings]\n", 1))
    assert p.backends["fast-a"].endpoints == ("embeddings",)
    # A launched backend (our local model server has no Responses API): chat and completions.
    launched = GOOD.replace("    models: [gpt-4o-mini]\n", "    models: [gpt-4o-mini]\n    launch: {model: tiny-random}\n", 1)
    assert parse_policy(launched).backends["fast-a"].endpoints == ("chat", "completions")
    for bad in ("[]", "[chat, images]"):
        text = GOOD.replace("    models: [gpt-4o-mini]\n", f"    models: [gpt-4o-mini]\n    endpoints: {bad}\n", 1)
        assert any(p.startswith("backends.fast-a.endpoints") for p in _problems(text)), bad


def test_the_cache_serves_sampled_answers_only_when_a_policy_says_so():
    p = parse_policy(GOOD)
    assert p.cache.include_sampled is False
    p = parse_policy(GOOD + "cache: {include_sampled: true}\n")
    assert p.cache.include_sampled is True
    p = parse_policy(GOOD.replace("gpt-4o-mini: {backends: [fast-a]}", "gpt-4o-mini: {backends: [fast-a], cache: {include_sampled: true}}"))
    assert p.models["gpt-4o-mini"].cache.include_sampled is True and p.tenants["acme"].cache is None
    assert any(p.startswith("cache.deterministic_only: unknown field") for p in _problems(GOOD + "cache: {deterministic_only: false}\n"))


def test_metrics_and_open_access_settings():
    p = parse_policy(GOOD)
    assert p.metrics.key_sha256 == () and p.metrics.tenant_label is True and p.server.open_access is False
    p = parse_policy(GOOD + "metrics: {key_sha256: ['%s'], tenant_label: false}\n" % ("b" * 64))
    assert p.metrics.key_sha256 == ("b" * 64,) and p.metrics.tenant_label is False
    assert any(p.startswith("metrics.key_sha256") for p in _problems(GOOD + "metrics: {key_sha256: [password]}\n"))
    # open_access is for a policy without tenants: with tenants it would say something untrue
    assert any(p.startswith("server.open_access:") for p in _problems(GOOD + "server: {open_access: true}\n"))


def test_shipped_policies_are_safe_to_copy():
    """No digest of a guessable key; a policy served on 0.0.0.0 has tenants (not an open relay)."""
    from pathlib import Path

    import yaml

    from gateway.tenants.auth import key_warnings

    root = Path(__file__).resolve().parents[1]
    texts = {f: f.read_text() for f in [*(root / "policies").rglob("*.yaml"), *(root / "deploy" / "policies").rglob("*.yaml")]}
    for f in (root / "deploy" / "kubernetes").glob("*.yaml"):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and doc.get("kind") == "ConfigMap" and "policy.yaml" in doc.get("data", {}):
                texts[f] = doc["data"]["policy.yaml"]
    deployed = {root / "deploy" / "policies" / "compose.yaml", root / "deploy" / "kubernetes" / "gateway.yaml"}
    assert deployed <= set(texts)
    for f, text in texts.items():
        policy = parse_policy(text, str(f))
        assert not [w for w in key_warnings(policy) if "guessable" in w], f
        if f in deployed:
            assert policy.tenants, f"{f} is served on 0.0.0.0: it needs tenants"


def test_tenant_quotas_are_validated_with_their_cross_references():
    tenant = "tenants: {t: {key_sha256: ['%s'], quota: %s}}\n"
    base = GOOD.split("tenants:")[0]  # without GOOD's own `tenants:`: a second one is refused as a duplicate key
    p = parse_policy(base + tenant % ("c" * 64, "{rpm: 5, tpm: 100, models: {gpt-4o-mini: {rpm: 1}}}"))
    q = p.tenants["t"].quota
    assert q is not None and q.rpm == 5 and q.models["gpt-4o-mini"].rpm == 1 and q.default_max_tokens == 1024
    assert any("quota.rpm" in x for x in _problems(base + tenant % ("c" * 64, "{rpm: 0}")))
    assert any("quota.concurency: unknown field; did you mean `concurrency`" in x for x in _problems(base + tenant % ("c" * 64, "{concurency: 5}")))
    assert any("quota.models.nope: unknown model" in x for x in _problems(base + tenant % ("c" * 64, "{models: {nope: {rpm: 1}}}")))
    assert any("needs a `price` on every backend" in x for x in _problems(base + tenant % ("c" * 64, "{spend_per_day_usd: 5}")))


def test_each_backend_has_a_default_temperature_for_the_cache():
    """OpenAI's 1.0 unless said; a launched backend's is its launch's (0: greedy), one value for both sides."""
    p = parse_policy(GOOD)
    assert p.backends["fast-a"].default_temperature is None and p.backends["fast-a"].sampling_default_temperature == 1.0
    p = parse_policy(GOOD.replace("    models: [gpt-4o-mini]\n", "    models: [gpt-4o-mini]\n    default_temperature: 0\n", 1))
    assert p.backends["fast-a"].sampling_default_temperature == 0.0
    launched = GOOD.replace("    models: [gpt-4o-mini]\n", "    models: [gpt-4o-mini]\n    launch: {model: tiny-random}\n", 1)
    p = parse_policy(launched)
    assert p.backends["fast-a"].launch.default_temperature == 0.0 and p.backends["fast-a"].sampling_default_temperature == 0.0
    p = parse_policy(launched.replace("launch: {model: tiny-random}", "launch: {model: tiny-random, default_temperature: 0.7}"))
    assert p.backends["fast-a"].sampling_default_temperature == 0.7
    same = launched.replace("launch: {model: tiny-random}", "launch: {model: tiny-random}\n    default_temperature: 0")
    assert parse_policy(same).backends["fast-a"].sampling_default_temperature == 0.0


def test_a_default_temperature_is_set_once_and_in_range():
    launched = GOOD.replace("    models: [gpt-4o-mini]\n", "    models: [gpt-4o-mini]\n    launch: {model: tiny-random}\n", 1)
    problems = _problems(launched.replace("launch: {model: tiny-random}", "launch: {model: tiny-random}\n    default_temperature: 1"))
    assert any(p.startswith("backends.fast-a: default_temperature 1 differs from launch.default_temperature 0: set it in `launch` only") for p in problems), problems
    problems = _problems(launched.replace("launch: {model: tiny-random}", "launch: {model: tiny-random, extra_args: [--default-temperature, '0.5']}"))
    assert any(p.startswith("backends.fast-a.launch.extra_args: set `default_temperature` in `launch` instead") for p in problems), problems
    problems = _problems(GOOD.replace("    models: [gpt-4o-mini]\n", "    models: [gpt-4o-mini]\n    default_temperature: 3\n", 1))
    assert any(p.startswith("backends.fast-a.default_temperature:") for p in problems), problems


def test_a_tenant_without_keys_closes_the_gateway_and_is_reached_by_virtual_keys_only():
    text = "backends: {b: {url: 'http://127.0.0.1:9/v1', models: [m]}}\ntenants: {ci: {}}\n"
    p = parse_policy(text)
    assert p.tenants["ci"].key_sha256 == () and not p.open
    tenants = Tenants(p)
    assert not tenants.open  # a tenant with no keys must never make the gateway open
    with pytest.raises(Unauthorized):
        tenants.authenticate("anything")
    assert any("tenants.ci: no keys" in w for w in key_warnings(p))
    with_admin = parse_policy(text + "admin: {key_sha256: ['%s'], viewer_key_sha256: ['%s']}\n" % ("a" * 64, "b" * 64))
    assert not any("tenants.ci" in w for w in key_warnings(with_admin))
    bad = _problems(text + "admin: {key_sha256: ['%s'], viewer_key_sha256: [nope]}\n" % ("a" * 64))
    assert any(b.startswith("admin.viewer_key_sha256") for b in bad)


# ---- aliases: a policy's size with them expanded ---------------------------------------------------


def _laughs(levels: int, width: int = 10) -> str:
    """The "billion laughs" shape: each level a list of `width` aliases of the one before."""
    lines = [f"l0: &l0 [{', '.join(['x'] * width)}]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_expanded_nodes_counts_each_alias_as_the_nodes_it_names():
    import yaml

    from gateway.config.policy import expanded_nodes

    root = yaml.compose("a: &a [x, y]\nb: [*a, *a, *a]\n", Loader=yaml.SafeLoader)
    # mapping 1 + keys a, b 2 + list a (1 + 2) + list b (1 + 3 x 3)
    assert expanded_nodes(root, 1000) == 1 + 2 + 3 + 10
    assert expanded_nodes(root, 5) == 6  # past the limit: limit + 1, whatever the real count
    deep = yaml.compose(_laughs(9), Loader=yaml.SafeLoader)  # 10^9 values as 90 written
    assert expanded_nodes(deep, 10**6) == 10**6 + 1


def test_an_alias_inside_itself_counts_as_too_many():
    import yaml

    from gateway.config.policy import expanded_nodes

    assert expanded_nodes(yaml.compose("a: &a [1, *a]\n", Loader=yaml.SafeLoader), 10**6) == 10**6 + 1


def test_a_policy_of_nested_aliases_is_refused_at_once_not_validated_for_hours():
    text = "version: 1\nbackends: {a: {url: 'http://127.0.0.1:1/v1', models: [m]}}\n" + _laughs(9)
    with pytest.raises(PolicyError, match="more than 1,000,000 values with its aliases expanded"):
        parse_policy(text)
    with pytest.raises(PolicyError, match="more than 50 values"):
        parse_policy("version: 1\nbackends: {a: {url: 'http://127.0.0.1:1/v1', models: [m]}}\n" + _laughs(2), max_nodes=50)


def test_aliases_within_the_bound_still_work():
    text = ("version: 1\nbackends:\n  a: {url: 'http://127.0.0.1:1/v1', models: &served [m, n]}\n"
            "  b: {url: 'http://127.0.0.1:2/v1', models: *served}\nmodels:\n  m: {backends: &both [a, b]}\n  n: {backends: *both}\n")
    p = parse_policy(text)
    assert p.backends["b"].models == p.backends["a"].models
    assert list(p.models["n"].backends) == ["a", "b"]
