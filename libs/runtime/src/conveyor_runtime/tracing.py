"""OpenTelemetry tracing: spans exported over OTLP when ``otlp_endpoint`` is set.

Without an endpoint nothing is configured and OpenTelemetry's no-op tracer makes every
span free, so the hot path pays nothing when tracing is off.
"""

from __future__ import annotations

import logging

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

logger = logging.getLogger(__name__)

_provider: TracerProvider | None = None


def configure_tracing(
    service: str, instance: str, endpoint: str | None, *, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """Install a tracer provider for this process (once); None when tracing is off.

    ``exporter`` replaces the OTLP exporter (tests pass an in-memory one).
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
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    logger.info("tracing.enabled service=%s endpoint=%s", service, endpoint)
    return provider


def shutdown_tracing() -> None:
    """Flush and stop the exporter (at process exit)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracing_enabled() -> bool:
    """True once :func:`configure_tracing` installed a provider in this process."""
    return _provider is not None


def tracer(name: str) -> trace.Tracer:
    """A tracer for ``name`` (a module); no-op until tracing is configured."""
    return trace.get_tracer(name)
