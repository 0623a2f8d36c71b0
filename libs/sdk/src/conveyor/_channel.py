"""How the SDK reaches a server: its default address, the gRPC channel options and the
bearer-token metadata, shared by the clients and the worker."""

from __future__ import annotations

from typing import Any

#: The api server's address when none is given.
DEFAULT_TARGET = "127.0.0.1:50051"
#: Responses carry whole tasks (payloads and results): allow more than gRPC's 4 MiB default.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata carrying ``token`` as a bearer token (empty without a token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()
