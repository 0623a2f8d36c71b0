"""A span per gRPC call (installed only when tracing is on)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from conveyor_runtime.tracing import tracer
from opentelemetry.trace import SpanKind, Status, StatusCode

_tracer = tracer(__name__)

if TYPE_CHECKING:
    _Continuation = Callable[
        [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]
    ]


def _attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each unary call and each stream in a server span named after the method."""

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        attributes = _attributes(method)
        if handler.unary_unary is not None:
            inner: Any = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                with _tracer.start_as_current_span(
                    method, kind=SpanKind.SERVER, attributes=attributes
                ) as span:
                    response = await inner(request, context)
                    code = context.code()
                    if code not in (None, grpc.StatusCode.OK):
                        span.set_status(Status(StatusCode.ERROR, str(code)))
                    return response

            return grpc.unary_unary_rpc_method_handler(
                unary,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None and not inspect.isasyncgenfunction(
            handler.stream_stream
        ):
            # A stream served with context.write (WorkerService.Session): one span for its life.
            inner_stream: Any = handler.stream_stream

            async def stream(
                requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
            ) -> None:
                with _tracer.start_as_current_span(
                    method, kind=SpanKind.SERVER, attributes=attributes
                ):
                    await inner_stream(requests, context)

            return grpc.stream_stream_rpc_method_handler(
                stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            inner_us: Any = handler.unary_stream

            async def unary_stream(
                request: Any, context: grpc.aio.ServicerContext[Any, Any]
            ) -> AsyncIterator[Any]:
                with _tracer.start_as_current_span(
                    method, kind=SpanKind.SERVER, attributes=attributes
                ):
                    async for response in inner_us(request, context):
                        yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler
