"""The REST process's link to the api: one gRPC channel, plaintext or TLS, opened on first
use (inside the event loop that serves the requests) and shared by every route, the
dashboard and the sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from conveyor_protos.v1 import service_pb2_grpc as pb_grpc
from conveyor_runtime.tls import grpc_target

if TYPE_CHECKING:
    from conveyor_runtime.settings import RestSettings

#: Answers carry whole tasks (a ListTasks page holds up to 4 MiB of payloads, results and
#: progress, plus the rest of each task): allow more than gRPC's 4 MiB default.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


@dataclass(frozen=True, slots=True)
class ApiTarget:
    """Where the api is: its gRPC ``address``, and the TLS credentials to reach it with
    (None: plaintext)."""

    address: str
    credentials: grpc.ChannelCredentials | None = None

    @classmethod
    def parse(cls, target: str) -> ApiTarget:
        """``target`` as the CLI takes it, without TLS files: ``https://host:port`` is TLS
        verified against the system's CAs, anything else plaintext."""
        address, tls = grpc_target(target)
        return cls(address, grpc.ssl_channel_credentials() if tls else None)

    @classmethod
    def from_settings(cls, settings: RestSettings) -> ApiTarget:
        """The api the settings name (``target``, ``tls_ca``, ``tls_client_cert`` and
        ``tls_client_key``: any TLS file, or an ``https://`` target, makes it TLS)."""
        address, scheme_tls = grpc_target(settings.target)
        material = bool(settings.tls_ca or settings.tls_client_cert or settings.tls_client_key)
        if not (scheme_tls if scheme_tls is not None else material):
            return cls(address)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_read(settings.tls_ca),
            private_key=_read(settings.tls_client_key),
            certificate_chain=_read(settings.tls_client_cert),
        )
        return cls(address, credentials)

    @property
    def tls(self) -> bool:
        """True when the channel is TLS."""
        return self.credentials is not None


class ApiLink:
    """The channel to the api (``channel``: one given instead, which the caller closes)
    and its service stubs."""

    def __init__(self, target: ApiTarget | str, *, channel: grpc.aio.Channel | None = None):
        self.target = target if isinstance(target, ApiTarget) else ApiTarget.parse(target)
        self._channel = channel
        self._owned = channel is None

    def channel(self) -> grpc.aio.Channel:
        """The channel, opened on the first call."""
        if self._channel is None:
            target = self.target
            if target.credentials is not None:
                self._channel = grpc.aio.secure_channel(
                    target.address, target.credentials, options=CHANNEL_OPTIONS
                )
            else:
                self._channel = grpc.aio.insecure_channel(target.address, options=CHANNEL_OPTIONS)
        return self._channel

    def admin(self) -> Any:
        """An AdminService stub."""
        return pb_grpc.AdminServiceStub(self.channel())  # type: ignore[no-untyped-call]

    def tasks(self) -> Any:
        """A TaskService stub."""
        return pb_grpc.TaskServiceStub(self.channel())  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        """Close the channel if this link opened it."""
        channel, self._channel = self._channel, None
        if channel is not None and self._owned:
            await channel.close()
