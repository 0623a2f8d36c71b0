"""TLS on Conveyor's links: the settings checks and the client contexts for NATS and
Postgres (the api's gRPC port has its own, in the api service).

The rule every service enforces at start (``conveyor dev`` aside, which allows
plaintext): nothing leaves the machine in plaintext. The api refuses to listen beyond
loopback without a certificate, and a service refuses a NATS or Postgres link to a
non-loopback host without TLS, unless ``CONVEYOR_ALLOW_PLAINTEXT=true`` says that is
intended. Loopback links (a sidecar, the tests) never leave the machine and may stay
plaintext.
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, cast
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from conveyor_runtime.settings import (
        ApiSettings,
        BepSettings,
        BepWebSettings,
        CommonSettings,
        RestSettings,
    )

__all__ = [
    "SECURE_SSLMODES",
    "SslMode",
    "check_links",
    "check_rest_tls",
    "check_server_tls",
    "client_context",
    "describe_hosts",
    "dsn_hosts",
    "effective_sslmode",
    "grpc_target",
    "is_loopback",
    "nats_hosts",
    "nats_tls_context",
    "nats_tls_wanted",
    "postgres_ssl",
]

SslMode = Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"]
#: The Postgres sslmodes that never fall back to plaintext.
SECURE_SSLMODES: frozenset[str] = frozenset({"require", "verify-ca", "verify-full"})
_SSLMODES: frozenset[str] = frozenset(
    {"disable", "allow", "prefer", "require", "verify-ca", "verify-full"}
)
_PLAINTEXT_HINT = "or, knowingly, CONVEYOR_ALLOW_PLAINTEXT=true"


def is_loopback(host: str) -> bool:
    """True for a host that never leaves this machine: ``localhost``, a loopback address,
    or no host at all (a Unix socket)."""
    host = host.strip().strip("[]").lower()
    if not host or host.startswith("/"):
        return True
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def nats_hosts(url: str) -> list[tuple[str, str]]:
    """``(scheme, host)`` of every server in a comma-separated NATS URL list."""
    hosts: list[tuple[str, str]] = []
    for part in url.split(","):
        part = part.strip()
        if not part:
            continue
        if "://" not in part:
            part = f"nats://{part}"
        parsed = urlsplit(part)
        hosts.append((parsed.scheme.lower(), parsed.hostname or ""))
    return hosts


def nats_tls_wanted(settings: CommonSettings) -> bool:
    """True when the settings ask for TLS to NATS: a ``tls://`` URL or any ``nats_tls_*``."""
    if settings.nats_tls_ca or settings.nats_tls_cert or settings.nats_tls_key:
        return True
    return any(scheme == "tls" for scheme, _ in nats_hosts(settings.nats_url))


def dsn_hosts(dsn: str) -> list[str]:
    """The hosts a Postgres DSN names (``""`` for a Unix socket)."""
    parsed = urlsplit(dsn)
    hosts: list[str] = []
    netloc = parsed.netloc.rpartition("@")[2]
    for part in netloc.split(","):
        part = part.strip()
        if part.startswith("["):
            hosts.append(part[1 : part.find("]")])
        else:
            hosts.append(part.partition(":")[0])
    query = parse_qs(parsed.query)
    for value in query.get("host", []):
        hosts += [h.strip() for h in value.split(",")]
    named = [h for h in hosts if h]
    if named:
        return named
    # No host anywhere: libpq (and asyncpg) use PGHOST, else the local Unix socket.
    pghost = os.environ.get("PGHOST", "")
    return [h.strip() for h in pghost.split(",")] if pghost else [""]


def _dsn_sslmode(dsn: str) -> str | None:
    values = parse_qs(urlsplit(dsn).query).get("sslmode")
    return values[-1] if values else None


def effective_sslmode(settings: CommonSettings) -> str:
    """The sslmode the Postgres connections use: ``db_sslmode``, else the DSN's, else
    ``PGSSLMODE``, else libpq's default ``prefer``."""
    return (
        settings.db_sslmode or _dsn_sslmode(settings.dsn) or os.environ.get("PGSSLMODE", "prefer")
    )


def _check_file(problems: list[str], variable: str, path: str | None) -> None:
    if path is None:
        return
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        problems.append(f"{variable}: cannot read {path}: {exc.strerror or exc}")


def _check_pair(
    problems: list[str], cert: tuple[str, str | None], key: tuple[str, str | None]
) -> None:
    if bool(cert[1]) != bool(key[1]):
        problems.append(f"{cert[0]} and {key[0]} go together: set both or neither")


def _raise(problems: list[str]) -> None:
    if problems:
        raise ValueError("; ".join(problems))


