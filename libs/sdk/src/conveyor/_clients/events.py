"""The live lifecycle events of ``watch_events``: :class:`AsyncEventStream` (asyncio)
and :class:`EventStream` (blocking), over an AdminService.WatchEvents call."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Any, Self

import grpc
import grpc.aio

from conveyor._clients.admin_types import TaskEvent
from conveyor._clients.admin_wire import event_from_wire
from conveyor._errors import error_from_rpc, error_from_status


class AsyncEventStream:
    """Live lifecycle events from :meth:`AsyncAdminClient.watch_events`.

    Iterate it with ``async for``. Used as an async context manager, entering waits until
    the server's subscription is live (so no event caused afterwards is missed) and
    leaving stops the stream; :meth:`close` stops it too.
    """

    def __init__(self, call: Any) -> None:
        self._call = call
        self._closed = False

    async def ready(self) -> None:
        """Wait until the server is subscribed; raise the server's error if it refused."""
        await self._call.initial_metadata()
        if self._call.done():
            code = await self._call.code()
            if code is not grpc.StatusCode.OK:
                details = await self._call.details()
                raise error_from_status(code.name, details or code.name.lower())

    def close(self) -> None:
        """Stop the stream; iteration ends."""
        self._closed = True
        self._call.cancel()

    def __aiter__(self) -> AsyncIterator[TaskEvent]:
        return self

    async def __anext__(self) -> TaskEvent:
        if self._closed:
            raise StopAsyncIteration
        try:
            message = await self._call.read()
        except grpc.aio.AioRpcError as exc:
            if self._closed or exc.code() is grpc.StatusCode.CANCELLED:
                raise StopAsyncIteration from None
            raise error_from_rpc(exc) from None
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        return event_from_wire(message)

    async def __aenter__(self) -> Self:
        try:
            await self.ready()
        except BaseException:
            self.close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class EventStream:
    """Live lifecycle events from :meth:`AdminClient.watch_events`: the blocking twin of
    :class:`AsyncEventStream` (iterate it with ``for``; a context manager)."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._closed = False

    def ready(self) -> None:
        """Wait until the server is subscribed; raise the server's error if it refused."""
        self._call.initial_metadata()
        if self._call.done() and self._call.code() is not grpc.StatusCode.OK:
            raise error_from_rpc(self._call)

    def close(self) -> None:
        """Stop the stream; iteration ends."""
        self._closed = True
        self._call.cancel()

    def __iter__(self) -> Iterator[TaskEvent]:
        return self

    def __next__(self) -> TaskEvent:
        if self._closed:
            raise StopIteration
        try:
            message = next(self._call)
        except grpc.RpcError as exc:
            if self._closed or getattr(exc, "code", lambda: None)() is grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise error_from_rpc(exc) from None
        return event_from_wire(message)

    def __enter__(self) -> Self:
        try:
            self.ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
