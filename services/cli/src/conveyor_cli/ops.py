"""Operator commands: enqueue, task get|list|cancel, queue list|stats|pause|resume."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import click
from conveyor import AdminClient, Client, ConveyorError, TaskSpec, spec
from rich.progress import Progress

from conveyor_cli.output import (
    cluster_view,
    dependency_table,
    emit_json,
    queue_detail,
    queue_table,
    task_detail,
    task_table,
)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

BULK_BATCH = 500


#: The TLS options of a command, as the SDK's keyword arguments (see connection_options).
_TLS_META = "conveyor.tls"


def _remember_tls(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None and param.name is not None:
        ctx.meta.setdefault(_TLS_META, {})[param.name] = value


def tls_options() -> dict[str, str]:
    """The ``--tls-ca``, ``--tls-cert`` and ``--tls-key`` of the current command (or their
    variables) by the SDK's argument names, the ones given only."""
    ctx = click.get_current_context(silent=True)
    return dict(ctx.meta.get(_TLS_META, {})) if ctx is not None else {}


def producer_client(target: str, token: str | None) -> Client:
    """A producer client for the command's connection options."""
    tls = tls_options()
    return Client(
        target,
        token=token,
        tls_ca=tls.get("tls_ca"),
        tls_cert=tls.get("tls_cert"),
        tls_key=tls.get("tls_key"),
    )


def admin_client(target: str, token: str | None) -> AdminClient:
    """An admin client for the command's connection options."""
    tls = tls_options()
    return AdminClient(
        target,
        token=token,
        tls_ca=tls.get("tls_ca"),
        tls_cert=tls.get("tls_cert"),
        tls_key=tls.get("tls_key"),
    )


def connection_options(func: F) -> F:
    """--target, --token, --tls-ca, --tls-cert, --tls-key and --json on a command.

    The TLS options reach the clients through :func:`producer_client` and
    :func:`admin_client` (they are not the command's parameters). Their variables are
    CONVEYOR_TLS_CA, CONVEYOR_TLS_CLIENT_CERT and CONVEYOR_TLS_CLIENT_KEY: the api's own
    CONVEYOR_TLS_CERT and CONVEYOR_TLS_KEY are its server certificate, which a command
    run beside it must not present as a client certificate.
    """
    func = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table")(
        func
    )
    for flag, variable, argument, what in reversed(
        (
            ("--tls-ca", "CONVEYOR_TLS_CA", "tls_ca", "CA bundle (PEM) that verifies the api"),
            (
                "--tls-cert",
                "CONVEYOR_TLS_CLIENT_CERT",
                "tls_cert",
                "Client certificate (PEM) for an api with mutual TLS",
            ),
            ("--tls-key", "CONVEYOR_TLS_CLIENT_KEY", "tls_key", "Private key (PEM) of --tls-cert"),
        )
    ):
        func = click.option(
            flag,
            argument,
            envvar=variable,
            default=None,
            expose_value=False,
            callback=_remember_tls,
            type=click.Path(exists=True, dir_okay=False),
            help=f"{what}; selects TLS (env {variable})",
        )(func)
    func = click.option(
        "--token", envvar="CONVEYOR_TOKEN", default=None, help="Bearer token (env CONVEYOR_TOKEN)"
    )(func)
    func = click.option(
        "--target",
        envvar="CONVEYOR_TARGET",
        default="127.0.0.1:50051",
        show_default=True,
        help="Conveyor api address: host:port, or https://host:port for TLS (env CONVEYOR_TARGET)",
    )(func)
    return func


@contextmanager
def clear_errors() -> Iterator[None]:
    """Turn SDK errors into one clear line and exit code 1."""
    try:
        yield
    except ConveyorError as exc:
        raise click.ClickException(str(exc)) from None


def _payload(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"payload is not JSON: {exc}") from None


def _spec_from_line(number: int, line: str) -> TaskSpec:
    try:
        item = json.loads(line)
        if not isinstance(item, dict) or "type" not in item:
            raise ValueError('each line must be an object with a "type"')
        task_type = item.pop("type")
        payload = item.pop("payload", None)
        return spec(task_type, payload, **item)
    except (ValueError, TypeError, ConveyorError) as exc:
        raise click.ClickException(f"line {number}: {exc}") from None


