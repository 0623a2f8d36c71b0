"""OpenTelemetry in the SDK, through ``opentelemetry-api`` alone: the application brings
the OpenTelemetry SDK, its exporter and its sampler, or nothing, and then the SDK makes no
span and writes no header.

- **Producer.** Each enqueue call (``enqueue``, ``enqueue_batch``, ``enqueue_tx``) is a
  span of its own (``conveyor.enqueue``, ``conveyor.enqueue_batch``,
  ``conveyor.enqueue_tx``; kind PRODUCER) when the application configured a tracer
  provider, the child of the application's current span. Its context goes into the
  headers of every task that carries no ``traceparent`` of its own (W3C trace context:
  ``traceparent``, ``tracestate``), so every hop after the enqueue joins the trace, and
  into the call's metadata, so the api's span of the call is its child. Without a
  provider but inside a valid span (a context the application attached), that span's
  context is written instead, with no span of the SDK's own.
- **Worker.** ``conveyor.run`` (kind CONSUMER) around each handler run, the child of the
  ``traceparent`` in the delivery's headers (the gateway's push) when the application
  configured a provider. It is the current span while the handler runs, so the
  handler's own spans, and the tasks it enqueues, belong to the task's trace. Each
  attempt of a task is a run span of its own in the same trace.

With no provider configured, an enqueue costs a look at the global provider and at the
current span (well under a microsecond); a handler run costs the look at the provider.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

from conveyor_protos.v1 import service_pb2 as svc
from conveyor_protos.v1 import task_pb2 as pb
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.environment_variables import OTEL_PYTHON_TRACER_PROVIDER
from opentelemetry.trace import (
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanKind,
    Status,
    StatusCode,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from conveyor._version import __version__

#: The W3C trace-context header names, in task headers and in gRPC metadata.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
#: The most headers a task may have (the server's limit): a task with no room left for
#: the trace context is sent without it rather than refused.
MAX_HEADERS = 64

_PROPAGATOR = TraceContextTextMapPropagator()
#: The providers that make no span: none configured yet (the proxy), or the no-op one.
_INERT = (ProxyTracerProvider, NoOpTracerProvider)
#: The SDK's tracer, with the provider it came from.
_cached: tuple[trace.TracerProvider, trace.Tracer] | None = None
#: A provider named by the environment is made by ``get_tracer_provider`` on first use.
_PROVIDER_FROM_ENV = OTEL_PYTHON_TRACER_PROVIDER in os.environ
_UNKNOWN = object()
_T = TypeVar("_T")

_OUTCOMES = {
    svc.OUTCOME_SUCCESS: "success",
    svc.OUTCOME_FAILURE: "failure",
    svc.OUTCOME_SKIP_RETRY: "skip_retry",
    svc.OUTCOME_RELEASE: "release",
}


def sdk_tracer() -> trace.Tracer | None:
    """The SDK's tracer from the application's global provider; None when the
    application configured none (the SDK then makes no span)."""
    global _cached
    provider = _global_provider()
    if provider is None or isinstance(provider, _INERT):
        return None
    cached = _cached
    if cached is not None and cached[0] is provider:
        return cached[1]
    tracer = provider.get_tracer("conveyor", __version__)
    _cached = (provider, tracer)
    return tracer


def _global_provider() -> trace.TracerProvider | None:
    """The application's global tracer provider; None while it has set none.

    Read from where ``set_tracer_provider`` puts it: ``get_tracer_provider`` looks the
    environment up on every call while no provider is set (a microsecond or more), and
    this runs once per enqueue and per handler run. When the environment names a
    provider, or the API keeps its global elsewhere, the public call decides.
    """
    if _PROVIDER_FROM_ENV:
        return trace.get_tracer_provider()
    provider = getattr(trace, "_TRACER_PROVIDER", _UNKNOWN)
    if provider is _UNKNOWN:
        return trace.get_tracer_provider()
    return cast("trace.TracerProvider | None", provider)


def _carrier(span: Span) -> dict[str, str]:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


class EnqueueTrace:
    """The trace of one enqueue call, used as ``with client._traced(...) as trace``:
    :meth:`stamp` writes its context into the tasks, :attr:`metadata` goes with the
    call, and the span (if any) ends with the block, with the error that ended it."""

    __slots__ = ("_carrier", "_span", "_token", "metadata")

    def __init__(self, carrier: dict[str, str], span: Span | None) -> None:
        self._carrier = carrier
        self._span = span
        self._token: object | None = None
        #: The trace context as gRPC call metadata (empty: none).
        self.metadata: tuple[tuple[str, str], ...] = tuple(carrier.items())

    def stamp(self, tasks: Sequence[pb.NewTask]) -> None:
        """Write the trace context into each task whose headers have no traceparent (a
        task given one by its caller keeps it, and one with no room left for it goes
        without)."""
        carrier = self._carrier
        if not carrier:
            return
        room = MAX_HEADERS - len(carrier)
        for task in tasks:
            headers = task.headers
            if TRACEPARENT not in headers and len(headers) <= room:
                headers.update(carrier)

    def identify(self, task_id: str) -> None:
        """Name the task the call enqueued (a single enqueue's span)."""
        if self._span is not None:
            self._span.set_attribute("conveyor.task.id", task_id)

    def __enter__(self) -> EnqueueTrace:
        if self._span is not None:
            self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        span = self._span
        if span is None:
            return
        if self._token is not None:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            self._token = None
        if exc is not None:
            _record_error(span, exc)
        span.end()


#: The trace of every enqueue while there is nothing to trace: stamps nothing.
OFF = EnqueueTrace({}, None)


def enqueue_trace(name: str, tasks: Sequence[pb.NewTask]) -> EnqueueTrace:
    """The trace of an enqueue call ``name`` of ``tasks``: a span of the application's
    provider, or the current span's context without a span of ours, or :data:`OFF`."""
    tracer = sdk_tracer()
    if tracer is None:
        current = trace.get_current_span()
        if not current.get_span_context().is_valid:
            return OFF
        return EnqueueTrace(_carrier(current), None)
    attributes: dict[str, Any] = {"messaging.system": "conveyor", "conveyor.tasks": len(tasks)}
    if tasks:
        attributes["conveyor.queue"] = tasks[0].queue
        if len(tasks) == 1:
            attributes["conveyor.task.type"] = tasks[0].type
    span = tracer.start_span(name, kind=SpanKind.PRODUCER, attributes=attributes)
    return EnqueueTrace(_carrier(span), span)


def start_run(
    envelope: pb.TaskEnvelope,
) -> tuple[Span | None, contextvars.Context | None]:
    """The run span of a delivery and a context in which it is current (for the handler's
    asyncio task), or ``(None, None)`` when the application configured no provider."""
    tracer = sdk_tracer()
    if tracer is None:
        return None, None
    headers = envelope.headers
    parent = _PROPAGATOR.extract(headers) if TRACEPARENT in headers else None
    span = tracer.start_span(
        "conveyor.run",
        parent,
        SpanKind.CONSUMER,
        {
            "messaging.system": "conveyor",
            "conveyor.queue": envelope.queue,
            "conveyor.task.id": envelope.id,
            "conveyor.task.type": envelope.type,
            "conveyor.attempt": envelope.attempt,
        },
    )
    context = contextvars.copy_context()
    context.run(otel_context.attach, trace.set_span_in_context(span))
    return span, context


def end_run(span: Span, task: asyncio.Task[svc.Result]) -> None:
    """End a run span with what the handler's task came to: its Result's outcome (an
    error status for a failure), or ``cancelled``."""
    _end_task_span(span, task, _record_outcome)


def end_batch_run(span: Span, task: asyncio.Task[list[svc.Result]]) -> None:
    """End a batch's run span: the members' outcome (``mixed`` when they differ), an
    error status when any failed, or ``cancelled``."""
    _end_task_span(span, task, _record_outcomes)


def _record_outcome(span: Span, result: svc.Result) -> None:
    span.set_attribute("conveyor.outcome", _OUTCOMES.get(result.outcome, "unknown"))
    if result.outcome in (svc.OUTCOME_FAILURE, svc.OUTCOME_SKIP_RETRY):
        span.set_status(Status(StatusCode.ERROR, result.error))


def _record_outcomes(span: Span, results: list[svc.Result]) -> None:
    names = {_OUTCOMES.get(r.outcome, "unknown") for r in results}
    span.set_attribute("conveyor.outcome", names.pop() if len(names) == 1 else "mixed")
    failed = sum(r.outcome in (svc.OUTCOME_FAILURE, svc.OUTCOME_SKIP_RETRY) for r in results)
    if failed:
        span.set_status(Status(StatusCode.ERROR, f"{failed} of {len(results)} failed"))


def _end_task_span(span: Span, task: asyncio.Task[_T], record: Callable[[Span, _T], None]) -> None:
    """End ``span`` with what ``task`` came to: ``record`` of its value, the exception
    it raised, or ``cancelled``."""
    if task.cancelled():
        span.set_attribute("conveyor.outcome", "cancelled")
    else:
        exc = task.exception()
        if exc is not None:
            _record_error(span, exc)
        else:
            record(span, task.result())
    span.end()


def _record_error(span: Span, exc: BaseException) -> None:
    span.record_exception(exc)
    span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
