"""A span per gRPC call (installed only when tracing is on), the child of the trace
context the caller sent in the call's metadata (``traceparent``); and the enqueue's own
parts: the trace context the api writes into a task that came without one, and the span
of the group commit."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import grpc
from conveyor_broker import NewTask
from conveyor_broker.validation import MAX_HEADERS
from conveyor_runtime.tracing import (
    TRACEPARENT,
    carrier_of,
    links_to,
    remote_parent,
    task_parent,
    tracer,
    tracing_enabled,
)
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

_tracer = tracer(__name__)
#: What :func:`commit_span` gives while tracing is off (reusable: it does nothing).
_OFF = contextlib.nullcontext()

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
        parent = remote_parent(handler_call_details.invocation_metadata)  # type: ignore[arg-type]
        if handler.unary_unary is not None:
            inner: Any = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                with _tracer.start_as_current_span(
                    method, parent, kind=SpanKind.SERVER, attributes=attributes
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
                    method, parent, kind=SpanKind.SERVER, attributes=attributes
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
                    method, parent, kind=SpanKind.SERVER, attributes=attributes
                ):
                    async for response in inner_us(request, context):
                        yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler


def stamp_tasks(tasks: Sequence[NewTask]) -> list[NewTask]:
    """``tasks``, each one that carries no ``traceparent`` given the current span's (the
    call's) while tracing is on and that span is sampled: so the task's trace starts
    here when its producer traces nothing, and every later hop joins it. A task with
    no room for another header is left as it is."""
    if not tracing_enabled():
        return list(tasks)
    span = trace.get_current_span()
    span_context = span.get_span_context()
    if not (span_context.is_valid and span_context.trace_flags.sampled):
        return list(tasks)
    carrier = carrier_of(span)
    return [
        task
        if TRACEPARENT in task.headers or len(task.headers) + len(carrier) > MAX_HEADERS
        else dataclasses.replace(task, headers={**task.headers, **carrier})
        for task in tasks
    ]


def commit_span(tasks: Sequence[NewTask]) -> AbstractContextManager[object]:
    """The span of an enqueue's group commit (``conveyor.commit``), current inside the
    ``with`` block; does nothing while tracing is off.

    Its parent is the call's span; for a single task whose headers carry another trace
    (a producer that sent its context in the task but not in the call), that trace. A
    batch's commit links to the other traces its tasks carry instead (at most
    :data:`~conveyor_runtime.tracing.MAX_LINKS`).
    """
    if not tracing_enabled():
        return _OFF
    current = trace.get_current_span().get_span_context()
    parent = None
    links = None
    if len(tasks) == 1:
        own = task_parent(tasks[0].headers)
        if own is not None and (
            trace.get_current_span(own).get_span_context().trace_id != current.trace_id
        ):
            parent = own
    else:
        links = links_to((task.headers for task in tasks), besides=current.trace_id)
    attributes: dict[str, Any] = {"conveyor.tasks": len(tasks)}
    if tasks:
        attributes["conveyor.queue"] = tasks[0].queue
    return _tracer.start_as_current_span(
        "conveyor.commit", parent, SpanKind.INTERNAL, attributes, links
    )
