"""Operator commands for aggregation groups: group set|list|delete|stats."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import click
from conveyor import GroupConfig, GroupStats
from rich.table import Table

from conveyor_cli.ops import admin_client, clear_errors, connection_options
from conveyor_cli.output import console, emit_json


def _seconds(config: GroupConfig, field: str) -> str:
    value = getattr(config, field)
    return f"{value.total_seconds():g}s"


def config_table(configs: Sequence[GroupConfig]) -> None:
    """A table of group configs, one per row."""
    table = Table(show_edge=False)
    for column in ("queue", "pattern", "max size", "max delay", "grace period"):
        table.add_column(column)
    for c in configs:
        table.add_row(
            c.queue,
            c.pattern,
            str(c.max_size),
            _seconds(c, "max_delay"),
            _seconds(c, "grace_period"),
        )
    console.print(table)


def _age(at: datetime, now: datetime) -> str:
    return f"{max((now - at).total_seconds(), 0.0):.1f}s"


def stats_table(groups: Sequence[GroupStats]) -> None:
    """A table of groups with waiting members: how many, and how long the first and the
    last have waited."""
    now = datetime.now(UTC)
    table = Table(show_edge=False)
    for column in ("queue", "group", "waiting", "oldest age", "newest age"):
        table.add_column(column)
    for g in groups:
        table.add_row(g.queue, g.group, str(g.size), _age(g.oldest_at, now), _age(g.newest_at, now))
    console.print(table)


@click.group("group")
def group_group() -> None:
    """Manage aggregation groups: when a queue's groups are delivered as one batch."""


@group_group.command("set")
@click.argument("queue")
@click.option(
    "--pattern",
    default="*",
    show_default=True,
    help="The group names it applies to: a glob (* any text, ? one character)",
)
@click.option("--max-size", type=int, default=None, help="Deliver once this many members wait")
@click.option("--max-delay", type=float, default=None, help="Seconds after the first member joined")
@click.option(
    "--grace-period", type=float, default=None, help="Seconds after the last member joined"
)
@connection_options
def group_set(
    queue: str,
    pattern: str,
    max_size: int | None,
    max_delay: float | None,
    grace_period: float | None,
    target: str,
    token: str | None,
    as_json: bool,
) -> None:
    """Create or replace the config of QUEUE's groups matching --pattern. An omitted
    option takes the server default."""
    with clear_errors(), admin_client(target, token) as admin:
        config = admin.set_group_config(
            queue,
            pattern=pattern,
            max_size=max_size,
            max_delay=max_delay,
            grace_period=grace_period,
        )
    if as_json:
        emit_json(config)
    else:
        click.echo(
            f"group config {config.queue} {config.pattern} saved: max size {config.max_size}, "
            f"max delay {_seconds(config, 'max_delay')}, "
            f"grace period {_seconds(config, 'grace_period')}"
        )


@group_group.command("list")
@click.option("--queue", default=None, help="Only this queue's configs")
@connection_options
def group_list(queue: str | None, target: str, token: str | None, as_json: bool) -> None:
    """The stored group configs, by queue then pattern."""
    with clear_errors(), admin_client(target, token) as admin:
        configs = admin.list_group_configs(queue)
    emit_json(configs) if as_json else config_table(configs)


@group_group.command("delete")
@click.argument("queue")
@click.option("--pattern", default="*", show_default=True)
@connection_options
def group_delete(queue: str, pattern: str, target: str, token: str | None, as_json: bool) -> None:
    """Delete the config of QUEUE and --pattern (its groups take the next matching one,
    or the defaults)."""
    with clear_errors(), admin_client(target, token) as admin:
        admin.delete_group_config(queue, pattern)
    if as_json:
        emit_json({"deleted": {"queue": queue, "pattern": pattern}})
    else:
        click.echo(f"group config {queue} {pattern} deleted")


@group_group.command("stats")
@click.argument("queue", required=False)
@click.option("--limit", type=int, default=1000, show_default=True)
@connection_options
def group_stats(
    queue: str | None, limit: int, target: str, token: str | None, as_json: bool
) -> None:
    """The groups with members waiting (of QUEUE, or all): how many, and their ages."""
    with clear_errors(), admin_client(target, token) as admin:
        groups = admin.group_stats(queue, limit)
    emit_json(groups) if as_json else stats_table(groups)
