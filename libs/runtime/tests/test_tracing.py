"""The process's tracing: configured and shut down any number of times, its own provider
(never the global one), the sampler, and trace contexts in task headers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conveyor_runtime import tracing
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

SAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("test", "t1", None, exporter=exporter)
    yield exporter
    tracing.shutdown_tracing()


def finished(exporter: InMemorySpanExporter) -> list[str]:
    provider = tracing._provider
    assert provider is not None
    provider.force_flush()
    return [span.name for span in exporter.get_finished_spans()]


def test_a_module_tracer_follows_every_configuration() -> None:
    module_tracer = tracing.tracer("some.module")
    for round_ in range(2):
        exporter = InMemorySpanExporter()
        tracing.configure_tracing("test", "t1", None, exporter=exporter)
        try:
            with module_tracer.start_as_current_span(f"round-{round_}"):
                pass
            assert finished(exporter) == [f"round-{round_}"]
        finally:
            tracing.shutdown_tracing()
    # Off again: the no-op tracer, and the global provider was never taken.
    assert not module_tracer.start_span("off").get_span_context().is_valid
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def test_the_sample_ratio_applies_to_traces_that_start_here() -> None:
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("test", "t1", None, sample_ratio=0.0, exporter=exporter)
    try:
        module_tracer = tracing.tracer("x")
        module_tracer.start_span("root").end()
        parent = tracing.task_parent({"traceparent": SAMPLED})
        module_tracer.start_span("child", parent).end()
        # A root is dropped at ratio 0; a span whose parent was sampled is recorded.
        assert finished(exporter) == ["child"]
    finally:
        tracing.shutdown_tracing()


def test_only_a_sampled_traceparent_is_a_parent() -> None:
    assert tracing.sampled(SAMPLED)
    assert not tracing.sampled(UNSAMPLED)
    assert not tracing.sampled("garbage")
    assert tracing.task_parent({}) is None
    assert tracing.task_parent({"traceparent": UNSAMPLED}) is None
    assert tracing.task_parent({"traceparent": SAMPLED[:-2] + "zz"}) is None
    assert tracing.task_parent({"traceparent": "00-" + "0" * 32 + "-b7ad6b7169203331-01"}) is None
    parent = tracing.task_parent({"traceparent": SAMPLED, "tracestate": "vendor=1"})
    assert parent is not None
    context = trace.get_current_span(parent).get_span_context()
    assert f"{context.trace_id:032x}" == SAMPLED.split("-")[1]
    assert context.trace_state.get("vendor") == "1"


def test_stamp_makes_the_span_the_next_hops_parent(spans: InMemorySpanExporter) -> None:
    parent = tracing.task_parent({"traceparent": SAMPLED})
    span = tracing.tracer("x").start_span("hop", parent)
    headers = {"traceparent": SAMPLED, "other": "kept"}
    tracing.stamp(headers, span)
    span.end()
    _, trace_id, span_id, flags = headers["traceparent"].split("-")
    context = span.get_span_context()
    assert (trace_id, span_id, flags) == (SAMPLED.split("-")[1], f"{context.span_id:016x}", "01")
    assert headers["other"] == "kept"
    assert tracing.carrier_of(span) == {"traceparent": headers["traceparent"]}


def test_remote_parent_reads_call_metadata() -> None:
    assert tracing.remote_parent(None) is None
    assert tracing.remote_parent([("authorization", "Bearer x")]) is None
    parent = tracing.remote_parent([("authorization", "Bearer x"), ("traceparent", SAMPLED)])
    assert parent is not None
    assert trace.get_current_span(parent).get_span_context().is_remote


def test_links_to_distinct_other_traces() -> None:
    other = "00-1af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    headers = [{"traceparent": SAMPLED}, {"traceparent": SAMPLED}, {"traceparent": other}, {}]
    own = int(SAMPLED.split("-")[1], 16)
    assert len(tracing.links_to(headers)) == 2
    (link,) = tracing.links_to(headers, besides=own)
    assert f"{link.context.trace_id:032x}" == other.split("-")[1]
