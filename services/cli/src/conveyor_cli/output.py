"""How the CLI prints: readable tables by default, JSON with ``--json``."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta
from enum import Enum
from typing import Any

import click
from conveyor import Breaker, ClusterInfo, QueueInfo, TaskDependency, TaskInfo, TaskState
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


def breaker_table(breakers: Sequence[Breaker], *, title: str | None = None) -> None:
    """A table of circuit breakers that are not closed, one (queue, type, worker) per
    row: whose it is (a worker's, or queue-wide), its state, until when, and the
    failures that opened it."""
    table = Table(title=title, show_edge=False)
    for column in ("queue", "type", "scope", "worker", "state", "until", "failures"):
        table.add_column(column)
    for b in breakers:
        table.add_row(
            b.queue,
            b.type,
            b.scope.value,
            b.worker_id or b.gateway or "-",
            b.state.value,
            _when(b.until),
            str(b.failures),
        )
    console.print(table)


def queue_detail(info: QueueInfo) -> None:
    """One queue's counts, then its breakers that are not closed (when it has any)."""
    queue_table([info])
    if info.breakers:
        breaker_table(info.breakers, title="circuit breakers")
    else:
        click.echo("circuit breakers: none open")


def cluster_view(info: ClusterInfo) -> None:
    """Every node, then the worker sessions, queue owners, leaders and webhook gateways."""
    click.echo(
        f"server {info.server_version}, broker {info.broker}, answered by {info.answered_by}"
    )
    nodes = Table(title="nodes", show_edge=False)
    for column in ("kind", "instance", "host", "pid", "version", "started", "holds"):
        nodes.add_column(column)
    for n in info.nodes:
        holds = list(n.leader_roles)
        if n.kind == "api":
            holds.insert(0, f"{len(n.sessions)} sessions")
        elif n.kind == "dispatcher":
            holds.insert(0, f"{len(n.owned_queues)} queues")
        elif n.kind == "webhook":
            holds.append(f"{len(n.webhook_gateways)} gateways")
        nodes.add_row(
            n.kind, n.instance, n.host, str(n.pid), n.version, _when(n.started_at), ", ".join(holds)
        )
    console.print(nodes)
    sessions = Table(title="worker sessions", show_edge=False)
    for column in ("api", "worker", "session", "queues", "slots in use", "connected"):
        sessions.add_column(column)
    for s in info.sessions:
        queues = ", ".join(f"{q}:{w}" for q, w in sorted(s.queues.items()))
        sessions.add_row(
            s.node,
            s.worker_id,
            s.session_id,
            queues,
            f"{s.in_flight}/{s.concurrency}",
            _when(s.connected_at),
        )
    console.print(sessions)
    owners = Table(title="queue owners", show_edge=False)
    owners.add_column("queue")
    owners.add_column("dispatcher")
    for queue, owner in sorted(info.queue_owners.items()):
        owners.add_row(queue, owner)
    console.print(owners)
    leaders = Table(title="leaders", show_edge=False)
    leaders.add_column("role")
    leaders.add_column("instance")
    for role, instance in sorted(info.leaders.items()):
        leaders.add_row(role, instance)
    console.print(leaders)
    if info.webhook_gateways:
        gateways = Table(title="webhook gateways", show_edge=False)
        for column in ("worker", "node", "queues", "in flight", "breaker", "paused"):
            gateways.add_column(column)
        for g in info.webhook_gateways:
            gateways.add_row(
                g.worker,
                g.node,
                ", ".join(f"{q}:{w}" for q, w in sorted(g.queues.items())),
                f"{g.in_flight}/{g.concurrency}",
                g.breaker,
                "yes" if g.paused else "",
            )
        console.print(gateways)
