"""`commctx-server`: run the rendezvous server until SIGTERM or SIGINT.

On the first signal the server drains (health NOT_SERVING, new joins refused,
in-flight calls finish within --grace-s) and exits 0; a second signal exits 1
at once. A server whose store another server has taken over stops serving and
exits 1. Settings: see server/config.py or `commctx-server --help`.

SIGHUP re-reads the token file and the TLS files (certificate, key, client CA).
"""

from __future__ import annotations

import os

# gRPC core logs a line for each failed TLS handshake, which anyone who reaches the port can cause at
# will; it reads this when grpc is first imported (below), so here. An operator's own setting stands.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import asyncio
import collections
import contextlib
import dataclasses
import errno
import gc
import ipaddress
import logging
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import grpc
import prometheus_client

from commctx.common.addresses import host_port

from .config import Config, from_env
from .rendezvous.model import Limits
from .rendezvous.sqlite import SqliteStore
from .rendezvous.store import Store, StoreError
from .rpc.app import ListenError, ServerTls
from .startup import start_server
from .telemetry import JsonFormatter, configure_logging
from .tokens import Callers

if TYPE_CHECKING:
    from .rendezvous.etcd import EtcdConfig

log = logging.getLogger("commctx.server")


class LogLimit(logging.Filter):
    """At most LINES lines of one event (its logger and message, WARNING and
    above) per WINDOW_S, on every path: a request that fails each time, a
    stranger's garbage, a flood of wrong secrets cannot fill the disk or slow
    the loop with log lines. The first line of an event let through after
    some were held back says how many (`held_back`). INFO and DEBUG lines
    pass: one per membership event, within the server's limits. The KEPT
    most recent events are remembered."""

    LINES, WINDOW_S, KEPT = 5, 60.0, 1024

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._clock = clock
        self._lock = threading.Lock()  # filters run outside the handler's lock, on any thread
        self._by: collections.OrderedDict[tuple[str, str], list[float]] = collections.OrderedDict()  # since, lines, held

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key, now = (record.name, str(record.msg)[:200]), self._clock()
        with self._lock:
            entry = self._by.get(key)
            if entry is None or now - entry[0] >= self.WINDOW_S:
                entry = self._by[key] = [now, 0, entry[2] if entry is not None else 0]
            self._by.move_to_end(key)
            while len(self._by) > self.KEPT:
                self._by.popitem(last=False)
            if entry[1] >= self.LINES:
                entry[2] += 1
                return False
            entry[1] += 1
            held, entry[2] = int(entry[2]), 0
        if held:
            record.fields = {**getattr(record, "fields", {}), "held_back": held}
        return True


def limit_logs() -> LogLimit:
    """Puts a LogLimit on every handler of the root logger (after configure_logging)."""
    limit = LogLimit()
    for handler in logging.getLogger().handlers:
        handler.addFilter(limit)
    return limit


def read_file(path: str, flag: str) -> bytes:
    """Raises: OSError naming the flag and the file that cannot be read."""
    try:
        with open(os.path.expanduser(path), "rb") as f:
            return f.read()
    except OSError as exc:
        raise OSError(f"cannot read {flag} {path}: {exc.strerror}") from None


EXPIRY_WARNING_S = 7 * 86400  # a certificate that expires sooner is logged as a warning


