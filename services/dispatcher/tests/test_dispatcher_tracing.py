"""The dispatcher's spans: a lease and an offer per sampled task of a round, children of
the task's trace context; the offer's context goes to the gateway in the envelope."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from conveyor_broker import FakeClock, NewTask
from conveyor_broker.memory import MemoryBroker
from conveyor_dispatcher.tracing import OfferSpans, lease_started
from conveyor_runtime import tracing
from conveyor_runtime.wire import task_to_envelope
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("dispatcher", "test", None, exporter=exporter)
    yield exporter
    tracing.shutdown_tracing()


async def test_each_sampled_task_gets_a_lease_and_an_offer(
    spans: InMemorySpanExporter, clock: FakeClock
) -> None:
    broker = MemoryBroker(clock)
    for value in (SAMPLED, UNSAMPLED, SAMPLED):
        await broker.enqueue(NewTask(queue="q", type="t", headers={"traceparent": value}))
    lease_at = lease_started()
    tasks = await broker.lease("q", 3, timedelta(seconds=30))
    offer = [(task, task_to_envelope(task)) for task in tasks]
    started = OfferSpans.start("q", offer, lease_at)
    assert started is not None
    started.end([tasks[2]])
    await broker.close()

    provider = tracing._provider
    assert provider is not None
    provider.force_flush()
    finished = spans.get_finished_spans()
    assert sorted(s.name for s in finished) == ["conveyor.lease"] * 2 + ["conveyor.offer"] * 2
    for span in finished:
        assert span.parent is not None
        assert f"{span.parent.span_id:016x}" == SAMPLED.split("-")[2]
        assert span.attributes is not None
        assert span.attributes["conveyor.attempt"] == 1
    offers = {s.attributes["conveyor.task.id"]: s for s in finished if s.name == "conveyor.offer"}  # type: ignore[index]
    assert offers[tasks[0].id].attributes["conveyor.accepted"] is True  # type: ignore[index]
    assert offers[tasks[2].id].attributes["conveyor.accepted"] is False  # type: ignore[index]
    # The gateway's parent is the offer; the unsampled task's envelope is as it was.
    envelopes = {task.id: envelope for task, envelope in offer}
    offer_id = offers[tasks[0].id].context.span_id
    assert envelopes[tasks[0].id].headers["traceparent"].split("-")[2] == f"{offer_id:016x}"
    assert envelopes[tasks[1].id].headers["traceparent"] == UNSAMPLED
    lease = next(s for s in finished if s.name == "conveyor.lease")
    assert lease.start_time == lease_at
    assert lease.end_time is not None
    assert lease.end_time <= time.time_ns()


def test_nothing_is_traced_while_tracing_is_off() -> None:
    assert lease_started() == 0
