"""PostgresBroker: the durable Broker on PostgreSQL, through an asyncpg pool.

Every method is one statement (so one round trip, committed on its own) where it can be:
batches are ``unnest``-ed arrays, and read-modify-write steps are CTEs that lock what they
change. "Now" is always taken from the injected clock and passed as a parameter. The
statements live in :mod:`conveyor_broker.postgres.queries`; asyncpg prepares and caches
them per connection.

Events go to the sink after the statement that made the change has committed, in the
order the rows were changed within one call. Calls running concurrently on different
connections report in the order they return, which can differ from their commit order
by the width of the race.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from importlib import metadata
from typing import TYPE_CHECKING, Any

import asyncpg

from conveyor_broker.clock import Clock, SystemClock
from conveyor_broker.errors import (
    BrokerClosed,
    DuplicateTask,
    InvalidState,
    InvalidTask,
    LeaseLost,
    TaskNotFound,
    WebhookWorkerNotFound,
)
from conveyor_broker.ids import is_ulid, new_ids
from conveyor_broker.interface import DEFAULT_MAX_RETRY, MAX_BATCH, Broker, EventSink
from conveyor_broker.postgres import enqueue, upkeep
from conveyor_broker.postgres.migrations import MIGRATION_LOCK_KEY, schema_version
from conveyor_broker.postgres.queries.admin import (
    ARCHIVE_TASK,
    CANCEL_TASK,
    DELETE_TASK,
    GET_TASK,
    LIST_TASKS,
    LIST_TASKS_BY_QUEUE,
    LIST_TASKS_BY_QUEUE_AND_STATE,
    LIST_TASKS_BY_STATE,
    QUEUE_PAUSED,
    QUEUE_STATS,
    QUEUE_STATS_QUEUE,
    RESCHEDULE_TASK,
    REVIVE_TASK,
    RUN_TASK_NOW,
    SET_QUEUE_PAUSED,
)
from conveyor_broker.postgres.queries.enqueue import FREE_LAPSED_CLAIMS, UNIQUE_HOLDER
from conveyor_broker.postgres.queries.lease import (
    EXTEND_LEASE,
    EXTEND_LEASES,
    LEASE,
    LEASE_MANY,
    SET_PROGRESS,
)
from conveyor_broker.postgres.queries.outcomes import ACK, ACK_BATCH, ARCHIVE, FAIL, RELEASE
from conveyor_broker.postgres.queries.sweeps import (
    ARCHIVE_EXPIRED,
    DUE_QUEUES,
    FREE_ALL_LAPSED_CLAIMS,
    PENDING_COUNT,
    PENDING_COUNT_QUEUE,
    PROMOTE_SCHEDULED,
    PURGE_TERMINAL,
    REAP_EXPIRED_LEASES,
)
from conveyor_broker.postgres.queries.webhooks import (
    DELETE_WEBHOOK_WORKER,
    GET_WEBHOOK_WORKER,
    LIST_WEBHOOK_WORKERS,
    SET_WEBHOOK_WORKER_PAUSED,
    UPSERT_WEBHOOK_WORKER,
)
from conveyor_broker.postgres.rows import (
    task_from_row,
    webhook_queues_to_json,
    webhook_worker_from_row,
)
from conveyor_broker.types import (
    EXPIRED_ERROR,
    LEASE_EXPIRED_ERROR,
    AckItem,
    BrokerInfo,
    EnqueueResult,
    LeaseRef,
    NewTask,
    QueueStats,
    ReapedTask,
    StorageUpkeep,
    Task,
    TaskEvent,
    TaskPage,
    TaskState,
    WebhookWorker,
    WebhookWorkerSpec,
)
from conveyor_broker.validation import (
    MAX_PAYLOAD,
    MAX_RETRY_CAP,
    check_batch,
    check_lease_wants,
    check_limit,
    check_queue,
    check_task_id,
    check_webhook_name,
    check_webhook_worker,
)

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    Pool = asyncpg.Pool[asyncpg.Record]

logger = logging.getLogger(__name__)

DRIVER = "postgres"
_UNIQUE_INDEX = "conveyor_tasks_unique_idx"


class PostgresBroker(Broker):
    """The Broker on PostgreSQL. Build it with :meth:`connect` (owns its pool) or around a
    pool you manage (``PostgresBroker(pool, clock=...)``; closing the broker leaves that
    pool open). The schema must be migrated first (:func:`~.migrations.migrate`)."""

    def __init__(
        self,
        pool: Pool,
        clock: Clock | None = None,
        *,
        max_payload: int = MAX_PAYLOAD,
        default_max_retry: int = DEFAULT_MAX_RETRY,
    ) -> None:
        if max_payload < 0:
            raise ValueError("max_payload must be >= 0")
        if not 0 <= default_max_retry <= MAX_RETRY_CAP:
            raise ValueError(f"default_max_retry must be in 0..{MAX_RETRY_CAP}")
        self._pool = pool
        self._clock: Clock = clock or SystemClock()
        self._max_payload = max_payload
        self._default_max_retry = default_max_retry
        self._sink: EventSink | None = None
        self._owns_pool = False
        self._closed = False
        # Storage upkeep: dead rows the last VACUUM could not remove (see upkeep), when
        # the next check may act, failed runs in a row, and whether the role was refused.
        self._dead_floor = 0
        self._upkeep_resume_at = datetime.min.replace(tzinfo=UTC)
        self._upkeep_failures = 0
        self._upkeep_refused = False

    @classmethod
    async def connect(
        cls,
        dsn: str,
        clock: Clock | None = None,
        *,
        min_size: int = 1,
        max_size: int = 10,
        max_payload: int = MAX_PAYLOAD,
        default_max_retry: int = DEFAULT_MAX_RETRY,
    ) -> PostgresBroker:
        """Open a pool on ``dsn`` and return a broker that closes it on :meth:`close`."""
        pool = await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, reset=_keep_session
        )
        broker = cls(pool, clock, max_payload=max_payload, default_max_retry=default_max_retry)
        broker._owns_pool = True
        return broker

    # ------------------------------------------------------------------ plumbing

    def _now(self) -> datetime:
        if self._closed:
            raise BrokerClosed("the broker is closed")
        return self._clock.now()

    def _emit(self, events: Iterable[TaskEvent]) -> None:
        sink = self._sink
        if sink is None:
            return
        for event in events:
            try:
                sink(event)
            except Exception:
                # The change is committed; a failing observer must not undo the caller's
                # view of it.
                logger.exception(
                    "broker.event_sink.failed task_id=%s state=%s", event.task_id, event.state
                )

    def _event(self, task: Task, previous: TaskState | None, at: datetime) -> TaskEvent:
        error = task.last_error if task.state in (TaskState.RETRY, TaskState.ARCHIVED) else None
        return TaskEvent(task.id, task.queue, task.type, task.state, previous, at, error)

    # ------------------------------------------------------------------- enqueue

    async def enqueue(self, task: NewTask) -> EnqueueResult:
        """Store one task. Same as ``enqueue_batch([task])[0]``."""
        return (await self.enqueue_batch([task]))[0]

    async def enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        """Store up to MAX_BATCH tasks, all-or-nothing (see :meth:`Broker.enqueue_batch`)."""
        now = self._now()
        check_batch(tasks, max_batch=MAX_BATCH, max_payload=self._max_payload)
        if not tasks:
            return []
        plan = enqueue.plan_ids(tasks, now)
        async with self._pool.acquire() as conn:
            if enqueue.needs_transaction(tasks):
                results = await enqueue.enqueue_checked(
                    conn, tasks, plan, now, self._default_max_retry
                )
            else:
                results = await enqueue.enqueue_plain(
                    conn, tasks, plan, now, self._default_max_retry
                )
        self._emit(
            self._event(r.task, None, now)
            for i, r in enumerate(results)
            if r.created and plan.first[i] == i
        )
        return results

    # --------------------------------------------------------------------- lease

    async def lease(self, queue: str, limit: int, ttl: timedelta) -> list[Task]:
        """Lease up to ``limit`` due tasks of ``queue`` in one round trip."""
        now = self._now()
        check_queue(queue)
        check_limit(limit, upper=MAX_BATCH)
        _check_ttl(ttl)
        lease_ids = new_ids(now, limit)
        rows = await self._pool.fetch(LEASE, queue, now, limit, lease_ids, now + ttl)
        return self._leased(rows, now)

    def _leased(self, rows: Iterable[asyncpg.Record], now: datetime) -> list[Task]:
        """The tasks a lease statement returned, in lease order; their events emitted."""
        leased = sorted(
            ((task_from_row(row), TaskState(row["previous_state"])) for row in rows),
            key=lambda pair: (pair[0].available_at, pair[0].id),
        )
        self._emit(self._event(task, previous, now) for task, previous in leased)
        return [task for task, _ in leased]

    async def lease_many(
        self, wants: Sequence[tuple[str, int]], ttl: timedelta
    ) -> list[list[Task]]:
        """Lease for several queues in one statement (see Broker.lease_many)."""
        now = self._now()
        check_lease_wants(wants, upper=MAX_BATCH)
        _check_ttl(ttl)
        if not wants:
            return []
        lease_ids = new_ids(now, sum(limit for _, limit in wants))
        rows = await self._pool.fetch(
            LEASE_MANY,
            [queue for queue, _ in wants],
            [limit for _, limit in wants],
            now,
            lease_ids,
            now + ttl,
        )
        by_queue: dict[str, list[Task]] = {queue: [] for queue, _ in wants}
        for task in self._leased(rows, now):
            by_queue[task.queue].append(task)
        return [by_queue[queue] for queue, _ in wants]

    async def extend_lease(self, task_id: str, lease_id: str, ttl: timedelta) -> datetime:
        """Set ``lease_expires_at = now + ttl`` and return it. Raises LeaseLost."""
        now = self._now()
        _check_ttl(ttl)
        check_task_id(task_id)
        expires: datetime | None = await self._pool.fetchval(
            EXTEND_LEASE, task_id, lease_id, now + ttl, now
        )
        if expires is None:
            raise LeaseLost(task_id, lease_id)
        return expires

    async def extend_leases(self, leases: Sequence[LeaseRef], ttl: timedelta) -> list[LeaseRef]:
        """Extend many leases in one round trip; return the ones that are lost."""
        now = self._now()
        _check_ttl(ttl)
        _check_batch_size(leases)
        for ref in leases:
            check_task_id(ref.task_id)
        if not leases:
            return []
        ordered = sorted(leases, key=lambda ref: ref.task_id)  # lock order: see ack_batch
        rows = await self._pool.fetch(
            EXTEND_LEASES,
            [ref.task_id for ref in ordered],
            [ref.lease_id for ref in ordered],
            now + ttl,
            now,
        )
        held = {(row["id"], row["lease_id"]) for row in rows}
        return [ref for ref in leases if (ref.task_id, ref.lease_id) not in held]

    async def set_progress(self, task_id: str, lease_id: str, progress: bytes) -> None:
        """Store the running task's progress. Raises LeaseLost."""
        now = self._now()
        check_task_id(task_id)
        if await self._pool.fetchval(SET_PROGRESS, task_id, lease_id, progress, now) is None:
            raise LeaseLost(task_id, lease_id)

    # ------------------------------------------------------------------ outcomes

    async def _lease_scoped(
        self, query: str, task_id: str, lease_id: str, now: datetime, *args: Any
    ) -> Task:
        check_task_id(task_id)
        row = await self._pool.fetchrow(query, task_id, lease_id, *args)
        if row is None:
            raise LeaseLost(task_id, lease_id)
        task = task_from_row(row)
        self._emit([self._event(task, TaskState.ACTIVE, now)])
        return task

    async def ack(self, task_id: str, lease_id: str, result: bytes | None = None) -> Task:
        """ACTIVE -> COMPLETED, storing ``result``. Raises LeaseLost."""
        now = self._now()
        return await self._lease_scoped(ACK, task_id, lease_id, now, result, now)

    async def ack_batch(self, items: Sequence[AckItem]) -> list[bool]:
        """Ack many tasks in one statement; False per item whose lease was lost."""
        now = self._now()
        _check_batch_size(items)
        for item in items:
            check_task_id(item.task_id)
        if not items:
            return []
        # Send each task once: the first item for an id decides, repeats report False.
        unique: dict[str, AckItem] = {}
        for item in items:
            unique.setdefault(item.task_id, item)
        # In id order, like every multi-row update, so concurrent batches lock rows in
        # the same order and cannot deadlock.
        sent = sorted(unique.values(), key=lambda item: item.task_id)
        rows = await self._pool.fetch(
            ACK_BATCH,
            [item.task_id for item in sent],
            [item.lease_id for item in sent],
            [item.result for item in sent],
            now,
        )
        done = {row["id"] for row in rows}
        self._emit(
            TaskEvent(
                row["id"], row["queue"], row["type"], TaskState.COMPLETED, TaskState.ACTIVE, now
            )
            for row in rows
        )
        return [item.task_id in done and unique[item.task_id] is item for item in items]

    async def fail(
        self,
        task_id: str,
        lease_id: str,
        error: str,
        retry_delay: timedelta,
        *,
        skip_retry: bool = False,
    ) -> Task:
        """A failed attempt: RETRY after ``retry_delay``, or ARCHIVED when exhausted or
        ``skip_retry``. Raises LeaseLost."""
        now = self._now()
        _check_not_negative("retry_delay", retry_delay)
        return await self._lease_scoped(
            FAIL, task_id, lease_id, now, error, now, skip_retry, now + retry_delay
        )

    async def release(self, task_id: str, lease_id: str) -> Task:
        """ACTIVE -> PENDING, due now, ``retried`` unchanged. Raises LeaseLost."""
        now = self._now()
        return await self._lease_scoped(RELEASE, task_id, lease_id, now, now)

    async def archive(self, task_id: str, lease_id: str, error: str) -> Task:
        """ACTIVE -> ARCHIVED at once with ``last_error = error``. Raises LeaseLost."""
        now = self._now()
        return await self._lease_scoped(ARCHIVE, task_id, lease_id, now, error, now)

    # ------------------------------------------------------- maintenance sweeps

    async def reap_expired_leases(
        self, limit: int = 1000, retry_delay: timedelta = timedelta(0)
    ) -> list[ReapedTask]:
        """Expired leases fail with LEASE_EXPIRED_ERROR: RETRY, or ARCHIVED when exhausted."""
        now = self._now()
        check_limit(limit, upper=MAX_BATCH)
        _check_not_negative("retry_delay", retry_delay)
        rows = await self._pool.fetch(REAP_EXPIRED_LEASES, now, limit, now + retry_delay)
        rows = sorted(rows, key=lambda row: (row["lease_expires_at"], row["id"]))
        reaped = [ReapedTask(row["id"], row["queue"], TaskState(row["state"])) for row in rows]
        self._emit(
            TaskEvent(
                row["id"],
                row["queue"],
                row["type"],
                TaskState(row["state"]),
                TaskState.ACTIVE,
                now,
                LEASE_EXPIRED_ERROR,
            )
            for row in rows
        )
        if reaped:
            logger.info("broker.leases.reaped count=%d", len(reaped), extra={"count": len(reaped)})
        return reaped

    async def promote_scheduled(self, limit: int = 1000) -> dict[str, int]:
        """Due SCHEDULED tasks become PENDING; returns how many per queue."""
        now = self._now()
        check_limit(limit, upper=MAX_BATCH)
        rows = await self._pool.fetch(PROMOTE_SCHEDULED, now, limit)
        promoted: dict[str, int] = {}
        for row in rows:
            promoted[row["queue"]] = promoted.get(row["queue"], 0) + 1
        self._emit(
            TaskEvent(
                row["id"], row["queue"], row["type"], TaskState.PENDING, TaskState.SCHEDULED, now
            )
            for row in sorted(rows, key=lambda row: (row["available_at"], row["id"]))
        )
        return promoted

    async def purge_terminal(
        self,
        *,
        archive_retention: timedelta,
        default_retention: timedelta = timedelta(0),
        limit: int = 1000,
    ) -> int:
        """Delete terminal rows past their retention; free lapsed unique claims."""
        now = self._now()
        _check_not_negative("archive_retention", archive_retention)
        _check_not_negative("default_retention", default_retention)
        check_limit(limit, upper=MAX_BATCH)
        async with self._pool.acquire() as conn:
            purged = await conn.fetchval(
                PURGE_TERMINAL, now, default_retention, archive_retention, limit
            )
            await conn.execute(FREE_ALL_LAPSED_CLAIMS, now, limit)
        return int(purged)

    async def archive_expired(self, limit: int = 1000) -> list[Task]:
        """Waiting tasks past ``expires_at`` become ARCHIVED with EXPIRED_ERROR."""
        now = self._now()
        check_limit(limit, upper=MAX_BATCH)
        rows = await self._pool.fetch(ARCHIVE_EXPIRED, now, limit, EXPIRED_ERROR)
        pairs = sorted(
            ((task_from_row(row), TaskState(row["previous_state"])) for row in rows),
            key=lambda pair: (pair[0].expires_at or now, pair[0].id),
        )
        self._emit(self._event(task, previous, now) for task, previous in pairs)
        return [task for task, _ in pairs]

    # ------------------------------------------------------- inspection / admin

    async def pending_count(self, queue: str | None = None) -> dict[str, int]:
        """Due tasks per queue (queues with none left out)."""
        now = self._now()
        if queue is None:
            rows = await self._pool.fetch(PENDING_COUNT, now)
            return {row["queue"]: row["n"] for row in rows}
        check_queue(queue)
        count: int = await self._pool.fetchval(PENDING_COUNT_QUEUE, now, queue)
        return {queue: count} if count else {}

    async def due_queues(self, *, after: str | None = None, limit: int = 1000) -> list[str]:
        """Queues with a due task, by name, named after ``after``, at most ``limit``: one
        index probe or two per queue that has PENDING or RETRY rows."""
        now = self._now()
        if after is not None:
            check_queue(after)
        check_limit(limit, upper=MAX_BATCH)
        rows = await self._pool.fetch(DUE_QUEUES, now, after or "", limit)
        return [row["queue"] for row in rows]

    async def queue_stats(self, queue: str | None = None) -> list[QueueStats]:
        """Per-state counts of every queue with tasks or a stored flag, sorted by name."""
        self._now()
        if queue is None:
            rows = await self._pool.fetch(QUEUE_STATS)
        else:
            check_queue(queue)
            rows = await self._pool.fetch(QUEUE_STATS_QUEUE, queue)
        counts: dict[str, dict[TaskState, int]] = {}
        paused: dict[str, bool] = {}
        for row in rows:
            name = row["queue"]
            counts.setdefault(name, dict.fromkeys(TaskState, 0))
            if row["state"] is None:
                paused[name] = row["paused"]
            else:
                counts[name][TaskState(row["state"])] = row["n"]
        if queue is not None and queue not in counts:
            counts[queue] = dict.fromkeys(TaskState, 0)
        return [QueueStats(name, paused.get(name, False), counts[name]) for name in sorted(counts)]

    async def get_task(self, task_id: str) -> Task:
        """The stored task. Raises TaskNotFound."""
        self._now()
        check_task_id(task_id)
        row = await self._pool.fetchrow(GET_TASK, task_id)
        if row is None:
            raise TaskNotFound(task_id)
        return task_from_row(row)

    async def list_tasks(
        self,
        *,
        queue: str | None = None,
        state: TaskState | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """Tasks ordered by id, filtered by queue and state, a page at a time."""
        self._now()
        check_limit(limit, upper=MAX_BATCH)
        if cursor is not None and not is_ulid(cursor):
            raise InvalidTask(f"malformed cursor {cursor!r}")
        if queue is not None:
            check_queue(queue)
        args: list[Any] = [cursor or "", limit + 1]
        if queue is not None:
            args.append(queue)
        if state is not None:
            args.append(TaskState(state).value)
        if queue is None:
            statement = LIST_TASKS if state is None else LIST_TASKS_BY_STATE
        else:
            statement = LIST_TASKS_BY_QUEUE if state is None else LIST_TASKS_BY_QUEUE_AND_STATE
        rows = await self._pool.fetch(statement, *args)
        tasks = [task_from_row(row) for row in rows[:limit]]
        next_cursor = tasks[-1].id if len(rows) > limit else None
        return TaskPage(tasks, next_cursor)

    async def _admin(self, query: str, task_id: str, operation: str, *args: Any) -> Task:
        now = self._now()
        check_task_id(task_id)
        row = await self._pool.fetchrow(query, task_id, now, *args)
        if row is None:
            raise TaskNotFound(task_id)
        previous = TaskState(row["previous_state"])
        if row["id"] is None:
            raise InvalidState(task_id, previous.value, operation)
        task = task_from_row(row)
        if task.state != previous:
            self._emit([self._event(task, previous, now)])
        return task

    async def cancel_task(self, task_id: str) -> Task:
        """Waiting -> CANCELED; ACTIVE -> ARCHIVED (the lease is gone). Terminal:
        InvalidState."""
        return await self._admin(CANCEL_TASK, task_id, "cancel")

    async def delete_task(self, task_id: str) -> None:
        """Delete a task that is not ACTIVE (InvalidState if it is)."""
        now = self._now()
        check_task_id(task_id)
        row = await self._pool.fetchrow(DELETE_TASK, task_id)
        if row is None:
            raise TaskNotFound(task_id)
        if not row["deleted"]:
            raise InvalidState(task_id, row["state"], "delete")
        self._emit(
            [TaskEvent(task_id, row["queue"], row["type"], None, TaskState(row["state"]), now)]
        )

    async def run_task_now(self, task_id: str) -> Task:
        """SCHEDULED, RETRY or PENDING -> PENDING, due now."""
        return await self._admin(RUN_TASK_NOW, task_id, "run now")

    async def reschedule_task(self, task_id: str, process_at: datetime) -> Task:
        """PENDING, SCHEDULED or RETRY -> SCHEDULED at ``process_at`` (PENDING when it is
        not after now)."""
        if process_at.tzinfo is None:
            raise InvalidTask("process_at must be timezone-aware")
        return await self._admin(RESCHEDULE_TASK, task_id, "reschedule", process_at)

    async def archive_task(self, task_id: str) -> Task:
        """A waiting task -> ARCHIVED with ARCHIVED_BY_ADMIN_ERROR."""
        return await self._admin(ARCHIVE_TASK, task_id, "archive")

    async def revive_task(self, task_id: str) -> Task:
        """ARCHIVED -> PENDING, due now, ``retried = 0``. DuplicateTask when another live
        task holds its unlapsed unique claim."""
        for attempt in range(2):
            try:
                return await self._admin(REVIVE_TASK, task_id, "revive")
            except asyncpg.UniqueViolationError as exc:
                if exc.constraint_name != _UNIQUE_INDEX:
                    raise
                task = await self.get_task(task_id)
                assert task.unique_key is not None
                if attempt == 0:
                    # The index may still hold a claim that has lapsed: free it and retry.
                    await self._pool.execute(
                        FREE_LAPSED_CLAIMS, [task.queue], [task.unique_key], self._now()
                    )
                    continue
                holder = await self._pool.fetchval(
                    UNIQUE_HOLDER, task.queue, task.unique_key, self._now()
                )
                raise DuplicateTask(task.queue, task.unique_key, holder or "") from None
        raise AssertionError("unreachable")

    async def set_queue_paused(self, queue: str, paused: bool) -> None:
        """Persist the pause flag of ``queue``."""
        now = self._now()
        check_queue(queue)
        await self._pool.execute(SET_QUEUE_PAUSED, queue, paused, now)

    async def queue_paused(self, queue: str) -> bool:
        """The stored pause flag (False for a queue never paused)."""
        self._now()
        check_queue(queue)
        return bool(await self._pool.fetchval(QUEUE_PAUSED, queue))

    async def info(self) -> BrokerInfo:
        """The driver name, this package's version and the applied schema version."""
        self._now()
        async with self._pool.acquire() as conn:
            version = await schema_version(conn)
        return BrokerInfo(DRIVER, _package_version(), version)

    async def upkeep_storage(self) -> StorageUpkeep:
        """ANALYZE and/or VACUUM the task table when its counters say it drifted (see
        :mod:`conveyor_broker.postgres.upkeep`); one cheap read of them otherwise."""
        now = self._now()
        if now < self._upkeep_resume_at:
            return StorageUpkeep()
        stats = await self._table_stats(self._pool)
        self._dead_floor = min(self._dead_floor, stats.dead_rows)
        seen = StorageUpkeep(
            live_rows=stats.live_rows, dead_rows=stats.dead_rows, changed_rows=stats.changed_rows
        )
        if not stats.maintainable:
            if not self._upkeep_refused:
                self._upkeep_refused = True
                logger.warning(
                    "broker.storage_upkeep_not_permitted table=%s: this role neither owns "
                    "the table or the database nor may maintain it; autovacuum alone "
                    "keeps it up",
                    upkeep.TABLE,
                )
            return seen
        statement = upkeep.upkeep_statement(stats, self._dead_floor)
        if statement is None:
            return seen
        try:
            after = await self._run_upkeep(statement)
        except (asyncpg.PostgresError, OSError) as exc:
            self._upkeep_failures += 1
            wait = upkeep.backoff(self._upkeep_failures)
            self._upkeep_resume_at = now + wait
            logger.warning(
                "broker.storage_upkeep_failed statement=%r failures=%d retry_in=%s error=%r",
                statement,
                self._upkeep_failures,
                wait,
                exc,
            )
            return seen
        if after is None:
            return seen  # a migration holds the lock: next check
        vacuumed = after.vacuums > stats.vacuums
        analyzed = after.analyzes > stats.analyzes
        if vacuumed:
            self._dead_floor = after.dead_rows
        if vacuumed or analyzed:
            self._upkeep_failures = 0
            self._upkeep_resume_at = now + upkeep.MIN_INTERVAL
        logger.debug(
            "broker.storage_upkeep statement=%r analyzed=%s vacuumed=%s",
            statement,
            analyzed,
            vacuumed,
        )
        return StorageUpkeep(
            analyzed=analyzed,
            vacuumed=vacuumed,
            live_rows=stats.live_rows,
            dead_rows=stats.dead_rows,
            changed_rows=stats.changed_rows,
        )

    async def _run_upkeep(self, statement: str) -> upkeep.TableStats | None:
        """Run ``statement`` holding the migration lock, without a statement timeout; the
        table's counters after it. None, running nothing, while a migration holds the lock."""
        async with self._pool.acquire() as conn:
            if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", MIGRATION_LOCK_KEY):
                return None
            try:
                await conn.execute("SET statement_timeout = 0")
                try:
                    await conn.execute(statement)
                finally:
                    await conn.execute("RESET statement_timeout")
                return await self._table_stats(conn)
            finally:
                try:
                    await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)
                except Exception:
                    # Ending the session is what releases the lock then.
                    conn.terminate()
                    raise

    async def _table_stats(
        self, on: Pool | PoolConnectionProxy[asyncpg.Record]
    ) -> upkeep.TableStats:
        row = await on.fetchrow(upkeep.STATS)
        assert row is not None  # the regclass cast raises for a missing table
        return upkeep.TableStats(
            planned_rows=row["planned_rows"],
            live_rows=row["live_rows"],
            dead_rows=row["dead_rows"],
            changed_rows=row["changed_rows"],
            maintainable=row["maintainable"],
            vacuums=row["vacuums"],
            analyzes=row["analyzes"],
        )

    # ------------------------------------------------------ webhook registrations

    async def upsert_webhook_worker(self, spec: WebhookWorkerSpec) -> WebhookWorker:
        """Create or replace the registration ``spec.name`` in one statement (see
        :meth:`Broker.upsert_webhook_worker`)."""
        now = self._now()
        check_webhook_worker(spec)
        row = await self._pool.fetchrow(
            UPSERT_WEBHOOK_WORKER,
            spec.name,
            spec.url,
            webhook_queues_to_json(spec.queues),
            int(spec.concurrency),
            spec.timeout,
            bool(spec.paused),
            list(spec.secrets),
            now,
        )
        assert row is not None  # an upsert always returns its row
        return webhook_worker_from_row(row)

    async def get_webhook_worker(self, name: str) -> WebhookWorker:
        """The registration ``name``. Raises WebhookWorkerNotFound."""
        self._now()
        check_webhook_name(name)
        row = await self._pool.fetchrow(GET_WEBHOOK_WORKER, name)
        if row is None:
            raise WebhookWorkerNotFound(name)
        return webhook_worker_from_row(row)

    async def list_webhook_workers(self) -> list[WebhookWorker]:
        """Every registration, by name (byte order)."""
        self._now()
        rows = await self._pool.fetch(LIST_WEBHOOK_WORKERS)
        return [webhook_worker_from_row(row) for row in rows]

    async def set_webhook_worker_paused(self, name: str, paused: bool) -> WebhookWorker:
        """Pause or resume a registration. Raises WebhookWorkerNotFound."""
        now = self._now()
        check_webhook_name(name)
        row = await self._pool.fetchrow(SET_WEBHOOK_WORKER_PAUSED, name, bool(paused), now)
        if row is None:
            raise WebhookWorkerNotFound(name)
        return webhook_worker_from_row(row)

    async def delete_webhook_worker(self, name: str) -> None:
        """Delete a registration. Raises WebhookWorkerNotFound."""
        self._now()
        check_webhook_name(name)
        if await self._pool.fetchval(DELETE_WEBHOOK_WORKER, name) is None:
            raise WebhookWorkerNotFound(name)

    # ----------------------------------------------------------------- lifecycle

    def set_event_sink(self, sink: EventSink | None) -> None:
        """Report every committed state change to ``sink`` (None stops reporting)."""
        self._sink = sink

    async def close(self) -> None:
        """Release resources (the pool, when this broker opened it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_pool:
            await self._pool.close()


async def _keep_session(conn: asyncpg.Connection[asyncpg.Record]) -> None:
    """The pool's connection reset: nothing to do.

    By default asyncpg sends ``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *;
    RESET ALL`` every time a connection goes back to the pool: a second round trip for
    every broker call. This broker's connections never take advisory locks, open cursors,
    LISTEN or change settings, so there is nothing to undo; an open transaction is still
    rolled back by the pool itself before this runs.
    """


def _package_version() -> str:
    try:
        return metadata.version("conveyor-broker")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0"


def _check_ttl(ttl: timedelta) -> None:
    if ttl <= timedelta(0):
        raise InvalidTask(f"lease ttl must be > 0, got {ttl}")


def _check_not_negative(name: str, value: timedelta) -> None:
    if value < timedelta(0):
        raise InvalidTask(f"{name} must be >= 0, got {value}")


def _check_batch_size(items: Sequence[object]) -> None:
    if len(items) > MAX_BATCH:
        raise InvalidTask(f"a batch holds at most {MAX_BATCH} items, got {len(items)}")
