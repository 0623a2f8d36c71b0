"""Connect to NATS the way every service does: named, reconnecting forever, logged,
and over TLS with credentials when the settings say so (:class:`NatsSecurity`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nats import errors as nats_errors
from nats.aio.client import Client as NatsClient

from conveyor_runtime import metrics
from conveyor_runtime.tls import nats_tls_context

if TYPE_CHECKING:
    from conveyor_runtime.settings import CommonSettings

logger = logging.getLogger(__name__)

__all__ = ["NatsClient", "NatsConnectError", "NatsSecurity", "close_nats", "connect_nats"]


class NatsConnectError(ConnectionError):
    """The first connection to NATS failed in a way that waiting will not heal: the
    server refused the credentials, or TLS failed (an untrusted certificate, a server
    that does not offer TLS although the settings ask for it)."""


@dataclass(frozen=True, slots=True)
class NatsSecurity:
    """How a connection proves itself to NATS and protects its link.

    ``tls``: a client context; TLS is then mandatory (a server that does not offer it is
    refused before anything, credentials included, is sent). At most one of
    ``user``/``password``, ``token``, ``nkey_seed`` (a seed file) and ``creds`` (a
    credentials file) authenticates the connection.
    """

    tls: ssl.SSLContext | None = None
    user: str | None = None
    password: str | None = None
    token: str | None = None
    nkey_seed: str | None = None
    creds: str | None = None

    @classmethod
    def from_settings(cls, settings: CommonSettings) -> NatsSecurity:
        """What ``settings`` ask for (``nats_tls_*``, ``nats_user``...)."""
        return cls(
            tls=nats_tls_context(settings),
            user=settings.nats_user,
            password=settings.nats_password,
            token=settings.nats_token,
            nkey_seed=settings.nats_nkey_seed,
            creds=settings.nats_creds,
        )

    def connect_options(self) -> dict[str, Any]:
        """The keyword arguments of ``nats.aio.client.Client.connect`` for this."""
        options: dict[str, Any] = {}
        if self.tls is not None:
            options["tls"] = self.tls
        if self.user is not None:
            options["user"] = self.user
            options["password"] = self.password
        if self.token is not None:
            options["token"] = self.token
        if self.nkey_seed is not None:
            options["nkeys_seed"] = self.nkey_seed
        if self.creds is not None:
            options["user_credentials"] = self.creds
        return options

    @property
    def authenticates(self) -> str:
        """How the connection authenticates, for the logs."""
        if self.user:
            return f"user:{self.user}"
        if self.token:
            return "token"
        if self.nkey_seed:
            return "nkey"
        if self.creds:
            return "creds"
        return "none"


class _Client(NatsClient):
    """nats-py's client with its PONG handling made safe.

    ``flush()`` queues a future for the server's PONG and waits for it; when that wait is
    cancelled (a gRPC handler whose caller went away, a service stopping) or times out,
    the future is cancelled but stays queued, and the PONG that answers it then raises
    InvalidStateError inside the read loop: the connection stops reading for good, and
    the process goes deaf to NATS while it still looks connected. Here the PONG is still
    matched to its future (one PONG per PING, in order), and a future nobody waits for
    any more is skipped.
    """

    async def _process_pong(self) -> None:
        if self._pongs:
            future = self._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0


class _TlsRequiredClient(_Client):
    """A client that refuses a server whose INFO does not require TLS.

    nats-py upgrades to TLS only when the server's INFO asks for it, and otherwise goes
    on in plaintext even with a TLS context: a misconfigured server (or anyone between
    us and it) would get the credentials in the clear. This check runs on every connect
    and reconnect, before the CONNECT that carries them.
    """

    async def _process_info(self, info: dict[str, Any], initial_connection: bool = False) -> None:
        if initial_connection and not info.get("tls_required"):
            server = self._current_server.uri.netloc if self._current_server else "?"
            raise nats_errors.Error(
                f"nats: TLS is required by this service's settings, but the server at "
                f"{server} does not offer it"
            )
        await super()._process_info(info, initial_connection)


def _fatal(exc: BaseException) -> bool:
    """An error of the first connect that retrying will not heal."""
    if isinstance(exc, ssl.SSLError | nats_errors.AuthorizationError):
        return True
    text = str(exc).lower()
    return "authorization violation" in text or "tls is required" in text


def _servers(url: str) -> list[str]:
    servers = [part.strip() for part in url.split(",") if part.strip()]
    if not servers:
        raise ValueError("no NATS server URL given")
    return servers


def _server(nc: NatsClient) -> str:
    url = nc.connected_url
    return url.netloc if url is not None else "?"


#: Seconds a draining close waits for pending messages before it closes anyway.
DRAIN_TIMEOUT = 5.0


async def connect_nats(
    url: str,
    *,
    name: str,
    security: NatsSecurity | None = None,
    reconnect_wait: float = 1.0,
    connect_timeout: float = 2.0,
) -> NatsClient:
    """Connect to the comma-separated NATS ``url`` list as ``name``, with ``security``
    (TLS and credentials; default none).

    The client never gives up on an unreachable server: the first connect and every
    reconnect retry forever (every ``reconnect_wait`` seconds), because every message we
    send is a hint and a service without NATS can only wait. The first connect does give
    up on what waiting will not heal (refused credentials, a TLS failure) with a
    :class:`NatsConnectError`. Errors and connection changes are logged.
    """
    security = security or NatsSecurity()
    connecting = True
    fatal: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        logger.warning("nats.error name=%s error=%r", name, exc)
        if connecting and _fatal(exc):
            # Raised out of nats-py's connect loop, which would otherwise retry forever.
            fatal.append(exc)
            raise exc

    async def on_disconnected() -> None:
        logger.warning("nats.disconnected name=%s", name)

    async def on_reconnected() -> None:
        metrics.NATS_RECONNECTS.inc()
        logger.info("nats.reconnected name=%s server=%s", name, _server(nc))

    async def on_closed() -> None:
        logger.info("nats.closed name=%s", name)

    nc = _TlsRequiredClient() if security.tls is not None else _Client()
    servers = _servers(url)
    try:
        await nc.connect(
            servers=servers,
            name=name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=reconnect_wait,  # type: ignore[arg-type]
            connect_timeout=connect_timeout,  # type: ignore[arg-type]
            # A drain at shutdown waits for every subscription's pending messages; they
            # are hints, so a stop waits this long at most (the client's default is 30 s).
            drain_timeout=DRAIN_TIMEOUT,  # type: ignore[arg-type]
            error_cb=on_error,
            disconnected_cb=on_disconnected,
            reconnected_cb=on_reconnected,
            closed_cb=on_closed,
            **security.connect_options(),
        )
    except BaseException:
        if not fatal:
            raise
        # A connection whose TLS handshake failed can hang in close (waiting for the
        # broken transport): bounded, since it carries nothing.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(close_nats(nc, drain=False), 1.0)
        raise NatsConnectError(
            f"cannot connect to NATS at {', '.join(servers)} as {name}: {_reason(fatal[0])}"
        ) from None
    finally:
        connecting = False
    logger.info(
        "nats.connected name=%s server=%s tls=%s auth=%s",
        name,
        _server(nc),
        "on" if security.tls is not None else "off",
        security.authenticates,
    )
    return nc


def _reason(exc: BaseException) -> str:
    """A readable reason for a fatal first-connect error."""
    text = str(exc).removeprefix("nats: ").strip("'")
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (
            f"TLS handshake failed: the server's certificate is not trusted "
            f"({exc.verify_message or text}): check CONVEYOR_NATS_TLS_CA"
        )
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed: {exc.reason or text}"
    if isinstance(exc, nats_errors.AuthorizationError) or "authorization violation" in text.lower():
        return (
            "the server refused the credentials (Authorization Violation): check "
            "CONVEYOR_NATS_USER and CONVEYOR_NATS_PASSWORD, CONVEYOR_NATS_TOKEN, "
            "CONVEYOR_NATS_NKEY_SEED or CONVEYOR_NATS_CREDS"
        )
    return text


async def close_nats(nc: NatsClient, *, drain: bool = True) -> None:
    """Close ``nc``, draining subscriptions and buffered publishes first when ``drain``.

    Never raises: a connection that is already broken is simply dropped.
    """
    if nc.is_closed:
        return
    if drain and nc.is_connected:
        try:
            await nc.drain()
            return
        except Exception as exc:
            logger.info("nats.drain_failed error=%r", exc)
    try:
        await nc.close()
    except Exception as exc:
        logger.info("nats.close_failed error=%r", exc)
