"""The ``conveyor`` command."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import click
from conveyor_runtime.settings import CommonSettings

from conveyor_cli.breakers import breakers_group
from conveyor_cli.cron import cron_group
from conveyor_cli.groups import group_group
from conveyor_cli.keys import keys
from conveyor_cli.limits import limits_group
from conveyor_cli.ops import cluster, enqueue, queue, task
from conveyor_cli.tokens import token
from conveyor_cli.webhooks import webhook

PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="conveyor-cli", prog_name="conveyor")
def cli() -> None:
    """Conveyor: a durable, push-based task queue.

    Run `conveyor dev` for a local server with nothing to install, or `conveyor serve
    <service>` for one service of a real deployment.
    """


@cli.group()
def serve() -> None:
    """Run one Conveyor service (flags and CONVEYOR_* variables; `--help` lists them)."""


def _serve(module: str, args: tuple[str, ...]) -> None:
    import importlib

    main = importlib.import_module(f"{module}.__main__").main
    sys.exit(main(list(args)))


@serve.command("api", context_settings=PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve_api(args: tuple[str, ...]) -> None:
    """The api service: TaskService, WorkerService sessions, AdminService."""
    _serve("conveyor_api", args)


@serve.command("dispatcher", context_settings=PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve_dispatcher(args: tuple[str, ...]) -> None:
    """The dispatcher service: one dispatch loop per owned queue."""
    _serve("conveyor_dispatcher", args)


@serve.command("maintenance", context_settings=PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve_maintenance(args: tuple[str, ...]) -> None:
    """The maintenance service: scheduler and reaper (leader-elected)."""
    _serve("conveyor_maintenance", args)


@serve.command("webhook", context_settings=PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve_webhook(args: tuple[str, ...]) -> None:
    """The webhook service: webhook workers (manager leader-elected)."""
    _serve("conveyor_webhook", args)


@serve.command("rest", context_settings=PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve_rest(args: tuple[str, ...]) -> None:
    """The REST admin API and the /ui dashboard, in front of an api (--target)."""
    _serve("conveyor_rest", args)


@serve.command("bep", context_settings=PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve_bep(args: tuple[str, ...]) -> None:
    """The build-event ingest: Bazel's --bes_backend (and the CAS sink) over gRPC."""
    _serve("conveyor_bep", ("serve", *args))


