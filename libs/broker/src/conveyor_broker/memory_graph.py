"""The memory broker's dependency graph: edges both ways, each waiting task's counters,
and which tasks still have dependents to resolve.

Mirrors the Postgres broker's ``conveyor_task_dependencies`` table and its counter
columns, so the two resolve alike. Not task-safe on its own: the broker holds its lock
around every use.
"""

from __future__ import annotations

from conveyor_broker.dependencies import Start
from conveyor_broker.types import DependencyOutcome


class DependencyGraph:
    """Edges (a task waits for a dependency), as the resolution needs them."""

    def __init__(self) -> None:
        # task -> {dependency: outcome}, in the order the task named them.
        self._waits_for: dict[str, dict[str, DependencyOutcome]] = {}
        # dependency -> {task: outcome}: the same edges from the other end.
        self._waited_by: dict[str, dict[str, DependencyOutcome]] = {}
        # dependency -> the tasks whose edge to it is open.
        self._open: dict[str, set[str]] = {}
        # task -> [open, failed] of its edges (kept while it is BLOCKED).
        self._counts: dict[str, list[int]] = {}
        #: Tasks whose dependents are not all resolved (they had an open edge to them).
        self.pending: set[str] = set()

    def add(self, task_id: str, start: Start) -> None:
        """Store the edges of a new task as ``start`` settled them."""
        self._waits_for[task_id] = dict(start.edges)
        for dep, outcome in start.edges:
            self._waited_by.setdefault(dep, {})[task_id] = outcome
            if outcome is DependencyOutcome.OPEN:
                self._open.setdefault(dep, set()).add(task_id)
                self.pending.add(dep)
        self._counts[task_id] = [start.open, start.failed]

    def counts(self, task_id: str) -> tuple[int, int]:
        """(open, failed) of ``task_id``'s edges."""
        open_count, failed = self._counts.get(task_id, (0, 0))
        return open_count, failed

    def set_counts(self, task_id: str, open_count: int, failed: int) -> None:
        """Store ``task_id``'s counters."""
        self._counts[task_id] = [open_count, failed]

    def open_dependents(self, dep: str, limit: int) -> list[str]:
        """The first ``limit`` tasks (by id) whose edge to ``dep`` is open."""
        return sorted(self._open.get(dep, ()))[:limit]

    def settle(self, task_id: str, dep: str, outcome: DependencyOutcome) -> None:
        """Set the outcome of the edge ``task_id`` -> ``dep``."""
        self._waits_for[task_id][dep] = outcome
        self._waited_by[dep][task_id] = outcome
        opened = self._open.get(dep)
        if outcome is DependencyOutcome.OPEN:
            self._open.setdefault(dep, set()).add(task_id)
        elif opened is not None:
            opened.discard(task_id)
            if not opened:
                del self._open[dep]

    def failed_dependents(self, dep: str) -> list[str]:
        """The tasks whose edge to ``dep`` failed, by id."""
        return sorted(
            task
            for task, outcome in self._waited_by.get(dep, {}).items()
            if outcome is DependencyOutcome.FAILED
        )

    def dependencies(self, task_id: str) -> dict[str, DependencyOutcome]:
        """``task_id``'s edges to the tasks it waits for."""
        return self._waits_for.get(task_id, {})

    def dependents(self, dep: str) -> dict[str, DependencyOutcome]:
        """The edges of the tasks that wait for ``dep``."""
        return self._waited_by.get(dep, {})

    def drop(self, task_id: str) -> None:
        """Forget a deleted or purged task: its own edges go with it (the tasks waiting for
        it keep theirs), and so does its flag."""
        for dep in self._waits_for.pop(task_id, {}):
            waiting = self._waited_by.get(dep)
            if waiting is not None:
                waiting.pop(task_id, None)
                if not waiting:
                    del self._waited_by[dep]
            opened = self._open.get(dep)
            if opened is not None:
                opened.discard(task_id)
                if not opened:
                    del self._open[dep]
        self._counts.pop(task_id, None)
        self.pending.discard(task_id)
