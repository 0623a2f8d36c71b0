"""The SDK's tracing, through opentelemetry-api: with the application's OpenTelemetry
configured (:func:`conveyor_testkit.tracing.app_tracing`) an enqueue is a span whose
context goes into the tasks' headers and the call's metadata, and a handler runs inside a
span that is the child of its delivery's traceparent; without it, nothing is written.

The producer talks to a TaskService double on a real gRPC socket that keeps each request
and its metadata; handler runs are :class:`~conveyor._worker.execution.Execution` objects
with a recording origin."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest
from conveyor import AsyncClient, Client, TaskContext, spec
from conveyor._payload import JsonCodec
from conveyor._tracing import MAX_HEADERS
from conveyor._worker.execution import Execution, Registration
from conveyor_broker.validation import MAX_HEADERS as SERVER_MAX_HEADERS
from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from conveyor_testkit.polling import wait_until
from conveyor_testkit.tracing import Recorded, app_tracing, one
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ULID = "01HZZZZZZZZZZZZZZZZZZZZZZA"


@dataclass
class Double:
    """A TaskService that stores nothing: it answers each enqueue with its tasks and
    keeps every request with its metadata."""

    requests: list[tuple[Any, dict[str, str]]] = field(default_factory=list)

    def _keep(self, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        metadata = context.invocation_metadata() or ()
        self.requests.append((request, {str(k): str(v) for k, v in metadata}))

    @staticmethod
    def _task(new: pb.NewTask, n: int = 0) -> pb.Task:
        return pb.Task(
            id=ULID[:-1] + "ABCDEFGH"[n], queue=new.queue, type=new.type, headers=new.headers
        )

    async def enqueue(self, request: svc.EnqueueRequest, context: Any) -> svc.EnqueueResponse:
        self._keep(request, context)
        return svc.EnqueueResponse(task=self._task(request.task), created=True)

    async def enqueue_batch(
        self, request: svc.EnqueueBatchRequest, context: Any
    ) -> svc.EnqueueBatchResponse:
        self._keep(request, context)
        results = [
            svc.EnqueueItemResult(task=self._task(t, n), created=True)
            for n, t in enumerate(request.tasks)
        ]
        return svc.EnqueueBatchResponse(results=results)

    def handler(self) -> grpc.GenericRpcHandler:
        methods: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Enqueue": grpc.unary_unary_rpc_method_handler(
                self.enqueue,
                request_deserializer=svc.EnqueueRequest.FromString,
                response_serializer=svc.EnqueueResponse.SerializeToString,
            ),
            "EnqueueBatch": grpc.unary_unary_rpc_method_handler(
                self.enqueue_batch,
                request_deserializer=svc.EnqueueBatchRequest.FromString,
                response_serializer=svc.EnqueueBatchResponse.SerializeToString,
            ),
        }
        return grpc.method_handlers_generic_handler("conveyor.v1.TaskService", methods)


@dataclass
class Served:
    double: Double
    target: str


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    double = Double()
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((double.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield Served(double, f"127.0.0.1:{port}")
    await server.stop(grace=None)


def parent_of(traceparent: str) -> tuple[str, str]:
    _, trace_id, span_id, _ = traceparent.split("-")
    return trace_id, span_id


def ids(span: Recorded) -> tuple[str, str]:
    return span.trace_id, span.span_id


async def test_without_opentelemetry_configured_nothing_is_written(served: Served) -> None:
    async with AsyncClient(served.target) as client:
        await client.enqueue("t", {}, queue="q", headers={"a": "b"})
    request, metadata = served.double.requests[0]
    assert dict(request.task.headers) == {"a": "b"}
    assert "traceparent" not in metadata


async def test_an_enqueue_is_a_span_carried_by_the_task_and_the_call(served: Served) -> None:
    with app_tracing() as app:
        tracer = app.provider.get_tracer("the-app")
        async with AsyncClient(served.target) as client:
            with tracer.start_as_current_span("request"):
                info = await client.enqueue("t", {}, queue="q")
            own = await client.enqueue("t", {}, queue="q", headers={"traceparent": SAMPLED})
        spans = app.spans()
    request_span = one(spans, "request")
    first, second = [s for s in spans if s.name == "conveyor.enqueue"]
    enqueue = first if first.child_of(request_span) else second
    assert enqueue.child_of(request_span)
    assert enqueue.kind == "producer"
    assert enqueue.attributes["conveyor.task.id"] == info.id
    assert enqueue.attributes["conveyor.queue"] == "q"
    (request, metadata), (own_request, own_metadata) = served.double.requests
    assert parent_of(request.task.headers["traceparent"]) == ids(enqueue)
    assert parent_of(metadata["traceparent"]) == ids(enqueue)
    # A task given a traceparent by its caller keeps it; the call still carries ours.
    assert own_request.task.headers["traceparent"] == SAMPLED
    assert own.headers["traceparent"] == SAMPLED
    assert parent_of(own_metadata["traceparent"]) != parent_of(SAMPLED)


async def test_a_task_with_no_room_for_another_header_goes_without(served: Served) -> None:
    full = {f"h{i}": "v" for i in range(64)}
    with app_tracing():
        async with AsyncClient(served.target) as client:
            await client.enqueue("t", {}, queue="q", headers=full)
    request, metadata = served.double.requests[0]
    assert dict(request.task.headers) == full
    assert "traceparent" in metadata


async def test_a_batch_is_one_span_every_task_carries(served: Served) -> None:
    with app_tracing() as app:
        async with AsyncClient(served.target) as client:
            await client.enqueue_batch([spec("t", i, queue="q") for i in range(3)])
        batch = one(app.spans(), "conveyor.enqueue_batch")
    request, _ = served.double.requests[0]
    assert batch.attributes["conveyor.tasks"] == 3
    assert {parent_of(t.headers["traceparent"]) for t in request.tasks} == {ids(batch)}


async def test_the_blocking_client_traces_the_same_way(served: Served) -> None:
    def enqueue() -> None:
        with Client(served.target) as client:
            client.enqueue("t", {}, queue="q")

    with app_tracing() as app:
        # Its own thread: a blocking call must not hold the server's loop.
        await asyncio.to_thread(enqueue)
        enqueue_span = one(app.spans(), "conveyor.enqueue")
    request, _ = served.double.requests[0]
    assert parent_of(request.task.headers["traceparent"]) == ids(enqueue_span)


async def test_an_attached_context_is_passed_on_without_a_span_of_ours(served: Served) -> None:
    remote = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(remote)))
    try:
        async with AsyncClient(served.target) as client:
            await client.enqueue("t", {}, queue="q")
    finally:
        otel_context.detach(token)
    request, _ = served.double.requests[0]
    assert request.task.headers["traceparent"] == SAMPLED


# ------------------------------------------------------------------ the worker


@dataclass
class Origin:
    """Where a run's Result goes: kept."""

    sent: list[svc.Result] = field(default_factory=list)
    live: bool = True
    max_result: int = 1 << 20

    def send(self, result: svc.Result) -> None:
        self.sent.append(result)

    def send_progress(self, task_id: str, lease_id: str, data: bytes) -> None:
        pass

    async def dependency_results(
        self, task_id: str, lease_id: str, cursor: str
    ) -> svc.GetDependencyResultsResponse:
        return svc.GetDependencyResultsResponse()


