"""EnqueueBatch for Postgres: plan the rows, insert them in one statement, map conflicts.

A batch with no unique keys and no dependencies (the hot path) is a single INSERT, atomic
on its own; when it names no ids (they are all made here) the INSERT looks for no
conflicts and returns nothing. Otherwise the batch runs in one transaction: read what it depends on (stored
ids, dependency states, live unique claims), check the items in order exactly as the
interface describes (dependencies as :func:`conveyor_broker.dependencies.plan_starts`
settles them), insert the tasks and their edges, and roll everything back on any error.
The stored dependencies are locked (and flagged as waited for) before they are read, so
an ack racing the enqueue either ends the dependency first (the new task sees it ended)
or after (and finds the flag, so the end is resolved for the new task). The INSERT's
``ON CONFLICT DO NOTHING`` is the backstop for races with concurrent writers: a row it
skips is either already stored (idempotent on id) or lost its unique key to a writer that
committed first (DuplicateTask).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING

import asyncpg
from conveyor_protos.construct import constructor

from conveyor_broker.dependencies import BatchItem, Start, plan_starts
from conveyor_broker.errors import BrokerError, DuplicateTask
from conveyor_broker.ids import new_ids
from conveyor_broker.postgres.queries import dependencies as dependency_queries
from conveyor_broker.postgres.queries import enqueue as queries
from conveyor_broker.postgres.rows import enqueue_statement, new_task, task_from_row
from conveyor_broker.types import DependencyOutcome, EnqueueResult, NewTask, Task, TaskState

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    Connection = asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]

#: EnqueueResult as its __init__ makes it, for less (see conveyor_protos.construct).
_result = constructor(EnqueueResult)
#: _lock_order of tasks without a unique key, for less.
_PLAIN_ORDER = operator.attrgetter("queue", "id")

# A row skipped by the INSERT whose id is not stored and whose key has no live holder
# lost a race with a writer that has finished since; the batch is tried again.
_ATTEMPTS = 3


def _lock_order(task: Task) -> tuple[bool, str, str, str]:
    # Concurrent batches insert (and so wait on each other's unique entries) in one global
    # order, so two of them can never wait on each other: a deadlock would abort one.
    return (task.unique_key is None, task.queue, task.unique_key or "", task.id)


@dataclass(frozen=True, slots=True)
class Plan:
    """The batch after id assignment."""

    ids: list[str]
    #: For each item, the index of the first item with the same id.
    first: list[int]


@dataclass(slots=True)
class _Known:
    """What the database says about the ids and keys a batch mentions."""

    stored: dict[str, Task] = field(default_factory=dict)
    dependency_states: dict[str, TaskState] = field(default_factory=dict)
    holders: dict[tuple[str, str], str] = field(default_factory=dict)


def plan_ids(tasks: Sequence[NewTask], now: datetime) -> Plan:
    """Assign ids; a repeated id within the batch refers to its first occurrence."""
    generated = iter(new_ids(now, sum(1 for task in tasks if task.id is None)))
    ids = [task.id if task.id is not None else next(generated) for task in tasks]
    first_of: dict[str, int] = {}
    first = [first_of.setdefault(task_id, index) for index, task_id in enumerate(ids)]
    return Plan(ids, first)


def needs_transaction(tasks: Sequence[NewTask]) -> bool:
    """True when the batch needs more than the single-statement hot path."""
    return any(task.unique_key is not None or task.depends_on for task in tasks)


async def enqueue_plain(
    conn: Connection, tasks: Sequence[NewTask], plan: Plan, now: datetime, default_max_retry: int
) -> list[EnqueueResult]:
    """The hot path: no unique keys, no dependencies. One INSERT, plus a read-back of the
    tasks whose id was already stored."""
    fresh = [i for i in range(len(tasks)) if plan.first[i] == i]
    todo = [_build(tasks[i], plan.ids[i], None, now, default_max_retry) for i in fresh]
    if all(tasks[i].id is None for i in fresh):
        # Every id was just made (80 random bits each): none can be stored, by anyone, so
        # the INSERT need not look for conflicts nor say which rows it took (ON CONFLICT
        # costs Postgres a speculative insertion per row, RETURNING a row back each).
        sql, params = enqueue_statement(todo, now, skip_existing=False)
        try:
            status = await conn.execute(sql, *params)
        except asyncpg.UniqueViolationError:
            pass  # an id clashed after all: the statement stored nothing; see below
        else:
            if status != f"INSERT 0 {len(todo)}":
                raise BrokerError(f"enqueue stored an unexpected number of rows: {status}")
            created = [_result(task=t, created=True) for t in todo]
            if len(todo) == len(tasks):
                return created
            return _in_order(plan, {r.task.id: r for r in created})
    results: dict[str, EnqueueResult] = {}
    for _ in range(_ATTEMPTS):
        # No unique keys here: _lock_order comes down to (queue, id).
        sql, params = enqueue_statement(sorted(todo, key=_PLAIN_ORDER), now)
        rows = await conn.fetch(sql, *params)
        inserted = {row[0] for row in rows}
        results.update((t.id, EnqueueResult(t, True)) for t in todo if t.id in inserted)
        skipped = [t.id for t in todo if t.id not in inserted]
        if not skipped:
            return _in_order(plan, results)
        for stored in await _stored(conn, skipped):
            results[stored.id] = EnqueueResult(stored, False)
        # A skipped id that is gone again was deleted in between: insert it anew.
        todo = [t for t in todo if t.id not in results]
        if not todo:
            return _in_order(plan, results)
    raise BrokerError("enqueue kept racing with concurrent deletes; try again")


async def enqueue_checked(
    conn: Connection, tasks: Sequence[NewTask], plan: Plan, now: datetime, default_max_retry: int
) -> list[EnqueueResult]:
    """Unique keys or dependencies: the whole batch in one transaction, all-or-nothing."""
    for _ in range(_ATTEMPTS):
        try:
            async with conn.transaction():
                return await _enqueue_in_transaction(conn, tasks, plan, now, default_max_retry)
        except (_Retry, asyncpg.DeadlockDetectedError):
            # A deadlock aborted this transaction (the other one goes on): run it again.
            continue
    raise BrokerError("enqueue kept racing with a concurrent writer; try again")


class _Retry(Exception):
    """Roll the transaction back and run the batch again."""


async def _enqueue_in_transaction(
    conn: Connection, tasks: Sequence[NewTask], plan: Plan, now: datetime, default_max_retry: int
) -> list[EnqueueResult]:
    known = await _read_known(conn, tasks, plan, now)
    results = {task_id: EnqueueResult(task, False) for task_id, task in known.stored.items()}
    items = [
        BatchItem(i, plan.ids[i], task)
        for i, task in enumerate(tasks)
        if plan.first[i] == i and plan.ids[i] not in known.stored
    ]
    # Unknown dependencies and cycles are bad input: they outrank a conflict.
    starts = plan_starts(items, known.dependency_states)
    planned: list[Task] = []
    claims: dict[tuple[str, str], str] = {}
    # Item by item, as the interface reads. Bad input outranks a conflict, so the first
    # duplicate is raised only once every item has been checked.
    conflict: DuplicateTask | None = None
    for item in items:
        task, task_id = item.task, item.task_id
        start = starts.get(task_id)
        born_canceled = start is not None and start.state is TaskState.CANCELED
        if task.unique_key is not None and not born_canceled:
            key = (task.queue, task.unique_key)
            holder = claims.get(key) or known.holders.get(key)
            if holder is not None:
                conflict = conflict or DuplicateTask(task.queue, task.unique_key, holder)
            claims[key] = task_id
        planned.append(_build(task, task_id, start, now, default_max_retry))
    if conflict is not None:
        raise conflict

    counters = {task_id: (start.open, start.failed) for task_id, start in starts.items()}
    waited_for = {
        dep
        for start in starts.values()
        for dep, outcome in start.edges
        if outcome is DependencyOutcome.OPEN
    }
    sql, params = enqueue_statement(
        sorted(planned, key=_lock_order), now, counters=counters, waited_for=waited_for
    )
    rows = await conn.fetch(sql, *params)
    inserted = {row[0] for row in rows}
    results.update((t.id, EnqueueResult(t, True)) for t in planned if t.id in inserted)
    skipped = [t for t in planned if t.id not in inserted]
    if skipped:
        # A concurrent writer committed the same id or a claim on the same key meanwhile.
        for stored in await _stored(conn, [t.id for t in skipped]):
            results[stored.id] = EnqueueResult(stored, False)
        claimed = [t for t in skipped if t.id not in results and t.unique_key is not None]
        if claimed:
            await _raise_duplicate(conn, claimed, now)
        if any(t.id not in results for t in skipped):
            raise _Retry
        # A task of the batch is another writer's now, and the batch's edges may wait
        # for it as if it were new: read the batch again against what is stored.
        if any(t.id in waited_for or t.id in starts for t in skipped):
            raise _Retry
    edges = [
        (task_id, dep, None if outcome is DependencyOutcome.OPEN else outcome.value)
        for task_id, start in starts.items()
        if task_id in inserted
        for dep, outcome in start.edges
    ]
    if edges:
        await conn.execute(
            dependency_queries.INSERT_DEPENDENCIES,
            [e[0] for e in edges],
            [e[1] for e in edges],
            [e[2] for e in edges],
        )
    return _in_order(plan, results)


async def _read_known(
    conn: Connection, tasks: Sequence[NewTask], plan: Plan, now: datetime
) -> _Known:
    known = _Known()
    given = sorted({task.id for task in tasks if task.id is not None})
    if given:
        known.stored = {task.id: task for task in await _stored(conn, given)}
    # The dependencies of the tasks to create that are not themselves created here: the
    # batch's items are settled in order by the caller. Locked, and flagged as waited
    # for when they have not ended.
    created = {
        plan.ids[i]
        for i in range(len(tasks))
        if plan.first[i] == i and plan.ids[i] not in known.stored
    }
    lookup = sorted(
        {
            dep
            for i, task in enumerate(tasks)
            if plan.ids[i] in created and plan.first[i] == i
            for dep in task.depends_on
        }
        - created
    )
    if lookup:
        rows = await conn.fetch(dependency_queries.LOCK_DEPENDENCIES, lookup)
        known.dependency_states = {row[0]: TaskState(row[1]) for row in rows}
    keys = sorted({(task.queue, task.unique_key) for task in tasks if task.unique_key is not None})
    if keys:
        rows = await conn.fetch(
            queries.FREE_LAPSED_CLAIMS_AND_READ_HOLDERS,
            [queue for queue, _ in keys],
            [key for _, key in keys],
            now,
        )
        known.holders = {(row[1], row[2]): row[0] for row in rows}
    return known


def _build(
    task: NewTask, task_id: str, start: Start | None, now: datetime, default_max_retry: int
) -> Task:
    if start is not None and start.state is not None:
        state = start.state
    elif task.group is not None:
        state = TaskState.AGGREGATING
    elif task.process_at is not None and task.process_at > now:
        state = TaskState.SCHEDULED
    else:
        state = TaskState.PENDING
    max_retry = task.max_retry if task.max_retry is not None else default_max_retry
    return new_task(
        task,
        task_id=task_id,
        state=state,
        now=now,
        max_retry=max_retry,
        error=start.error if start is not None else None,
    )


async def _stored(conn: Connection, ids: list[str]) -> list[Task]:
    return [task_from_row(row) for row in await conn.fetch(queries.TASKS_BY_IDS, ids)]


async def _raise_duplicate(conn: Connection, claimed: list[Task], now: datetime) -> None:
    for task in claimed:
        assert task.unique_key is not None
        holder = await conn.fetchval(queries.UNIQUE_HOLDER, task.queue, task.unique_key, now)
        if holder is not None:
            raise DuplicateTask(task.queue, task.unique_key, holder)


def _in_order(plan: Plan, results: dict[str, EnqueueResult]) -> list[EnqueueResult]:
    ordered: list[EnqueueResult] = []
    for i, task_id in enumerate(plan.ids):
        result = results[task_id]
        # A repeated id within the batch: the first occurrence decided; the rest see it.
        ordered.append(result if plan.first[i] == i else EnqueueResult(result.task, False))
    return ordered
