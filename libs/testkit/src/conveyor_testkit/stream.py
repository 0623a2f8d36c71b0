"""Driving an api server by hand, without the SDK: a raw worker stream, a recorder of the
bus's messages, and a stand-in dispatcher.

Nothing here sleeps for time: waits poll a condition until a timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic

import grpc
from conveyor_protos.v1 import cluster_pb2, service_pb2, service_pb2_grpc, task_pb2
from conveyor_runtime.bus import Bus, M
from nats.aio.subscription import Subscription

from conveyor_testkit.polling import wait_until

if TYPE_CHECKING:
    from conveyor_api.server import ApiServer

#: Starts an ApiServer with settings overrides (the api tests' ``make_api`` fixture).
MakeApi = Callable[..., Awaitable["ApiServer"]]


class WorkerStream:
    """One raw ``WorkerService.Session`` call, spoken frame by frame."""

    def __init__(self, channel: grpc.aio.Channel, *, token: str | None = None) -> None:
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        stub: Any = service_pb2_grpc.WorkerServiceStub
        self.call: Any = stub(channel).Session(metadata=metadata)

    async def send(self, frame: service_pb2.WorkerFrame) -> None:
        """Write one frame."""
        await self.call.write(frame)

    async def read(self, within: float = 5.0, *, pings: bool = False) -> service_pb2.ServerFrame:
        """The next server frame, skipping keepalive Pings unless ``pings`` (a worker
        ignores them); EOFError when the stream ended (whatever its status)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + within
        while True:
            try:
                frame = await asyncio.wait_for(self.call.read(), max(0.0, until - loop.time()))
            except grpc.aio.AioRpcError as exc:
                raise EOFError(f"the stream ended with {exc.code().name}: {exc.details()}") from exc
            if frame is grpc.aio.EOF:
                raise EOFError("the server ended the stream")
            assert isinstance(frame, service_pb2.ServerFrame)
            if pings or frame.WhichOneof("frame") != "ping":
                return frame

    async def read_kind(self, kind: str, within: float = 5.0) -> service_pb2.ServerFrame:
        """The next frame, which must be of ``kind`` (``dispatch``, ``cancel``, ...)."""
        frame = await self.read(within, pings=kind == "ping")
        got = frame.WhichOneof("frame")
        if got != kind:
            raise AssertionError(f"expected a {kind} frame, got {got}: {frame}")
        return frame

    async def hello(
        self,
        queues: Mapping[str, int],
        concurrency: int,
        *,
        sdk_version: str = "0.1.0",
        min_server_version: str = "",
        labels: Mapping[str, str] | None = None,
        worker_id: str = "test-worker",
        accepts_dispatches: bool = False,
    ) -> service_pb2.Welcome:
        """Send Hello and return the Welcome."""
        hello = service_pb2.Hello(
            queues=dict(queues),
            concurrency=concurrency,
            labels=dict(labels or {}),
            sdk_version=sdk_version,
            min_server_version=min_server_version,
            worker_id=worker_id,
            accepts_dispatches=accepts_dispatches,
        )
        await self.send(service_pb2.WorkerFrame(hello=hello))
        return (await self.read_kind("welcome")).welcome

    async def result(
        self,
        env: task_pb2.TaskEnvelope,
        outcome: service_pb2.Outcome,
        *,
        result: bytes = b"",
        error: str = "",
        retry_after: float | None = None,
    ) -> None:
        """Report the outcome of a dispatched task."""
        msg = service_pb2.Result(
            task_id=env.id,
            lease_id=env.lease_id,
            outcome=outcome,
            result=result,
            error=error,
        )
        if retry_after is not None:
            msg.retry_after.FromNanoseconds(int(retry_after * 1e9))
        await self.send(service_pb2.WorkerFrame(result=msg))

    async def status(self, within: float = 5.0) -> grpc.StatusCode:
        """Wait for the stream to end and return its status code."""
        code: grpc.StatusCode = await asyncio.wait_for(self.call.code(), within)
        return code

    async def details(self) -> str:
        """The status message the stream ended with."""
        text: str = await self.call.details()
        return text

    async def close(self) -> None:
        """Half-close: the worker is done sending."""
        await self.call.done_writing()

    def cancel(self) -> None:
        """Abandon the call (like a worker process dying)."""
        self.call.cancel()


class Recorder(Generic[M]):
    """Collects the ``kind`` messages on the bus (see :meth:`Bus.subscribe`)."""

    def __init__(self, kind: type[M]) -> None:
        self.kind: type[M] = kind
        self.messages: list[M] = []
        self._sub: Subscription | None = None

    async def start(self, bus: Bus, *, queue: str = "*") -> Recorder[M]:
        """Subscribe to those of ``queue`` (default: every queue's; per-queue kinds only),
        and flush, so nothing published afterwards is missed."""
        self._sub = await bus.subscribe(self.kind, self.messages.append, queue=queue)
        await bus.nc.flush()
        return self

    async def wait_for(
        self,
        predicate: Callable[[M], bool] = lambda _: True,
        *,
        count: int = 1,
        within: float = 5.0,
    ) -> list[M]:
        """Wait until ``count`` recorded messages match ``predicate``; return them."""
        await wait_until(
            lambda: sum(1 for m in self.messages if predicate(m)) >= count,
            within=within,
            message=f"{count} {self.kind.__name__} message(s)",
        )
        return [m for m in self.messages if predicate(m)]

    async def stop(self) -> None:
        """Unsubscribe."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None


async def dispatch(
    bus: Bus,
    gateway: str,
    queue: str,
    envelopes: Sequence[task_pb2.TaskEnvelope],
    *,
    within: float = 5.0,
) -> cluster_pb2.DispatchReply:
    """Act as the dispatcher: offer ``envelopes`` to ``gateway`` and return its reply."""
    request = cluster_pb2.DispatchRequest(queue=queue, dispatcher="test", tasks=list(envelopes))
    return await bus.dispatch(gateway, request, within=within)


async def refused(call: Any, request: Any, **kwargs: Any) -> tuple[grpc.StatusCode, str]:
    """The status code and details of a unary call that must fail (``kwargs``: its
    metadata, say); AssertionError when it succeeds."""
    try:
        await call(request, **kwargs)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    raise AssertionError(f"{request.DESCRIPTOR.name} was not refused")
