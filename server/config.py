"""Server configuration: every setting, its flag, its COMMCTX_* variable and its
default, in one table. The only place the server reads the environment.

A flag beats its variable, which beats the default. Invalid values stop the
server at start with a message naming the flag or variable and the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def _version() -> str:
    try:
        return importlib.metadata.version("commctx")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown: the commctx distribution is not installed)"


def _number(text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise ValueError("not a number" if kind is float else "not a whole number") from None


def _port(text: str) -> int:
    value = _number(text, int)
    if not 0 <= value <= 65535:
        raise ValueError("out of range 0..65535")
    return value


def _optional_port(text: str) -> int | None:
    return None if text in ("", "off") else _port(text)


def _count(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise ValueError("must be at least 1")
    return value


def _positive(text: str) -> float:
    value = _number(text, float)
    if not value > 0:
        raise ValueError("must be positive")
    return value


def _non_negative(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise ValueError("must not be negative")
    return value


def _share(text: str) -> float:
    value = _number(text, float)
    if not 0 < value <= 1:
        raise ValueError("must be above 0 and at most 1")
    return value


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.lower()
        if value not in options:
            raise ValueError(f"not one of {', '.join(options)}")
        return value

    return parse


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    parse: Callable[[str], Any]
    default: str
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "COMMCTX_" + self.name.upper()


SETTINGS = (
    Setting("host", str, "127.0.0.1", "address every port (--port, --health-port, --http-port) listens on; the default serves this machine only; 0.0.0.0 or :: serves every interface (a loud warning without --auth-tokens or --tls-client-ca)"),
    Setting("port", _port, "50051", "rendezvous (and health) gRPC port; 0 picks a free one"),
    Setting("health_port", _optional_port, "off", "an extra plaintext port serving only grpc.health.v1, e.g. for Kubernetes' gRPC probes; 0 picks a free one"),
    Setting("http_port", _optional_port, "50080", "HTTP port of the dashboard (/), the JSON API (/api/v1) and Prometheus metrics (/metrics); 0 picks a free one; off: none"),
    Setting("metrics_port", _optional_port, "off", "the old name of --http-port (when given, the HTTP server listens there)"),
    Setting("http_max_connections", _count, "1000", "HTTP connections open at once, all peers together; another is answered 503 and closed"),
    Setting("http_peer_connections", _count, "32", "HTTP connections one peer address may hold open at once; another is answered 429 and closed (behind a proxy every connection is the proxy's: raise it there)"),
    Setting("http_idle_timeout_s", _positive, "15", "an HTTP connection that sends no byte of a request this long after it opened, or after its last answer, is closed"),
    Setting("http_header_timeout_s", _positive, "10", "an HTTP connection whose request line and headers are not complete this long after their first byte is closed (slowloris)"),
    Setting("lease_ttl_s", _positive, "10", "member lease in seconds; clients renew at a third of it"),
    Setting("reconnect_grace_s", _non_negative, "1", "a member whose session ends without a Leave (its process was killed, its connection broke) keeps its seat this long for a new session, then is removed and its world re-forms; at most --lease-ttl-s. A hung process keeps its connection and is found by its lease"),
    Setting("store", _choice("sqlite", "memory", "etcd"), "sqlite", "where state lives: a SQLite database under --state-dir (survives restarts), memory only, or etcd (several replicas, one leader: high availability)"),
    Setting("state_dir", str, "~/.local/state/commctx", "directory of the SQLite store"),
    Setting("grace_s", _non_negative, "5", "on SIGTERM, how long in-flight calls may finish"),
    Setting("log_level", _choice("debug", "info", "warning", "error"), "info", "log level"),
    Setting("log_format", _choice("plain", "json"), "plain", "one line per event, as key=value text or JSON"),
    Setting("max_jobs", _count, "10000", "jobs one server holds at most; a Join that would create another gets RESOURCE_EXHAUSTED"),
    Setting("max_members", _count, "200000", "members (workers) one server holds at most, across its jobs"),
    Setting("max_spec_bytes", _count, "65536", "largest JobSpec a Join may carry, in bytes"),
    Setting("max_spec_rules", _count, "1024", "most roles + group rules + cpu twins + expected nodes a JobSpec may list"),
    Setting("max_join_wait_s", _positive, "3600", "longest a Join waits for its world, whatever wait it asks for"),
    Setting("max_streams", _count, "200000", "open Session streams at most; another gets RESOURCE_EXHAUSTED (its client retries)"),
    Setting("max_world_size", _count, "131072", "workers one job holds at most (its world, its standbys and the Joins waiting in it, a node membership's counted by its workers); a Join that would take a job past it gets RESOURCE_EXHAUSTED, and a spec whose smallest world is larger INVALID_ARGUMENT. 131,072 (2^17, 128 nodes of 1,024) covers a 100,000-GPU job with room for standbys; much more would let one job's world stall the server for seconds"),
    Setting("max_workers_per_caller", _count, "131072", "workers one caller holds at most, waiting or placed, all its jobs together (a node Join counts its workers); another Join gets RESOURCE_EXHAUSTED. The default is one largest world (--max-world-size): one token can bring the biggest job at once, and no caller two; admin tokens are exempt"),
    Setting("retain_ended_jobs", _count, "1000", "runs that ended (finished, failed or closed) kept after their last worker left, with who took part and their events (status --all, the dashboard); the oldest go first"),
    Setting("retain_ended_s", _positive, "300", "how long such a run is kept"),
    Setting("caller_share", _share, "0.25", "the fraction of --max-jobs, --max-members (as Joins waiting) and --max-streams one caller may hold: a token (with --auth-tokens), else a client certificate, else a peer address; admin tokens are exempt"),
    Setting("max_events_per_job", _count, "1000", "a job's history (commctx events, the dashboard) keeps its last this many events"),
    Setting("max_connection_age_s", _positive, "3600", "a connection is closed (GOAWAY) after this long, its calls in flight then get --max-join-wait-s + 1 s more; clients reconnect"),
    Setting("tls_cert", str, "", "PEM certificate chain: the main port speaks TLS only (the health-only port stays plaintext)"),
    Setting("tls_key", str, "", "PEM private key of --tls-cert"),
    Setting("auth_tokens", str, "", "file of bearer tokens, one per line ('TOKEN' or 'TOKEN admin'); every call but health then needs one; re-read on SIGHUP"),
    Setting("tls_client_ca", str, "", "PEM CA bundle: require client certificates it signed (mutual TLS; needs --tls-cert)"),
    Setting("etcd_endpoints", str, "", "with --store etcd: host:port[,host:port...] of the etcd cluster"),
    Setting("etcd_prefix", str, "/commctx", "with --store etcd: the key prefix this rendezvous keeps its state and election under"),
    Setting("etcd_ca", str, "", "PEM CA bundle of etcd's server certificates: talk to etcd over TLS"),
    Setting("etcd_cert", str, "", "PEM client certificate for etcd (mutual TLS; with --etcd-key)"),
    Setting("etcd_key", str, "", "PEM private key of --etcd-cert"),
    Setting("etcd_user", str, "", "etcd user (with COMMCTX_ETCD_PASSWORD)"),
    Setting("etcd_password", str, "", "password of --etcd-user (prefer the variable: flags show in ps)"),
    Setting("advertise_addr", str, "", "host:port clients reach this replica at, handed out as the leader's address (default: --host:--port, or this host's address when --host is 0.0.0.0 or ::)"),
    Setting("election_ttl_s", _positive, "5", "with --store etcd: the election lease; a dead leader is replaced within it (+1 s)"),
)


@dataclasses.dataclass(frozen=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 50051
    health_port: int | None = None
    http_port: int | None = 50080
    metrics_port: int | None = None
    http_max_connections: int = 1000
    http_peer_connections: int = 32
    http_idle_timeout_s: float = 15.0
    http_header_timeout_s: float = 10.0
    lease_ttl_s: float = 10.0
    reconnect_grace_s: float = 1.0
    store: str = "sqlite"
    state_dir: str = "~/.local/state/commctx"
    grace_s: float = 5.0
    log_level: str = "info"
    log_format: str = "plain"
    max_jobs: int = 10_000
    max_members: int = 200_000
    max_spec_bytes: int = 65_536
    max_spec_rules: int = 1024
    max_join_wait_s: float = 3600.0
    max_streams: int = 200_000
    max_world_size: int = 131_072
    max_workers_per_caller: int = 131_072
    retain_ended_jobs: int = 1000
    retain_ended_s: float = 300.0
    max_connection_age_s: float = 3600.0
    max_events_per_job: int = 1000
    caller_share: float = 0.25
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_tokens: str = ""
    etcd_endpoints: str = ""
    etcd_prefix: str = "/commctx"
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    etcd_user: str = ""
    etcd_password: str = ""
    advertise_addr: str = ""
    election_ttl_s: float = 5.0


def parser(prog: str = "commctx-server") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="commctx rendezvous server")
    p.add_argument("--version", action="version", version=f"{prog} {_version()}")
    for s in SETTINGS:
        p.add_argument(s.flag, dest=s.name, metavar=s.name.upper(), help=f"{s.help} ({s.env}; default {s.default})")
    return p


def from_env(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Reads flags (argv), then COMMCTX_* variables (env), then defaults.

    Raises:
        SystemExit: an invalid value (argparse's usage error, exit status 2).
    """
    env = os.environ if env is None else env
    p = parser()
    args = p.parse_args(argv)
    values = {}
    for s in SETTINGS:
        flag_value = getattr(args, s.name)
        source, raw = (s.flag, flag_value) if flag_value is not None else (s.env, env.get(s.env, s.default))
        try:
            values[s.name] = s.parse(raw)
        except ValueError as exc:
            p.error(f"{source}={raw}: {exc}")
    for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_tokens"):  # security never turns off by an empty flag
        setting = next(x for x in SETTINGS if x.name == name)
        if getattr(args, name) == "" and env.get(setting.env):
            p.error(f"{setting.flag} is empty but {setting.env} is set: an empty flag would turn "
                    f"{'TLS' if name.startswith('tls') else 'tokens'} off; unset {setting.env} to serve without it")
    grace_given = args.reconnect_grace_s is not None or "COMMCTX_RECONNECT_GRACE_S" in env
    if not grace_given:  # the default 1 s, but never beyond a shorter lease
        values["reconnect_grace_s"] = min(values["reconnect_grace_s"], values["lease_ttl_s"])
    elif values["reconnect_grace_s"] > values["lease_ttl_s"]:
        p.error(f"--reconnect-grace-s {values['reconnect_grace_s']:g} is longer than --lease-ttl-s "
                f"{values['lease_ttl_s']:g}: a grace beyond the lease would keep a dead member longer than its lease")
    if bool(values["tls_cert"]) != bool(values["tls_key"]):
        p.error("--tls-cert and --tls-key go together (COMMCTX_TLS_CERT, COMMCTX_TLS_KEY)")
    if values["store"] == "etcd" and not values["etcd_endpoints"]:
        p.error("--store etcd needs --etcd-endpoints host:port[,host:port...] (COMMCTX_ETCD_ENDPOINTS)")
    if bool(values["etcd_cert"]) != bool(values["etcd_key"]):
        p.error("--etcd-cert and --etcd-key go together (COMMCTX_ETCD_CERT, COMMCTX_ETCD_KEY)")
    if bool(values["etcd_user"]) != bool(values["etcd_password"]):
        p.error("--etcd-user needs its password (COMMCTX_ETCD_PASSWORD), and the password its user")
    if values["tls_client_ca"] and not values["tls_cert"]:
        p.error("--tls-client-ca requires client certificates over TLS: give --tls-cert and --tls-key too")
    if values["metrics_port"] is not None:  # the old name: it is the HTTP port, unless the --http-port flag is given too
        if args.http_port is not None and values["http_port"] != values["metrics_port"]:
            p.error(f"--metrics-port is the old name of --http-port: give one of them (they say "
                    f"{values['metrics_port']} and {values['http_port']})")
        values["http_port"] = values["metrics_port"]
    values["metrics_port"] = None
    ports = [(flag, values[name]) for flag, name in (("--port", "port"), ("--health-port", "health_port"),
                                                     ("--http-port", "http_port")) if values[name]]
    for i, (flag, port) in enumerate(ports):  # 0 (any free port) and off never clash
        for other, same in ports[:i]:
            if same == port:
                p.error(f"{other} and {flag} are both {port}: each needs a port of its own")
    return Config(**values)
