"""The gRPC plumbing every client shares: settings, the channel, calls and their errors.

:class:`AsyncRpcClient` and :class:`SyncRpcClient` are the bases of the producer clients
(TaskService), the admin clients (AdminService) and the webhook callbacks
(WebhookService); a subclass names its service in ``_service`` and calls
``_call(method, request, response_type)``.
"""

from __future__ import annotations

from datetime import timedelta
from types import TracebackType
from typing import Any, ClassVar, Self

import grpc
import grpc.aio

from conveyor._channel import Endpoint, TlsFile, auth_metadata, endpoint
from conveyor._errors import ConveyorError, InvalidArgument, TaskNotFound, error_from_rpc
from conveyor._payload import Codec
from conveyor._types import DurationLike, to_timedelta


def with_task_id(exc: ConveyorError, task_id: str) -> ConveyorError:
    """``exc``, naming ``task_id`` when it is a TaskNotFound that does not yet."""
    if isinstance(exc, TaskNotFound) and exc.task_id is None:
        return TaskNotFound(exc.message, code=exc.code, task_id=task_id)
    return exc


class _Settings:
    """What every client is configured with: target and its transport security, bearer
    token, codec, call timeout."""

    #: The gRPC method prefix of the service, e.g. ``/conveyor.v1.TaskService/``.
    _service: ClassVar[str]

    def __init__(
        self,
        target: str,
        *,
        token: str | None,
        codec: Codec,
        timeout: DurationLike | None,
        tls: bool | None = None,
        tls_ca: TlsFile | None = None,
        tls_cert: TlsFile | None = None,
        tls_key: TlsFile | None = None,
    ) -> None:
        self._endpoint: Endpoint = endpoint(
            target, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key
        )
        delta = to_timedelta("timeout", timeout)
        if delta is not None and delta <= timedelta(0):
            raise InvalidArgument("timeout must be > 0")
        self._target = target
        self._codec = codec
        self._metadata = auth_metadata(token)
        self._timeout = delta.total_seconds() if delta is not None else None

    @property
    def target(self) -> str:
        """The server address this client talks to."""
        return self._target

    @property
    def tls(self) -> bool:
        """Whether this client's channel uses TLS."""
        return self._endpoint.tls

    @property
    def codec(self) -> Codec:
        """The codec that encodes payloads and decodes payloads, progress and results."""
        return self._codec


class AsyncRpcClient(_Settings):
    """An asyncio client of one service; the channel opens on first use, inside the
    running event loop."""

    def __init__(self, target: str, **settings: Any) -> None:
        super().__init__(target, **settings)
        self._channel: grpc.aio.Channel | None = None
        self._closed = False

    def _open(self) -> grpc.aio.Channel:
        if self._closed:
            raise ConveyorError("the client is closed")
        if self._channel is None:
            self._channel = self._endpoint.aio_channel()
        return self._channel

    async def _call(
        self,
        method: str,
        request: Any,
        response_type: Any,
        *,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Any:
        """One unary call; ``metadata`` goes with it besides the token (a trace context)."""
        rpc = self._open().unary_unary(
            self._service + method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        sent = self._metadata + metadata if metadata else self._metadata
        try:
            return await rpc(request, timeout=self._timeout, metadata=sent)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, tls=self._endpoint.tls) from None

    def _stream(self, method: str, request: Any, response_type: Any) -> Any:
        """A server-streaming call (no timeout: it lasts until cancelled)."""
        rpc = self._open().unary_stream(
            self._service + method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        return rpc(request, metadata=self._metadata)

    async def close(self) -> None:
        """Close the channel; the client cannot be used afterwards. Safe to call twice."""
        self._closed = True
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class SyncRpcClient(_Settings):
    """A blocking client of one service over gRPC's synchronous channel."""

    def __init__(self, target: str, **settings: Any) -> None:
        super().__init__(target, **settings)
        self._channel: grpc.Channel | None = self._endpoint.sync_channel()

    def _live_channel(self) -> grpc.Channel:
        if self._channel is None:
            raise ConveyorError("the client is closed")
        return self._channel

    def _call(
        self,
        method: str,
        request: Any,
        response_type: Any,
        *,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Any:
        """One unary call; ``metadata`` goes with it besides the token (a trace context)."""
        rpc = self._live_channel().unary_unary(
            self._service + method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        sent = self._metadata + metadata if metadata else self._metadata
        try:
            return rpc(request, timeout=self._timeout, metadata=sent)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, tls=self._endpoint.tls) from None

    def _stream(self, method: str, request: Any, response_type: Any) -> Any:
        """A server-streaming call (no timeout: it lasts until cancelled)."""
        rpc = self._live_channel().unary_stream(
            self._service + method,
            request_serializer=type(request).SerializeToString,
            response_deserializer=response_type.FromString,
        )
        return rpc(request, metadata=self._metadata)

    def close(self) -> None:
        """Close the channel; the client cannot be used afterwards. Safe to call twice."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
