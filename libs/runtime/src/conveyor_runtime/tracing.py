"""OpenTelemetry tracing: spans exported over OTLP when ``otlp_endpoint`` is set.

Without an endpoint nothing is configured: :func:`tracing_enabled` is False, the hot path
checks it once per batch and creates no span object at all, and the tracers of
:func:`tracer` are OpenTelemetry's no-op tracer (for the few spans off the hot path).

The provider is this process's own: it is *not* installed as OpenTelemetry's global
provider, so a service embedded in an application's process (``conveyor dev``, the
testing server) never takes the application's tracing over, and tests can configure and
shut tracing down as often as they like. Its sampler is parent-based with a ratio
(``trace_sample_ratio``) for the traces that start here.

**One trace per task.** A task carries its trace context in its headers, as W3C
``traceparent`` (and ``tracestate``): the producer's SDK writes it at enqueue (or the
api, for a producer that sent none, while tracing is on), and every hop after the
enqueue makes its spans children of the context it received and passes its own span on
in the envelope's headers: the dispatcher's offer in the ``DispatchRequest`` (a NATS
message), the gateway's push in the frame to the worker or the webhook delivery.
:func:`task_parent` reads such a context, :func:`stamp` writes one. A hop traces a
task only when its traceparent says *sampled*: the decision is taken once, where the
trace begins, so a task's trace is whole or absent, and an unsampled task costs a hop
one string lookup.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

logger = logging.getLogger(__name__)

#: The W3C trace-context header names, as task headers and as gRPC metadata.
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

#: The most links a span that stands for many tasks (a batch's commit) carries.
MAX_LINKS = 32

_provider: TracerProvider | None = None
_NOOP = trace.NoOpTracer()
_PROPAGATOR = TraceContextTextMapPropagator()
#: The last hex digit of a traceparent's flags when the trace is sampled (bit 0 set).
_SAMPLED_DIGITS = frozenset("13579bdf")


def configure_tracing(
    service: str,
    instance: str,
    endpoint: str | None,
    *,
    sample_ratio: float = 1.0,
    exporter: SpanExporter | None = None,
) -> TracerProvider | None:
    """Install this process's tracer provider (once); None when tracing is off.

    ``sample_ratio`` is the share of the traces starting here that are recorded (a span
    with a parent follows its parent's decision). ``exporter`` replaces the OTLP
    exporter (tests pass an in-memory one).
    """
    global _provider
    if endpoint is None and exporter is None:
        return None
    if _provider is not None:
        return _provider
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=endpoint, insecure=endpoint.startswith("http://"))  # type: ignore[union-attr]
    resource = Resource.create(
        {"service.name": f"conveyor-{service}", "service.instance.id": instance}
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio))
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider = provider
    logger.info(
        "tracing.enabled service=%s endpoint=%s sample_ratio=%s", service, endpoint, sample_ratio
    )
    return provider


def shutdown_tracing() -> None:
    """Flush and stop the exporter (at process exit)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracing_enabled() -> bool:
    """True once :func:`configure_tracing` installed a provider in this process: the one
    check the hot path makes before it traces anything."""
    return _provider is not None


class Tracer:
    """A tracer of this process's provider, looked up at each span: OpenTelemetry's
    no-op tracer while tracing is off, and the right one again after tracing was
    configured anew (module-level tracers outlive a test's configuration)."""

    __slots__ = ("_for", "_name", "_real")

    def __init__(self, name: str) -> None:
        self._name = name
        self._for: TracerProvider | None = None
        self._real: trace.Tracer = _NOOP

    def _current(self) -> trace.Tracer:
        provider = _provider
        if provider is None:
            return _NOOP
        if self._for is not provider:
            self._real = provider.get_tracer(self._name)
            self._for = provider
        return self._real

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
    ) -> Span:
        """Start a span (see ``opentelemetry.trace.Tracer.start_span``); end it yourself."""
        return self._current().start_span(
            name, context, kind, attributes, links, start_time=start_time
        )

    def start_as_current_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[Link] | None = None,
    ) -> AbstractContextManager[Span]:
        """A span that is the current one inside the ``with`` block, ended on its way out."""
        return self._current().start_as_current_span(name, context, kind, attributes, links)


def tracer(name: str) -> Tracer:
    """A tracer for ``name`` (a module); no-op until tracing is configured."""
    return Tracer(name)


# ----------------------------------------------------------- trace context in headers


def sampled(traceparent: str) -> bool:
    """True when a W3C ``traceparent`` value (``00-<trace id>-<span id>-<flags>``) has
    the sampled flag; False for anything else (absent, malformed, unsampled)."""
    return len(traceparent) == 55 and traceparent[52] == "-" and traceparent[54] in _SAMPLED_DIGITS


def task_parent(headers: Mapping[str, str]) -> Context | None:
    """The trace context a task's (or an envelope's) headers carry when its trace is
    sampled; None otherwise, and then the hop traces nothing for the task."""
    value = headers.get(TRACEPARENT)
    if not value or not sampled(value):
        return None
    carrier = {TRACEPARENT: value}
    state = headers.get(TRACESTATE)
    if state:
        carrier[TRACESTATE] = state
    context = _PROPAGATOR.extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def context_of(span: Span) -> Context:
    """A context whose current span is ``span``: the parent of its children."""
    return trace.set_span_in_context(span)


def stamp(headers: MutableMapping[str, str], span: Span) -> None:
    """Write ``span``'s trace context into ``headers`` (a dict or a protobuf map) as
    ``traceparent`` and ``tracestate``, replacing what was there: the next hop's parent."""
    _PROPAGATOR.inject(headers, context=context_of(span))


def carrier_of(span: Span) -> dict[str, str]:
    """``span``'s trace context as headers (``traceparent``, and ``tracestate`` when
    there is one)."""
    carrier: dict[str, str] = {}
    stamp(carrier, span)
    return carrier


def remote_parent(metadata: Iterable[tuple[str, str]] | None) -> Context | None:
    """The trace context of gRPC call metadata (what a traced client sent), or None."""
    if not metadata:
        return None
    carrier = {key: value for key, value in metadata if key in (TRACEPARENT, TRACESTATE)}
    if TRACEPARENT not in carrier:
        return None
    context = _PROPAGATOR.extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def links_to(headers: Iterable[Mapping[str, str]], *, besides: int = 0) -> list[Link]:
    """Links to the distinct sampled trace contexts among ``headers`` (at most
    :data:`MAX_LINKS`), leaving out those of the trace ``besides`` (a trace id): for a
    span that stands for many tasks."""
    links: list[Link] = []
    seen: set[tuple[int, int]] = set()
    for item in headers:
        parent = task_parent(item)
        if parent is None:
            continue
        span_context = trace.get_current_span(parent).get_span_context()
        key = (span_context.trace_id, span_context.span_id)
        if span_context.trace_id == besides or key in seen:
            continue
        seen.add(key)
        links.append(Link(span_context))
        if len(links) >= MAX_LINKS:
            break
    return links
