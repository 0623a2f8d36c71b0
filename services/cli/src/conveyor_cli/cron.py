"""Operator commands for cron entries: cron list|get|set|apply|pause|resume|trigger|delete."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import click
from conveyor import ConveyorError, CronEntry, CronSpec, cron
from rich.table import Table

from conveyor_cli.ops import admin_client, clear_errors, connection_options
from conveyor_cli.output import console, emit_json, task_detail

#: The keys an entry of an apply file may have (those of ``conveyor.cron``).
_ENTRY_KEYS = frozenset(
    {
        "name",
        "schedule",
        "type",
        "payload",
        "queue",
        "timezone",
        "misfire",
        "paused",
        "headers",
        "max_retry",
        "timeout",
        "retention",
    }
)


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%SZ") if value else "-"


def _next(entry: CronEntry) -> str:
    return "paused" if entry.paused else _when(entry.next_run_at)


def cron_table(entries: Sequence[CronEntry]) -> None:
    """A table of cron entries, one per row."""
    table = Table(show_edge=False)
    for column in ("name", "schedule", "timezone", "queue", "type", "next run", "last run"):
        table.add_column(column)
    for e in entries:
        table.add_row(
            e.name,
            e.schedule,
            e.timezone,
            e.task.queue,
            e.task.type,
            _next(e),
            _when(e.last_run_at),
        )
    console.print(table)


def cron_detail(entry: CronEntry) -> None:
    """Every field of one cron entry."""
    table = Table(show_header=False, show_edge=False)
    table.add_column(style="bold")
    table.add_column()
    options = entry.task.options
    rows: list[tuple[str, str]] = [
        ("name", entry.name),
        ("schedule", entry.schedule),
        ("timezone", entry.timezone),
        ("misfire", entry.misfire.value),
        ("paused", "yes" if entry.paused else "no"),
        ("next run", _next(entry)),
        ("last run", _when(entry.last_run_at)),
        ("queue", entry.task.queue),
        ("type", entry.task.type),
        ("payload", json.dumps(entry.task.payload)),
    ]
    if entry.task.headers:
        rows.append(("headers", ",".join(f"{k}={v}" for k, v in entry.task.headers.items())))
    if options.max_retry is not None:
        rows.append(("max retry", str(options.max_retry)))
    if options.timeout is not None:
        rows.append(("timeout", f"{options.timeout.total_seconds():g}s"))
    if options.retention is not None:
        rows.append(("retention", f"{options.retention.total_seconds():g}s"))
    rows += [("created", _when(entry.created_at)), ("updated", _when(entry.updated_at))]
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)


def _headers(values: Sequence[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for value in values:
        key, sep, text = value.partition("=")
        if not key or not sep:
            raise click.BadParameter(f"{value!r}: expected KEY=VALUE", param_hint="--header")
        headers[key] = text
    return headers


def _payload(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"payload is not JSON: {exc}", param_hint="--payload") from None


def read_entries(path: Path) -> list[CronSpec]:
    """The entries an apply file declares: TOML (``[[cron]]`` tables) or JSON (a list
    of objects, or ``{"cron": [...]}``), each with the keys of ``conveyor.cron``."""
    text = path.read_text(encoding="utf-8")
    try:
        loaded: Any = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise click.ClickException(f"{path}: {exc}") from None
    items = loaded.get("cron") if isinstance(loaded, dict) else loaded
    if not isinstance(items, list):
        raise click.ClickException(
            f"{path}: expected a list of cron entries (JSON), or [[cron]] tables (TOML)"
        )
    entries: list[CronSpec] = []
    for number, item in enumerate(items, start=1):
        if not isinstance(item, dict):
            raise click.ClickException(f"{path}: entry {number} is not a table/object")
        unknown = sorted(set(item) - _ENTRY_KEYS)
        if unknown:
            raise click.ClickException(
                f"{path}: entry {number} has unknown keys {', '.join(unknown)}"
            )
        missing = sorted({"name", "schedule", "type"} - set(item))
        if missing:
            raise click.ClickException(f"{path}: entry {number} needs {', '.join(missing)}")
        fields = dict(item)
        try:
            entries.append(cron(fields.pop("name"), fields.pop("schedule"), **fields))
        except (ConveyorError, TypeError) as exc:
            raise click.ClickException(f"{path}: entry {number}: {exc}") from None
    return entries


@click.group("cron")
def cron_group() -> None:
    """Manage cron entries: tasks the server enqueues on a schedule, once per slot."""


@cron_group.command("list")
@connection_options
def cron_list(target: str, token: str | None, as_json: bool) -> None:
    """Every cron entry, with its next and last run."""
    with clear_errors(), admin_client(target, token) as admin:
        entries = admin.list_cron_entries()
    emit_json(entries) if as_json else cron_table(entries)


@cron_group.command("get")
@click.argument("name")
@connection_options
def cron_get(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Show one cron entry."""
    with clear_errors(), admin_client(target, token) as admin:
        entry = admin.get_cron_entry(name)
    emit_json(entry) if as_json else cron_detail(entry)