def check_links(settings: CommonSettings) -> None:
    """Raise ValueError naming every problem with the NATS and Postgres TLS settings:
    unreadable files, a certificate without its key, and (unless ``allow_plaintext``) a
    plaintext link to a host beyond this machine."""
    problems: list[str] = []
    for variable, path in (
        ("CONVEYOR_NATS_TLS_CA", settings.nats_tls_ca),
        ("CONVEYOR_NATS_TLS_CERT", settings.nats_tls_cert),
        ("CONVEYOR_NATS_TLS_KEY", settings.nats_tls_key),
        ("CONVEYOR_NATS_NKEY_SEED", settings.nats_nkey_seed),
        ("CONVEYOR_NATS_CREDS", settings.nats_creds),
        ("CONVEYOR_DB_SSLROOTCERT", settings.db_sslrootcert),
        ("CONVEYOR_DB_SSLCERT", settings.db_sslcert),
        ("CONVEYOR_DB_SSLKEY", settings.db_sslkey),
    ):
        _check_file(problems, variable, path)
    _check_pair(
        problems,
        ("CONVEYOR_NATS_TLS_CERT", settings.nats_tls_cert),
        ("CONVEYOR_NATS_TLS_KEY", settings.nats_tls_key),
    )
    _check_pair(
        problems,
        ("CONVEYOR_DB_SSLCERT", settings.db_sslcert),
        ("CONVEYOR_DB_SSLKEY", settings.db_sslkey),
    )
    if bool(settings.nats_user) != bool(settings.nats_password):
        problems.append("CONVEYOR_NATS_USER and CONVEYOR_NATS_PASSWORD go together")
    methods = [
        name
        for name, value in (
            ("CONVEYOR_NATS_USER", settings.nats_user),
            ("CONVEYOR_NATS_TOKEN", settings.nats_token),
            ("CONVEYOR_NATS_NKEY_SEED", settings.nats_nkey_seed),
            ("CONVEYOR_NATS_CREDS", settings.nats_creds),
        )
        if value
    ]
    if len(methods) > 1:
        problems.append(f"one NATS authentication at a time: {', '.join(methods)} are all set")
    mode = effective_sslmode(settings)
    if mode not in _SSLMODES:
        problems.append(f"unknown Postgres sslmode {mode!r}")
    if not settings.allow_plaintext:
        if not nats_tls_wanted(settings):
            remote = [host for _, host in nats_hosts(settings.nats_url) if not is_loopback(host)]
            if remote:
                problems.append(
                    f"NATS at {', '.join(remote)} without TLS: set CONVEYOR_NATS_TLS_CA "
                    f"(or a tls:// URL), {_PLAINTEXT_HINT}"
                )
        if settings.broker == "postgres" and mode not in SECURE_SSLMODES:
            remote = [host for host in dsn_hosts(settings.dsn) if not is_loopback(host)]
            if remote:
                problems.append(
                    f"Postgres at {', '.join(remote)} with sslmode={mode}, which may fall "
                    "back to plaintext: set CONVEYOR_DB_SSLMODE=verify-full (with "
                    f"CONVEYOR_DB_SSLROOTCERT for a private CA), {_PLAINTEXT_HINT}"
                )
    _raise(problems)


def check_server_tls(
    settings: ApiSettings | BepSettings | BepWebSettings, *, port: str = "gRPC"
) -> None:
    """Raise ValueError for a server's TLS settings (the api's and the ingest's gRPC
    port, the build-event web UI's HTTPS): a certificate without its key, a client CA
    without a certificate, unreadable files, and (unless ``allow_plaintext``) no
    certificate on a port that listens beyond loopback."""
    problems: list[str] = []
    client_ca = getattr(settings, "tls_client_ca", None)
    for variable, path in (
        ("CONVEYOR_TLS_CERT", settings.tls_cert),
        ("CONVEYOR_TLS_KEY", settings.tls_key),
        ("CONVEYOR_TLS_CLIENT_CA", client_ca),
    ):
        _check_file(problems, variable, path)
    _check_pair(
        problems, ("CONVEYOR_TLS_CERT", settings.tls_cert), ("CONVEYOR_TLS_KEY", settings.tls_key)
    )
    if client_ca and not settings.tls_cert:
        problems.append(
            "CONVEYOR_TLS_CLIENT_CA (mutual TLS) needs CONVEYOR_TLS_CERT and CONVEYOR_TLS_KEY"
        )
    if not settings.tls_cert and not settings.allow_plaintext and not is_loopback(settings.host):
        problems.append(
            f"no TLS certificate for the {port} port on {settings.host}: set CONVEYOR_TLS_CERT "
            f"and CONVEYOR_TLS_KEY, {_PLAINTEXT_HINT}"
        )
    _raise(problems)


def grpc_target(target: str) -> tuple[str, bool | None]:
    """A gRPC target as the CLI and the SDK take it: ``https://host:port`` is
    ``("host:port", True)``, ``http://host:port`` ``("host:port", False)``, anything
    else (``host:port``, a gRPC target string) itself and None (TLS if TLS files are
    given). ValueError for a URL with a path."""
    match = re.match(r"^(https?)://([^/]+)/?$", target, flags=re.IGNORECASE)
    if match is not None:
        return match.group(2), match.group(1).lower() == "https"
    if re.match(r"^https?://", target, flags=re.IGNORECASE):
        raise ValueError(f"target {target!r} has a path: give https://host:port")
    return target, None


