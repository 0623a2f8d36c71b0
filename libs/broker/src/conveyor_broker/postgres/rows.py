"""Conversions between the broker's types and Postgres rows and statement parameters."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import asyncpg
from conveyor_protos.construct import constructor

from conveyor_broker.postgres.queries import TASK_FIELDS
from conveyor_broker.postgres.queries.cron import CRON_FIELDS
from conveyor_broker.postgres.queries.enqueue import ENQUEUE_COLUMNS
from conveyor_broker.postgres.queries.enqueue import enqueue_statement as enqueue_sql
from conveyor_broker.postgres.queries.webhooks import WEBHOOK_FIELDS
from conveyor_broker.types import (
    CronEntry,
    CronEntrySpec,
    CronMisfire,
    NewTask,
    OnFailure,
    Task,
    TaskState,
    WebhookWorker,
)

TASK_FIELD_COUNT = len(TASK_FIELDS)
WEBHOOK_FIELD_COUNT = len(WEBHOOK_FIELDS)
CRON_FIELD_COUNT = len(CRON_FIELDS)


def _headers_from_json(text: str) -> dict[str, str]:
    if text == "{}":
        return {}
    loaded: dict[str, str] = json.loads(text)
    return loaded


def _headers_to_json(headers: Mapping[str, str]) -> str:
    return json.dumps(dict(headers), separators=(",", ":")) if headers else "{}"


_STATES = {state.value: state for state in TaskState}
#: Task as its __init__ makes it, for less (see conveyor_protos.construct): an enqueue or a
#: lease of a thousand tasks builds a thousand.
_task = constructor(Task)
_ON_FAILURE = {value.value: value for value in OnFailure}


def task_from_row(row: asyncpg.Record) -> Task:
    """The Task a row describes: its first columns are ``queries.TASK_FIELDS``, in order.

    Read by position, not by name: leases and acks decode thousands of rows a second.
    """
    (
        task_id,
        queue,
        task_type,
        payload,
        headers,
        state,
        max_retry,
        retried,
        timeout,
        deadline,
        process_at,
        expires_at,
        retention,
        unique_key,
        unique_until,
        group_key,
        depends_on,
        on_failure,
        concurrency_key,
        available_at,
        lease_id,
        lease_expires_at,
        progress,
        result,
        last_error,
        created_at,
        updated_at,
        started_at,
        completed_at,
        holder,
    ) = row[:TASK_FIELD_COUNT]
    return _task(
        id=task_id,
        queue=queue,
        type=task_type,
        payload=payload,
        headers=_headers_from_json(headers),
        state=_STATES[state],
        max_retry=max_retry,
        retried=retried,
        timeout=timeout,
        deadline=deadline,
        process_at=process_at,
        expires_at=expires_at,
        retention=retention,
        unique_key=unique_key,
        unique_until=unique_until,
        group=group_key,
        depends_on=tuple(depends_on),
        on_failure=_ON_FAILURE[on_failure],
        concurrency_key=concurrency_key,
        available_at=available_at,
        lease_id=lease_id,
        lease_expires_at=lease_expires_at,
        progress=progress,
        result=result,
        last_error=last_error,
        created_at=created_at,
        updated_at=updated_at,
        started_at=started_at,
        completed_at=completed_at,
        holder=holder,
    )


def new_task(
    new: NewTask,
    *,
    task_id: str,
    state: TaskState,
    now: datetime,
    max_retry: int,
    error: str | None = None,
) -> Task:
    """The Task that enqueuing ``new`` stores, exactly as it will read back. A task born
    CANCELED (a failed dependency) has ``completed_at = now`` and ``error`` as its
    ``last_error``. Times are normalised to UTC, as Postgres hands them back, so the Task
    built here is identical to the one read back."""
    process_at = new.process_at
    if process_at is not None:
        process_at = process_at.astimezone(UTC)
    deadline = new.deadline
    expires_at = new.expires_at
    on_failure = new.on_failure
    payload = new.payload
    headers = new.headers
    return _task(
        id=task_id,
        queue=new.queue,
        type=new.type,
        payload=payload if type(payload) is bytes else bytes(payload),
        headers=dict(headers) if headers else {},
        state=state,
        max_retry=max_retry,
        retried=0,
        timeout=new.timeout,
        deadline=None if deadline is None else deadline.astimezone(UTC),
        process_at=process_at,
        expires_at=None if expires_at is None else expires_at.astimezone(UTC),
        retention=new.retention,
        unique_key=new.unique_key,
        unique_until=now + new.unique_ttl if new.unique_ttl is not None else None,
        group=new.group,
        depends_on=tuple(new.depends_on),
        on_failure=on_failure if type(on_failure) is OnFailure else OnFailure(on_failure),
        concurrency_key=new.concurrency_key,
        available_at=process_at or now,
        lease_id=None,
        lease_expires_at=None,
        progress=None,
        result=None,
        last_error=error,
        created_at=now,
        updated_at=now,
        started_at=None,
        completed_at=now if state is TaskState.CANCELED else None,
        holder=None,
    )


def enqueue_statement(
    tasks: Sequence[Task],
    now: datetime,
    *,
    counters: Mapping[str, tuple[int, int]] | None = None,
    waited_for: Collection[str] = (),
    skip_existing: bool = True,
) -> tuple[str, list[Any]]:
    """The INSERT for ``tasks`` and its parameters: only the optional columns that some
    task sets (see ``queries.enqueue.ENQUEUE_OPTIONAL``), and one value for each column
    whose values are all equal (``queries.enqueue.enqueue_statement``'s scalars).

    ``counters`` maps the id of a task that has dependencies to its (open, failed) edge
    counts; ``waited_for`` are the ids of tasks that others wait for (open edges).
    ``skip_existing`` False: the plain INSERT, for ids that were just made.
    """
    columns: dict[str, list[Any]] = {
        "id": [t.id for t in tasks],
        "queue": [t.queue for t in tasks],
        "type": [t.type for t in tasks],
        "payload": [t.payload for t in tasks],
        "state": [t.state.value for t in tasks],
        "max_retry": [t.max_retry for t in tasks],
        "on_failure": [t.on_failure.value for t in tasks],
        "available_at": [t.available_at for t in tasks],
    }
    if any(t.headers for t in tasks):
        columns["headers"] = [_headers_to_json(t.headers) for t in tasks]
    if any(t.depends_on for t in tasks):
        columns["depends_on"] = [",".join(t.depends_on) for t in tasks]
    count = len(tasks)
    for name, values in (
        ("timeout", [t.timeout for t in tasks]),
        ("deadline", [t.deadline for t in tasks]),
        ("process_at", [t.process_at for t in tasks]),
        ("expires_at", [t.expires_at for t in tasks]),
        ("retention", [t.retention for t in tasks]),
        ("unique_key", [t.unique_key for t in tasks]),
        ("unique_until", [t.unique_until for t in tasks]),
        ("group_key", [t.group for t in tasks]),
        ("concurrency_key", [t.concurrency_key for t in tasks]),
        ("completed_at", [t.completed_at for t in tasks]),
        ("last_error", [t.last_error for t in tasks]),
    ):
        if values.count(None) != count:
            columns[name] = values
    if counters:
        columns["deps_open"] = [counters.get(t.id, (0, 0))[0] for t in tasks]
        columns["deps_failed"] = [counters.get(t.id, (0, 0))[1] for t in tasks]
    if waited_for:
        columns["dependents_pending"] = [t.id in waited_for for t in tasks]
    order = tuple(name for name in ENQUEUE_COLUMNS if name in columns)
    # A column every task agrees on goes as one value (ids never do: they are distinct).
    scalars = frozenset(
        name
        for name in order
        if count and name != "id" and (values := columns[name]).count(values[0]) == count
    )
    params = [columns[name][0] if name in scalars else columns[name] for name in order]
    return enqueue_sql(order, scalars, skip_existing=skip_existing), [*params, now]


def enqueue_params(tasks: Sequence[Task], now: datetime) -> list[Any]:
    """The parameters of ``queries.enqueue.ENQUEUE`` (every column) for ``tasks``."""
    return [
        [t.id for t in tasks],
        [t.queue for t in tasks],
        [t.type for t in tasks],
        [t.payload for t in tasks],
        [_headers_to_json(t.headers) for t in tasks],
        [t.state.value for t in tasks],
        [t.max_retry for t in tasks],
        [t.timeout for t in tasks],
        [t.deadline for t in tasks],
        [t.process_at for t in tasks],
        [t.expires_at for t in tasks],
        [t.retention for t in tasks],
        [t.unique_key for t in tasks],
        [t.unique_until for t in tasks],
        [t.group for t in tasks],
        [",".join(t.depends_on) for t in tasks],
        [t.on_failure.value for t in tasks],
        [t.concurrency_key for t in tasks],
        [t.available_at for t in tasks],
        now,
    ]


def webhook_queues_to_json(queues: Mapping[str, int]) -> str:
    """The ``queues`` column value (a JSON object, queue -> weight) for a registration."""
    return json.dumps({queue: int(weight) for queue, weight in queues.items()})


def webhook_worker_from_row(row: asyncpg.Record) -> WebhookWorker:
    """The WebhookWorker a row describes: its columns are
    ``queries.webhooks.WEBHOOK_FIELDS``, in order (``queues`` as JSON text)."""
    (
        name,
        url,
        queues,
        concurrency,
        timeout,
        paused,
        secrets,
        created_at,
        updated_at,
        batch_types,
    ) = row[:WEBHOOK_FIELD_COUNT]
    loaded: dict[str, int] = json.loads(queues)
    return WebhookWorker(
        name=name,
        url=url,
        # Read-only, like the memory broker's snapshots.
        queues=MappingProxyType(loaded),
        concurrency=concurrency,
        timeout=timeout,
        paused=paused,
        secrets=tuple(secrets),
        created_at=created_at,
        updated_at=updated_at,
        batch_types=tuple(batch_types),
    )


def cron_entry_from_row(row: asyncpg.Record) -> CronEntry:
    """The CronEntry a row describes: its first columns are
    ``queries.cron.CRON_FIELDS``, in order (``headers`` as JSON text)."""
    (
        name,
        schedule,
        timezone,
        paused,
        misfire,
        task_queue,
        task_type,
        payload,
        headers,
        max_retry,
        timeout,
        retention,
        group_key,
        concurrency_key,
        next_run_at,
        last_run_at,
        created_at,
        updated_at,
    ) = row[:CRON_FIELD_COUNT]
    template = NewTask(
        queue=task_queue,
        type=task_type,
        payload=payload,
        headers=_headers_from_json(headers),
        max_retry=max_retry,
        timeout=timeout,
        retention=retention,
        group=group_key,
        concurrency_key=concurrency_key,
    )
    return CronEntry(
        name=name,
        schedule=schedule,
        timezone=timezone,
        task=template,
        paused=paused,
        misfire=CronMisfire(misfire),
        next_run_at=next_run_at,
        last_run_at=last_run_at,
        created_at=created_at,
        updated_at=updated_at,
    )


def cron_upsert_params(
    spec: CronEntrySpec, next_run_at: datetime | None, now: datetime
) -> list[Any]:
    """The parameters of ``queries.cron.UPSERT_CRON_ENTRY`` for ``spec``."""
    task = spec.task
    return [
        spec.name,
        spec.schedule,
        spec.timezone,
        bool(spec.paused),
        spec.misfire.value,
        task.queue,
        task.type,
        bytes(task.payload),
        _headers_to_json(task.headers),
        task.max_retry,
        task.timeout,
        task.retention,
        task.group,
        task.concurrency_key,
        next_run_at,
        now,
    ]