@cron_group.command("set")
@click.argument("name")
@click.option(
    "--schedule",
    required=True,
    help='Five cron fields ("0 3 * * *"), six with seconds first, an alias (@daily, '
    '@hourly, ...) or "@every 90s"',
)
@click.option("--type", "task_type", required=True, help="The task type to enqueue")
@click.option("--payload", default=None, help="The task payload, as JSON")
@click.option("--queue", default="default", show_default=True)
@click.option(
    "--timezone", default="UTC", show_default=True, help="The IANA time zone of the schedule"
)
@click.option(
    "--misfire",
    type=click.Choice(["run_once", "skip"]),
    default="run_once",
    show_default=True,
    help="Slots missed while the cluster was down: one task for them, or none",
)
@click.option("--paused", is_flag=True, help="Store it paused")
@click.option("--header", "headers", multiple=True, metavar="KEY=VALUE", help="Repeat for more")
@click.option("--max-retry", type=int, default=None)
@click.option("--timeout", type=float, default=None, help="Per-attempt timeout, seconds")
@click.option("--retention", type=float, default=None, help="Seconds a completed task is kept")
@connection_options
def cron_set(
    name: str,
    schedule: str,
    task_type: str,
    payload: str | None,
    queue: str,
    timezone: str,
    misfire: str,
    paused: bool,
    headers: tuple[str, ...],
    max_retry: int | None,
    timeout: float | None,
    retention: float | None,
    target: str,
    token: str | None,
    as_json: bool,
) -> None:
    """Create or replace the cron entry NAME. Every field is replaced (an omitted option
    takes its default); the same schedule and time zone keep the entry's next run."""
    with clear_errors():
        declared = cron(
            name,
            schedule,
            task_type,
            _payload(payload),
            queue=queue,
            timezone=timezone,
            misfire=misfire,
            paused=paused,
            headers=_headers(headers),
            max_retry=max_retry,
            timeout=timeout,
            retention=retention,
        )
        with admin_client(target, token) as admin:
            [entry] = admin.apply_cron_entries([declared])
    if as_json:
        emit_json(entry)
    else:
        click.echo(
            f"cron entry {entry.name} saved: {entry.schedule} ({entry.timezone}), next {_next(entry)}"
        )


@cron_group.command("apply")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@connection_options
def cron_apply(file: Path, target: str, token: str | None, as_json: bool) -> None:
    """Create or replace every entry FILE declares (TOML [[cron]] tables, or a JSON list),
    each with the keys of conveyor.cron: name, schedule, type, and optionally payload,
    queue, timezone, misfire, paused, headers, max_retry, timeout, retention. Idempotent;
    entries not in the file are left alone."""
    declared = read_entries(file)
    with clear_errors(), admin_client(target, token) as admin:
        entries = admin.apply_cron_entries(declared)
    if as_json:
        emit_json(entries)
    else:
        for entry in entries:
            click.echo(f"cron entry {entry.name} saved: next {_next(entry)}")


@cron_group.command("pause")
@click.argument("name")
@connection_options
def cron_pause(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Stop an entry firing (the slots that pass meanwhile never fire)."""
    with clear_errors(), admin_client(target, token) as admin:
        entry = admin.pause_cron_entry(name)
    emit_json(entry) if as_json else click.echo(f"cron entry {name} paused")


@cron_group.command("resume")
@click.argument("name")
@connection_options
def cron_resume(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Fire a paused entry again, from its first slot after now."""
    with clear_errors(), admin_client(target, token) as admin:
        entry = admin.resume_cron_entry(name)
    if as_json:
        emit_json(entry)
    else:
        click.echo(f"cron entry {name} resumed, next {_next(entry)}")


@cron_group.command("trigger")
@click.argument("name")
@connection_options
def cron_trigger(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Enqueue an entry's task now, outside its schedule."""
    with clear_errors(), admin_client(target, token) as admin:
        task = admin.trigger_cron_entry(name)
    emit_json(task) if as_json else task_detail(task)


@cron_group.command("delete")
@click.argument("name")
@connection_options
def cron_delete(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Delete an entry (the tasks it created stay)."""
    with clear_errors(), admin_client(target, token) as admin:
        admin.delete_cron_entry(name)
    if as_json:
        emit_json({"cron": name, "deleted": True})
    else:
        click.echo(f"cron entry {name} deleted")
