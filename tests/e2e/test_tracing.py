"""One trace per task, through real processes: api, dispatcher, maintenance and webhook
service processes export their spans over OTLP to a collector in the test
(:class:`conveyor_testkit.tracing.SpanCollector`); the producer and the worker are the
SDK in the test's process, as an application that configured OpenTelemetry
(:func:`conveyor_testkit.tracing.app_tracing`). Every wait is on a condition with a
timeout."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any

import pytest
from conveyor import AsyncAdminClient, AsyncClient, RetryAfter, TaskContext, TaskState, Worker
from conveyor_testkit.polling import wait_until
from conveyor_testkit.tracing import (
    FAST_EXPORT,
    Recorded,
    SpanCollector,
    app_tracing,
    one,
    spans_named,
)
from conveyor_testkit.webhooks import Delivery, Endpoint

from tests.e2e.harness import POLL_INTERVAL, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

SECRET = "whsec_" + base64.b64encode(b"e2e-tracing-secret-0123456789abc").decode()


def parent_of(traceparent: str) -> tuple[str, str]:
    """The (trace id, span id) a W3C traceparent names."""
    _, trace_id, span_id, _ = traceparent.split("-")
    return trace_id, span_id


def children(spans: list[Recorded], parent: Recorded, name: str) -> list[Recorded]:
    """The spans called ``name`` that are ``parent``'s children."""
    return [span for span in spans if span.name == name and span.child_of(parent)]


async def wait_spans(
    collect: Callable[[], list[Recorded]], ready: Callable[[list[Recorded]], bool]
) -> list[Recorded]:
    """Wait until the spans ``collect`` returns are ``ready``; return them."""
    await wait_until(lambda: ready(collect()), within=30, interval=POLL_INTERVAL, message="spans")
    return collect()


async def test_one_trace_follows_each_task_through_every_process(cluster: Cluster) -> None:
    async with SpanCollector() as collector:
        cluster.settings_env.update({"CONVEYOR_OTLP_ENDPOINT": collector.endpoint, **FAST_EXPORT})
        target = await cluster.start_services()
        # A producer that traces nothing: the api starts the task's trace (its call span).
        async with AsyncClient(target) as client:
            untraced = await client.enqueue("traced.ok", {"n": 0}, queue="traced")
        assert "traceparent" in untraced.headers

        with app_tracing() as app:
            seen: dict[tuple[str, int], str] = {}
            worker = Worker(target=target, queues={"traced": 1}, concurrency=4)

            @worker.task("traced.ok")
            async def ok(payload: Any, ctx: TaskContext) -> Any:
                seen[ctx.task_id, ctx.attempt] = ctx.headers["traceparent"]
                return payload

            @worker.task("traced.retried")
            async def retried(payload: Any, ctx: TaskContext) -> Any:
                seen[ctx.task_id, ctx.attempt] = ctx.headers["traceparent"]
                if ctx.attempt == 1:
                    raise RetryAfter(0.05, "once more")
                return payload

            running = asyncio.ensure_future(worker.run())
            try:
                async with AsyncClient(target) as client:
                    task = await client.enqueue("traced.ok", {"n": 1}, queue="traced")
                    again = await client.enqueue("traced.retried", {"n": 2}, queue="traced")

                    async def completed() -> bool:
                        states = [
                            (await client.get_task(t.id)).state for t in (untraced, task, again)
                        ]
                        return states == [TaskState.COMPLETED] * 3

                    await wait_until(completed, within=60, interval=POLL_INTERVAL)
                    stored = await client.get_task(task.id)
            finally:
                worker.stop()
                await asyncio.wait_for(running, 30)

            def ready(spans: list[Recorded]) -> bool:
                acks = spans_named(spans, "conveyor.ack")
                outcomes = spans_named(spans, "conveyor.outcome")
                runs = spans_named(spans, "conveyor.run")
                return len(acks) == 3 and len(outcomes) == 1 and len(runs) == 4

            spans = await wait_spans(lambda: collector.spans() + app.spans(), ready)

    services = {span.service for span in spans}
    assert {"conveyor-api", "conveyor-dispatcher", "app"} <= services

    # The traced producer: enqueue (SDK) -> the api's call -> its commit; the task's
    # stored headers carry the enqueue span.
    enqueue = one(spans, "conveyor.enqueue", conveyor__task__id=task.id)
    assert enqueue.service == "app"
    assert enqueue.kind == "producer"
    (call,) = children(spans, enqueue, "/conveyor.v1.TaskService/Enqueue")
    assert call.service == "conveyor-api"
    assert call.kind == "server"
    assert children(spans, call, "conveyor.commit")
    assert parent_of(stored.headers["traceparent"]) == (enqueue.trace_id, enqueue.span_id)

    def attempt(task_id: str, root: Recorded, n: int) -> tuple[Recorded, Recorded]:
        """Lease, offer, push, run: attempt ``n`` of ``task_id``, all under ``root``;
        returns its push and run spans."""
        lease = one(spans, "conveyor.lease", conveyor__task__id=task_id, conveyor__attempt=n)
        offer = one(spans, "conveyor.offer", conveyor__task__id=task_id, conveyor__attempt=n)
        assert lease.service == offer.service == "conveyor-dispatcher"
        assert lease.child_of(root)
        assert offer.child_of(root)
        assert offer.attributes["conveyor.accepted"] is True
        push = one(spans, "conveyor.push", conveyor__task__id=task_id, conveyor__attempt=n)
        assert push.service == "conveyor-api"
        assert push.child_of(offer)
        run = one(spans, "conveyor.run", conveyor__task__id=task_id, conveyor__attempt=n)
        assert run.service == "app"
        assert run.child_of(push)
        # The handler saw the push as its parent in the delivery's headers.
        assert parent_of(seen[task_id, n]) == (push.trace_id, push.span_id)
        return push, run

    push, run = attempt(task.id, enqueue, 1)
    assert run.attributes["conveyor.outcome"] == "success"
    (ack,) = children(spans, push, "conveyor.ack")
    assert ack.service == "conveyor-api"
    assert len({s.trace_id for s in spans if s.attributes.get("conveyor.task.id") == task.id}) == 1

    # A retried task: each attempt is new spans in the one trace of its enqueue.
    first_enqueue = one(spans, "conveyor.enqueue", conveyor__task__id=again.id)
    push1, run1 = attempt(again.id, first_enqueue, 1)
    push2, run2 = attempt(again.id, first_enqueue, 2)
    assert run1.attributes["conveyor.outcome"] == "failure"
    assert children(spans, push1, "conveyor.outcome")[0].attributes["conveyor.outcome"] == (
        "failure"
    )
    assert children(spans, push2, "conveyor.ack")
    assert run1.trace_id == run2.trace_id == first_enqueue.trace_id
    assert run1.span_id != run2.span_id

    # The untraced producer's task: its trace starts at the api's call span.
    root_call = next(
        s
        for s in spans
        if s.name == "/conveyor.v1.TaskService/Enqueue"
        and (s.trace_id, s.span_id) == parent_of(untraced.headers["traceparent"])
    )
    assert root_call.parent_id == ""
    push0, _ = attempt(untraced.id, root_call, 1)
    assert children(spans, push0, "conveyor.ack")


