"""How the CLI prints: readable tables by default, JSON with ``--json``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

import click
from conveyor import QueueInfo, TaskDependency, TaskInfo, TaskState
from rich.console import Console
from rich.table import Table

console = Console()


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(_plain(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value


def emit_json(value: Any) -> None:
    """Print ``value`` (dataclasses, enums, datetimes included) as JSON."""
    click.echo(json.dumps(_plain(value), indent=2, sort_keys=True))


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def task_table(tasks: Sequence[TaskInfo]) -> None:
    """A table of tasks, one per row."""
    table = Table(show_edge=False)
    for column in ("id", "queue", "type", "state", "retried", "created", "last error"):
        table.add_column(column)
    for t in tasks:
        table.add_row(
            t.id,
            t.queue,
            t.type,
            t.state.value,
            f"{t.retried}/{t.max_retry}",
            _when(t.created_at),
            (t.last_error or "")[:60],
        )
    console.print(table)


def task_detail(task: TaskInfo) -> None:
    """Every field of one task."""
    table = Table(show_header=False, show_edge=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in _plain(task).items():
        if value is None or value == {} or value == []:
            continue
        table.add_row(name, json.dumps(value) if isinstance(value, dict | list) else str(value))
    console.print(table)


def dependency_table(edges: Sequence[TaskDependency]) -> None:
    """A table of dependency edges: the other task, its state, and the edge's outcome."""
    table = Table(show_edge=False)
    for column in ("id", "queue", "type", "state", "dependency"):
        table.add_column(column)
    for e in edges:
        table.add_row(
            e.task_id,
            e.queue or "-",
            e.type or "-",
            e.state.value if e.state is not None else "gone",
            e.outcome.value,
        )
    console.print(table)


def queue_table(queues: Sequence[QueueInfo]) -> None:
    """A table of queues with their per-state counts."""
    shown = [
        TaskState.PENDING,
        TaskState.SCHEDULED,
        TaskState.ACTIVE,
        TaskState.RETRY,
        TaskState.COMPLETED,
        TaskState.ARCHIVED,
    ]
    table = Table(show_edge=False)
    table.add_column("queue")
    table.add_column("paused")
    for state in shown:
        table.add_column(state.value, justify="right")
    for q in queues:
        table.add_row(q.name, "yes" if q.paused else "", *(str(q.counts.get(s, 0)) for s in shown))
    console.print(table)
