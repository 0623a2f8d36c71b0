"""Metrics off, for ``python -m bench.e2e_bench --metrics off|both``: the benchmark puts
this folder on the PYTHONPATH of every process it starts, and Python imports this module
at start-up, before any service code.

It turns prometheus_client's recording calls into no-ops (``labels`` returns the metric
itself, ``inc``, ``dec``, ``set`` and ``observe`` do nothing), so a run measures the
services without the cost of their instrumentation: the baseline the metrics' overhead
is measured against. What is left is the label caps' set lookups at the call sites.
Never used outside the benchmark.
"""

from __future__ import annotations

from typing import Any


def _nothing(self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def _itself(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self


def _switch_off() -> None:
    try:
        from prometheus_client import metrics
    except ImportError:  # a Python without it (a tool's own interpreter): nothing to do
        return
    metrics.MetricWrapperBase.labels = _itself  # type: ignore[method-assign]
    metrics.MetricWrapperBase.remove = _nothing  # type: ignore[method-assign]
    metrics.MetricWrapperBase.clear = _nothing  # type: ignore[method-assign]
    metrics.Counter.inc = _nothing  # type: ignore[method-assign]
    metrics.Gauge.inc = _nothing  # type: ignore[method-assign]
    metrics.Gauge.dec = _nothing  # type: ignore[method-assign]
    metrics.Gauge.set = _nothing  # type: ignore[method-assign]
    metrics.Histogram.observe = _nothing  # type: ignore[method-assign]
    metrics.Summary.observe = _nothing  # type: ignore[method-assign]


_switch_off()