@click.command()
@click.argument("task_type", required=False)
@click.argument("payload", required=False)
@click.option("--queue", default="default", show_default=True)
@click.option("--max-retry", type=int, default=None)
@click.option("--timeout", type=float, default=None, help="Per-attempt timeout, seconds")
@click.option(
    "--process-in", type=float, default=None, help="Run no earlier than this many seconds from now"
)
@click.option("--unique-key", default=None)
@click.option(
    "--file",
    "file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help='Bulk: a JSON-lines file, one {"type", "payload", "queue", ...} per line',
)
@connection_options
def enqueue(
    task_type: str | None,
    payload: str | None,
    queue: str,
    max_retry: int | None,
    timeout: float | None,
    process_in: float | None,
    unique_key: str | None,
    file: Path | None,
    target: str,
    token: str | None,
    as_json: bool,
) -> None:
    """Enqueue one task (TYPE and a JSON PAYLOAD), or many from --file."""
    with clear_errors(), producer_client(target, token) as client:
        if file is not None:
            _enqueue_file(client, file, as_json)
            return
        if task_type is None:
            raise click.UsageError("give a task TYPE, or --file")
        task = client.enqueue(
            task_type,
            _payload(payload),
            queue=queue,
            max_retry=max_retry,
            timeout=timeout,
            process_in=process_in,
            unique_key=unique_key,
        )
        if as_json:
            emit_json(task)
        else:
            click.echo(f"enqueued {task.id} ({task.state.value}) on {task.queue}")


def _enqueue_file(client: Client, file: Path, as_json: bool) -> None:
    lines = [(n, line) for n, line in enumerate(file.read_text().splitlines(), 1) if line.strip()]
    specs = [_spec_from_line(n, line) for n, line in lines]
    created = failed = 0
    errors: list[str] = []
    with Progress(disable=as_json, transient=False) as progress:
        bar = progress.add_task(f"enqueue {file.name}", total=len(specs))
        for start in range(0, len(specs), BULK_BATCH):
            chunk = specs[start : start + BULK_BATCH]
            for offset, result in enumerate(client.enqueue_batch(chunk)):
                if result.ok:
                    created += 1
                else:
                    failed += 1
                    errors.append(f"line {lines[start + offset][0]}: {result.error}")
            progress.advance(bar, len(chunk))
    if as_json:
        emit_json({"enqueued": created, "failed": failed, "errors": errors})
    else:
        click.echo(f"enqueued {created} task(s), {failed} failed")
        for error in errors[:20]:
            click.echo(f"  {error}", err=True)
    if failed:
        raise SystemExit(1)


@click.group()
def task() -> None:
    """Inspect and act on tasks."""


@task.command("get")
@click.argument("task_id")
@connection_options
def task_get(task_id: str, target: str, token: str | None, as_json: bool) -> None:
    """Show one task."""
    with clear_errors(), admin_client(target, token) as admin:
        info = admin.get_task(task_id)
    emit_json(info) if as_json else task_detail(info)


@task.command("list")
@click.option("--queue", default=None)
@click.option(
    "--state", default=None, help="pending, scheduled, active, retry, completed, archived, ..."
)
@click.option("--limit", default=50, show_default=True)
@click.option("--cursor", default=None, help="next_cursor of the previous page")
@click.option(
    "--payloads/--no-payloads",
    default=False,
    show_default=True,
    help="include each task's payload, progress and result (with --json)",
)
@connection_options
def task_list(
    queue: str | None,
    state: str | None,
    limit: int,
    cursor: str | None,
    payloads: bool,
    target: str,
    token: str | None,
    as_json: bool,
) -> None:
    """List tasks, oldest first (a page may end early at the server's byte budget: follow
    the cursor it prints)."""
    with clear_errors(), admin_client(target, token) as admin:
        page = admin.list_tasks(
            queue=queue, state=state, limit=limit, cursor=cursor, with_payloads=payloads
        )
    if as_json:
        emit_json(page)
        return
    task_table(page.tasks)
    if page.next_cursor:
        click.echo(f"more: --cursor {page.next_cursor}")