def read_tls(config: Config, now: float | None = None) -> ServerTls | None:
    """The TLS files the configuration names, read and checked: the chain and
    its key must load and match, the client CA bundle must load, and the
    certificate must be valid now (not expired, not yet valid).

    Raises:
        OSError: naming the file that cannot be read, or the files and why they
            cannot serve (never a bind failure later).
    """
    if not config.tls_cert:
        return None
    tls = ReloadableTls(read_file(config.tls_cert, "--tls-cert"), read_file(config.tls_key, "--tls-key"),
                        read_file(config.tls_client_ca, "--tls-client-ca") if config.tls_client_ca else None)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(os.path.expanduser(config.tls_cert), os.path.expanduser(config.tls_key))
    except ssl.SSLError as exc:
        raise OSError(f"--tls-cert {config.tls_cert} and --tls-key {config.tls_key} cannot serve TLS: "
                      f"{_ssl_reason(exc)}") from None
    if tls.client_ca is not None:
        try:
            context.load_verify_locations(cadata=tls.client_ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:
            raise OSError(f"--tls-client-ca {config.tls_client_ca} is not a PEM CA bundle: {_ssl_reason(exc)}") from None
    left = cert_seconds_left(tls.cert_chain, config.tls_cert, now)
    if left < EXPIRY_WARNING_S:
        log.warning("tls_certificate_expires_soon", extra={"fields": {"file": config.tls_cert, "days_left": round(left / 86400, 1)}})
    return tls


def cert_seconds_left(chain: bytes, path: str, now: float | None = None) -> float:
    """Seconds until the first certificate of `chain` expires.

    Raises:
        OSError: it is not a certificate, has expired, or is not valid yet (naming `path`).
    """
    from cryptography import x509  # only a TLS server loads it

    try:
        cert = x509.load_pem_x509_certificate(chain)
    except ValueError as exc:
        raise OSError(f"--tls-cert {path} is not a PEM certificate: {exc}") from None
    now = time.time() if now is None else now
    starts, ends = cert.not_valid_before_utc.timestamp(), cert.not_valid_after_utc.timestamp()
    if now < starts:
        raise OSError(f"--tls-cert {path} is not valid yet: its validity starts {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC")
    if now >= ends:
        raise OSError(f"--tls-cert {path} expired {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC")
    return ends - now


def _ssl_reason(exc: Exception) -> str:
    reason = getattr(exc, "reason", None)
    text = {"KEY_VALUES_MISMATCH": "the key does not match the certificate",
            "PEM_LIB": "not PEM (a certificate or key that does not parse)"}.get(reason or "", None)
    return text or (str(exc.args[-1]) if exc.args else str(exc))


class TlsReloads:
    """The files SIGHUP re-read, for gRPC's next handshake: gRPC asks `fetch`
    before each (grpc.dynamic_ssl_server_credentials), None meaning "as before"."""

    def __init__(self) -> None:
        self._next: grpc.ServerCertificateConfiguration | None = None

    def put(self, tls: ServerTls) -> None:
        self._next = _certificates(tls)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:  # on gRPC's threads
        ready, self._next = self._next, None
        return ready


@dataclasses.dataclass(frozen=True)
class ReloadableTls(ServerTls):
    """The main port's TLS, whose files SIGHUP re-reads: connections made after
    a reload are served with the new certificate and key, and admitted by the
    new client CA bundle (a client certificate only the old CA signed is
    refused); connections already open keep theirs until
    --max-connection-age-s closes them."""

    reloads: TlsReloads = dataclasses.field(default_factory=TlsReloads, compare=False, repr=False)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(_certificates(self), self.reloads.fetch,
                                                   require_client_authentication=self.client_ca is not None)


def _certificates(tls: ServerTls) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(tls.key, tls.cert_chain)], root_certificates=tls.client_ca)


def reload_tls(config: Config, tls: ReloadableTls, server=None) -> None:
    """SIGHUP: re-reads and checks the TLS files as at start; files that do not
    serve (unreadable, mismatched, expired, a CA bundle that does not load)
    change nothing and log `tls_not_reloaded` with the reason."""
    try:
        fresh = read_tls(config)
    except OSError as exc:
        log.error("tls_not_reloaded", extra={"fields": {"reason": str(exc)}})
        return
    assert fresh is not None  # the configuration names the files: they were read at start
    tls.reloads.put(fresh)
    if server is not None:  # commctx_tls_cert_expiry_seconds counts down to the new certificate's end
        server.telemetry._tls_expires_at = time.time() + cert_seconds_left(fresh.cert_chain, config.tls_cert)
    log.info("tls_reloaded", extra={"fields": {"cert": config.tls_cert, "client_ca": config.tls_client_ca or None}})


def reload_tokens(callers: Callers, server=None) -> None:
    """SIGHUP: re-reads the token file (a file that no longer parses changes
    nothing); the calls in flight of tokens it no longer holds end at once."""
    try:
        callers.reload()
    except (OSError, ValueError) as exc:
        log.error("tokens_not_reloaded", extra={"fields": {"reason": str(exc)}})
        return
    ended = server.revoke_tokens() if server is not None else 0
    log.info("tokens_reloaded", extra={"fields": {"tokens": len(callers), "calls_ended": ended}})


def reload(config: Config, callers: Callers | None, tls: ServerTls | None, server=None) -> None:
    """SIGHUP: re-reads the token file and the TLS files, each if the server has them."""
    if callers is not None:
        reload_tokens(callers, server)
    if isinstance(tls, ReloadableTls):
        reload_tls(config, tls, server)