def _target_host(address: str) -> str:
    # "host:port", "[::1]:port", "host": the host part.
    return urlsplit(f"//{address}").hostname or ""


def check_rest_tls(settings: RestSettings) -> None:
    """Raise ValueError for the REST process's TLS settings: unreadable files, a
    certificate without its key, TLS files for an ``http://`` target, and (unless
    ``allow_plaintext``) a plaintext link to an api beyond loopback or plain HTTP on an
    address beyond loopback: either would carry bearer tokens in clear."""
    problems: list[str] = []
    for variable, path in (
        ("CONVEYOR_TLS_CA", settings.tls_ca),
        ("CONVEYOR_TLS_CLIENT_CERT", settings.tls_client_cert),
        ("CONVEYOR_TLS_CLIENT_KEY", settings.tls_client_key),
        ("CONVEYOR_REST_TLS_CERT", settings.rest_tls_cert),
        ("CONVEYOR_REST_TLS_KEY", settings.rest_tls_key),
    ):
        _check_file(problems, variable, path)
    _check_pair(
        problems,
        ("CONVEYOR_TLS_CLIENT_CERT", settings.tls_client_cert),
        ("CONVEYOR_TLS_CLIENT_KEY", settings.tls_client_key),
    )
    _check_pair(
        problems,
        ("CONVEYOR_REST_TLS_CERT", settings.rest_tls_cert),
        ("CONVEYOR_REST_TLS_KEY", settings.rest_tls_key),
    )
    try:
        address, scheme_tls = grpc_target(settings.target)
    except ValueError as exc:
        problems.append(f"CONVEYOR_TARGET: {exc}")
        address, scheme_tls = settings.target, None
    material = bool(settings.tls_ca or settings.tls_client_cert or settings.tls_client_key)
    if scheme_tls is False and material:
        problems.append(
            "CONVEYOR_TARGET is http:// (plaintext) but TLS files are set: use https://"
        )
    tls = scheme_tls if scheme_tls is not None else material
    if not settings.allow_plaintext:
        host = _target_host(address)
        if not tls and not is_loopback(host):
            problems.append(
                f"the api at {host} without TLS: set CONVEYOR_TARGET=https://{address} "
                f"(with CONVEYOR_TLS_CA for a private CA), {_PLAINTEXT_HINT}"
            )
        if not settings.rest_tls_cert and not is_loopback(settings.rest_host):
            problems.append(
                f"plain HTTP on {settings.rest_host}: set CONVEYOR_REST_TLS_CERT and "
                f"CONVEYOR_REST_TLS_KEY, {_PLAINTEXT_HINT}"
            )
    _raise(problems)


def client_context(
    *,
    ca: str | None,
    cert: str | None = None,
    key: str | None = None,
    check_hostname: bool = True,
    verify: bool = True,
) -> ssl.SSLContext:
    """A TLS 1.2+ client context trusting ``ca`` (a PEM file; None: the system's CAs),
    presenting ``cert``/``key`` when given."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if verify:
        if ca:
            context.load_verify_locations(cafile=ca)
        else:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
        context.check_hostname = check_hostname
        context.verify_mode = ssl.CERT_REQUIRED
    else:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if cert:
        context.load_cert_chain(cert, key)
    return context


def nats_tls_context(settings: CommonSettings) -> ssl.SSLContext | None:
    """The context for TLS to NATS, or None when the settings do not ask for TLS."""
    if not nats_tls_wanted(settings):
        return None
    return client_context(
        ca=settings.nats_tls_ca, cert=settings.nats_tls_cert, key=settings.nats_tls_key
    )


def postgres_ssl(settings: CommonSettings) -> ssl.SSLContext | SslMode | None:
    """asyncpg's ``ssl`` argument for the settings.

    None when no ``db_ssl*`` setting is given (asyncpg then follows the DSN's own
    ``sslmode``, ``sslrootcert``... exactly as libpq does). Otherwise, for ``require``,
    ``verify-ca`` and ``verify-full`` a context (TLS is then mandatory): ``verify-full``
    checks the chain and the host name, ``verify-ca`` the chain only, ``require`` nothing
    unless a root certificate is given (then it behaves as ``verify-ca``, like libpq);
    the weaker modes are passed on as their name.
    """
    if not (
        settings.db_sslmode or settings.db_sslrootcert or settings.db_sslcert or settings.db_sslkey
    ):
        return None
    mode = effective_sslmode(settings)
    if mode not in SECURE_SSLMODES:
        return cast(SslMode, mode)  # check_links refused any other name
    verify = mode != "require" or settings.db_sslrootcert is not None
    return client_context(
        ca=settings.db_sslrootcert,
        cert=settings.db_sslcert,
        key=settings.db_sslkey,
        check_hostname=mode == "verify-full",
        verify=verify,
    )


def describe_hosts(hosts: Iterable[str]) -> str:
    """Hosts for a log line or an error (``local socket`` for a Unix socket)."""
    return ", ".join(host or "local socket" for host in hosts)
