"""Operator commands for flow control: limits rate|concurrency set|list|delete."""

from __future__ import annotations

from collections.abc import Sequence

import click
from conveyor import ConcurrencyLimit, RateLimit
from rich.table import Table

from conveyor_cli.ops import admin_client, clear_errors, connection_options
from conveyor_cli.output import console, emit_json


def rate_table(limits: Sequence[RateLimit]) -> None:
    """A table of rate limits, one queue per row."""
    table = Table(show_edge=False)
    for column in ("queue", "per second", "burst"):
        table.add_column(column)
    for limit in limits:
        table.add_row(limit.queue, f"{limit.per_second:g}", str(limit.burst))
    console.print(table)


@click.group("limits")
def limits_group() -> None:
    """Flow control: how fast, and how many at once, a queue's tasks start."""


@limits_group.group("rate")
def rate_group() -> None:
    """Rate limits: at most N task starts a second per queue, across every worker."""


@rate_group.command("set")
@click.argument("queue")
@click.argument("per_second", type=float)
@click.option(
    "--burst",
    type=int,
    default=None,
    help="At most this many at once after a quiet spell (default: one second's worth)",
)
@connection_options
def rate_set(
    queue: str,
    per_second: float,
    burst: int | None,
    target: str,
    token: str | None,
    as_json: bool,
) -> None:
    """Start at most PER_SECOND tasks of QUEUE a second (0.5: one every two seconds).
    Replacing a limit keeps the tokens its bucket holds: no fresh burst."""
    with clear_errors(), admin_client(target, token) as admin:
        limit = admin.set_rate_limit(queue, per_second, burst=burst)
    if as_json:
        emit_json(limit)
    else:
        click.echo(
            f"rate limit {limit.queue} saved: {limit.per_second:g} a second, burst {limit.burst}"
        )


@rate_group.command("list")
@connection_options
def rate_list(target: str, token: str | None, as_json: bool) -> None:
    """Every queue's rate limit."""
    with clear_errors(), admin_client(target, token) as admin:
        limits = admin.list_rate_limits()
    emit_json(limits) if as_json else rate_table(limits)


@rate_group.command("delete")
@click.argument("queue")
@connection_options
def rate_delete(queue: str, target: str, token: str | None, as_json: bool) -> None:
    """Remove QUEUE's rate limit: its tasks start as fast as workers take them."""
    with clear_errors(), admin_client(target, token) as admin:
        admin.delete_rate_limit(queue)
    if as_json:
        emit_json({"deleted": {"queue": queue}})
    else:
        click.echo(f"rate limit {queue} deleted")


def concurrency_table(limits: Sequence[ConcurrencyLimit]) -> None:
    """A table of concurrency limits, one (queue, key pattern) per row."""
    table = Table(show_edge=False)
    for column in ("queue", "key pattern", "per key"):
        table.add_column(column)
    for limit in limits:
        table.add_row(limit.queue, limit.pattern, str(limit.per_key))
    console.print(table)


@limits_group.group("concurrency")
def concurrency_group() -> None:
    """Concurrency limits: at most N tasks running at once per concurrency key."""


_PATTERN = click.option(
    "--pattern",
    default="*",
    show_default=True,
    help="The keys it applies to: a glob, '*' any text, '?' one character",
)


@concurrency_group.command("set")
@click.argument("queue")
@click.argument("per_key", type=int)
@_PATTERN
@connection_options
def concurrency_set(
    queue: str, per_key: int, pattern: str, target: str, token: str | None, as_json: bool
) -> None:
    """Run at most PER_KEY tasks of QUEUE at once per concurrency key (of the keys
    matching --pattern), across every worker; the others wait HELD."""
    with clear_errors(), admin_client(target, token) as admin:
        limit = admin.set_concurrency_limit(queue, per_key, pattern=pattern)
    if as_json:
        emit_json(limit)
    else:
        click.echo(
            f"concurrency limit {limit.queue} {limit.pattern} saved: "
            f"{limit.per_key} at once per key"
        )


@concurrency_group.command("list")
@click.option("--queue", default=None, help="Only this queue's limits")
@connection_options
def concurrency_list(queue: str | None, target: str, token: str | None, as_json: bool) -> None:
    """The concurrency limits (of --queue, or of every queue)."""
    with clear_errors(), admin_client(target, token) as admin:
        limits = admin.list_concurrency_limits(queue)
    emit_json(limits) if as_json else concurrency_table(limits)


@concurrency_group.command("delete")
@click.argument("queue")
@_PATTERN
@connection_options
def concurrency_delete(
    queue: str, pattern: str, target: str, token: str | None, as_json: bool
) -> None:
    """Remove QUEUE's concurrency limit for --pattern."""
    with clear_errors(), admin_client(target, token) as admin:
        admin.delete_concurrency_limit(queue, pattern=pattern)
    if as_json:
        emit_json({"deleted": {"queue": queue, "pattern": pattern}})
    else:
        click.echo(f"concurrency limit {queue} {pattern} deleted")
