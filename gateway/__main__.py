"""CLI: `gateway serve`, `gateway check`, `gateway hash-key`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

__all__ = ["main"]

log = logging.getLogger("gateway")


def _policy_path(arg: str | None) -> str:
    path = arg or os.environ.get("GATEWAY_POLICY")
    if not path:
        sys.exit("gateway: no policy: pass --policy FILE or set GATEWAY_POLICY")
    return path


def cmd_check(args: argparse.Namespace) -> int:
    from .config.policy import PolicyError, load_policy

    try:
        policy = load_policy(args.file)
    except PolicyError as exc:
        for problem in exc.problems:
            print(f"{exc.source}: {problem}", file=sys.stderr)
        print(f"{exc.source}: {len(exc.problems)} error(s)", file=sys.stderr)
        return 1
    from .admin.policy_view import env_warnings
    from .tenants.auth import key_warnings

    for line in [*env_warnings(policy), *key_warnings(policy)]:
        print(f"{args.file}: warning: {line}", file=sys.stderr)
    from .classify.classifier import Classifier
    from .config.runtime import cascade_for

    try:
        classifier = Classifier.load(policy.classifier.weights_file)
    except ValueError as exc:
        print(f"{args.file}: classifier.weights_file: {exc}", file=sys.stderr)
        return 1
    try:
        cascade_for(policy, classifier, None)  # the encoder's folder, read as `serve` reads it
    except ValueError as exc:
        print(f"{args.file}: {exc}", file=sys.stderr)
        return 1
    print(
        f"{args.file}: ok ({len(policy.backends)} backends, {len(policy.public_models())} models, "
        f"{len(policy.tenants)} tenants)"
    )
    return 0


def cmd_hash_key(args: argparse.Namespace) -> int:
    from .tenants.auth import hash_key

    if args.new:
        import secrets

        key = "sk-" + secrets.token_urlsafe(32)
        print(f"key:        {key}   (give it to the caller; it is stored nowhere)")
        print(f"key_sha256: {hash_key(key)}   (put this in the policy)")
        return 0
    key = args.key
    if key is None:
        # From stdin: a key on the command line shows up in `ps` and in shell history.
        if sys.stdin.isatty():
            print("key (not echoed, end with Enter): ", end="", file=sys.stderr, flush=True)
            import getpass

            key = getpass.getpass(prompt="")
        else:
            key = sys.stdin.readline()
        key = key.strip()  # as the gateway strips the bearer header
    if not key:
        print("gateway: hash-key: empty key", file=sys.stderr)
        return 1
    print(hash_key(key))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    policy = _policy_path(args.policy)
    from .config.policy import PolicyError, load_policy
    from .config.runtime import build_runtime
    from .tenants.auth import open_mode_problem

    try:
        # Fail fast, with every error, before binding anything: the policy, then what it refers
        # to (API key variables, a classifier weights file).
        loaded = load_policy(policy)
        problem = open_mode_problem(loaded, args.host)
        if problem is not None:
            print(f"gateway: {policy}: {problem}", file=sys.stderr)
            return 2
        build_runtime(loaded, {}, generation=0)  # to validate only: never activated, nothing is put in force
    except (PolicyError, ValueError) as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 1
    from .process.serve import listen_problem, run_worker, supervise_workers

    # Before anything starts (launched models, workers): a taken port is one line, not a traceback.
    problem = listen_problem(args.host, args.port, reuse_port=args.workers > 1)
    if problem is not None:
        print(f"gateway: {problem}", file=sys.stderr)
        return 1
    if args.workers <= 1:
        return run_worker(policy, args.host, args.port, False, args.access_log)
    if loaded.store.url is None and any(t.quota is not None and t.quota.any() for t in loaded.tenants.values()):
        print(
            f"gateway: {policy}: quotas live in each worker's memory (no `store.url`): every limit applies "
            f"per worker, so {args.workers} workers admit up to {args.workers}x; set store.url to a Redis to share them",
            file=sys.stderr,
        )
    for name, b in loaded.backends.items():
        if b.max_concurrency < args.workers:
            print(
                f"gateway: {policy}: backends.{name}.max_concurrency is {b.max_concurrency}, below --workers "
                f"{args.workers}: each worker holds at least one slot, so up to {args.workers} requests reach it at once",
                file=sys.stderr,
            )
    return supervise_workers(policy, args.host, args.port, args.workers, args.access_log)


def _int_in(low: int, high: int | None) -> Callable[[str], int]:
    """An argparse type: an integer from `low` to `high` (None: no upper bound). argparse's own
    `int` took `--port 70000` (bound as 70000 mod 65536) and `--workers -3` (one worker)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is not from {low} to {high}" if high is not None else f"{value} is below {low}")
        return value

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway", description="Latency-aware OpenAI-compatible LLM gateway")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--policy", help="policy YAML (default: $GATEWAY_POLICY)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_int_in(1, 65535), default=8080)
    serve.add_argument("--workers", type=_int_in(1, None), default=1, help="processes sharing the port (SO_REUSEPORT)")
    serve.add_argument("--access-log", action="store_true", help="write the JSON access log (one line per request on stdout), as the policy's log.access does")
    serve.set_defaults(func=cmd_serve)
    check = sub.add_parser("check", help="validate a policy file; exit 1 on error")
    check.add_argument("file")
    check.set_defaults(func=cmd_check)
    hk = sub.add_parser(
        "hash-key",
        help="print the sha256 to put in a policy's key_sha256 list (the key is read from stdin)",
    )
    hk.add_argument("key", nargs="?", help="the key (better: omit it and pipe it on stdin; argv shows in ps)")
    hk.add_argument("--new", action="store_true", help="make a new random key and print it with its digest")
    hk.set_defaults(func=cmd_hash_key)
    args = parser.parse_args(argv)
    from .process.serve import setup_logging

    setup_logging()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
