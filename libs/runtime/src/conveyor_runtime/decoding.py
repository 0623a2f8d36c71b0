"""Registering gRPC services so an undecodable request gets INVALID_ARGUMENT (the task
queue's api and the build-event ingest).

gRPC parses a request with the method's deserializer before any handler runs. When that
raises (the bytes are not a valid protobuf message), grpc.aio ends a unary call with
UNKNOWN naming the DecodeError, and on a request stream ``context.read()`` raises it. So
the services are registered here instead, from their proto descriptors, with a
deserializer that returns an :class:`Undecodable` marker rather than raising:

- a method taking one request gets a thin wrapper that ends the call with
  INVALID_ARGUMENT "malformed request: not a valid <full message name> message" before
  the servicer method runs, so nothing is read or stored;
- a method taking a request stream (the api's ``WorkerService.Session``, the ingest's
  ``PublishBuildToolEventStream``) receives the marker as one of its messages and ends
  the stream itself (it has tasks to release or batches to commit first).

Interceptors see ordinary handlers and keep working: they wrap the behaviour and pass the
deserializer on. A valid message is parsed by the same ``FromString`` call as with the
generated ``add_*Servicer_to_server`` code, with no extra copy; the wrapper adds one type
check per call.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, NoReturn, final

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    _Context = grpc.aio.ServicerContext[Any, Any]
    _Handler = grpc.RpcMethodHandler[Any, Any]


def malformed_message(type_name: str) -> str:
    """The status message for bytes that do not parse as the message ``type_name``."""
    return f"malformed request: not a valid {type_name} message"


@final
class Undecodable:
    """Stands in for a request message whose bytes did not parse as ``type_name``."""

    __slots__ = ("message", "type_name")

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name
        #: The INVALID_ARGUMENT message to end the call with.
        self.message = malformed_message(type_name)

    def __repr__(self) -> str:
        return f"Undecodable({self.type_name!r})"


def tolerant_deserializer(
    message_class: type[Message],
) -> Callable[[bytes], Message | Undecodable]:
    """``message_class.FromString``, returning an :class:`Undecodable` instead of raising."""
    from_string = message_class.FromString
    undecodable = Undecodable(message_class.DESCRIPTOR.full_name)

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return from_string(data)
        except DecodeError:
            return undecodable

    return deserialize


def add_service(server: grpc.aio.Server, service: ServiceDescriptor, servicer: object) -> None:
    """Serve ``service`` with ``servicer``'s methods, as the generated
    ``add_<Service>Servicer_to_server`` would, except for undecodable requests."""
    handlers = {
        method.name: _handler(method, getattr(servicer, method.name)) for method in service.methods
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _handler(method: MethodDescriptor, behavior: Callable[..., Any]) -> _Handler:
    request_class = GetMessageClass(method.input_type)
    response_class = GetMessageClass(method.output_type)
    deserializer: Callable[[bytes], Any]
    streams = inspect.isasyncgenfunction(behavior)
    if streams or inspect.iscoroutinefunction(behavior):
        deserializer = tolerant_deserializer(request_class)
        if not method.client_streaming:
            check = _checked_stream if streams else _checked
            behavior = check(method.full_name, behavior)
    else:
        # Not a coroutine (the generated base class's UNIMPLEMENTED stub): served exactly
        # as the generated code would serve it.
        deserializer = request_class.FromString
    make = _MAKERS[(method.client_streaming, method.server_streaming)]
    return make(
        behavior,
        request_deserializer=deserializer,
        response_serializer=response_class.SerializeToString,
    )


async def _refuse(method: str, request: Undecodable, context: _Context) -> NoReturn:
    logger.info("grpc.malformed_request method=%s", method)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _checked(method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def handle(request: object, context: _Context) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(method, request, context)
        return await behavior(request, context)

    return handle


def _checked_stream(method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
    # An async generator stays one, so grpc.aio (and the interceptors) iterate it as before.
    async def handle(request: object, context: _Context) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await _refuse(method, request, context)
        async with aclosing(behavior(request, context)) as responses:
            async for response in responses:
                yield response

    return handle
