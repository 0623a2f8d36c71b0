"""Metrics off, for ``python -m bench.e2e_bench --metrics off|both``: the benchmark puts
this folder on the PYTHONPATH of every process it starts, and Python imports this module
at start-up, before any service code.

It turns prometheus_client's recording calls into no-ops (``labels`` returns the metric
itself, ``inc``, ``dec``, ``set`` and ``observe`` do nothing), and so are
``conveyor_runtime.metrics``' own (``Observations.observe``, ``observe_many``,
``Tally.add``), patched as that module is first imported; so a run measures the services
without the cost of their instrumentation: the baseline the metrics' overhead is measured
against. What is left is the label caps' and ``Bound``'s dict lookups at the call sites.
Never used outside the benchmark.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
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


#: conveyor_runtime.metrics' own recording calls.
_OWN = "conveyor_runtime.metrics"


def _switch_off_own(module: ModuleType) -> None:
    module.Observations.observe = _nothing
    module.Observations.observe_many = _nothing
    module.Tally.add = _nothing


class _Loader(importlib.abc.Loader):
    """Runs the real loader of conveyor_runtime.metrics, then switches its calls off."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _switch_off_own(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds conveyor_runtime.metrics as the other finders do, with :class:`_Loader`."""

    def find_spec(
        self, fullname: str, path: Any, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _OWN:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec: importlib.machinery.ModuleSpec | None = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
                return spec
        return None


_switch_off()
sys.meta_path.insert(0, _Finder())
