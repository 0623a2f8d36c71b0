"""PostgresBroker: the durable Broker on PostgreSQL, through an asyncpg pool.

Every method is one statement (so one round trip, committed on its own) where it can be:
batches are ``unnest``-ed arrays, and read-modify-write steps are CTEs that lock what they
change. "Now" is always taken from the injected clock and passed as a parameter. The
statements live in :mod:`conveyor_broker.postgres.queries`; asyncpg prepares and caches
them per connection. Arguments arrive checked (see
:class:`~conveyor_broker.interface.Broker`).

Events go to the sink after the statement that made the change has committed, in the
order the rows were changed within one call. Calls running concurrently on different
connections report in the order they return, which can differ from their commit order
by the width of the race.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from ssl import SSLContext
from typing import TYPE_CHECKING, Any, Literal

import asyncpg

from conveyor_broker import cron, groups, rates
from conveyor_broker.clock import Clock
from conveyor_broker.errors import (
    BreakerConfigNotFound,
    ConcurrencyLimitNotFound,
    CronEntryNotFound,
    DatabaseUnavailable,
    DuplicateTask,
    GroupConfigNotFound,
    InvalidState,
    InvalidTask,
    LeaseLost,
    RateLimitNotFound,
    TaskNotFound,
    WebhookWorkerNotFound,
)
from conveyor_broker.ids import new_id, new_ids
from conveyor_broker.interface import DEFAULT_MAX_RETRY, MAX_BATCH, Broker, package_version
from conveyor_broker.postgres import enqueue, keyed, upkeep
from conveyor_broker.postgres.migrations import schema_version
from conveyor_broker.postgres.queries.admin import (
    ARCHIVE_TASK,
    CANCEL_TASK,
    DELETE_TASK,
    GET_TASK,
    LIST_QUEUES,
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
from conveyor_broker.postgres.queries.breakers import (
    DELETE_BREAKER_CONFIG,
    DROP_BREAKER,
    LIST_BREAKER_CONFIGS,
    LIST_BREAKERS,
    PUT_BREAKER,
    SET_BREAKER_CONFIG,
    TAKE_PROBE,
)
from conveyor_broker.postgres.queries.concurrency import LIMITED_QUEUES, LIST_CONCURRENCY_LIMITS
from conveyor_broker.postgres.queries.cron import (
    ADVANCE_CRON_ENTRY,
    DELETE_CRON_ENTRY,
    GET_CRON_ENTRY,
    LIST_CRON_ENTRIES,
    LIST_DUE_CRON_ENTRIES,
    LOCK_CRON_ENTRY,
    SET_CRON_PAUSED,
    UPSERT_CRON_ENTRY,
)
from conveyor_broker.postgres.queries.dependencies import (
    LIST_DEPENDENCIES,
    LIST_DEPENDENTS,
    LOCK_FOR_DELETE,
    READY_TO_RESOLVE,
    RESOLVE_DELETED,
    RESOLVE_DEPENDENTS,
    TASK_EXISTS,
)
from conveyor_broker.postgres.queries.enqueue import (
    FREE_LAPSED_CLAIMS,
    TASKS_BY_IDS,
    UNIQUE_HOLDER,
)
from conveyor_broker.postgres.queries.groups import (
    DELETE_GROUP_CONFIG,
    DUE_GROUPS,
    GROUP_STATS,
    LEASE_GROUP,
    LIST_GROUP_CONFIGS,
    SET_GROUP_CONFIG,
)
from conveyor_broker.postgres.queries.lease import (
    EXTEND_LEASE,
    EXTEND_LEASES,
    LEASE,
    LEASE_FILTERED,
    LEASE_MANY,
    SET_PROGRESS,
)
from conveyor_broker.postgres.queries.outcomes import ACK, ACK_BATCH, ARCHIVE, FAIL, RELEASE
from conveyor_broker.postgres.queries.rates import (
    DELETE_RATE_LIMIT,
    GET_RATE_LIMIT,
    LIST_RATE_LIMITS,
    LOCK_RATE_LIMIT,
    STORE_RATE_BUCKET,
)
from conveyor_broker.postgres.queries.sweeps import (
    ARCHIVE_EXPIRED,
    BEAT_HOLDER,
    DEAD_HOLDERS,
    DUE_AMONG,
    DUE_COUNT_CAPPED,
    DUE_QUEUES,
    FREE_ALL_LAPSED_CLAIMS,
    OLDEST_DUE,
    PENDING_COUNT,
    PENDING_COUNT_QUEUE,
    PROMOTE_SCHEDULED,
    PURGE_TERMINAL,
    REAP_EXPIRED_LEASES,
    RELEASE_DEAD_HOLDERS,
)
from conveyor_broker.postgres.queries.webhooks import (
    DELETE_WEBHOOK_WORKER,
    GET_WEBHOOK_WORKER,
    LIST_WEBHOOK_WORKERS,
    REPLACE_WEBHOOK_SECRETS,
    SET_WEBHOOK_WORKER_PAUSED,
    UPSERT_WEBHOOK_WORKER,
)
from conveyor_broker.postgres.rows import (
    cron_entry_from_row,
    cron_upsert_params,
    task_from_row,
    webhook_queues_to_json,
    webhook_worker_from_row,
)
from conveyor_broker.types import (
    DEFAULT_GROUP_CONFIG,
    EXPIRED_ERROR,
    LEASE_EXPIRED_ERROR,
    TERMINAL_STATES,
    AckItem,
    Breaker,
    BreakerConfig,
    BreakerScope,
    BreakerStatus,
    BrokerInfo,
    ConcurrencyLimit,
    CronEntry,
    CronEntrySpec,
    CronFired,
    DependencyLink,
    DependencyListParams,
    DependencyOutcome,
    DependencyPage,
    DueGroup,
    EnqueueResult,
    GroupConfig,
    GroupStats,
    HolderReleaseParams,
    LeaseReapParams,
    LeaseRef,
    NewTask,
    QueuePage,
    QueueStats,
    RateGrant,
    RateLimit,
    ReapedTask,
    ReleasedTask,
    Resolution,
    StorageUpkeep,
    Task,
    TaskEvent,
    TaskListParams,
    TaskPage,
    TaskState,
    TerminalPurgeParams,
    WebhookWorker,
    WebhookWorkerSpec,
)
from conveyor_broker.validation import MAX_PAYLOAD

if TYPE_CHECKING:
    Pool = asyncpg.Pool[asyncpg.Record]

logger = logging.getLogger(__name__)

DRIVER = "postgres"
#: Tries of a statement that a deadlock aborted (a resolution against a concurrent delete).
_DEADLOCK_TRIES = 3
#: The byte budget of a ListTasks page that has none (a bigint bound).
_NO_BUDGET = 2**62
_UNIQUE_INDEX = "conveyor_tasks_unique_idx"
#: What a breaker config's window and cool-down are stored in.
_MILLISECOND = timedelta(milliseconds=1)


class PostgresBroker(Broker):
    """The Broker on PostgreSQL. Build it with :meth:`connect` (owns its pool) or around a
    pool you manage (``PostgresBroker(pool, clock=...)``; closing the broker leaves that
    pool open). The schema must be migrated first (:func:`~.migrations.migrate`). The
    other arguments are :class:`~conveyor_broker.interface.Broker`'s."""

    #: Every task a call returns is built from its row by that call.
    returns_fresh_tasks = True

    def __init__(
        self,
        pool: Pool,
        clock: Clock | None = None,
        *,
        max_payload: int = MAX_PAYLOAD,
        default_max_retry: int = DEFAULT_MAX_RETRY,
        acquire_timeout: float | None = None,
    ) -> None:
        super().__init__(clock, max_payload=max_payload, default_max_retry=default_max_retry)
        self._pool = pool
        self._acquire_timeout = acquire_timeout
        self._owns_pool = False
        self._upkeep = upkeep.TableUpkeep()

    def pool_stats(self) -> tuple[int, int]:
        """The connection pool's (size, idle connections), from asyncpg's bookkeeping."""
        return self._pool.get_size(), self._pool.get_idle_size()

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
        ssl: SSLContext
        | Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"]
        | None = None,
        statement_timeout: float | None = None,
        command_timeout: float | None = None,
        acquire_timeout: float | None = None,
        connect_timeout: float = 60.0,
    ) -> PostgresBroker:
        """Open a pool on ``dsn`` and return a broker that closes it on :meth:`close`.

        ``ssl`` is asyncpg's: an ``ssl.SSLContext`` (TLS is then mandatory and the context
        verifies the server) or an sslmode name; None follows the DSN's ``sslmode``.

        Timeouts, in seconds (None or 0: none). ``statement_timeout`` is the server's: it
        becomes every pool connection's session default, and a statement that runs longer
        is canceled by Postgres. ``command_timeout`` is the client's, for a connection
        that does not answer at all (a half-open TCP link, a frozen server): the call
        fails with :class:`DatabaseUnavailable` and asyncpg cancels the statement, ending
        the connection when even the cancel gets no answer, so the pool opens a fresh one.
        Keep it above ``statement_timeout`` so that a slow statement is the server's to
        cancel. ``acquire_timeout`` bounds the wait for a free pool connection.
        """
        server_settings: dict[str, str] = {}
        if statement_timeout:
            server_settings["statement_timeout"] = str(max(1, round(statement_timeout * 1000)))
        pool = await asyncpg.create_pool(
            dsn,
            min_size=min_size,
            max_size=max_size,
            reset=_keep_session,
            ssl=ssl,
            server_settings=server_settings,
            command_timeout=command_timeout or None,
            timeout=connect_timeout,
        )
        broker = cls(
            pool,
            clock,
            max_payload=max_payload,
            default_max_retry=default_max_retry,
            acquire_timeout=acquire_timeout or None,
        )
        broker._owns_pool = True
        return broker

    # ------------------------------------------------------------------ plumbing

    @asynccontextmanager
    async def _conn(self) -> AsyncIterator[asyncpg.pool.PoolConnectionProxy[asyncpg.Record]]:
        """A pool connection, waited for at most the acquire timeout; a failure of the
        link (not of the statement) comes out as :class:`DatabaseUnavailable`."""
        try:
            async with self._pool.acquire(timeout=self._acquire_timeout) as conn:
                yield conn
        except _LINK_ERRORS as exc:
            if isinstance(exc, ValueError):
                raise  # a value asyncpg could not encode: the caller's, not the link's
            raise _unavailable(exc) from exc

    async def _fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        async with self._conn() as conn:
            return await conn.fetch(query, *args)

    async def _fetchrow(self, query: str, *args: Any) -> asyncpg.Record | None:
        async with self._conn() as conn:
            return await conn.fetchrow(query, *args)

    async def _fetchval(self, query: str, *args: Any) -> Any:
        async with self._conn() as conn:
            return await conn.fetchval(query, *args)

    async def _execute(self, query: str, *args: Any) -> str:
        async with self._conn() as conn:
            return await conn.execute(query, *args)

    def _event(self, task: Task, previous: TaskState | None, at: datetime) -> TaskEvent:
        error = task.last_error if task.state in (TaskState.RETRY, TaskState.ARCHIVED) else None
        return TaskEvent(task.id, task.queue, task.type, task.state, previous, at, error)

    # ------------------------------------------------------------------- enqueue

    async def _enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        now = self._clock.now()
        plan = enqueue.plan_ids(tasks, now)
        try:
            async with self._conn() as conn:
                if enqueue.needs_transaction(tasks):
                    results = await enqueue.enqueue_checked(
                        conn, tasks, plan, now, self._default_max_retry
                    )
                else:
                    results = await enqueue.enqueue_plain(
                        conn, tasks, plan, now, self._default_max_retry
                    )
        except (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError) as exc:
            # The database refused a value of the batch (data exception, class 22, or a
            # constraint, class 23) that validation let through: it is an item's fault,
            # so it is InvalidTask, and nothing was stored. A group commit splits the
            # batch on it to find the item (conveyor_gateway.group_commit).
            raise InvalidTask(f"the database refused a value: {exc}") from exc
        self._emit(
            self._event(r.task, None, now)
            for i, r in enumerate(results)
            if r.created and plan.first[i] == i
        )
        return results

    # --------------------------------------------------------------------- lease

    async def _lease(
        self,
        queue: str,
        limit: int,
        ttl: timedelta,
        holders: tuple[str, ...],
        exclude_types: tuple[str, ...] = (),
        only_types: tuple[str, ...] | None = None,
    ) -> list[Task]:
        now = self._clock.now()
        lease_ids = new_ids(now, limit)
        if not exclude_types and only_types is None:
            rows = await self._fetch(LEASE, queue, now, limit, lease_ids, now + ttl, holders)
        else:
            # Its own statement: the unfiltered one above keeps its text and its plan.
            rows = await self._fetch(
                LEASE_FILTERED,
                queue,
                now,
                limit,
                lease_ids,
                now + ttl,
                holders,
                list(exclude_types),
                None if only_types is None else list(only_types),
            )
        if rows:
            return self._leased(rows, now)
        # Nothing due, or the queue has concurrency limits (the statement skips it).
        return (
            await self._lease_limited([(queue, limit, holders)], ttl, exclude_types, only_types)
        ).get(queue, [])

    async def _lease_limited(
        self,
        wants: Sequence[tuple[str, int, Sequence[str]]],
        ttl: timedelta,
        exclude_types: Sequence[str] = (),
        only_types: Sequence[str] | None = None,
    ) -> dict[str, list[Task]]:
        """The keyed leases (:mod:`.keyed`) of those of ``wants`` (queue, limit, holders)
        that have concurrency limits, which the plain lease statements skip: one query
        finds them (a queue without limits costs only that), then each is leased (with
        the type filters given, if any)."""
        queues = [queue for queue, _, _ in wants]
        limited = {row["queue"] for row in await self._fetch(LIMITED_QUEUES, queues)}
        out: dict[str, list[Task]] = {}
        for queue, limit, holders in wants:
            if queue not in limited:
                continue
            now = self._clock.now()
            async with self._conn() as conn:
                done = await keyed.lease(
                    conn, queue, limit, ttl, holders, now, exclude_types, only_types
                )
            if done is not None:
                self._emit(self._event(task, previous, now) for task, previous in done.changes)
                out[queue] = done.leased
        return out

    def _leased(self, rows: Iterable[asyncpg.Record], now: datetime) -> list[Task]:
        """The tasks a lease statement returned, in lease order; their events emitted."""
        leased = sorted(
            ((task_from_row(row), TaskState(row["previous_state"])) for row in rows),
            key=lambda pair: (pair[0].available_at, pair[0].id),
        )
        self._emit(self._event(task, previous, now) for task, previous in leased)
        return [task for task, _ in leased]

    async def _lease_many(
        self,
        wants: Sequence[tuple[str, int]],
        ttl: timedelta,
        holders: Sequence[tuple[str, ...]],
    ) -> list[list[Task]]:
        # One statement for every queue.
        now = self._clock.now()
        lease_ids = new_ids(now, sum(limit for _, limit in wants))
        # Each queue's holders padded to its limit, one after another ([] when none).
        offsets: list[int] = []
        flat: list[str] = []
        named = any(holders)
        for (_, limit), queue_holders in zip(wants, holders, strict=True):
            offsets.append(len(flat))
            if named:
                flat += queue_holders
                flat += [""] * (limit - len(queue_holders))
        rows = await self._fetch(
            LEASE_MANY,
            [queue for queue, _ in wants],
            [limit for _, limit in wants],
            now,
            lease_ids,
            now + ttl,
            offsets,
            flat,
        )
        by_queue: dict[str, list[Task]] = {queue: [] for queue, _ in wants}
        for task in self._leased(rows, now):
            by_queue[task.queue].append(task)
        empty = [
            (queue, limit, queue_holders)
            for (queue, limit), queue_holders in zip(wants, holders, strict=True)
            if not by_queue[queue]
        ]
        if empty:
            by_queue.update(await self._lease_limited(empty, ttl))
        return [by_queue[queue] for queue, _ in wants]

    async def _extend_lease(self, task_id: str, lease_id: str, ttl: timedelta) -> datetime:
        now = self._clock.now()
        expires: datetime | None = await self._fetchval(
            EXTEND_LEASE, task_id, lease_id, now + ttl, now
        )
        if expires is None:
            raise LeaseLost(task_id, lease_id)
        return expires

    async def _extend_leases(self, leases: Sequence[LeaseRef], ttl: timedelta) -> list[LeaseRef]:
        now = self._clock.now()
        ordered = sorted(leases, key=lambda ref: ref.task_id)  # lock order: see ack_batch
        rows = await self._fetch(
            EXTEND_LEASES,
            [ref.task_id for ref in ordered],
            [ref.lease_id for ref in ordered],
            now + ttl,
            now,
        )
        held = {(row["id"], row["lease_id"]) for row in rows}
        return [ref for ref in leases if (ref.task_id, ref.lease_id) not in held]

    async def _set_progress(self, task_id: str, lease_id: str, progress: bytes) -> None:
        now = self._clock.now()
        if await self._fetchval(SET_PROGRESS, task_id, lease_id, progress, now) is None:
            raise LeaseLost(task_id, lease_id)

    # ------------------------------------------------------------------ outcomes

    async def _lease_scoped(
        self, query: str, task_id: str, lease_id: str, now: datetime, *args: Any
    ) -> Task:
        row = await self._fetchrow(query, task_id, lease_id, *args)
        if row is None:
            raise LeaseLost(task_id, lease_id)
        task = task_from_row(row)
        self._emit([self._event(task, TaskState.ACTIVE, now)])
        if task.state in TERMINAL_STATES and row["dependents_pending"]:
            self._report(Resolution(pending=(task.id,)))
        return task

    async def _ack(self, task_id: str, lease_id: str, result: bytes | None) -> Task:
        now = self._clock.now()
        return await self._lease_scoped(ACK, task_id, lease_id, now, result, now)

    async def _ack_batch(self, items: Sequence[AckItem]) -> list[bool]:
        now = self._clock.now()
        # Send each task once: the first item for an id decides, repeats report False.
        unique: dict[str, AckItem] = {}
        for item in items:
            unique.setdefault(item.task_id, item)
        # In id order, like every multi-row update, so concurrent batches lock rows in
        # the same order and cannot deadlock.
        sent = sorted(unique.values(), key=lambda item: item.task_id)
        rows = await self._fetch(
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
        self._report_ended(row["id"] for row in rows if row["dependents_pending"])
        return [item.task_id in done and unique[item.task_id] is item for item in items]

    async def _fail(
        self, task_id: str, lease_id: str, error: str, retry_delay: timedelta, skip_retry: bool
    ) -> Task:
        now = self._clock.now()
        return await self._lease_scoped(
            FAIL, task_id, lease_id, now, error, now, skip_retry, now + retry_delay
        )

    async def _release(self, task_id: str, lease_id: str) -> Task:
        now = self._clock.now()
        return await self._lease_scoped(RELEASE, task_id, lease_id, now, now)

    async def _archive(self, task_id: str, lease_id: str, error: str) -> Task:
        now = self._clock.now()
        return await self._lease_scoped(ARCHIVE, task_id, lease_id, now, error, now)

    # ------------------------------------------------------- maintenance sweeps

    async def _reap_expired_leases(self, params: LeaseReapParams) -> list[ReapedTask]:
        now = self._clock.now()
        rows = await self._fetch(REAP_EXPIRED_LEASES, now, params.limit, now + params.retry_delay)
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
        self._report_ended(
            row["id"]
            for row in rows
            if row["dependents_pending"] and row["state"] == TaskState.ARCHIVED
        )
        if reaped:
            logger.info("broker.leases.reaped count=%d", len(reaped), extra={"count": len(reaped)})
        return reaped

    async def _beat_holder(self, holder: str) -> None:
        await self._execute(BEAT_HOLDER, holder, self._clock.now())

    async def _release_dead_holders(self, params: HolderReleaseParams) -> list[ReleasedTask]:
        now = self._clock.now()
        cutoff = now - params.silence
        # The common case (nobody dead) costs one look at a table of a few rows.
        dead = [row["holder"] for row in await self._fetch(DEAD_HOLDERS, cutoff, params.alive)]
        if not dead:
            return []
        rows = await self._fetch(RELEASE_DEAD_HOLDERS, now, cutoff, dead, params.limit)
        rows = sorted(rows, key=lambda row: (row["lease_expires_at"], row["id"]))
        self._emit(
            TaskEvent(
                row["id"], row["queue"], row["type"], TaskState.PENDING, TaskState.ACTIVE, now
            )
            for row in rows
        )
        released = [ReleasedTask(row["id"], row["queue"], row["holder"]) for row in rows]
        if released:
            logger.info("broker.holders.released count=%d", len(released))
        return released

    async def _promote_scheduled(self, limit: int) -> dict[str, int]:
        now = self._clock.now()
        rows = await self._fetch(PROMOTE_SCHEDULED, now, limit)
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

    async def _purge_terminal(self, params: TerminalPurgeParams) -> int:
        # Lapsed unique claims are freed on the way (housekeeping).
        now = self._clock.now()
        async with self._conn() as conn:
            purged = await conn.fetchval(
                PURGE_TERMINAL,
                now,
                params.default_retention,
                params.archive_retention,
                params.limit,
            )
            await conn.execute(FREE_ALL_LAPSED_CLAIMS, now, params.limit)
        return int(purged)

    async def _archive_expired(self, limit: int) -> list[Task]:
        now = self._clock.now()
        rows = await self._fetch(ARCHIVE_EXPIRED, now, limit, EXPIRED_ERROR)
        pairs = sorted(
            ((task_from_row(row), TaskState(row["previous_state"])) for row in rows),
            key=lambda pair: (pair[0].expires_at or now, pair[0].id),
        )
        self._emit(self._event(task, previous, now) for task, previous in pairs)
        self._report_ended(row["id"] for row in rows if row["dependents_pending"])
        return [task for task, _ in pairs]

    # ------------------------------------------------------------- dependencies

    async def _resolve_dependents(self, task_ids: Sequence[str], limit: int) -> Resolution:
        for attempt in range(_DEADLOCK_TRIES):
            now = self._clock.now()
            try:
                rows = await self._fetch(RESOLVE_DEPENDENTS, list(task_ids), now, limit)
            except asyncpg.DeadlockDetectedError:
                # A concurrent delete of a waiting task won: the statement changed nothing.
                if attempt + 1 == _DEADLOCK_TRIES:
                    raise
                continue
            events: list[TaskEvent] = []
            left = _Left()
            left.add(rows, now, events)
            self._emit(events)
            return left.resolution()
        raise AssertionError("unreachable")

    async def _promote_ready_dependents(self, limit: int, min_age: timedelta) -> Resolution:
        now = self._clock.now()
        rows = await self._fetch(READY_TO_RESOLVE, now - min_age, limit)
        if not rows:
            return Resolution()
        return await self._resolve_dependents(sorted(row["id"] for row in rows), limit)

    async def _list_dependencies(self, params: DependencyListParams) -> DependencyPage:
        query = LIST_DEPENDENTS if params.dependents else LIST_DEPENDENCIES
        async with self._conn() as conn:
            rows = await conn.fetch(query, params.task_id, params.cursor or "", params.limit + 1)
            if not rows and not await conn.fetchval(TASK_EXISTS, params.task_id):
                raise TaskNotFound(params.task_id)
        links = [
            DependencyLink(
                task_id=row["other"],
                outcome=DependencyOutcome(row["outcome"] or DependencyOutcome.OPEN),
                queue=row["queue"],
                type=row["type"],
                state=None if row["state"] is None else TaskState(row["state"]),
            )
            for row in rows[: params.limit]
        ]
        more = len(rows) > params.limit
        return DependencyPage(links, links[-1].task_id if more else None)

    def _report_ended(self, task_ids: Iterable[str]) -> None:
        """Report ended tasks whose dependents are not resolved yet to the dependency
        sink."""
        pending = tuple(sorted(task_ids))
        if pending:
            self._report(Resolution(pending=pending))

    # ------------------------------------------------------- inspection / admin

    async def _pending_count(self, queue: str | None) -> dict[str, int]:
        now = self._clock.now()
        if queue is None:
            rows = await self._fetch(PENDING_COUNT, now)
            return {row["queue"]: row["n"] for row in rows}
        count: int = await self._fetchval(PENDING_COUNT_QUEUE, now, queue)
        return {queue: count} if count else {}

    async def _due_count(self, queue: str, cap: int) -> int:
        # At most ``cap`` entries of the due index read, however long the backlog.
        count: int = await self._fetchval(DUE_COUNT_CAPPED, self._clock.now(), queue, cap)
        return count

    async def _due_queues(self, after: str | None, limit: int) -> list[str]:
        # One index probe or two per queue that has PENDING or RETRY rows.
        rows = await self._fetch(DUE_QUEUES, self._clock.now(), after or "", limit)
        return [row["queue"] for row in rows]

    async def _due_among(self, queues: list[str]) -> list[str]:
        # One index probe per name asked about.
        rows = await self._fetch(DUE_AMONG, self._clock.now(), queues)
        return [row["queue"] for row in rows]

    async def _oldest_due(self, queues: list[str]) -> dict[str, datetime]:
        # The same probe of the due index per name, keeping the row's due time.
        rows = await self._fetch(OLDEST_DUE, self._clock.now(), queues)
        return {row["queue"]: row["available_at"] for row in sorted(rows, key=lambda r: r["queue"])}

    async def _queue_stats(self, queue: str | None) -> list[QueueStats]:
        if queue is None:
            rows = await self._fetch(QUEUE_STATS)
        else:
            rows = await self._fetch(QUEUE_STATS_QUEUE, queue)
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

    async def _get_task(self, task_id: str) -> Task:
        row = await self._fetchrow(GET_TASK, task_id)
        if row is None:
            raise TaskNotFound(task_id)
        return task_from_row(row)

    async def _get_tasks(self, task_ids: Sequence[str]) -> list[Task]:
        rows = await self._fetch(TASKS_BY_IDS, list(task_ids))
        found = {task.id: task for task in map(task_from_row, rows)}
        return [found[task_id] for task_id in task_ids if task_id in found]

    async def _list_tasks(self, params: TaskListParams) -> TaskPage:
        queue, state, limit = params.queue, params.state, params.limit
        budget = params.max_bytes if params.max_bytes is not None else _NO_BUDGET
        page = (params.cursor or "", limit + 1, budget, params.omit_payloads)
        if queue is None and state is None:
            rows = await self._fetch(LIST_TASKS, *page)
        elif state is None:
            rows = await self._fetch(LIST_TASKS_BY_QUEUE, *page, queue)
        elif queue is None:
            rows = await self._fetch(LIST_TASKS_BY_STATE, *page, TaskState(state).value)
        else:
            rows = await self._fetch(
                LIST_TASKS_BY_QUEUE_AND_STATE, *page, queue, TaskState(state).value
            )
        tasks = [task_from_row(row) for row in rows[:limit]]
        fetched = rows[0]["fetched"] if rows else 0
        next_cursor = tasks[-1].id if fetched > len(tasks) else None
        return TaskPage(tasks, next_cursor)

    async def _list_queues(self, after: str | None, limit: int) -> QueuePage:
        rows = await self._fetch(LIST_QUEUES, after or "", limit + 1)
        counts: dict[str, dict[TaskState, int]] = {}
        paused: dict[str, bool] = {}
        for row in rows:
            name = row["queue"]
            counts.setdefault(name, dict.fromkeys(TaskState, 0))
            paused[name] = bool(row["paused"])
            if row["state"] is not None:
                counts[name][TaskState(row["state"])] = row["n"]
        names = sorted(counts)
        stats = [QueueStats(name, paused[name], counts[name]) for name in names[:limit]]
        return QueuePage(stats, stats[-1].queue if len(names) > limit else None)

    async def _admin(self, query: str, task_id: str, operation: str, *args: Any) -> Task:
        now = self._clock.now()
        row = await self._fetchrow(query, task_id, now, *args)
        if row is None:
            raise TaskNotFound(task_id)
        previous = TaskState(row["previous_state"])
        if row["id"] is None:
            raise InvalidState(task_id, previous.value, operation)
        task = task_from_row(row)
        if task.state != previous:
            self._emit([self._event(task, previous, now)])
            if task.state in TERMINAL_STATES and row.get("dependents_pending"):
                self._report(Resolution(pending=(task.id,)))
        return task

    async def _cancel_task(self, task_id: str) -> Task:
        return await self._admin(CANCEL_TASK, task_id, "cancel")

    async def _delete_task(self, task_id: str) -> None:
        # Tasks that wait for it are resolved first, in the same transaction: as if it had
        # failed (or completed, when it had), since it never will now.
        for attempt in range(_DEADLOCK_TRIES):
            now = self._clock.now()
            events: list[TaskEvent] = []
            left = _Left()
            try:
                async with self._conn() as conn, conn.transaction():
                    locked = await conn.fetchrow(LOCK_FOR_DELETE, task_id)
                    if locked is None:
                        raise TaskNotFound(task_id)
                    state = TaskState(locked["state"])
                    if locked["dependents_pending"] and state != TaskState.ACTIVE:
                        ended_as = "completed" if state == TaskState.COMPLETED else "canceled"
                        more = True
                        while more:
                            rows = await conn.fetch(
                                RESOLVE_DELETED, [task_id], now, MAX_BATCH, ended_as
                            )
                            more = left.add(rows, now, events)
                    row = await conn.fetchrow(DELETE_TASK, task_id)
            except asyncpg.DeadlockDetectedError:
                if attempt + 1 == _DEADLOCK_TRIES:
                    raise
                continue
            break
        assert row is not None  # locked above
        if not row["deleted"]:
            raise InvalidState(task_id, row["state"], "delete")
        events.append(
            TaskEvent(task_id, row["queue"], row["type"], None, TaskState(row["state"]), now)
        )
        self._emit(events)
        left.pending.discard(task_id)  # gone
        self._report(left.resolution(pending_only=True))

    async def _run_task_now(self, task_id: str) -> Task:
        return await self._admin(RUN_TASK_NOW, task_id, "run now")

    async def _reschedule_task(self, task_id: str, process_at: datetime) -> Task:
        return await self._admin(RESCHEDULE_TASK, task_id, "reschedule", process_at)

    async def _archive_task(self, task_id: str) -> Task:
        return await self._admin(ARCHIVE_TASK, task_id, "archive")

    async def _revive_task(self, task_id: str) -> Task:
        for attempt in range(2):
            try:
                return await self._admin(REVIVE_TASK, task_id, "revive")
            except asyncpg.UniqueViolationError as exc:
                if exc.constraint_name != _UNIQUE_INDEX:
                    raise
                task = await self._get_task(task_id)
                assert task.unique_key is not None
                if attempt == 0:
                    # The index may still hold a claim that has lapsed: free it and retry.
                    await self._execute(
                        FREE_LAPSED_CLAIMS, [task.queue], [task.unique_key], self._clock.now()
                    )
                    continue
                holder = await self._fetchval(
                    UNIQUE_HOLDER, task.queue, task.unique_key, self._clock.now()
                )
                raise DuplicateTask(task.queue, task.unique_key, holder or "") from None
        raise AssertionError("unreachable")

    async def _set_queue_paused(self, queue: str, paused: bool) -> None:
        await self._execute(SET_QUEUE_PAUSED, queue, paused, self._clock.now())

    async def _queue_paused(self, queue: str) -> bool:
        return bool(await self._fetchval(QUEUE_PAUSED, queue))

    async def _info(self) -> BrokerInfo:
        # The driver name, this package's version and the applied schema version.
        async with self._conn() as conn:
            version = await schema_version(conn)
        return BrokerInfo(DRIVER, package_version(), version)

    async def _upkeep_storage(self) -> StorageUpkeep:
        return await self._upkeep.check(self._pool, self._clock.now())

    # ------------------------------------------------------ webhook registrations

    async def _upsert_webhook_worker(self, spec: WebhookWorkerSpec) -> WebhookWorker:
        now = self._clock.now()
        row = await self._fetchrow(
            UPSERT_WEBHOOK_WORKER,
            spec.name,
            spec.url,
            webhook_queues_to_json(spec.queues),
            int(spec.concurrency),
            spec.timeout,
            bool(spec.paused),
            list(spec.secrets),
            now,
            list(spec.batch_types),
        )
        assert row is not None  # an upsert always returns its row
        return webhook_worker_from_row(row)

    async def _get_webhook_worker(self, name: str) -> WebhookWorker:
        row = await self._fetchrow(GET_WEBHOOK_WORKER, name)
        if row is None:
            raise WebhookWorkerNotFound(name)
        return webhook_worker_from_row(row)

    async def _list_webhook_workers(self) -> list[WebhookWorker]:
        # By name in byte order.
        rows = await self._fetch(LIST_WEBHOOK_WORKERS)
        return [webhook_worker_from_row(row) for row in rows]

    async def _set_webhook_worker_paused(self, name: str, paused: bool) -> WebhookWorker:
        row = await self._fetchrow(SET_WEBHOOK_WORKER_PAUSED, name, bool(paused), self._clock.now())
        if row is None:
            raise WebhookWorkerNotFound(name)
        return webhook_worker_from_row(row)

    async def _delete_webhook_worker(self, name: str) -> None:
        if await self._fetchval(DELETE_WEBHOOK_WORKER, name) is None:
            raise WebhookWorkerNotFound(name)

    async def _replace_webhook_secrets(
        self, name: str, expected: tuple[str, ...], secrets: tuple[str, ...]
    ) -> bool:
        done = await self._pool.fetchval(
            REPLACE_WEBHOOK_SECRETS, name, list(expected), list(secrets)
        )
        return done is not None

    # ------------------------------------------------------- aggregation groups

    async def _set_group_config(self, config: GroupConfig) -> GroupConfig:
        row = await self._fetchrow(
            SET_GROUP_CONFIG,
            config.queue,
            config.pattern,
            groups.pattern_like(config.pattern),
            int(config.max_size),
            config.max_delay,
            config.grace_period,
        )
        assert row is not None  # an upsert always returns its row
        return _group_config(row)

    async def _delete_group_config(self, queue: str, pattern: str) -> None:
        if await self._fetchval(DELETE_GROUP_CONFIG, queue, pattern) is None:
            raise GroupConfigNotFound(queue, pattern)

    async def _list_group_configs(self, queue: str | None) -> list[GroupConfig]:
        return [_group_config(row) for row in await self._fetch(LIST_GROUP_CONFIGS, queue)]

    async def _group_stats(self, queue: str | None, limit: int) -> list[GroupStats]:
        rows = await self._fetch(GROUP_STATS, queue, limit)
        return [
            GroupStats(
                row["queue"], row["group_key"], row["size"], row["oldest_at"], row["newest_at"]
            )
            for row in rows
        ]

    async def _due_groups(self, limit: int) -> list[DueGroup]:
        now = self._clock.now()
        default = DEFAULT_GROUP_CONFIG
        rows = await self._fetch(
            DUE_GROUPS, now, default.max_size, default.max_delay, default.grace_period, limit
        )
        due: list[DueGroup] = []
        for row in rows:
            stats = GroupStats(
                row["queue"], row["group_key"], row["size"], row["oldest_at"], row["newest_at"]
            )
            config = GroupConfig(
                row["queue"], "*", row["max_size"], row["max_delay"], row["grace_period"]
            )
            why = groups.trigger(stats, config, now)
            assert why is not None  # the statement's filter
            due.append(DueGroup(stats.queue, stats.group, stats.size, why, config.max_size))
        return due

    async def _lease_group(
        self, queue: str, group: str, limit: int, ttl: timedelta, holder: str
    ) -> list[Task]:
        now = self._clock.now()
        rows = await self._fetch(
            LEASE_GROUP, queue, group, limit, now, new_id(now), now + ttl, holder
        )
        leased = sorted((task_from_row(row) for row in rows), key=lambda t: (t.created_at, t.id))
        self._emit(self._event(task, TaskState.AGGREGATING, now) for task in leased)
        return leased

    # -------------------------------------------------------- concurrency limits

    async def _set_concurrency_limit(self, limit: ConcurrencyLimit) -> ConcurrencyLimit:
        now = self._clock.now()
        async with self._conn() as conn:
            changes = await keyed.set_limit(conn, limit, now)
        self._emit(self._event(task, previous, now) for task, previous in changes)
        return limit

    async def _list_concurrency_limits(self, queue: str | None) -> list[ConcurrencyLimit]:
        return [
            keyed.limit_from_row(row) for row in await self._fetch(LIST_CONCURRENCY_LIMITS, queue)
        ]

    async def _delete_concurrency_limit(self, queue: str, pattern: str) -> None:
        now = self._clock.now()
        async with self._conn() as conn:
            changes = await keyed.delete_limit(conn, queue, pattern, now)
        if changes is None:
            raise ConcurrencyLimitNotFound(queue, pattern)
        self._emit(self._event(task, previous, now) for task, previous in changes)

    # --------------------------------------------------------- circuit breakers

    async def _set_breaker_config(self, config: BreakerConfig) -> BreakerConfig:
        await self._execute(
            SET_BREAKER_CONFIG,
            config.queue,
            config.pattern,
            config.failures,
            config.window // _MILLISECOND,
            config.cooldown // _MILLISECOND,
            config.scope.value,
        )
        return config

    async def _list_breaker_configs(self, queue: str | None) -> list[BreakerConfig]:
        return [_breaker_config(row) for row in await self._fetch(LIST_BREAKER_CONFIGS, queue)]

    async def _delete_breaker_config(self, queue: str, pattern: str) -> None:
        if await self._fetchval(DELETE_BREAKER_CONFIG, queue, pattern) is None:
            raise BreakerConfigNotFound(queue, pattern)

    async def _put_breaker(self, breaker: Breaker) -> None:
        await self._execute(
            PUT_BREAKER,
            breaker.queue,
            breaker.type,
            breaker.gateway,
            breaker.status.value,
            breaker.opened_at,
            breaker.until,
            breaker.failures,
            breaker.worker_id,
            breaker.holder,
        )

    async def _drop_breaker(self, queue: str, task_type: str, gateway: str) -> bool:
        return await self._fetchval(DROP_BREAKER, queue, task_type, gateway) is not None

    async def _list_breakers(self, queue: str | None) -> list[Breaker]:
        return [_breaker(row) for row in await self._fetch(LIST_BREAKERS, queue)]

    async def _take_probe(self, queue: str, task_type: str, until: datetime) -> bool:
        now = self._clock.now()
        return await self._fetchval(TAKE_PROBE, queue, task_type, until, now) is not None

    # -------------------------------------------------------------- rate limits

    async def _bucket(
        self, conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record], queue: str, now: datetime
    ) -> tuple[RateLimit, float] | None:
        """Queue's limit and the tokens its bucket holds at ``now``, the row locked."""
        row = await conn.fetchrow(LOCK_RATE_LIMIT, queue)
        if row is None:
            return None
        limit = _rate_limit(row)
        return limit, rates.refilled(limit, row["tokens"], row["refilled_at"], now)

    @staticmethod
    async def _keep(
        conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record],
        limit: RateLimit,
        tokens: float,
        now: datetime,
    ) -> None:
        await conn.execute(
            STORE_RATE_BUCKET, limit.queue, limit.per_second, limit.burst, tokens, now
        )

    async def _set_rate_limit(self, limit: RateLimit) -> RateLimit:
        now = self._clock.now()
        async with self._conn() as conn, conn.transaction():
            bucket = await self._bucket(conn, limit.queue, now)
            tokens = float(limit.burst) if bucket is None else min(bucket[1], limit.burst)
            await self._keep(conn, limit, tokens, now)
        return limit

    async def _get_rate_limit(self, queue: str) -> RateLimit | None:
        row = await self._fetchrow(GET_RATE_LIMIT, queue)
        return None if row is None else _rate_limit(row)

    async def _list_rate_limits(self) -> list[RateLimit]:
        return [_rate_limit(row) for row in await self._fetch(LIST_RATE_LIMITS)]

    async def _delete_rate_limit(self, queue: str) -> None:
        if await self._fetchval(DELETE_RATE_LIMIT, queue) is None:
            raise RateLimitNotFound(queue)

    async def _take_rate_tokens(self, queue: str, want: int) -> RateGrant:
        now = self._clock.now()
        async with self._conn() as conn, conn.transaction():
            bucket = await self._bucket(conn, queue, now)
            if bucket is None:
                return RateGrant(want)
            limit, tokens = bucket
            grant, left = rates.take(limit, tokens, want)
            await self._keep(conn, limit, left, now)
            return grant

    async def _return_rate_tokens(self, queue: str, count: int) -> None:
        now = self._clock.now()
        async with self._conn() as conn, conn.transaction():
            bucket = await self._bucket(conn, queue, now)
            if bucket is not None:
                limit, tokens = bucket
                await self._keep(conn, limit, min(float(limit.burst), tokens + count), now)

    # ------------------------------------------------------------- cron entries

    async def _upsert_cron_entry(self, spec: CronEntrySpec) -> CronEntry:
        now = self._clock.now()
        async with self._conn() as conn, conn.transaction():
            locked = await conn.fetchrow(LOCK_CRON_ENTRY, spec.name)
            stored = None if locked is None else cron_entry_from_row(locked)
            next_run_at = self._cron_next_run(spec, stored, now)
            row = await conn.fetchrow(
                UPSERT_CRON_ENTRY, *cron_upsert_params(spec, next_run_at, now)
            )
        assert row is not None  # an upsert always returns its row
        return cron_entry_from_row(row)

    async def _get_cron_entry(self, name: str) -> CronEntry:
        row = await self._fetchrow(GET_CRON_ENTRY, name)
        if row is None:
            raise CronEntryNotFound(name)
        return cron_entry_from_row(row)

    async def _list_cron_entries(self) -> list[CronEntry]:
        return [cron_entry_from_row(row) for row in await self._fetch(LIST_CRON_ENTRIES)]

    async def _list_due_cron_entries(self, limit: int) -> list[CronEntry]:
        rows = await self._fetch(LIST_DUE_CRON_ENTRIES, self._clock.now(), limit)
        return [cron_entry_from_row(row) for row in rows]

    async def _set_cron_paused(self, name: str, paused: bool) -> CronEntry:
        now = self._clock.now()
        async with self._conn() as conn, conn.transaction():
            locked = await conn.fetchrow(LOCK_CRON_ENTRY, name)
            if locked is None:
                raise CronEntryNotFound(name)
            entry = cron_entry_from_row(locked)
            if entry.paused == paused:
                return entry
            next_run_at = None if paused else self._cron_resumed(entry, now)
            row = await conn.fetchrow(SET_CRON_PAUSED, name, paused, next_run_at, now)
        assert row is not None  # the row is locked
        return cron_entry_from_row(row)

    async def _delete_cron_entry(self, name: str) -> None:
        if await self._fetchval(DELETE_CRON_ENTRY, name) is None:
            raise CronEntryNotFound(name)

    async def _fire_cron_entry(
        self,
        name: str,
        expected: datetime,
        next_run_at: datetime | None,
        slot: datetime | None,
    ) -> CronFired:
        now = self._clock.now()
        result: EnqueueResult | None = None
        try:
            async with self._conn() as conn, conn.transaction():
                locked = await conn.fetchrow(LOCK_CRON_ENTRY, name)
                if locked is None:
                    return CronFired(applied=False)
                entry = cron_entry_from_row(locked)
                if entry.next_run_at != expected:
                    return CronFired(applied=False)
                if slot is not None:
                    task = self._cron_task(name, cron.slot_task(name, entry.task, slot))
                    try:
                        # In a savepoint of this transaction: the slot's task and the
                        # move of next_run_at commit together or not at all.
                        result = (await self._enqueue_on(conn, [task], now))[0]
                    except DuplicateTask:
                        result = None  # a live task holds the slot's key: it has its task
                row = await conn.fetchrow(ADVANCE_CRON_ENTRY, name, next_run_at, slot)
        except (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError) as exc:
            raise InvalidTask(f"the database refused a value: {exc}") from exc
        assert row is not None  # the row is locked
        if result is not None and result.created:
            self._emit([self._event(result.task, None, now)])
        return CronFired(applied=True, entry=cron_entry_from_row(row), task=result)

    async def _trigger_cron_entry(self, name: str) -> EnqueueResult:
        entry = await self._get_cron_entry(name)
        task = self._cron_task(name, cron.triggered_task(name, entry.task, self._clock.now()))
        return (await self._enqueue_batch([task]))[0]

    async def _enqueue_on(
        self,
        conn: asyncpg.pool.PoolConnectionProxy[asyncpg.Record],
        tasks: list[NewTask],
        now: datetime,
    ) -> list[EnqueueResult]:
        """Enqueue ``tasks`` on ``conn`` (in the caller's transaction); no events."""
        plan = enqueue.plan_ids(tasks, now)
        if enqueue.needs_transaction(tasks):
            return await enqueue.enqueue_checked(conn, tasks, plan, now, self._default_max_retry)
        return await enqueue.enqueue_plain(conn, tasks, plan, now, self._default_max_retry)

    # ----------------------------------------------------------------- lifecycle

    async def close(self) -> None:
        """Release resources (the pool, when this broker opened it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_pool:
            await self._pool.close()


class _Left:
    """The work of one or more resolution statements, added up: see
    ``queries.dependencies``."""

    def __init__(self) -> None:
        self.promoted: dict[str, int] = {}
        self.canceled: list[str] = []
        self.pending: set[str] = set()
        self.edges = 0

    def add(self, rows: Iterable[asyncpg.Record], now: datetime, events: list[TaskEvent]) -> bool:
        """Take in a resolution's rows, appending the events of its changes (by id) to
        ``events``; True when ended tasks were left with edges to settle."""
        changed: list[asyncpg.Record] = []
        more = False
        for row in rows:
            kind = row["kind"]
            if kind == "changed":
                changed.append(row)
            elif kind == "more":
                self.pending.add(row["id"])
                more = True
            else:
                self.edges += row["settled"]
        for row in sorted(changed, key=lambda r: str(r["id"])):
            state = TaskState(row["state"])
            if state == TaskState.BLOCKED:
                continue
            events.append(
                TaskEvent(row["id"], row["queue"], row["type"], state, TaskState.BLOCKED, now)
            )
            if state == TaskState.PENDING:
                self.promoted[row["queue"]] = self.promoted.get(row["queue"], 0) + 1
            elif state == TaskState.CANCELED:
                self.canceled.append(row["id"])
                if row["dependents_pending"]:
                    self.pending.add(row["id"])
        return more

    def resolution(self, *, pending_only: bool = False) -> Resolution:
        """What was done and left; with ``pending_only``, only what the dependency sink
        hears of (promotions, and what is left to resolve)."""
        if pending_only:
            return Resolution(promoted=self.promoted, pending=tuple(sorted(self.pending)))
        return Resolution(
            promoted=self.promoted,
            pending=tuple(sorted(self.pending)),
            canceled=tuple(sorted(self.canceled)),
            edges=self.edges,
        )


#: What a lost, wedged or unreachable database raises through asyncpg (as opposed to a
#: statement the server refused): an ended or unusable connection (InterfaceError; and
#: InternalClientError, asyncpg's "cannot switch to state ...; another operation is in
#: progress" on a connection left mid-operation by an outage), the server shutting down or refusing connections,
#: a socket error, and a timeout (command or acquire).
_LINK_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    OSError,
    TimeoutError,
)


def _unavailable(exc: BaseException) -> DatabaseUnavailable:
    """A clean :class:`DatabaseUnavailable` for a link failure; the driver's text (which
    can be internal) is logged here, once."""
    if isinstance(exc, DatabaseUnavailable):
        return exc
    logger.warning("postgres.unavailable error=%r", exc)
    reason = "timed out" if isinstance(exc, TimeoutError) else "connection failed"
    return DatabaseUnavailable(f"database unavailable ({reason}): retry")


def _group_config(row: asyncpg.Record) -> GroupConfig:
    return GroupConfig(
        row["queue"], row["pattern"], row["max_size"], row["max_delay"], row["grace_period"]
    )


async def _keep_session(conn: asyncpg.Connection[asyncpg.Record]) -> None:
    """The pool's connection reset: nothing to do.

    By default asyncpg sends ``SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *;
    RESET ALL`` every time a connection goes back to the pool: a second round trip for
    every broker call. This broker's connections never take advisory locks, open cursors,
    LISTEN or change settings, so there is nothing to undo; an open transaction is still
    rolled back by the pool itself before this runs.
    """


def _rate_limit(row: asyncpg.Record) -> RateLimit:
    return RateLimit(row["queue"], row["per_second"], row["burst"])


def _breaker_config(row: asyncpg.Record) -> BreakerConfig:
    return BreakerConfig(
        queue=row["queue"],
        pattern=row["pattern"],
        failures=row["failures"],
        window=row["window_ms"] * _MILLISECOND,
        cooldown=row["cooldown_ms"] * _MILLISECOND,
        scope=BreakerScope(row["scope"]),
    )


def _breaker(row: asyncpg.Record) -> Breaker:
    return Breaker(
        queue=row["queue"],
        type=row["type"],
        status=BreakerStatus(row["status"]),
        opened_at=row["opened_at"],
        until=row["until"],
        failures=row["failures"],
        gateway=row["gateway"],
        worker_id=row["worker_id"],
        holder=row["holder"],
    )
