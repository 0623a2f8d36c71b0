"""Server interceptors: bearer-token auth with roles, and read-only mode."""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import grpc
from conveyor_protos.v1 import service_pb2
from conveyor_runtime.tokens import Role, Token, digest

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    _Context = grpc.aio.ServicerContext[Any, Any]
    _Continuation = Callable[
        [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
    ]

ADMIN_SERVICE = "/conveyor.v1.AdminService/"
TASK_SERVICE = "/conveyor.v1.TaskService/"
WORKER_SERVICE = "/conveyor.v1.WorkerService/"
#: Webhook callbacks authenticate with their per-delivery lease token instead.
_TOKEN_EXEMPT_PREFIXES = ("/conveyor.v1.WebhookService/",)
#: AdminService methods that only read. Everything else on AdminService mutates.
ADMIN_READS = frozenset(
    {
        "GetTask",
        "ListTasks",
        "ListQueues",
        "GetQueueStats",
        "ListTaskDependencies",
        "ListRateLimits",
        "ListConcurrencyLimits",
        "ListBreakerConfigs",
        "ListBreakers",
        "ListGroupConfigs",
        "GetGroupStats",
        "ListCronEntries",
        "GetCronEntry",
        "GetWebhookWorker",
        "ListWebhookWorkers",
        "GetClusterInfo",
        "WatchEvents",
    }
)
#: AdminService methods any authenticated token may call, whatever its role: the caller
#: asking what it may do (a producer or worker token too). Read-only mode lets them pass.
ANY_ROLE = frozenset({"WhoAmI"})


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


def any_role(method: str) -> bool:
    """True for a method every authenticated token may call (:data:`ANY_ROLE`)."""
    return method.startswith(ADMIN_SERVICE) and method.removeprefix(ADMIN_SERVICE) in ANY_ROLE


def needed_role(method: str) -> Role:
    """The role a call needs besides admin, as refusals name it: ``producer``,
    ``worker``, ``read-only`` or ``admin`` (every method not listed here: fail closed).
    The :data:`ANY_ROLE` methods need none: the interceptor lets every token through."""
    if method.startswith(TASK_SERVICE):
        return Role.PRODUCER
    if method.startswith(WORKER_SERVICE):
        return Role.WORKER
    if method.startswith(ADMIN_SERVICE) and method.removeprefix(ADMIN_SERVICE) in ADMIN_READS:
        return Role.READ_ONLY
    return Role.ADMIN


def _call_name(method: str) -> str:
    # "/conveyor.v1.AdminService/DeleteTask" -> "AdminService.DeleteTask"
    service, _, name = method.lstrip("/").partition("/")
    return f"{service.rpartition('.')[2]}.{name}"


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Accepts a call only with ``authorization: Bearer <secret>`` naming a configured
    token whose role allows the call.

    - no token, or one nobody configured: UNAUTHENTICATED;
    - a token whose role does not cover the method: PERMISSION_DENIED naming the role the
      call needs;
    - a ``worker=<queues>`` token: a session whose Hello names another queue ends with
      PERMISSION_DENIED naming that queue;
    - WebhookService calls pass: they authenticate with their per-delivery lease token.

    The presented secret is hashed once and compared in constant time with the digest of
    every configured token, all of them, so the time taken says nothing about which one
    matched or how close another one was.
    """

    def __init__(self, tokens: Iterable[Token]) -> None:
        self._tokens = tuple(tokens)
        if not self._tokens:
            raise ValueError("BearerAuthInterceptor needs at least one token")
        logger.info(
            "auth.tokens %s",
            " ".join(f"{token.name}={token.role_text}" for token in self._tokens),
        )

    def identify(self, secret: bytes | None) -> Token | None:
        """The configured token whose secret is ``secret``, if any."""
        if secret is None:
            return None
        presented = digest(secret)
        found: Token | None = None
        for token in self._tokens:
            if hmac.compare_digest(presented, token.secret_digest):
                found = token
        return found

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Token | None:
        """The configured token a call's ``metadata`` presents (its ``authorization:
        Bearer`` entry), if any: what a handler asks to learn who called it."""
        return self.identify(_bearer(metadata))

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_TOKEN_EXEMPT_PREFIXES):
            return handler
        metadata: Any = handler_call_details.invocation_metadata
        token = self.identify(_bearer(metadata))
        if token is None:
            logger.warning("auth.rejected method=%s", method)
            return _refusal(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or invalid bearer token (metadata 'authorization: Bearer <secret>', "
                "the secret part of a name:role:secret token)",
            )
        if token.role is Role.ADMIN or any_role(method):
            return handler
        needed = needed_role(method)
        if token.role is not needed:
            logger.warning(
                "auth.denied token=%s role=%s method=%s needs=%s",
                token.name,
                token.role_text,
                method,
                needed,
            )
            either = "" if needed is Role.ADMIN else " or admin"
            return _refusal(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{_call_name(method)} needs role {needed}{either}; token {token.name!r} "
                f"has role {token.role_text}",
            )
        if token.queues is not None and handler.stream_stream is not None:
            return _queue_limited(handler, token)
        return handler


def _queue_limited(
    handler: grpc.RpcMethodHandler[Any, Any], token: Token
) -> grpc.RpcMethodHandler[Any, Any]:
    """``handler`` (WorkerService.Session) behind a check of the Hello's queues.

    The session reads its frames with ``context.read()``; it is handed a context whose
    first read checks the Hello and ends the call with PERMISSION_DENIED when it names a
    queue the token does not cover, before the session does anything with it. Every later
    read is the real context's, with nothing in between. A first frame that is not a
    Hello goes to the session, which refuses it as it refuses it for everyone.
    """
    inner: Any = handler.stream_stream
    behavior: Any
    if inspect.isasyncgenfunction(inner):

        async def streamed(requests: Any, context: _Context) -> AsyncIterator[Any]:
            async with aclosing(inner(requests, _HelloCheckedContext(context, token))) as out:
                async for response in out:
                    yield response

        behavior = streamed
    else:

        async def written(requests: Any, context: _Context) -> Any:
            return await inner(requests, _HelloCheckedContext(context, token))

        behavior = written
    return grpc.stream_stream_rpc_method_handler(
        behavior,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class _HelloCheckedContext:
    """A servicer context whose first ``read()`` refuses a Hello naming a queue outside
    the token's; everything else is the wrapped context's."""

    def __init__(self, context: _Context, token: Token) -> None:
        self._context = context
        self._token = token
        self.read: Callable[[], Awaitable[Any]] = self._first_read

    async def _first_read(self) -> Any:
        context = self._context
        # From now on the session reads the real stream directly.
        self.read = context.read
        frame = await context.read()
        if isinstance(frame, service_pb2.WorkerFrame) and frame.WhichOneof("frame") == "hello":
            allowed = self._token.queues or frozenset()
            outside = sorted(set(frame.hello.queues) - allowed)
            if outside:
                token = self._token
                # Names from the client, not yet validated (the session does that): the
                # first one only, quoted, and a count of the rest.
                more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
                logger.warning(
                    "auth.denied token=%s role=%s method=WorkerService.Session queue=%r%s",
                    token.name,
                    token.role_text,
                    outside[0][:128],
                    more,
                )
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"token {token.name!r} (role {token.role_text}) may not serve queue "
                    f"{outside[0][:128]!r}{more}; it is limited to {', '.join(sorted(allowed))}",
                )
        return frame

    def __getattr__(self, name: str) -> Any:
        # Only for names not found here; kept, so the next lookup (a write per frame) is
        # an attribute read. The context's attributes are its methods: they do not change.
        value = getattr(self._context, name)
        setattr(self, name, value)
        return value


def who_am_i(
    token: Token | None, *, auth_enabled: bool, read_only: bool
) -> service_pb2.WhoAmIResponse:
    """AdminService.WhoAmI's answer for a caller presenting ``token`` (None with auth
    off): its role, and what the interceptors above let it do on the AdminService (reads
    need an admin or read-only token, mutations an admin one and an api that is not
    read-only)."""
    if not auth_enabled:
        role, name = Role.ADMIN, ""
        text = str(Role.ADMIN)
    elif token is None:
        raise ValueError("who_am_i: auth is on, so the caller has a token")
    else:
        role, name, text = token.role, token.name, token.role_text
    can_read = role in (Role.ADMIN, Role.READ_ONLY)
    return service_pb2.WhoAmIResponse(
        role=text,
        token_name=name,
        auth_enabled=auth_enabled,
        read_only=read_only,
        can_read=can_read,
        can_mutate=role is Role.ADMIN and not read_only,
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
        if name in ADMIN_READS or name in ANY_ROLE:
            return handler
        return _refusal(
            handler,
            grpc.StatusCode.PERMISSION_DENIED,
            f"the server is read-only: AdminService.{name} is not allowed",
        )
