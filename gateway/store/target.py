"""What a `store.url` names: one Redis, a master behind Sentinel, or a Cluster. Parsed here (no
redis import), so the policy checks a URL when it is loaded and the clients are built from the
same reading (store/connect.py)."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

__all__ = ["Topology", "Target", "parse_target", "hide_password"]


class Topology(enum.Enum):
    SINGLE = "single"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


@dataclass(frozen=True)
class Target:
    """Where a store URL points. `hosts` are the sentinels or the cluster's seed nodes."""

    topology: Topology
    url: str
    tls: bool
    hosts: tuple[tuple[str, int], ...] = ()
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None


_MULTI = re.compile(r"^(redis|rediss)\+(sentinel|cluster)://(?:(?P<auth>[^@/]*)@)?(?P<hosts>[^/?#]+)(?P<path>/[^?#]*)?(?:\?(?P<query>[^#]*))?$")
# Up to the authority's last '@': yarl, aiohttp and redis-py split a password holding a raw '@' there.
_USERINFO = re.compile(r"^([a-z][a-z0-9+.-]*://)[^/?#]*@", re.I)
# redis-py also reads the credentials from the query (`?password=...&username=...`); other URLs a
# policy holds (a metrics_url, an OTLP endpoint) may carry a token or key there.
_SECRET_PARAM = re.compile(
    r"([?&](?:[a-z0-9_.-]*(?:password|passwd|secret|token|key|auth|signature|credential)[a-z0-9_.-]*|username|user|sig)=)[^&#]*",
    re.I)
_OWNED = {"max_connections", "socket_timeout", "socket_connect_timeout", "timeout", "retry_on_timeout", "retry_on_error",
          "client_name", "health_check_interval"}
_DEFAULT_PORT = {Topology.SENTINEL: 26379, Topology.CLUSTER: 6379}


def parse_target(url: str) -> Target:
    """The topology a store URL names; ValueError saying what is wrong with it.

    `redis+sentinel://[user:password@]host:port,host:port/service[/db]` (the password is the
    master's; sentinels are asked without one), `redis+cluster://[user:password@]host:port,...`
    (seed nodes: the client learns the others), and `rediss+...` for TLS to every node."""
    if re.match(r"^(redis|rediss|unix)://", url):
        query = parse_qs(url.partition("?")[2].partition("#")[0])
        if owned := sorted(set(query) & _OWNED):
            # redis-py lets a URL's options override the client's: these would undo the pool's
            # bound and the calls' deadlines.
            raise ValueError(f"{', '.join(owned)} in the URL: the policy's `store` section sets those "
                             f"(max_connections, timeout_ms, quota_timeout_ms), not the URL")
        if not url.startswith("unix://"):
            try:
                port = urlsplit(url).port
            except ValueError:  # not a number, or past 65535: redis-py refuses it when it connects
                port = 0
            if port == 0:
                raise ValueError(f"the port must be a number from 1 to 65535 in {hide_password(url)!r}")
        return Target(Topology.SINGLE, url, tls=url.startswith("rediss://"))
    m = _MULTI.match(url)
    if m is None:
        raise ValueError(
            f"must be a redis://, rediss://, unix://, redis+sentinel://host:port,.../service or "
            f"redis+cluster://host:port,... URL (rediss+ for TLS), got {hide_password(url)!r}"
        )
    topology = Topology.SENTINEL if m.group(2) == "sentinel" else Topology.CLUSTER
    username = password = None
    if m.group("auth"):
        user, _, pw = m.group("auth").partition(":")
        username, password = unquote(user) or None, unquote(pw) or None
    hosts = tuple(_host(h, _DEFAULT_PORT[topology], url) for h in m.group("hosts").split(","))
    parts = [p for p in (m.group("path") or "").split("/") if p]
    service, db = "", 0
    if topology is Topology.SENTINEL:
        if not parts or len(parts) > 2:
            raise ValueError(f"a Sentinel URL names its service after the hosts (…/mymaster or …/mymaster/0), got {hide_password(url)!r}")
        service = unquote(parts[0])
        if len(parts) == 2:
            db = _int(parts[1], "database", url)
    elif parts:
        raise ValueError(f"a Cluster URL has no path (a cluster has one database), got {hide_password(url)!r}")
    if m.group("query"):
        raise ValueError(f"options of {m.group(1)}+{m.group(2)}:// go in the policy's `store` section, not the URL: {sorted(parse_qs(m.group('query')))}")
    return Target(topology, url, m.group(1) == "rediss", hosts, service, db, username, password)


def _host(text: str, default_port: int, url: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host, port = text.strip(), str(default_port)
    if not host:
        raise ValueError(f"empty host in {hide_password(url)!r}")
    number = _int(port, "port", url)
    if not 1 <= number <= 65535:
        raise ValueError(f"port {port!r} is not from 1 to 65535 in {hide_password(url)!r}")
    return host.strip("[]"), number


def _int(text: str, what: str, url: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number in {hide_password(url)!r}") from None
    if v < 0:
        raise ValueError(f"{what} {text!r} is negative in {hide_password(url)!r}")
    return v


def hide_password(url: str) -> str:
    """`url` with the credentials before its `@` replaced (`redis://:secret@h` -> `redis://<redacted>@h`),
    and those of its query (`?password=secret` -> `?password=<redacted>`, which redis-py reads
    too): for errors, logs and the admin plane's view of the policy."""
    return _SECRET_PARAM.sub(r"\1<redacted>", _USERINFO.sub(r"\1<redacted>@", url))