async def run_one(handler: Any, headers: dict[str, str]) -> Origin:
    """Run ``handler`` on one delivery with ``headers``; the origin its Result went to."""
    envelope = pb.TaskEnvelope(
        id=ULID, queue="q", type="t", payload=b"{}", headers=headers, lease_id="l1", attempt=2
    )
    origin = Origin()
    execution = Execution(envelope, Registration.of("t", handler), origin, JsonCodec())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        done = asyncio.Event()
        execution.start(pool, lambda _: done.set())
        await asyncio.wait_for(done.wait(), 10)
    await wait_until(lambda: bool(origin.sent))
    return origin


async def test_a_handler_runs_inside_a_child_of_its_deliverys_traceparent() -> None:
    inside: list[trace.Span] = []

    async def handler(payload: Any, ctx: TaskContext) -> str:
        inside.append(trace.get_current_span())
        return "ok"

    def failing(payload: Any, ctx: TaskContext) -> None:  # sync: runs in the pool
        inside.append(trace.get_current_span())
        raise RuntimeError("boom")

    with app_tracing() as app:
        await run_one(handler, {"traceparent": SAMPLED})
        await run_one(failing, {"traceparent": SAMPLED})
        await run_one(handler, {})
        spans = app.spans()
    runs = [s for s in spans if s.name == "conveyor.run"]
    assert len(runs) == 3
    ok, failed, root = runs
    for span in (ok, failed):
        assert (span.trace_id, span.parent_id) == parent_of(SAMPLED)
        assert span.kind == "consumer"
        assert span.attributes["conveyor.attempt"] == 2
    assert ok.attributes["conveyor.outcome"] == "success"
    assert failed.attributes["conveyor.outcome"] == "failure"
    # The span is the current one in the handler (async or in a thread): what the handler
    # traces or enqueues joins the task's trace.
    assert [f"{s.get_span_context().span_id:016x}" for s in inside] == [
        ok.span_id,
        failed.span_id,
        root.span_id,
    ]
    assert root.parent_id == ""


async def test_a_handler_runs_untraced_without_opentelemetry() -> None:
    seen: list[bool] = []

    async def handler(payload: Any, ctx: TaskContext) -> None:
        seen.append(trace.get_current_span().get_span_context().is_valid)

    origin = await run_one(handler, {"traceparent": SAMPLED})
    assert origin.sent[0].outcome == svc.OUTCOME_SUCCESS
    assert seen == [False]


def test_the_header_limit_is_the_servers() -> None:
    assert MAX_HEADERS == SERVER_MAX_HEADERS