@serve.command("bep-web", context_settings=PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve_bep_web(args: tuple[str, ...]) -> None:
    """The build-event web UI: builds, live build pages, logs, projects and keys."""
    _serve("conveyor_bep_web", ("serve", *args))


@cli.command("bep", context_settings=PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bep(args: tuple[str, ...]) -> None:
    """The build-event ingest's admin commands (`conveyor-bep`: migrate, project create,
    key create, key revoke, prune); `conveyor bep --help` lists them."""
    _serve("conveyor_bep", args if args else ("--help",))


@cli.command()
@click.option(
    "--dsn",
    envvar="CONVEYOR_DSN",
    default=CommonSettings.model_fields["dsn"].default,
    show_default=True,
    help="PostgreSQL DSN (env CONVEYOR_DSN)",
)
@click.option(
    "--db-sslmode",
    type=click.Choice(["disable", "allow", "prefer", "require", "verify-ca", "verify-full"]),
    default=None,
    help="Postgres TLS mode (env CONVEYOR_DB_SSLMODE; unset: the DSN's)",
)
@click.option(
    "--db-sslrootcert",
    default=None,
    help="CA bundle that verifies Postgres (env CONVEYOR_DB_SSLROOTCERT)",
)
@click.option(
    "--db-sslcert", default=None, help="Client certificate for Postgres (env CONVEYOR_DB_SSLCERT)"
)
@click.option("--db-sslkey", default=None, help="Key of --db-sslcert (env CONVEYOR_DB_SSLKEY)")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text")
def migrate(
    dsn: str,
    db_sslmode: str | None,
    db_sslrootcert: str | None,
    db_sslcert: str | None,
    db_sslkey: str | None,
    as_json: bool,
) -> None:
    """Apply pending database migrations (safe to run from several places at once).

    Postgres TLS comes from the CONVEYOR_DB_SSL* variables (or these flags), as for
    every service; a plaintext link beyond this machine is refused unless
    CONVEYOR_ALLOW_PLAINTEXT=true."""
    from pydantic import ValidationError

    from conveyor_cli.migrate import run_migrations

    flags: dict[str, Any] = {
        "db_sslmode": db_sslmode,
        "db_sslrootcert": db_sslrootcert,
        "db_sslcert": db_sslcert,
        "db_sslkey": db_sslkey,
    }
    try:
        settings = CommonSettings(
            broker="postgres", dsn=dsn, **{k: v for k, v in flags.items() if v is not None}
        )
    except ValidationError as exc:
        problems = "; ".join(
            str(error["msg"]).removeprefix("Value error, ") for error in exc.errors()
        )
        raise click.ClickException(f"invalid settings: {problems}") from None
    try:
        applied = asyncio.run(run_migrations(settings, show_progress=not as_json))
    except Exception as exc:  # one clear line, not a traceback
        raise click.ClickException(f"migration failed: {exc}") from None
    if as_json:
        from conveyor_cli.output import emit_json

        emit_json({"applied": applied})
    else:
        click.echo(f"applied migration(s) {applied}" if applied else "database is up to date")


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="gRPC listen address")
@click.option(
    "--port", default=50051, show_default=True, help="gRPC listen port (0: any free port)"
)
@click.option("--dsn", default=None, help="Use Postgres at this DSN instead of the memory broker")
@click.option(
    "--nats", "nats_url", default=None, help="Use this NATS server instead of an embedded one"
)
@click.option(
    "--lease-ttl",
    default=30.0,
    show_default=True,
    help="Seconds a task stays leased without a heartbeat",
)
def dev(host: str, port: int, dsn: str | None, nats_url: str | None, lease_ttl: float) -> None:
    """Every service in one process: memory broker, embedded NATS, auth and TLS off."""
    from conveyor_runtime.service import run_service

    from conveyor_cli.dev import DevOptions, run_dev

    options = DevOptions(host=host, port=port, dsn=dsn, nats_url=nats_url, lease_ttl=lease_ttl)

    async def main(_settings: CommonSettings, stop: asyncio.Event) -> None:
        await run_dev(options, stop)

    sys.exit(run_service(main, CommonSettings(broker="memory", allow_plaintext=True), name="dev"))


@cli.command("cluster-key")
def cluster_key() -> None:
    """Print a new random cluster key (base64): give the same one to every service, as
    CONVEYOR_CLUSTER_KEY or in the file CONVEYOR_CLUSTER_KEY_FILE names."""
    from conveyor_runtime.cluster_key import generate_key

    click.echo(generate_key())


@cli.command()
@click.option("--file", "path", required=True, help="The service's --health-file")
@click.option("--max-age", default=10.0, show_default=True, help="Seconds the file may be old")
@click.option(
    "--port", default=None, type=int, help="Also require this local TCP port to accept connections"
)
def health(path: str, max_age: float, port: int | None) -> None:
    """Exit 0 when a service is healthy (for container health checks)."""
    import socket

    from conveyor_runtime.health import is_fresh

    if not is_fresh(path, max_age):
        raise click.ClickException(f"unhealthy: {path} not touched in the last {max_age}s")
    if port is not None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except OSError as exc:
            raise click.ClickException(f"unhealthy: port {port}: {exc}") from None
    click.echo("healthy")


cli.add_command(enqueue)
cli.add_command(task)
cli.add_command(queue)
cli.add_command(cluster)
cli.add_command(webhook)
cli.add_command(cron_group)
cli.add_command(group_group)
cli.add_command(limits_group)
cli.add_command(breakers_group)
cli.add_command(token)
cli.add_command(keys)
