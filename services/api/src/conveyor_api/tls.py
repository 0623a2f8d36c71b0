"""TLS on the api's gRPC port: the server credentials from ``CONVEYOR_TLS_CERT``,
``CONVEYOR_TLS_KEY`` and ``CONVEYOR_TLS_CLIENT_CA`` (mutual TLS), reloaded when the files
change so that a renewed certificate is served without a restart.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass

import grpc
from conveyor_runtime.settings import ApiSettings
from conveyor_runtime.tls import is_loopback

logger = logging.getLogger(__name__)

__all__ = ["CertificateFiles", "server_credentials"]

#: Seconds between two looks at the files' modification times (a look happens on a new
#: connection's handshake, never on a timer).
RELOAD_CHECK_INTERVAL = 1.0


@dataclass(frozen=True, slots=True)
class _Loaded:
    stamp: tuple[float, ...]
    config: grpc.ServerCertificateConfiguration


class CertificateFiles:
    """The certificate chain, key and (optional) client CA bundle the port serves.

    gRPC asks :meth:`fetch` for the configuration on each new connection's handshake;
    when a file changed since the last load, the files are read again and, if they make
    a valid pair, served from then on. A half-written update (a new certificate whose
    key is not in place yet) is logged and the previous pair kept, so renewing the files
    in any order never breaks the port.
    """

    def __init__(self, cert: str, key: str, client_ca: str | None = None) -> None:
        self.cert = cert
        self.key = key
        self.client_ca = client_ca
        self._lock = threading.Lock()
        self._checked_at = 0.0
        self._loaded = self._load()

    @property
    def paths(self) -> tuple[str, ...]:
        """The files served, in the order of their stamps."""
        return (self.cert, self.key) + ((self.client_ca,) if self.client_ca else ())

    def _stamp(self) -> tuple[float, ...]:
        return tuple(os.stat(path).st_mtime for path in self.paths)

    def _load(self) -> _Loaded:
        stamp = self._stamp()
        with open(self.cert, "rb") as f:
            cert = f.read()
        with open(self.key, "rb") as f:
            key = f.read()
        client_ca = None
        if self.client_ca:
            with open(self.client_ca, "rb") as f:
                client_ca = f.read()
        # gRPC reports a bad pair only as a failed handshake, per connection: check it here
        # with the same files, once, for an error that names them.
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert, self.key)
            if self.client_ca:
                ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(self.client_ca)
        except ssl.SSLError as exc:
            raise ValueError(
                f"TLS files unusable (CONVEYOR_TLS_CERT={self.cert}, CONVEYOR_TLS_KEY="
                f"{self.key}, CONVEYOR_TLS_CLIENT_CA={self.client_ca}): {exc.reason or exc}"
            ) from None
        config = grpc.ssl_server_certificate_configuration([(key, cert)], client_ca)
        return _Loaded(stamp, config)

    def initial(self) -> grpc.ServerCertificateConfiguration:
        """The configuration loaded at start."""
        return self._loaded.config

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """A new configuration when the files changed (gRPC's fetcher), else None."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked_at < RELOAD_CHECK_INTERVAL:
                return None
            self._checked_at = now
            try:
                if self._stamp() == self._loaded.stamp:
                    return None
                loaded = self._load()
            except (OSError, ValueError) as exc:
                logger.error(
                    "api.tls_reload_failed error=%s (still serving the previous pair)", exc
                )
                return None
            self._loaded = loaded
            logger.info("api.tls_reloaded cert=%s", self.cert)
            return loaded.config


def server_credentials(settings: ApiSettings) -> grpc.ServerCredentials | None:
    """The port's TLS credentials, or None for plaintext (no ``tls_cert``).

    With ``tls_client_ca`` the handshake requires a client certificate signed by it.
    Raises ValueError when the files cannot be used.
    """
    if not settings.tls_cert or not settings.tls_key:
        if not is_loopback(settings.host):
            # ApiSettings refuses this unless allow_plaintext is set.
            logger.warning(
                "tls.DISABLED: the gRPC port on %s is plaintext (allow_plaintext is set): "
                "tokens, payloads and results cross the network in the clear",
                settings.host,
            )
        return None
    files = CertificateFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    return grpc.dynamic_ssl_server_credentials(
        files.initial(),
        # The stub says the fetcher always returns a configuration; gRPC documents None
        # as "unchanged", which is what fetch returns between renewals.
        files.fetch,  # type: ignore[arg-type]
        require_client_authentication=settings.tls_client_ca is not None,
    )
