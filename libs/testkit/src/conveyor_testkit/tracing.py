"""Testing traces: spans from the test's own process (the SDK, as an application that
configured OpenTelemetry) and from service processes (over OTLP, to a collector in the
test), as one kind of record, and the relations a test checks between them.

- :func:`app_tracing`: the application's OpenTelemetry for the block, as an app would
  configure it (a global tracer provider), exporting to memory at once; the global is
  reset afterwards, so the next test starts untraced.
- :class:`SpanCollector`: an OTLP/gRPC trace collector on a free local port. Give its
  :attr:`~SpanCollector.endpoint` to services as ``CONVEYOR_OTLP_ENDPOINT`` (with a short
  ``OTEL_BSP_SCHEDULE_DELAY``, :data:`FAST_EXPORT`, so their batches come soon).
- :class:`Recorded`: one finished span, with ids in hex.

Nothing here sleeps for time: waits poll a condition until a timeout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

#: The environment that makes a service's batch span processor export every 50 ms (the
#: default waits 5 s).
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}

#: OTLP's span kinds by number, as OpenTelemetry's SpanKind names them (lower case).
_OTLP_KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


@dataclass(frozen=True, slots=True)
class Recorded:
    """One finished span: ids in lower-case hex (``parent_id`` empty for a root), its
    links as ``(trace id, span id)``, its attributes, its kind (``internal``, ``server``,
    ``producer``...) and the ``service.name`` of the process that made it."""

    name: str
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: str
    attributes: Mapping[str, Any]
    links: tuple[tuple[str, str], ...] = ()

    def child_of(self, parent: Recorded) -> bool:
        """True when this span is ``parent``'s child (same trace, parent id)."""
        return self.trace_id == parent.trace_id and self.parent_id == parent.span_id


def spans_named(spans: Iterable[Recorded], name: str, **attributes: Any) -> list[Recorded]:
    """The spans called ``name`` whose attributes hold ``attributes`` (dots in attribute
    names written as ``__``: ``conveyor__task__id=...``)."""
    wanted = {key.replace("__", "."): value for key, value in attributes.items()}
    return [
        span
        for span in spans
        if span.name == name and all(span.attributes.get(k) == v for k, v in wanted.items())
    ]


def one(spans: Iterable[Recorded], name: str, **attributes: Any) -> Recorded:
    """The one span :func:`spans_named` finds; AssertionError when it finds another count."""
    found = spans_named(spans, name, **attributes)
    assert len(found) == 1, f"{len(found)} spans {name} {attributes}: {found}"
    return found[0]


# ------------------------------------------------------------- in this process


def _recorded(span: ReadableSpan) -> Recorded:
    context = span.get_span_context()
    assert context is not None
    parent = span.parent
    return Recorded(
        name=span.name,
        service=str(span.resource.attributes.get("service.name", "")),
        trace_id=f"{context.trace_id:032x}",
        span_id=f"{context.span_id:016x}",
        parent_id=f"{parent.span_id:016x}" if parent is not None else "",
        kind=span.kind.name.lower(),
        attributes=dict(span.attributes or {}),
        links=tuple(
            (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in span.links
        ),
    )


class AppSpans:
    """What the test process's application tracing recorded (see :func:`app_tracing`)."""

    def __init__(self, exporter: InMemorySpanExporter, provider: TracerProvider) -> None:
        self._exporter = exporter
        #: The provider installed as the global one.
        self.provider = provider

    def spans(self) -> list[Recorded]:
        """Every span finished so far."""
        return [_recorded(span) for span in self._exporter.get_finished_spans()]


def _reset_global_provider() -> None:
    # OpenTelemetry lets the global provider be set once per process; tests need it set
    # and cleared again (what opentelemetry-test-utils' reset_trace_globals does).
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None


@contextmanager
def app_tracing(service: str = "app") -> Iterator[AppSpans]:
    """Configure OpenTelemetry for the block as an application does (the global tracer
    provider, ``service.name`` = ``service``), every span exported to memory as it ends;
    the global provider is unset again afterwards."""
    from opentelemetry.sdk.resources import Resource

    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _reset_global_provider()
    trace.set_tracer_provider(provider)
    try:
        yield AppSpans(exporter, provider)
    finally:
        provider.shutdown()
        _reset_global_provider()


# ------------------------------------------------------------ other processes


def _value(value: common_pb2.AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _attributes(items: Sequence[common_pb2.KeyValue]) -> dict[str, Any]:
    return {item.key: _value(item.value) for item in items}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    """The OTLP TraceService, appending what it receives to ``into``."""

    def __init__(self, into: list[Recorded]) -> None:
        self._into = into

    async def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        """Keep every span of the request."""
        for resource_spans in request.resource_spans:
            service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    self._into.append(
                        Recorded(
                            name=span.name,
                            service=service,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            kind=_OTLP_KINDS.get(span.kind, "unspecified"),
                            attributes=_attributes(span.attributes),
                            links=tuple(
                                (link.trace_id.hex(), link.span_id.hex()) for link in span.links
                            ),
                        )
                    )
        return trace_service_pb2.ExportTraceServiceResponse()


class SpanCollector:
    """An OTLP/gRPC trace collector on 127.0.0.1 (plaintext): every span service processes
    export to :attr:`endpoint`, kept in arrival order. ``async with SpanCollector() as c``."""

    def __init__(self) -> None:
        self._spans: list[Recorded] = []
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        """The collector's address, for ``CONVEYOR_OTLP_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[Recorded]:
        """Every span received so far."""
        return list(self._spans)

    async def __aenter__(self) -> SpanCollector:
        server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _TraceService(self._spans), server
        )
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
