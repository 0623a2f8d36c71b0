"""Operator commands for webhook workers: webhook list|get|set|pause|resume|delete, and
new-secret."""

from __future__ import annotations

import base64
import secrets as random
from collections.abc import Mapping, Sequence
from datetime import datetime

import click
from conveyor import WebhookWorker
from rich.table import Table

from conveyor_cli.ops import admin_client, clear_errors, connection_options
from conveyor_cli.output import console, emit_json


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _queues(queues: Mapping[str, int]) -> str:
    return ",".join(f"{name}={weight}" for name, weight in sorted(queues.items()))


def _seconds(worker: WebhookWorker) -> str:
    return f"{worker.timeout.total_seconds():g}s"


def _batch_types(worker: WebhookWorker) -> str:
    return ",".join(worker.batch_types)


def webhook_table(workers: Sequence[WebhookWorker]) -> None:
    """A table of webhook workers, one per row (secrets are never shown: never returned)."""
    table = Table(show_edge=False)
    columns = ("name", "url", "queues", "concurrency", "timeout", "batch types", "paused")
    for column in (*columns, "updated"):
        # The name whole, however narrow the terminal: it is what the other commands take.
        table.add_column(column, no_wrap=column == "name")
    for w in workers:
        table.add_row(
            w.name,
            w.url,
            _queues(w.queues),
            str(w.concurrency),
            _seconds(w),
            _batch_types(w),
            "yes" if w.paused else "",
            _when(w.updated_at),
        )
    console.print(table)


def webhook_detail(worker: WebhookWorker) -> None:
    """Every field of one webhook worker."""
    table = Table(show_header=False, show_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("name", worker.name)
    table.add_row("url", worker.url)
    table.add_row("queues", _queues(worker.queues))
    table.add_row("concurrency", str(worker.concurrency))
    table.add_row("timeout", _seconds(worker))
    table.add_row("batch types", _batch_types(worker) or "-")
    table.add_row("paused", "yes" if worker.paused else "no")
    table.add_row("created", _when(worker.created_at))
    table.add_row("updated", _when(worker.updated_at))
    console.print(table)


def _parse_queues(values: Sequence[str]) -> dict[str, int]:
    weights: dict[str, int] = {}
    for value in values:
        name, sep, weight = value.partition("=")
        if not name:
            raise click.BadParameter(
                f"{value!r}: expected NAME or NAME=WEIGHT", param_hint="--queue"
            )
        try:
            weights[name] = int(weight) if sep else 1
        except ValueError:
            raise click.BadParameter(
                f"{value!r}: the weight must be an integer", param_hint="--queue"
            ) from None
    return weights


@click.group()
def webhook() -> None:
    """Register and manage webhook workers (HTTP endpoints the server delivers tasks to)."""


@webhook.command("list")
@connection_options
def webhook_list(target: str, token: str | None, as_json: bool) -> None:
    """Every webhook worker registration."""
    with clear_errors(), admin_client(target, token) as admin:
        workers = admin.list_webhook_workers()
    emit_json(workers) if as_json else webhook_table(workers)


@webhook.command("get")
@click.argument("name")
@connection_options
def webhook_get(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Show one webhook worker (its secrets are never shown)."""
    with clear_errors(), admin_client(target, token) as admin:
        worker = admin.get_webhook_worker(name)
    emit_json(worker) if as_json else webhook_detail(worker)


@webhook.command("set")
@click.argument("name")
@click.option("--url", required=True, help="The endpoint: an http:// or https:// URL")
@click.option(
    "--queue",
    "queues",
    multiple=True,
    required=True,
    metavar="NAME[=WEIGHT]",
    help="A queue to serve, with its weight (default 1); repeat for more",
)
@click.option(
    "--concurrency", default=10, show_default=True, help="Most deliveries in flight at once"
)
@click.option(
    "--timeout", default=30.0, show_default=True, help="Seconds the endpoint has to answer"
)
@click.option(
    "--secret",
    "secrets",
    multiple=True,
    envvar="CONVEYOR_WEBHOOK_SECRETS",
    help="A signing secret of at least 32 bytes (`webhook new-secret` makes one), newest "
    "first; repeat for more (env CONVEYOR_WEBHOOK_SECRETS, space-separated, keeps them out "
    "of the process list). None: keep the stored ones",
)
@click.option(
    "--batch-type",
    "batch_types",
    multiple=True,
    metavar="TYPE",
    help="A task type the endpoint takes as whole aggregation groups (one call carries "
    "every member of a due group); repeat for more",
)
@click.option("--paused", is_flag=True, help="Register it paused (no deliveries)")
@connection_options
def webhook_set(
    name: str,
    url: str,
    queues: tuple[str, ...],
    concurrency: int,
    timeout: float,
    secrets: tuple[str, ...],
    batch_types: tuple[str, ...],
    paused: bool,
    target: str,
    token: str | None,
    as_json: bool,
) -> None:
    """Create or replace the webhook worker NAME.

    Every field is replaced (an omitted option takes its default, so --paused and every
    --batch-type must be repeated to keep them); without --secret the stored secrets are
    kept. To
    rotate, give the new secret first and the old one after it, then drop the old one
    once deliveries signed with it are done.
    """
    weights = _parse_queues(queues)
    with clear_errors(), admin_client(target, token) as admin:
        worker = admin.upsert_webhook_worker(
            name,
            url,
            weights,
            concurrency=concurrency,
            timeout=timeout,
            paused=paused,
            secrets=secrets,
            batch_types=batch_types,
        )
    if as_json:
        emit_json(worker)
    else:
        state = "paused" if worker.paused else "active"
        click.echo(f"webhook worker {worker.name} saved ({state}) -> {worker.url}")


@webhook.command("new-secret")
def webhook_new_secret() -> None:
    """Print a new signing secret: whsec_ and the base64 of 32 random bytes (the Standard
    Webhooks form; give it to `webhook set --secret` and to the endpoint)."""
    click.echo("whsec_" + base64.b64encode(random.token_bytes(32)).decode("ascii"))


@webhook.command("pause")
@click.argument("name")
@connection_options
def webhook_pause(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Stop new deliveries to a webhook worker (deliveries in flight finish)."""
    with clear_errors(), admin_client(target, token) as admin:
        admin.pause_webhook_worker(name)
    if as_json:
        emit_json({"webhook": name, "paused": True})
    else:
        click.echo(f"webhook worker {name} paused")


@webhook.command("resume")
@click.argument("name")
@connection_options
def webhook_resume(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Deliver to a paused webhook worker again."""
    with clear_errors(), admin_client(target, token) as admin:
        admin.resume_webhook_worker(name)
    if as_json:
        emit_json({"webhook": name, "paused": False})
    else:
        click.echo(f"webhook worker {name} resumed")


@webhook.command("delete")
@click.argument("name")
@connection_options
def webhook_delete(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Remove a webhook worker registration."""
    with clear_errors(), admin_client(target, token) as admin:
        admin.delete_webhook_worker(name)
    if as_json:
        emit_json({"webhook": name, "deleted": True})
    else:
        click.echo(f"webhook worker {name} deleted")