def etcd_config(config: Config) -> EtcdConfig:
    """Raises: OSError naming a TLS file that cannot be read."""
    from .rendezvous.etcd import EtcdConfig  # only an etcd-backed server loads its client (aetcd)

    def read(path: str, flag: str) -> bytes | None:
        return read_file(path, flag) if path else None

    return EtcdConfig(
        tuple(e.strip() for e in config.etcd_endpoints.split(",") if e.strip()), config.etcd_prefix,
        read(config.etcd_ca, "--etcd-ca"), read(config.etcd_cert, "--etcd-cert"), read(config.etcd_key, "--etcd-key"),
        config.etcd_user, config.etcd_password)


def port_in_use(host: str, port: int, what: str = "port", flag: str = "--port") -> str:
    """"" when `port` on `host` can be listened on now, else the one line that
    says why not (e.g. "port 50051 on 0.0.0.0 is already in use (--port)").

    Asked before gRPC binds (which, with SO_REUSEPORT off, fails on a busy port
    too), because a failed bind there costs a traceback and gRPC's own log lines.
    Port 0 (any free port) is always fine.
    """
    if not port:
        return ""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        return f"cannot listen on {host_port(host, port)} ({flag}): host {host!r} does not resolve: {getattr(exc, 'strerror', None) or exc}"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT leftovers are no conflict
            if family == socket.AF_INET6:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                s.bind(sockaddr)
                s.listen(1)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return f"{what} {port} on {host} is already in use ({flag})"
                return f"cannot listen on {host_port(host, port)} ({flag}): {exc.strerror or exc}"
    return ""


def ports_in_use(config: Config) -> str:
    """The first of the configured ports that cannot be listened on (see port_in_use), or ""."""
    wanted = [(config.port, "port", "--port"), (config.health_port, "health port", "--health-port"),
              (config.http_port, "HTTP port", "--http-port")]
    for port, what, flag in wanted:
        if port is not None:
            problem = port_in_use(config.host, port, what, flag)
            if problem:
                return problem
    return ""


def store_line(config: Config, server) -> str:
    """Where the server keeps its state, and what it found there, in words."""
    if config.store == "etcd":
        return (f"etcd {config.etcd_endpoints} under {config.etcd_prefix} (an HA replica: it serves while elected "
                f"leader, restoring the jobs kept there)")
    if config.store == "memory":
        return "memory only (nothing survives a restart)"
    jobs = len(server.machine.job_ids())
    path = os.path.join(os.path.expanduser(config.state_dir), "commctx.sqlite3")
    return f"sqlite {path} ({jobs} job{'s' * (jobs != 1)} restored)"


def loopback_only(host: str) -> bool:
    """Whether every address `host` listens on is a loopback one (127.0.0.0/8,
    ::1): only this machine can reach it. 0.0.0.0, :: and "" are every interface;
    a name counts by what it resolves to, and one that does not resolve as not loopback."""
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError):
        return False

    def loopback(text: str) -> bool:
        try:
            ip = ipaddress.ip_address(text.split("%", 1)[0])
        except ValueError:
            return False
        mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
        return (mapped or ip).is_loopback

    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(loopback(a) for a in addresses)


def exposure(config: Config, tls: ServerTls | None, callers: Callers | None, port: int) -> tuple[bool, list[str]]:
    """Whether the server is open to the network without authentication, and
    the warnings to give at start (stderr) and on the dashboard: none on
    loopback; serving beyond it, one when calls need neither a token
    (--auth-tokens) nor a client certificate (--tls-client-ca). (With client
    certificates and no tokens the HTTP port's JSON API is closed: server/web.)"""
    if loopback_only(config.host):
        return False, []
    if callers is None and (tls is None or tls.client_ca is None):
        return True, [f"WARNING: serving on {host_port(config.host, port)} to the network without authentication: "
                      f"anyone who reaches it can join, read and close jobs; set --auth-tokens or --tls-client-ca"]
    return False, []


def warn_loudly(line: str, log_format: str) -> None:
    """One line on stderr whatever --log-level says (with --log-format json, a JSON one)."""
    if log_format == "json":
        record = log.makeRecord(log.name, logging.WARNING, __file__, 0, "serving_without_authentication", (), None,
                                extra={"fields": {"warning": line}})
        line = JsonFormatter().format(record)
    print(line, file=sys.stderr, flush=True)


def advertise_address(config: Config, port: int) -> str:
    """--advertise-addr, else --host:port, else (host 0.0.0.0 or ::) this host's
    own address: the name of the host if it resolves, as in a StatefulSet."""
    if config.advertise_addr:
        return config.advertise_addr
    host = config.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
        with contextlib.suppress(OSError):
            host = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]
    return host_port(host, port)


