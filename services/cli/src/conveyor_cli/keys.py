"""``conveyor keys new|status|rotate``: the keys of encryption at rest.

``status`` and ``rotate`` work on the Postgres store directly (``CONVEYOR_DSN`` and the
``CONVEYOR_DB_SSL*`` settings, as every service), with the keys of
``CONVEYOR_ENCRYPTION_KEYS`` (or ``CONVEYOR_ENCRYPTION_KEYS_FILE``); the services keep
running meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import click
from conveyor_broker.keyring import Keyring, KeyringError, generate_key
from conveyor_runtime.settings import CommonSettings
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from conveyor_cli.output import console, emit_json

if TYPE_CHECKING:
    from conveyor_broker.postgres.rotation import KeyStatus, RotationProgress

#: Tasks per batch of a rotation (conveyor_broker.postgres.rotation.DEFAULT_BATCH; the
#: Postgres modules load only when a command runs).
DEFAULT_BATCH = 500

_DSN_OPTION = click.option(
    "--dsn",
    envvar="CONVEYOR_DSN",
    default=CommonSettings.model_fields["dsn"].default,
    show_default=True,
    help="PostgreSQL DSN (env CONVEYOR_DSN; TLS from the CONVEYOR_DB_SSL* variables)",
)


def _settings(dsn: str) -> CommonSettings:
    from pydantic import ValidationError

    try:
        return CommonSettings(broker="postgres", dsn=dsn)
    except ValidationError as exc:
        problems = "; ".join(
            str(error["msg"]).removeprefix("Value error, ")
            for error in exc.errors(include_input=False)
        )
        raise click.ClickException(f"invalid settings: {problems}") from None


def _keyring(settings: CommonSettings) -> Keyring | None:
    try:
        return settings.encryption_keyring()
    except KeyringError as exc:
        raise click.ClickException(str(exc)) from None


@click.group()
def keys() -> None:
    """Encryption at rest: make keys, count stored values per key, rotate to a new key
    (docs/operations.md, Encryption at rest)."""


@keys.command("new")
@click.option("--id", "key_id", default=None, help="The key's id (default: k<random>)")
def keys_new(key_id: str | None) -> None:
    """Print a new random key, <id>:<base64 of 32 bytes>, for CONVEYOR_ENCRYPTION_KEYS
    (mark the one that encrypts with '*': *<id>:...)."""
    try:
        click.echo(generate_key(key_id))
    except KeyringError as exc:
        raise click.BadParameter(str(exc), param_hint="--id") from None


def _status_rows(status: KeyStatus, keyring: Keyring | None) -> list[dict[str, Any]]:
    tasks, secrets = status.task_values(), status.secrets()
    ids = {*tasks, *secrets, *(keyring.ids if keyring else ())}
    rows = []
    for kid in sorted(ids, key=lambda k: (k is None, k or "")):
        if kid is None:
            configured = "-"
        elif keyring is None:
            configured = "not configured here"
        elif kid == keyring.primary:
            configured = "primary"
        elif kid in keyring.ids:
            configured = "yes"
        else:
            configured = "MISSING" if tasks.get(kid) else "no"
        rows.append(
            {
                "key": kid,
                "task_values": tasks.get(kid, 0),
                "webhook_secrets": secrets.get(kid, 0),
                "configured": configured,
            }
        )
    return rows


@keys.command("status")
@_DSN_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table")
def keys_status(dsn: str, as_json: bool) -> None:
    """Count the stored values per key id: task payloads, header values, results,
    progress and errors (sealed under CONVEYOR_ENCRYPTION_KEYS), webhook secrets (sealed
    under CONVEYOR_WEBHOOK_SECRET_KEY), and those in clear. A key can be dropped from
    the configuration once no value uses it."""
    from conveyor_broker.postgres.rotation import key_status
    from conveyor_runtime.broker_factory import postgres_connection

    settings = _settings(dsn)
    keyring = _keyring(settings)

    async def run() -> KeyStatus:
        async with postgres_connection(settings) as conn:
            return await key_status(conn)

    try:
        status = asyncio.run(run())
    except Exception as exc:  # one clear line, not a traceback
        raise click.ClickException(f"cannot read the key status: {exc}") from None
    rows = _status_rows(status, keyring)
    if as_json:
        emit_json(
            {
                "keys": rows,
                "server_errors_in_clear": status.server_errors(),
                "by_field": [
                    {"field": c.field, "key": c.key_id, "count": c.count} for c in status.counts
                ],
            }
        )
        return
    table = Table(show_edge=False)
    for column in ("key", "task values", "webhook secrets", "configured"):
        table.add_column(column, justify="right" if "values" in column else "left")
    for row in rows:
        table.add_row(
            row["key"] or "(in clear)",
            str(row["task_values"]),
            str(row["webhook_secrets"]),
            row["configured"],
        )
    console.print(table)
    if status.server_errors():
        click.echo(
            f"{status.server_errors()} error texts of the broker's own (like 'lease expired') "
            "are in clear by design"
        )
    if keyring is not None:
        for kid in keyring.ids:
            if kid != keyring.primary and not status.task_values().get(kid):
                click.echo(f"key {kid!r}: no task value uses it; it can be dropped")


def _report(done: RotationProgress, primary: str) -> str:
    lines = [
        f"re-encrypted {done.values} values in {done.tasks} tasks "
        f"and {done.entries} cron templates under key {primary!r} "
        f"({done.scanned} tasks looked at)"
    ]
    if done.unreadable:
        listed = ", ".join(f"{kid!r}: {n}" for kid, n in sorted(done.unreadable.items()))
        lines.append(
            f"left as they are, not decryptable with the configured keys: {listed} value(s); "
            "add those keys to CONVEYOR_ENCRYPTION_KEYS and run again"
        )
    if done.changed:
        lines.append(f"{done.changed} task(s) changed under every try (busy): run again to finish")
    return "\n".join(lines)


@keys.command("rotate")
@_DSN_OPTION
@click.option(
    "--batch-size",
    default=DEFAULT_BATCH,
    show_default=True,
    type=click.IntRange(1, 10000),
    help="Tasks read and rewritten per statement",
)
@click.option(
    "--pause",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0),
    help="Seconds to wait between batches, to leave the database to the services",
)
@click.option("--json", "as_json", is_flag=True, help="Print the totals as JSON, no progress bar")
def keys_rotate(dsn: str, batch_size: int, pause: float, as_json: bool) -> None:
    """Re-encrypt every stored task value under the primary key of
    CONVEYOR_ENCRYPTION_KEYS (values in clear included), in batches, while the services
    run. Safe to stop or kill at any point: run it again and it goes on where it
    stopped. Exit 1 when values were left behind (the reason is printed).

    Every service must know the new key before (and keep the old ones until `conveyor
    keys status` counts no value under them)."""
    from conveyor_broker.postgres.rotation import rotate
    from conveyor_runtime.broker_factory import postgres_connection

    settings = _settings(dsn)
    keyring = _keyring(settings)
    if keyring is None:
        raise click.ClickException(
            "no encryption keys: set CONVEYOR_ENCRYPTION_KEYS (or CONVEYOR_ENCRYPTION_KEYS_FILE) "
            "as the services have them, the new key marked primary"
        )
    progress_bar = Progress(
        TextColumn("re-encrypting under {task.fields[key]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tasks"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=as_json,
    )

    async def run() -> RotationProgress:
        async with postgres_connection(settings) as conn:
            with progress_bar:
                bar = progress_bar.add_task("rotate", total=None, key=keyring.primary)

                def on_batch(done: RotationProgress) -> None:
                    progress_bar.update(bar, total=max(done.total, done.scanned))
                    progress_bar.update(bar, completed=done.scanned)

                return await rotate(
                    conn, keyring, batch_size=batch_size, pause=pause, on_batch=on_batch
                )

    try:
        done = asyncio.run(run())
    except Exception as exc:  # one clear line, not a traceback
        raise click.ClickException(f"rotation failed: {exc}") from None
    if as_json:
        emit_json(
            {
                "primary": keyring.primary,
                "tasks": done.tasks,
                "cron_entries": done.entries,
                "values": done.values,
                "scanned": done.scanned,
                "unreadable": done.unreadable,
                "changed": done.changed,
                "complete": done.complete,
            }
        )
    else:
        click.echo(_report(done, keyring.primary))
    if not done.complete:
        raise SystemExit(1)