@task.command("cancel")
@click.argument("task_id")
@connection_options
def task_cancel(task_id: str, target: str, token: str | None, as_json: bool) -> None:
    """Cancel a waiting task, or abort a running one."""
    with clear_errors(), admin_client(target, token) as admin:
        info = admin.cancel_task(task_id)
    emit_json(info) if as_json else click.echo(f"{info.id} is now {info.state.value}")


@task.command("run-now")
@click.argument("task_id")
@connection_options
def task_run_now(task_id: str, target: str, token: str | None, as_json: bool) -> None:
    """Make a waiting task due now; a blocked one runs despite its unmet dependencies."""
    with clear_errors(), admin_client(target, token) as admin:
        info = admin.run_task_now(task_id)
    emit_json(info) if as_json else click.echo(f"{info.id} is now {info.state.value}")


@task.command("deps")
@click.argument("task_id")
@click.option(
    "--limit", default=1000, show_default=True, help="most edges shown each way (by task id)"
)
@connection_options
def task_deps(task_id: str, limit: int, target: str, token: str | None, as_json: bool) -> None:
    """The tasks a task waits for and the tasks that wait for it, with their states and
    how each dependency stands (open, satisfied, failed)."""
    if limit < 1:
        raise click.BadParameter("must be at least 1", param_hint="--limit")
    with clear_errors(), admin_client(target, token) as admin:
        ways = {}
        for name, dependents in (("dependencies", False), ("dependents", True)):
            edges = admin.iter_dependencies(
                task_id, dependents=dependents, page_size=min(limit, 1000)
            )
            ways[name] = list(itertools.islice(edges, limit + 1))
    shown = {name: edges[:limit] for name, edges in ways.items()}
    if as_json:
        emit_json(shown)
        return
    for name, title in (("dependencies", "waits for"), ("dependents", "waited for by")):
        more = " (more not shown)" if len(ways[name]) > limit else ""
        click.echo(f"{task_id} {title}: {len(shown[name])}{more}")
        if shown[name]:
            dependency_table(shown[name])


@click.group()
def queue() -> None:
    """Inspect, pause and resume queues."""


@queue.command("list")
@connection_options
def queue_list(target: str, token: str | None, as_json: bool) -> None:
    """Every queue with its task counts (page after page)."""
    with clear_errors(), admin_client(target, token) as admin:
        queues = list(admin.iter_queues(page_size=1000))
    emit_json(queues) if as_json else queue_table(queues)


@queue.command("stats")
@click.argument("name")
@connection_options
def queue_stats(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Task counts of one queue, and its circuit breakers that are open or half-open."""
    with clear_errors(), admin_client(target, token) as admin:
        info = admin.queue_stats(name)
    emit_json(info) if as_json else queue_detail(info)


@queue.command("pause")
@click.argument("name")
@connection_options
def queue_pause(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Stop dispatching a queue's tasks (enqueue still works)."""
    with clear_errors(), admin_client(target, token) as admin:
        admin.pause_queue(name)
    emit_json({"queue": name, "paused": True}) if as_json else click.echo(f"queue {name} paused")


@queue.command("resume")
@click.argument("name")
@connection_options
def queue_resume(name: str, target: str, token: str | None, as_json: bool) -> None:
    """Resume dispatching a paused queue."""
    with clear_errors(), admin_client(target, token) as admin:
        admin.resume_queue(name)
    emit_json({"queue": name, "paused": False}) if as_json else click.echo(f"queue {name} resumed")


@click.command("cluster")
@connection_options
def cluster(target: str, token: str | None, as_json: bool) -> None:
    """Every service process: api nodes and their worker sessions, dispatchers and the
    queues they own, the leaders of the singleton roles, webhook gateways."""
    with clear_errors(), admin_client(target, token) as admin:
        info = admin.cluster_info()
    emit_json(info) if as_json else cluster_view(info)
