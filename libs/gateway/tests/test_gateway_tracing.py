"""A gateway's spans while tracing is on: the push of each sampled delivery (its context
handed to the worker in the envelope's headers) and the commit of its outcome; nothing
for an unsampled or untraced delivery, and nothing at all while tracing is off.

A MemoryBroker on a FakeClock and a transport that records the envelopes it was given;
offers go to :meth:`Gateway.accept` directly, results to :meth:`Gateway.on_results`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from conveyor_broker import FakeClock, NewTask, Task, TaskState
from conveyor_broker.memory import MemoryBroker
from conveyor_gateway import AckBatcher, Gateway, GatewayConfig, WakePublisher, WorkerSpec
from conveyor_protos.v1 import cluster_pb2, service_pb2, task_pb2
from conveyor_runtime import tracing
from conveyor_runtime.bus import Bus
from conveyor_runtime.wire import task_to_envelope
from conveyor_testkit.polling import wait_until
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

TTL = timedelta(seconds=30)
SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@dataclass
class Recording:
    """A transport that keeps the envelopes it was given."""

    envelopes: list[task_pb2.TaskEnvelope] = field(default_factory=list)

    def dispatch(self, tasks: Sequence[task_pb2.TaskEnvelope]) -> None:
        self.envelopes += tasks

    def dispatch_batch(self, batch: service_pb2.BatchDispatch) -> None:
        pass

    def cancel(self, task_id: str, lease_id: str, reason: str) -> None:
        pass


@dataclass
class Parts:
    broker: MemoryBroker
    gateway: Gateway
    transport: Recording
    acks: AckBatcher
    wakes: WakePublisher

    async def leased(self, *traceparents: str) -> list[Task]:
        for value in traceparents:
            headers = {"traceparent": value} if value else {}
            await self.broker.enqueue(NewTask(queue="q", type="t", headers=headers))
        return await self.broker.lease("q", len(traceparents), TTL)


@pytest.fixture
async def parts(bus: Bus, clock: FakeClock) -> AsyncIterator[Parts]:
    broker = MemoryBroker(clock)
    acks, wakes, transport = AckBatcher(broker), WakePublisher(bus), Recording()
    gateway = Gateway(
        "gw-traced",
        WorkerSpec(queues={"q": 1}, concurrency=4, worker_id="w"),
        broker=broker,
        bus=bus,
        config=GatewayConfig(lease_ttl=TTL, register_tick=60.0, max_result=100, clock=clock),
        acks=acks,
        wakes=wakes,
        transport=transport,
        connected_at=clock.now(),
    )
    yield Parts(broker, gateway, transport, acks, wakes)
    await gateway.close()
    await acks.aclose()
    await wakes.aclose()
    await broker.close()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("api", "test", None, exporter=exporter)
    yield exporter
    tracing.shutdown_tracing()


def finished(exporter: InMemorySpanExporter) -> list[ReadableSpan]:
    provider = tracing._provider
    assert provider is not None
    provider.force_flush()
    return list(exporter.get_finished_spans())


def offer(tasks: Sequence[Task]) -> cluster_pb2.DispatchRequest:
    return cluster_pb2.DispatchRequest(
        queue="q", dispatcher="test", tasks=[task_to_envelope(t) for t in tasks]
    )


def success(task: Task) -> service_pb2.Result:
    assert task.lease_id is not None
    return service_pb2.Result(
        task_id=task.id, lease_id=task.lease_id, outcome=service_pb2.OUTCOME_SUCCESS
    )


def span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.span_id:016x}"


async def test_a_sampled_delivery_is_pushed_then_acked_in_its_trace(
    parts: Parts, spans: InMemorySpanExporter
) -> None:
    traced, unsampled, untraced = await parts.leased(SAMPLED, UNSAMPLED, "")
    parts.gateway.accept(offer([traced, unsampled, untraced]))
    sent = {env.id: env for env in parts.transport.envelopes}
    # The worker gets the push as its parent; the others keep what they carried.
    assert sent[unsampled.id].headers["traceparent"] == UNSAMPLED
    assert "traceparent" not in sent[untraced.id].headers
    pushed = sent[traced.id].headers["traceparent"]
    assert pushed != SAMPLED
    assert pushed.split("-")[1] == SAMPLED.split("-")[1]

    parts.gateway.on_results([success(traced), success(unsampled), success(untraced)])

    async def acked() -> bool:
        return (await parts.broker.get_task(traced.id)).state is TaskState.COMPLETED

    await wait_until(acked)
    await wait_until(lambda: len(finished(spans)) == 2)
    by_name = {span.name: span for span in finished(spans)}
    push, ack = by_name["conveyor.push"], by_name["conveyor.ack"]
    assert push.parent is not None
    assert f"{push.parent.span_id:016x}" == SAMPLED.split("-")[2]
    assert span_id(push) == pushed.split("-")[2]
    assert push.attributes is not None
    assert push.attributes["conveyor.task.id"] == traced.id
    assert push.attributes["conveyor.outcome"] == "success"
    assert push.attributes["conveyor.gateway"] == "gw-traced"
    assert ack.parent is not None
    assert f"{ack.parent.span_id:016x}" == span_id(push)


async def test_a_delivery_that_ends_without_a_result_ends_its_push(
    parts: Parts, spans: InMemorySpanExporter
) -> None:
    (task,) = await parts.leased(SAMPLED)
    parts.gateway.accept(offer([task]))
    assert parts.gateway.cancel(task.id, "canceled")
    (push,) = finished(spans)
    assert push.name == "conveyor.push"
    assert push.attributes is not None
    assert push.attributes["conveyor.outcome"] == "none"


async def test_nothing_is_traced_while_tracing_is_off(parts: Parts) -> None:
    (task,) = await parts.leased(SAMPLED)
    parts.gateway.accept(offer([task]))
    assert parts.transport.envelopes[0].headers["traceparent"] == SAMPLED
    assert not parts.gateway._traces.spans
