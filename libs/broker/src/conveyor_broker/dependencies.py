"""Dependency rules every broker shares: how a dependent stands given its edges, and how
an enqueue batch's dependencies are checked and settled before anything is stored.

A task that waits for others keeps two counters beside its edges: how many of its
dependencies have not ended yet (``open``) and how many ended without completing
(``failed``). Its :func:`verdict` follows from them and its ``on_failure`` policy alone,
so each resolution step touches one edge and one counter pair, never the whole list:
a fan-in of 10,000 costs the same per completion as a fan-in of two.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from conveyor_broker.errors import InvalidTask
from conveyor_broker.types import (
    DEPENDENCY_FAILED_ERROR,
    TERMINAL_STATES,
    DependencyOutcome,
    NewTask,
    OnFailure,
    TaskState,
)


class Verdict(enum.Enum):
    """What a task waiting for dependencies does now."""

    WAIT = "wait"
    RUN = "run"
    CANCEL = "cancel"


def verdict(open_count: int, failed: int, on_failure: OnFailure) -> Verdict:
    """The verdict for a task with ``open_count`` dependencies not ended yet and ``failed``
    ended without completing.

    CASCADE_CANCEL cancels on the first failure; otherwise the task waits while any
    dependency is open; then BLOCK keeps waiting after a failure (for an operator), and
    CONTINUE (or no failure at all) runs.
    """
    if failed and on_failure is OnFailure.CASCADE_CANCEL:
        return Verdict.CANCEL
    if open_count or (failed and on_failure is OnFailure.BLOCK):
        return Verdict.WAIT
    return Verdict.RUN


def edge_outcome(state: TaskState | None) -> DependencyOutcome:
    """How an edge to a dependency in ``state`` stands (None: the dependency is gone, which
    counts as a failure: it will never complete)."""
    if state is TaskState.COMPLETED:
        return DependencyOutcome.SATISFIED
    if state is None or state in TERMINAL_STATES:
        return DependencyOutcome.FAILED
    return DependencyOutcome.OPEN


def dependency_failed_error(dependency_id: str) -> str:
    """The ``last_error`` of a task a failed dependency canceled."""
    return DEPENDENCY_FAILED_ERROR.format(dependency_id)


def unique_dependencies(depends_on: Sequence[str]) -> tuple[str, ...]:
    """``depends_on`` without repeats, in first-seen order (a task waits for each once)."""
    return tuple(dict.fromkeys(depends_on))


@dataclass(frozen=True, slots=True)
class BatchItem:
    """A task of an enqueue batch that will be created: its index in the batch and id."""

    index: int
    task_id: str
    task: NewTask


@dataclass(frozen=True, slots=True)
class Start:
    """How a new task with dependencies starts.

    ``state`` is BLOCKED or CANCELED, or None when it starts as a task without
    dependencies would (every dependency completed, or ended and the policy lets it run).
    ``edges`` pairs each dependency with its outcome; ``open`` and ``failed`` count them;
    ``error`` is the ``last_error`` of a task born CANCELED.
    """

    state: TaskState | None
    edges: tuple[tuple[str, DependencyOutcome], ...]
    open: int
    failed: int
    error: str | None = None


def plan_starts(items: Sequence[BatchItem], stored: Mapping[str, TaskState]) -> dict[str, Start]:
    """How each new task of a batch that has dependencies starts (by id).

    ``items`` are the batch's tasks that will be created, in batch order (a repeated id
    only at its first occurrence); ``stored`` the states of the stored tasks the batch
    names. A dependency may be a stored task or any item of the batch, earlier or later.

    Raises InvalidTask for a dependency that is neither (the first such, in batch order)
    or for a cycle among the items, naming it. Items are settled dependencies first, so
    a task that depends on an item born CANCELED sees that failure at once.
    """
    by_id = {item.task_id: item for item in items}
    for item in items:
        for dep in item.task.depends_on:
            if dep not in by_id and dep not in stored:
                raise InvalidTask(f"task {item.index}: unknown dependency {dep!r}")
    starts: dict[str, Start] = {}
    for item in _dependencies_first(items, by_id):
        if item.task.depends_on:
            starts[item.task_id] = _start(item, stored, starts)
    return starts


def _start(item: BatchItem, stored: Mapping[str, TaskState], planned: Mapping[str, Start]) -> Start:
    edges: list[tuple[str, DependencyOutcome]] = []
    for dep in item.task.depends_on:
        if dep in planned:
            # An item of this batch: new, so open, unless a cascade cancels it at birth.
            born_canceled = planned[dep].state is TaskState.CANCELED
            outcome = DependencyOutcome.FAILED if born_canceled else DependencyOutcome.OPEN
        elif dep in stored:
            outcome = edge_outcome(stored[dep])
        else:
            # An item of the batch without dependencies of its own: new, so open.
            outcome = DependencyOutcome.OPEN
        edges.append((dep, outcome))
    open_count = sum(outcome is DependencyOutcome.OPEN for _, outcome in edges)
    failed = [dep for dep, outcome in edges if outcome is DependencyOutcome.FAILED]
    match verdict(open_count, len(failed), item.task.on_failure):
        case Verdict.CANCEL:
            return Start(
                TaskState.CANCELED,
                tuple(edges),
                open_count,
                len(failed),
                dependency_failed_error(min(failed)),
            )
        case Verdict.WAIT:
            return Start(TaskState.BLOCKED, tuple(edges), open_count, len(failed))
        case Verdict.RUN:
            return Start(None, tuple(edges), open_count, len(failed))


def _dependencies_first(
    items: Sequence[BatchItem], by_id: Mapping[str, BatchItem]
) -> list[BatchItem]:
    """``items`` ordered so that every item comes after the items it depends on (batch order
    otherwise); InvalidTask naming a cycle if there is one. Iterative: a chain of a whole
    batch is as deep as the batch."""
    done: set[str] = set()
    on_path: dict[str, int] = {}  # id -> position in path
    ordered: list[BatchItem] = []
    for root in items:
        if root.task_id in done:
            continue
        path: list[str] = [root.task_id]
        on_path[root.task_id] = 0
        # For each item on the path, an iterator over its dependencies still to visit.
        pending = [iter(root.task.depends_on)]
        while path:
            step = next(pending[-1], None)
            if step is None:
                finished = path.pop()
                pending.pop()
                del on_path[finished]
                done.add(finished)
                ordered.append(by_id[finished])
                continue
            if step not in by_id or step in done:
                continue
            if step in on_path:
                raise InvalidTask(_cycle_message([*path[on_path[step] :], step], by_id))
            on_path[step] = len(path)
            path.append(step)
            pending.append(iter(by_id[step].task.depends_on))
    return ordered


def _cycle_message(cycle: Sequence[str], by_id: Mapping[str, BatchItem]) -> str:
    shown = [f"task {by_id[task_id].index} ({task_id})" for task_id in cycle]
    if len(shown) > 12:
        shown = [*shown[:5], f"... {len(shown) - 10} more ...", *shown[-5:]]
    return "dependency cycle: " + " -> ".join(shown)
