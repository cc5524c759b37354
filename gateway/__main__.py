"""CLI: `gateway serve`, `gateway check`, `gateway hash-key`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

__all__ = ["main"]

log = logging.getLogger("gateway")


def _policy_path(arg: str | None) -> str:
    path = arg or os.environ.get("GATEWAY_POLICY")
    if not path:
        sys.exit("gateway: no policy: pass --policy FILE or set GATEWAY_POLICY")
    return path


def cmd_check(args: argparse.Namespace) -> int:
    from .policy import PolicyError, load_policy

    try:
        policy = load_policy(args.file)
    except PolicyError as exc:
        for problem in exc.problems:
            print(f"{exc.source}: {problem}", file=sys.stderr)
        print(f"{exc.source}: {len(exc.problems)} error(s)", file=sys.stderr)
        return 1
    missing = [
        f"backends.{name}.api_key_env: environment variable {b.api_key_env} is not set here"
        for name, b in policy.backends.items()
        if b.api_key_env and not os.environ.get(b.api_key_env)
    ]
    for line in missing:
        print(f"{args.file}: warning: {line}", file=sys.stderr)
    from .classify import Classifier

    try:
        Classifier.load(policy.classifier.weights_file)
    except ValueError as exc:
        print(f"{args.file}: classifier.weights_file: {exc}", file=sys.stderr)
        return 1
    print(
        f"{args.file}: ok ({len(policy.backends)} backends, {len(policy.public_models())} models, "
        f"{len(policy.tenants)} tenants)"
    )
    return 0


def cmd_hash_key(args: argparse.Namespace) -> int:
    from .auth import hash_key

    print(hash_key(args.key))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    policy = _policy_path(args.policy)
    from .policy import PolicyError, load_policy

    from .runtime import build_runtime

    try:
        # Fail fast, with every error, before binding anything: the policy, then what it refers
        # to (API key variables, a classifier weights file).
        build_runtime(load_policy(policy), {}, generation=0)
    except (PolicyError, ValueError) as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 1
    from .serve import run_worker, supervise_workers

    if args.workers <= 1:
        run_worker(policy, args.host, args.port, False, args.access_log)
        return 0
    return supervise_workers(policy, args.host, args.port, args.workers, args.access_log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description="Latency-aware OpenAI-compatible LLM gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--policy", help="policy YAML (default: $GATEWAY_POLICY)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--workers", type=int, default=1, help="processes sharing the port (SO_REUSEPORT)")
    serve.add_argument("--access-log", action="store_true", help="log every request (off: it costs latency)")
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check", help="validate a policy file; exit 1 on error")
    check.add_argument("file")
    check.set_defaults(func=cmd_check)
    hk = sub.add_parser("hash-key", help="print the sha256 to put in a policy's key_sha256 list")
    hk.add_argument("key")
    hk.set_defaults(func=cmd_hash_key)
    args = parser.parse_args(argv)
    from .serve import setup_logging

    setup_logging()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