async def serve(config: Config, tls: ServerTls | None = None, callers: Callers | None = None,
                etcd: EtcdConfig | None = None) -> int:
    replica = None
    if etcd is not None:
        from .rendezvous.etcd import EtcdStore

        store: Store | None = EtcdStore(etcd)
        if not config.port:
            raise StoreError("--store etcd needs a fixed --port: the replica's address is published to clients")
        from .ha import Replica  # only HA replicas load the election

        replica = Replica(etcd, store, advertise_address(config, config.port), config.election_ttl_s)
    else:
        store = SqliteStore(os.path.expanduser(config.state_dir)) if config.store == "sqlite" else None
    server = await start_server(
        config.host, config.port, lease_ttl_s=config.lease_ttl_s, reconnect_grace_s=config.reconnect_grace_s,
        health_port=config.health_port, http_port=config.http_port, store=store, pace_gc=True, tls=tls,
        callers=callers,
        limits=Limits(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Limits)}),  # same names as the settings
        replica=replica,
    )
    web = server.web  # the HTTP port (None: off), set before the loop serves a request on it
    if web is not None:
        web.connections.max_connections = config.http_max_connections
        web.connections.peer_connections = config.http_peer_connections
        web.connections.idle_s, web.connections.header_s = config.http_idle_timeout_s, config.http_header_timeout_s
        web.client_certs = tls is not None and tls.client_ca is not None  # then its JSON API needs a token, or is closed
    security = ("mutual TLS" if tls.client_ca else "TLS") if tls is not None else "plaintext"
    # The address last on the line, as tools read it (e.g. line.rsplit(":", 1)).
    print(f"commctx-server ({security}, tokens {'on' if callers is not None else 'off'}) listening on "
          f"{host_port(config.host, server.port)}", flush=True)
    if tls is not None:
        server.telemetry.tls_expiry(cert_seconds_left(tls.cert_chain, config.tls_cert))
    if server.health_port is not None:
        print(f"commctx-server health on {host_port(config.host, server.health_port)}", flush=True)
    if server.http_port is not None:
        print(f"commctx-server http on http://{host_port(config.host, server.http_port)}/ "
              f"(the dashboard; /metrics; /api/v1/jobs)", flush=True)
    print(f"commctx-server store: {store_line(config, server)}", flush=True)  # last: tools read the lines above by position
    exposed, warnings = exposure(config, tls, callers, server.port)
    for line in warnings:
        warn_loudly(line, config.log_format)
    if web is not None:  # the dashboard shows them too (a banner; /api/v1/server)
        web.open_to_network, web.warnings = exposed, tuple(warnings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if callers is not None or isinstance(tls, ReloadableTls):
        loop.add_signal_handler(signal.SIGHUP, reload, config, callers, tls, server)
    signalled = asyncio.ensure_future(stop.wait())
    # An HA replica fenced by another goes back to campaigning; a single server stops.
    deposed = asyncio.ensure_future(server.deposed.wait() if replica is None else asyncio.Event().wait())
    await asyncio.wait([signalled, deposed], return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    deposed.cancel()
    log.info("draining", extra={"fields": {"grace_s": config.grace_s}})
    for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal: exit at once
        loop.add_signal_handler(sig, os._exit, 1)
    await server.stop(config.grace_s)
    if server.deposed.is_set() and replica is None:
        log.error("stopped", extra={"fields": {"reason": "another server took over the state store"}})
        return 1
    log.info("stopped")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    config = from_env(argv)
    configure_logging(config.log_level, config.log_format)
    limit_logs()
    prometheus_client.disable_created_metrics()  # no *_created series beside each counter
    gc.freeze()  # what start-up made lives as long as the process: never scan it
    try:
        tls = read_tls(config)
        callers = Callers(os.path.expanduser(config.auth_tokens)) if config.auth_tokens else None
        etcd = etcd_config(config) if config.store == "etcd" else None
    except (OSError, ValueError) as exc:  # one line naming the file; no traceback
        print(f"commctx-server: {exc}", file=sys.stderr)
        return 1
    busy = ports_in_use(config)  # one line naming the port; no traceback
    if busy:
        print(f"commctx-server: {busy}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(serve(config, tls, callers, etcd))
    except StoreError as exc:
        print(f"commctx-server: {exc}", file=sys.stderr)
        return 1
    except ListenError as exc:  # a port taken between the check above and the bind
        print(f"commctx-server: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    except OSError as exc:  # the metrics port, likewise
        if exc.errno != errno.EADDRINUSE:
            raise
        print(f"commctx-server: cannot listen: {exc.strerror}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
