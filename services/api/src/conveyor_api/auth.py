"""Server interceptors: bearer-token auth and read-only mode."""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import grpc

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    _Continuation = Callable[
        [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
    ]

ADMIN_SERVICE = "/conveyor.v1.AdminService/"
#: Webhook callbacks authenticate with their per-delivery lease token instead.
_TOKEN_EXEMPT_PREFIXES = ("/conveyor.v1.WebhookService/",)
#: AdminService methods that only read. Everything else on AdminService mutates.
ADMIN_READS = frozenset(
    {
        "GetTask",
        "ListTasks",
        "ListQueues",
        "GetQueueStats",
        "ListRateLimits",
        "ListConcurrencyLimits",
        "ListGroupConfigs",
        "GetGroupStats",
        "ListCronEntries",
        "GetWebhookWorker",
        "ListWebhookWorkers",
        "GetClusterInfo",
        "WatchEvents",
    }
)


def _refusal(
    handler: grpc.RpcMethodHandler[Any, Any], code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same shape as ``handler`` that ends the call with ``code``."""

    async def refuse(_request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(code, message)

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        raw = value.encode() if isinstance(value, str) else value
        scheme, _, token = raw.partition(b" ")
        if scheme.lower() == b"bearer" and token:
            return token.strip()
        return None
    return None


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Accepts a call only with ``authorization: Bearer <token>`` naming a known token.

    Tokens are compared in constant time, and every configured token is tried, so the
    time taken says nothing about which one was close.
    """

    def __init__(self, tokens: Iterable[str]) -> None:
        self._tokens = [t.encode() for t in tokens]
        if not self._tokens:
            raise ValueError("BearerAuthInterceptor needs at least one token")

    def _accepts(self, token: bytes | None) -> bool:
        if token is None:
            return False
        ok = False
        for known in self._tokens:
            ok |= hmac.compare_digest(token, known)
        return ok

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_TOKEN_EXEMPT_PREFIXES):
            return handler
        metadata: Any = handler_call_details.invocation_metadata
        if self._accepts(_bearer(metadata)):
            return handler
        logger.warning("auth.rejected method=%s", method)
        return _refusal(
            handler,
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or invalid bearer token (metadata 'authorization: Bearer <token>')",
        )


class ReadOnlyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses AdminService mutations with PERMISSION_DENIED; everything else passes."""

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(ADMIN_SERVICE):
            return handler
        name = method.removeprefix(ADMIN_SERVICE)
        if name in ADMIN_READS:
            return handler
        return _refusal(
            handler,
            grpc.StatusCode.PERMISSION_DENIED,
            f"the server is read-only: AdminService.{name} is not allowed",
        )
