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
