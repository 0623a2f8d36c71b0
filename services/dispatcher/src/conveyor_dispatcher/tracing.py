"""The dispatcher's spans: a lease and an offer per sampled task, made only while tracing
is on.

The dispatcher works in batches (one lease statement, one DispatchRequest per gateway),
but a task's trace is the task's: each sampled task of a round gets two spans of its
own, children of the trace context in its headers (see
:mod:`conveyor_runtime.tracing`):

- ``conveyor.lease``: from the start of the round's lease to the building of its offer
  (the batch's times, recorded once per round: a clock read before the lease and one
  after), made after the fact with those times;
- ``conveyor.offer``: from then until the gateway answered (``conveyor.accepted`` says
  whether it took the task). Its context replaces the traceparent in the task's
  envelope, so the gateway's push is its child.

Per-task spans instead of one span per batch with a link per task: the spans then share
the task's trace id (a viewer shows the whole path of one task as one trace), a round
with no sampled task costs one header lookup per task, and with tracing off a round
costs one check of :func:`~conveyor_runtime.tracing.tracing_enabled`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from conveyor_broker.types import Task
from conveyor_protos.v1 import task_pb2
from conveyor_runtime.tracing import stamp, task_parent, tracer, tracing_enabled
from opentelemetry.trace import Span, SpanKind

_tracer = tracer(__name__)


def lease_started() -> int:
    """The time (ns since the epoch) a round's lease starts while tracing is on; 0 when
    it is off, and then the round traces nothing."""
    return time.time_ns() if tracing_enabled() else 0


class OfferSpans:
    """The offer spans of one round's sampled tasks, by task id, until the gateways
    answered."""

    __slots__ = ("_spans",)

    def __init__(self, spans: list[tuple[str, Span]]) -> None:
        self._spans = spans

    @classmethod
    def start(
        cls,
        queue: str,
        offer: Sequence[tuple[Task, task_pb2.TaskEnvelope]],
        lease_at: int,
    ) -> OfferSpans | None:
        """Record the lease span of every sampled task of ``offer`` (from ``lease_at``
        until now), start its offer span and write that into its envelope's headers; None
        when no task of the offer is sampled."""
        now = time.time_ns()
        spans: list[tuple[str, Span]] = []
        for task, envelope in offer:
            parent = task_parent(task.headers)
            if parent is None:
                continue
            attributes = {
                "conveyor.queue": queue,
                "conveyor.task.id": task.id,
                "conveyor.task.type": task.type,
                "conveyor.attempt": task.retried + 1,
            }
            lease = _tracer.start_span(
                "conveyor.lease", parent, SpanKind.INTERNAL, attributes, start_time=lease_at
            )
            lease.end(end_time=now)
            span = _tracer.start_span(
                "conveyor.offer", parent, SpanKind.PRODUCER, attributes, start_time=now
            )
            stamp(envelope.headers, span)
            spans.append((task.id, span))
        return cls(spans) if spans else None

    def end(self, rejected: Sequence[Task]) -> None:
        """The gateways answered: end every offer span, saying whether its task was taken
        (``rejected``: the tasks nobody accepted)."""
        refused = {task.id for task in rejected}
        for task_id, span in self._spans:
            span.set_attribute("conveyor.accepted", task_id not in refused)
            span.end()
