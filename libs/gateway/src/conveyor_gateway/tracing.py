"""A gateway's spans: the push of each sampled delivery and the commit of its outcome,
made only while tracing is on.

- ``conveyor.push``: from the moment the gateway takes a delivery of a dispatch offer
  until the worker's answer for it (or until the delivery ends otherwise: lost, canceled,
  overrun, the gateway closing; ``conveyor.outcome`` says which). It is the child of the
  trace context in the envelope's headers (the dispatcher's offer), and its own context
  replaces it there before the envelope goes to the worker (the stream's Dispatches
  frame, a webhook's POST), so the worker's handler span is its child.
- ``conveyor.ack`` (a success) or ``conveyor.outcome`` (a failure, skip-retry or
  release): the child of the push, from the worker's Result until the broker committed
  the outcome (or the gateway handed it to its retry loop).

A delivery whose traceparent is absent or unsampled gets no span (see
:mod:`conveyor_runtime.tracing`). While tracing is off :attr:`DeliveryTraces.spans` stays
empty, and the gateway's only cost is a test of that empty dict per frame of results and
per delivery it stops holding.
"""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any

from conveyor_protos.v1 import service_pb2, task_pb2
from conveyor_runtime.tracing import context_of, stamp, task_parent, tracer
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

_tracer = tracer(__name__)

#: The outcome attribute of each Result outcome.
OUTCOME_NAMES: dict[int, str] = {
    service_pb2.OUTCOME_SUCCESS: "success",
    service_pb2.OUTCOME_FAILURE: "failure",
    service_pb2.OUTCOME_SKIP_RETRY: "skip_retry",
    service_pb2.OUTCOME_RELEASE: "release",
}


class DeliveryTraces:
    """The open push span of every sampled delivery one gateway holds, by lease id."""

    __slots__ = ("gateway", "spans")

    def __init__(self, gateway: str = "") -> None:
        #: The gateway's id (an attribute of its spans).
        self.gateway = gateway
        #: Lease id -> the delivery's push span (only sampled deliveries; empty while
        #: tracing is off).
        self.spans: dict[str, Span] = {}

    def push(self, envelopes: Sequence[task_pb2.TaskEnvelope]) -> None:
        """Start the push span of each sampled delivery of ``envelopes`` (just taken, about
        to go to the worker) and write it into the envelope's headers."""
        for env in envelopes:
            parent = task_parent(env.headers)
            if parent is None:
                continue
            span = _tracer.start_span(
                "conveyor.push",
                parent,
                SpanKind.CONSUMER,
                {
                    "conveyor.queue": env.queue,
                    "conveyor.task.id": env.id,
                    "conveyor.task.type": env.type,
                    "conveyor.attempt": env.attempt,
                    "conveyor.gateway": self.gateway,
                },
            )
            stamp(env.headers, span)
            self.spans[env.lease_id] = span

    def answered(self, lease_id: str, outcome: int) -> Span | None:
        """The worker answered the delivery under ``lease_id`` with ``outcome``: end its
        push span and return the started span of the outcome's commit (None when the
        delivery is not traced). The caller ends it (see :func:`traced`)."""
        span = self.spans.pop(lease_id, None)
        if span is None:
            return None
        name = OUTCOME_NAMES.get(outcome, "unknown")
        span.set_attribute("conveyor.outcome", name)
        span.end()
        return _tracer.start_span(
            "conveyor.ack" if outcome == service_pb2.OUTCOME_SUCCESS else "conveyor.outcome",
            context_of(span),
            SpanKind.INTERNAL,
            {"conveyor.outcome": name, "conveyor.gateway": self.gateway},
        )

    def drop(self, lease_id: str) -> None:
        """The delivery under ``lease_id`` ended without a Result seen here (lost,
        canceled, overrun, given back): end its push span."""
        span = self.spans.pop(lease_id, None)
        if span is not None:
            span.set_attribute("conveyor.outcome", "none")
            span.end()

    def clear(self) -> None:
        """End every push span (the gateway stops holding anything)."""
        spans = list(self.spans.values())
        self.spans.clear()
        for span in spans:
            span.set_attribute("conveyor.outcome", "none")
            span.end()


def traced(work: Coroutine[Any, Any, None], spans: Sequence[Span]) -> Coroutine[Any, Any, None]:
    """``work``, ending ``spans`` when it is over (``work`` itself when there are none)."""
    if not spans:
        return work
    return _traced(work, spans)


async def _traced(work: Awaitable[None], spans: Sequence[Span]) -> None:
    try:
        await work
    except BaseException as exc:
        for span in spans:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        for span in spans:
            span.end()