async def test_webhook_deliveries_carry_the_traceparent(cluster: Cluster) -> None:
    async with SpanCollector() as collector, Endpoint() as endpoint:
        cluster.settings_env.update({"CONVEYOR_OTLP_ENDPOINT": collector.endpoint, **FAST_EXPORT})
        target = await cluster.start_services()
        cluster.start_webhook(
            {"CONVEYOR_CALLBACK_ADDRESS": target, "CONVEYOR_RECONCILE_TICK": "0.2"}
        )
        with app_tracing() as app:
            async with AsyncAdminClient(target) as admin, AsyncClient(target) as client:
                await admin.upsert_webhook_worker(
                    "traced-hook", endpoint.url, {"hooks": 1}, secrets=[SECRET]
                )
                task = await client.enqueue("invoice.charge", {"amount": 1}, queue="hooks")

                async def completed() -> bool:
                    return (await client.get_task(task.id)).state == TaskState.COMPLETED

                await wait_until(completed, within=60, interval=POLL_INTERVAL)

            def ready(spans: list[Recorded]) -> bool:
                return bool(spans_named(spans, "conveyor.ack"))

            spans = await wait_spans(lambda: collector.spans() + app.spans(), ready)

    (delivery,) = [d for d in endpoint.deliveries if d.task_id == task.id]
    traceparent = header(delivery, "traceparent")
    assert traceparent is not None
    enqueue = one(spans, "conveyor.enqueue", conveyor__task__id=task.id)
    push = one(spans, "conveyor.push", conveyor__task__id=task.id)
    assert push.service == "conveyor-webhook"
    assert push.trace_id == enqueue.trace_id
    # The endpoint's parent is the webhook gateway's push: a traced endpoint joins the
    # task's trace; the JSON-RPC body's headers say the same.
    assert parent_of(traceparent) == (push.trace_id, push.span_id)
    assert delivery.call["params"]["headers"]["traceparent"] == traceparent
    (ack,) = children(spans, push, "conveyor.ack")
    assert ack.service == "conveyor-webhook"


def header(delivery: Delivery, name: str) -> str | None:
    """A delivery's HTTP header, looked up case-insensitively."""
    wanted = name.lower()
    return next((v for k, v in delivery.headers.items() if k.lower() == wanted), None)
