"""How the SDK reaches a server: its address and transport security, the gRPC channel
options and the bearer-token metadata, shared by the clients and the worker."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from conveyor._errors import InvalidArgument, transport_hint

#: The api server's address when none is given.
DEFAULT_TARGET = "127.0.0.1:50051"
#: Responses carry whole tasks (payloads and results): allow more than gRPC's 4 MiB default.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)

#: A PEM file: its path (``str`` or path-like), or its contents as ``bytes``.
TlsFile = str | os.PathLike[str] | bytes


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying ``token`` as a bearer token (empty without a token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _pem(argument: str, value: TlsFile | None) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str | os.PathLike):
        raise InvalidArgument(f"{argument} must be a file path or PEM bytes, got {value!r}")
    try:
        with open(value, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidArgument(f"{argument}: cannot read {value}: {exc.strerror or exc}") from None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where the api server is and how to reach it: the gRPC ``address``, and whether
    the channel uses TLS (with the CA bundle that verifies the server, None for the
    system's, and the client certificate for mutual TLS)."""

    address: str
    tls: bool = False
    root_certificates: bytes | None = None
    private_key: bytes | None = None
    certificate_chain: bytes | None = None

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.root_certificates,
            private_key=self.private_key,
            certificate_chain=self.certificate_chain,
        )

    def aio_channel(self) -> grpc.aio.Channel:
        """A new asyncio channel (inside a running event loop)."""
        if self.tls:
            return grpc.aio.secure_channel(
                self.address, self._credentials(), options=CHANNEL_OPTIONS
            )
        return grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)

    def sync_channel(self) -> grpc.Channel:
        """A new blocking channel."""
        if self.tls:
            return grpc.secure_channel(self.address, self._credentials(), options=CHANNEL_OPTIONS)
        return grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)

    def explain(self, details: str) -> str:
        """``details`` of an UNAVAILABLE status, with what to do first when it looks like
        the two sides disagree about TLS."""
        hint = transport_hint(details, tls=self.tls)
        return f"{hint} ({details})" if hint else details


def endpoint(
    target: str,
    *,
    tls: bool | None = None,
    tls_ca: TlsFile | None = None,
    tls_cert: TlsFile | None = None,
    tls_key: TlsFile | None = None,
) -> Endpoint:
    """The :class:`Endpoint` for the SDK's connection arguments.

    ``https://host:port`` selects TLS, ``http://host:port`` plaintext; any other target
    (``host:port``, or any gRPC target string) is plaintext unless ``tls=True`` or a TLS
    file is given. ``tls_ca`` verifies the server (default: the system's CAs);
    ``tls_cert`` and ``tls_key`` are the client certificate a mutual-TLS server asks for.
    Files are read here, so a missing one fails at once with :class:`InvalidArgument`.
    """
    if not isinstance(target, str) or not target:
        raise InvalidArgument("target must be a non-empty 'host:port' string")
    if tls is not None and not isinstance(tls, bool):
        raise InvalidArgument(f"tls must be a bool, got {tls!r}")
    address, scheme_tls = target, None
    match = re.match(r"^(https?)://([^/]+)/?$", target, flags=re.IGNORECASE)
    if match is not None:
        scheme_tls = match.group(1).lower() == "https"
        address = match.group(2)
    elif re.match(r"^https?://", target, flags=re.IGNORECASE):
        raise InvalidArgument(f"target {target!r} has a path: give 'https://host:port'")
    material = tls_ca is not None or tls_cert is not None or tls_key is not None
    if scheme_tls is False and (tls or material):
        raise InvalidArgument(
            f"target {target!r} is plaintext (http://) but TLS was asked for: use https://"
        )
    if scheme_tls is True and tls is False:
        raise InvalidArgument(f"target {target!r} is https:// but tls=False")
    if tls is False and material:
        raise InvalidArgument("tls=False with tls_ca, tls_cert or tls_key: drop one or the other")
    if (tls_cert is None) != (tls_key is None):
        raise InvalidArgument("tls_cert and tls_key go together: give both or neither")
    use_tls = scheme_tls if scheme_tls is not None else bool(tls or material)
    return Endpoint(
        address=address,
        tls=use_tls,
        root_certificates=_pem("tls_ca", tls_ca),
        private_key=_pem("tls_key", tls_key),
        certificate_chain=_pem("tls_cert", tls_cert),
    )
