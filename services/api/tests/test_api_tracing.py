"""With tracing on, every gRPC call becomes a server span exported over the configured
exporter (OTLP in deployments; an in-memory one here)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from conveyor_protos.v1 import service_pb2, service_pb2_grpc, task_pb2
from conveyor_runtime import tracing
from conveyor_testkit.polling import wait_until
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("api", "test", None, exporter=exporter)
    yield exporter
    tracing.shutdown_tracing()


async def test_calls_are_traced_with_their_status(
    spans: InMemorySpanExporter, make_api: Any
) -> None:
    api = await make_api()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        stub: Any = service_pb2_grpc.TaskServiceStub(channel)  # type: ignore[no-untyped-call]
        new = task_pb2.NewTask(queue="traced", type="t")
        await stub.Enqueue(service_pb2.EnqueueRequest(task=new))
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.GetTask(service_pb2.GetTaskRequest(id="01ARZ3NDEKTSV4RRFFQ69G5FAV"))
    provider = tracing._provider
    assert provider is not None
    names = {"/conveyor.v1.TaskService/Enqueue", "/conveyor.v1.TaskService/GetTask"}

    def finished() -> bool:
        # A server span ends after its response went out: the client may see the answer
        # before the span is finished.
        provider.force_flush()
        return names <= {s.name for s in spans.get_finished_spans()}

    await wait_until(finished)
    by_name = {s.name: s for s in spans.get_finished_spans()}
    enqueue = by_name["/conveyor.v1.TaskService/Enqueue"]
    assert enqueue.attributes is not None
    assert enqueue.attributes["rpc.method"] == "Enqueue"
    assert enqueue.status.status_code is not StatusCode.ERROR
    assert by_name["/conveyor.v1.TaskService/GetTask"].status.status_code is StatusCode.ERROR


async def test_tracing_is_off_without_an_endpoint() -> None:
    assert tracing.configure_tracing("api", "test", None) is None
    assert not tracing.tracing_enabled()


SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
OTHER = "00-1af7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01"


def _finished(spans: InMemorySpanExporter) -> list[Any]:
    provider = tracing._provider
    assert provider is not None
    provider.force_flush()
    return list(spans.get_finished_spans())


async def _spans_named(spans: InMemorySpanExporter, *names: str) -> dict[str, list[Any]]:
    def ready() -> bool:
        found = {s.name for s in _finished(spans)}
        return set(names) <= found

    await wait_until(ready)
    by_name: dict[str, list[Any]] = {}
    for span in _finished(spans):
        by_name.setdefault(span.name, []).append(span)
    return by_name


async def test_the_call_continues_the_callers_trace_and_stamps_an_untraced_task(
    spans: InMemorySpanExporter, make_api: Any
) -> None:
    api = await make_api()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        stub: Any = service_pb2_grpc.TaskServiceStub(channel)  # type: ignore[no-untyped-call]
        new = task_pb2.NewTask(queue="traced", type="t", headers={"a": "b"})
        reply = await stub.Enqueue(
            service_pb2.EnqueueRequest(task=new), metadata=(("traceparent", SAMPLED),)
        )
    by_name = await _spans_named(spans, "/conveyor.v1.TaskService/Enqueue", "conveyor.commit")
    (call,) = by_name["/conveyor.v1.TaskService/Enqueue"]
    (commit,) = by_name["conveyor.commit"]
    assert call.parent is not None
    assert f"{call.parent.span_id:016x}" == SAMPLED.split("-")[2]
    assert f"{call.context.trace_id:032x}" == SAMPLED.split("-")[1]
    assert commit.parent is not None
    assert commit.parent.span_id == call.context.span_id
    # The task came without a trace context: it carries the call's, its own headers kept.
    stored = reply.task.headers
    assert stored["a"] == "b"
    assert stored["traceparent"] == (
        f"00-{call.context.trace_id:032x}-{call.context.span_id:016x}-01"
    )


async def test_a_task_keeps_its_own_trace_and_its_commit_joins_it(
    spans: InMemorySpanExporter, make_api: Any
) -> None:
    api = await make_api()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        stub: Any = service_pb2_grpc.TaskServiceStub(channel)  # type: ignore[no-untyped-call]
        new = task_pb2.NewTask(queue="traced", type="t", headers={"traceparent": SAMPLED})
        reply = await stub.Enqueue(service_pb2.EnqueueRequest(task=new))
        batch = [
            task_pb2.NewTask(queue="traced", type="t", headers={"traceparent": tp})
            for tp in (SAMPLED, OTHER, OTHER)
        ]
        await stub.EnqueueBatch(service_pb2.EnqueueBatchRequest(tasks=batch))
    assert reply.task.headers["traceparent"] == SAMPLED
    by_name = await _spans_named(spans, "/conveyor.v1.TaskService/EnqueueBatch")
    single, many = sorted(by_name["conveyor.commit"], key=lambda s: s.attributes["conveyor.tasks"])
    # A producer that sent its context only in the task: the commit is in the task's trace.
    assert f"{single.parent.span_id:016x}" == SAMPLED.split("-")[2]
    # A batch's commit is the call's child, linked to each other trace of its tasks.
    (call,) = by_name["/conveyor.v1.TaskService/EnqueueBatch"]
    assert many.parent.span_id == call.context.span_id
    linked = {f"{link.context.trace_id:032x}" for link in many.links}
    assert linked == {SAMPLED.split("-")[1], OTHER.split("-")[1]}


async def test_an_unsampled_call_stamps_nothing(make_api: Any) -> None:
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("api", "test", None, sample_ratio=0.0, exporter=exporter)
    try:
        api = await make_api()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
            stub: Any = service_pb2_grpc.TaskServiceStub(channel)  # type: ignore[no-untyped-call]
            reply = await stub.Enqueue(
                service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue="q", type="t"))
            )
        assert "traceparent" not in reply.task.headers
        assert _finished(exporter) == []
    finally:
        tracing.shutdown_tracing()
