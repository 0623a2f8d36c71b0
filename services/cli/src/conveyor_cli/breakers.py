"""Operator commands for circuit breakers per task type: breakers set|list|status|delete."""

from __future__ import annotations

from collections.abc import Sequence

import click
from conveyor import BreakerConfig
from rich.table import Table

from conveyor_cli.ops import admin_client, clear_errors, connection_options
from conveyor_cli.output import breaker_table, console, emit_json


def _seconds(value: float) -> str:
    return f"{value:g}s"


def config_table(configs: Sequence[BreakerConfig]) -> None:
    """A table of breaker configs, one (queue, type pattern) per row."""
    table = Table(show_edge=False)
    for column in ("queue", "type pattern", "failures", "window", "cooldown", "scope"):
        table.add_column(column)
    for c in configs:
        table.add_row(
            c.queue,
            c.pattern,
            str(c.failures),
            _seconds(c.window.total_seconds()),
            _seconds(c.cooldown.total_seconds()),
            c.scope.value,
        )
    console.print(table)


@click.group("breakers")
def breakers_group() -> None:
    """Circuit breakers per task type: stop sending a type that keeps failing to a
    worker (or to the whole queue) for a while, then let one probe through."""


_PATTERN = click.option(
    "--pattern",
    default="*",
    show_default=True,
    help="The task types it applies to: a glob, '*' any text, '?' one character",
)


@breakers_group.command("set")
@click.argument("queue")
@click.option(
    "--failures",
    type=int,
    required=True,
    help="Failed attempts of one type within --window that open the breaker (1..10,000)",
)
@click.option(
    "--window",
    type=float,
    required=True,
    help="Seconds the failures are counted in (1 .. 86,400)",
)
@click.option(
    "--cooldown",
    type=float,
    required=True,
    help="Seconds an open breaker waits before it lets one probe through (0.1 .. 86,400)",
)
@_PATTERN
@click.option(
    "--scope",
    type=click.Choice(["worker", "queue"]),
    default="worker",
    show_default=True,
    help="Whom an open breaker stops the type going to: the failing worker, or every worker",
)
@connection_options
def breakers_set(
    queue: str,
    failures: int,
    window: float,
    cooldown: float,
    pattern: str,
    scope: str,
    target: str,
    token: str | None,
    as_json: bool,
) -> None:
    """Create or replace the circuit breaker of QUEUE's task types matching --pattern:
    once --failures attempts of one type fail within --window seconds, the type goes to
    nobody in --scope for --cooldown seconds, then one probe decides."""
    with clear_errors(), admin_client(target, token) as admin:
        config = admin.set_breaker_config(
            queue, failures, window, cooldown, pattern=pattern, scope=scope
        )
    if as_json:
        emit_json(config)
    else:
        click.echo(
            f"breaker config {config.queue} {config.pattern} saved: {config.failures} "
            f"failures in {_seconds(config.window.total_seconds())} open it for "
            f"{_seconds(config.cooldown.total_seconds())}, scope {config.scope.value}"
        )


@breakers_group.command("list")
@click.option("--queue", default=None, help="Only this queue's configs")
@connection_options
def breakers_list(queue: str | None, target: str, token: str | None, as_json: bool) -> None:
    """The breaker configs (of --queue, or of every queue), by queue and pattern."""
    with clear_errors(), admin_client(target, token) as admin:
        configs = admin.list_breaker_configs(queue)
    emit_json(configs) if as_json else config_table(configs)


@breakers_group.command("status")
@click.option("--queue", default=None, help="Only this queue's breakers")
@connection_options
def breakers_status(queue: str | None, target: str, token: str | None, as_json: bool) -> None:
    """The breakers that are open or half-open (of --queue, or of every queue): queue,
    task type, scope, worker, state, until when, and the failures that opened each."""
    with clear_errors(), admin_client(target, token) as admin:
        breakers = admin.list_breakers(queue)
    if as_json:
        emit_json(breakers)
    elif breakers:
        breaker_table(breakers)
    else:
        click.echo("no circuit breaker is open")


@breakers_group.command("delete")
@click.argument("queue")
@_PATTERN
@connection_options
def breakers_delete(
    queue: str, pattern: str, target: str, token: str | None, as_json: bool
) -> None:
    """Remove QUEUE's breaker config for --pattern: its types take another pattern's
    config, or have no breaker."""
    with clear_errors(), admin_client(target, token) as admin:
        admin.delete_breaker_config(queue, pattern=pattern)
    if as_json:
        emit_json({"deleted": {"queue": queue, "pattern": pattern}})
    else:
        click.echo(f"breaker config {queue} {pattern} deleted")
