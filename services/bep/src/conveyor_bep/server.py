"""The BES gRPC server: the auth interceptor, the writer shards and the servicer, wired.

:class:`BepServer` is what ``conveyor-bep serve`` runs and what tests start in process.
Authentication is a server interceptor: it maps ``x-api-key`` (``conveyor_<id>_<secret>``)
to a :class:`~conveyor_bep.keys.Project` through the node's
:class:`~conveyor_bep.keys.KeyCache` and hands it to the handler in a context variable; a
missing, malformed, unknown or revoked key gets UNAUTHENTICATED before any handler runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from conveyor_runtime.decoding import add_service

from conveyor_bep.bazel.google.devtools.build.v1 import publish_build_event_pb2
from conveyor_bep.cas import CasConfig, add_cas_services
from conveyor_bep.ingest import IngestLimits, PublishBuildEventService, Shards
from conveyor_bep.keys import KeyCache, Project
from conveyor_bep.writer import WriterShard

logger = logging.getLogger(__name__)

API_KEY_HEADER = "x-api-key"
_PROJECT: ContextVar[Project | None] = ContextVar("conveyor_bep_project", default=None)


def header_project() -> Project | None:
    """The project the auth interceptor authenticated from ``x-api-key`` for this RPC
    (None: the call had no such header; the handler then reads the key from the requests'
    ``project_id``, which is how Bazel before 5 can carry it)."""
    return _PROJECT.get()


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED when ``x-api-key`` is present and names no live key; the project
    otherwise. A call without the header goes on to the handler, which authenticates it
    by the requests' ``project_id`` field (``--project_id=<key>``) or refuses it."""

    def __init__(self, keys: KeyCache) -> None:
        self._keys = keys

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        metadata = dict(handler_call_details.invocation_metadata or ())
        header = metadata.get(API_KEY_HEADER)
        key = header.decode(errors="replace") if isinstance(header, bytes) else header
        keys = self._keys

        async def project_of(context: grpc.aio.ServicerContext[Any, Any]) -> Project:
            assert key is not None
            project = await keys.authenticate(key)
            if project is None:
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "invalid x-api-key: unknown, revoked or malformed key",
                )
            return project

        def wrap(behavior: Any) -> Any:
            async def authenticated(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> Any:
                if key is None:
                    return await behavior(request, context)
                token = _PROJECT.set(await project_of(context))
                try:
                    return await behavior(request, context)
                finally:
                    _PROJECT.reset(token)

            return authenticated

        def wrap_streaming(behavior: Any) -> Any:
            # A server-streaming handler (ByteStream.Read) is an async generator.
            async def authenticated(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[Any]:
                token = None if key is None else _PROJECT.set(await project_of(context))
                try:
                    async for response in behavior(request, context):
                        yield response
                finally:
                    if token is not None:
                        with contextlib.suppress(ValueError):
                            _PROJECT.reset(token)

            return authenticated

        # Each kind of call, with the wrapper of its behaviour (a server-streaming one
        # is an async generator and stays one).
        for kind, make, wrapper in (
            ("unary_unary", grpc.unary_unary_rpc_method_handler, wrap),
            ("stream_stream", grpc.stream_stream_rpc_method_handler, wrap),
            ("stream_unary", grpc.stream_unary_rpc_method_handler, wrap),
            ("unary_stream", grpc.unary_stream_rpc_method_handler, wrap_streaming),
        ):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return make(
                    wrapper(behavior),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler


def _server_credentials(cert: str, key: str, client_ca: str | None) -> grpc.ServerCredentials:
    """TLS for the BES port (mutual when ``client_ca`` is set)."""
    return grpc.ssl_server_credentials(
        [(Path(key).read_bytes(), Path(cert).read_bytes())],
        root_certificates=Path(client_ca).read_bytes() if client_ca else None,
        require_client_auth=client_ca is not None,
    )


class BepServer:
    """The ingest of one node: a gRPC server on ``host:port`` over a Postgres pool, with
    the CAS sink (:mod:`conveyor_bep.cas`) when ``cas`` is given."""

    def __init__(
        self,
        pool: asyncpg.Pool[Any] | Any,
        keys: KeyCache,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        shards: int = 4,
        commit_interval: float = 0.02,
        limits: IngestLimits | None = None,
        max_message: int = 64 * 1024 * 1024,
        tls: tuple[str, str, str | None] | None = None,
        on_committed: Callable[[Any], None] | None = None,
        cas: CasConfig | None = None,
    ) -> None:
        self.pool = pool
        self.keys = keys
        self._host = host
        self._port = port
        self._tls = tls
        self.writers = [
            WriterShard(pool, interval=commit_interval, on_committed=on_committed)
            for _ in range(shards)
        ]
        self.service = PublishBuildEventService(
            pool, Shards(self.writers), keys, header_project, limits
        )
        self._server = grpc.aio.server(
            interceptors=[ApiKeyInterceptor(keys)],
            options=[
                ("grpc.max_receive_message_length", max_message),
                ("grpc.max_send_message_length", max_message),
            ],
        )
        # Registered from the descriptor so an undecodable request is INVALID_ARGUMENT.
        add_service(
            self._server,
            publish_build_event_pb2.DESCRIPTOR.services_by_name["PublishBuildEvent"],
            self.service,
        )
        # The CAS sink on the same port; without a blob root its services are not served
        # (UNIMPLEMENTED).
        if cas is not None:
            add_cas_services(self._server, pool, cas, header_project)
        self.port = 0

    async def start(self) -> int:
        """Start the writer shards and listen; return the bound port."""
        for writer in self.writers:
            writer.start()
        address = f"{self._host}:{self._port}"
        if self._tls is not None:
            credentials = _server_credentials(*self._tls)
            self.port = self._server.add_secure_port(address, credentials)
        else:
            self.port = self._server.add_insecure_port(address)
        await self._server.start()
        logger.info("bep.listening host=%s port=%d", self._host, self.port)
        return self.port

    async def stop(self, grace: float = 5.0) -> None:
        """Stop accepting streams, let open ones end, then commit what is pending."""
        await self._server.stop(grace)
        for writer in self.writers:
            await writer.stop()
