"""The in-memory broker: the whole store in dicts, guarded by one asyncio lock.

For development (``conveyor dev``) and as the reference the Postgres broker is checked
against. Stored tasks are frozen :class:`~conveyor_broker.types.Task` values; every change
stores a new value (``dataclasses.replace``), so what a caller holds is a snapshot.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from importlib import metadata
from types import MappingProxyType
from typing import Any

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
from conveyor_broker.ids import new_id
from conveyor_broker.interface import DEFAULT_MAX_RETRY, MAX_BATCH, Broker, EventSink
from conveyor_broker.memory_table import TaskTable, new_row
from conveyor_broker.types import (
    ARCHIVED_BY_ADMIN_ERROR,
    CANCELED_WHILE_RUNNING_ERROR,
    EXPIRED_ERROR,
    LEASE_EXPIRED_ERROR,
    TERMINAL_STATES,
    WAITING_STATES,
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

logger = logging.getLogger(__name__)

_RUNNABLE_NOW = frozenset({TaskState.PENDING, TaskState.SCHEDULED, TaskState.RETRY})


def _package_version() -> str:
    try:
        return metadata.version("conveyor-broker")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0"


def _check_ttl(name: str, ttl: timedelta) -> None:
    if ttl <= timedelta(0):
        raise InvalidTask(f"{name} must be > 0, got {ttl}")


def _check_not_negative(name: str, value: timedelta) -> None:
    if value < timedelta(0):
        raise InvalidTask(f"{name} must be >= 0, got {value}")


def _check_batch_size(items: Sequence[Any]) -> None:
    if len(items) > MAX_BATCH:
        raise InvalidTask(f"a batch holds at most {MAX_BATCH} items, got {len(items)}")


class MemoryBroker(Broker):
    """A Broker that keeps everything in process memory. Nothing survives a restart."""

    def __init__(
        self,
        clock: Clock | None = None,
        *,
        max_payload: int = MAX_PAYLOAD,
        default_max_retry: int = DEFAULT_MAX_RETRY,
    ) -> None:
        if max_payload < 0:
            raise ValueError("max_payload must be >= 0")
        if not 0 <= default_max_retry <= MAX_RETRY_CAP:
            raise ValueError(f"default_max_retry must be in 0..{MAX_RETRY_CAP}")
        self._clock: Clock = clock or SystemClock()
        self._max_payload = max_payload
        self._default_max_retry = default_max_retry
        self._lock = asyncio.Lock()
        self._closed = False
        self._sink: EventSink | None = None
        self._table = TaskTable()
        self._paused: dict[str, bool] = {}
        self._webhooks: dict[str, WebhookWorker] = {}

    # ---------------------------------------------------------------- plumbing

    @asynccontextmanager
    async def _locked(self) -> AsyncIterator[datetime]:
        """Hold the lock on an open broker; yield "now"; report events on the way out.

        Events go out under the lock so that they reach the sink in commit order.
        """
        async with self._lock:
            if self._closed:
                raise BrokerClosed("broker is closed")
            try:
                yield self._clock.now()
            finally:
                self._emit(self._table.take_events())

    def _emit(self, events: Iterable[TaskEvent]) -> None:
        sink = self._sink
        if sink is None:
            return
        for event in events:
            try:
                sink(event)
            except Exception:
                # A broken sink must not undo or block a committed change.
                logger.exception(
                    "broker.event_sink_failed task_id=%s state=%s", event.task_id, event.state
                )

    def _get(self, task_id: str) -> Task:
        check_task_id(task_id)
        task = self._table.get(task_id)
        if task is None:
            raise TaskNotFound(task_id)
        return task

    def _leased(self, task_id: str, lease_id: str) -> Task:
        check_task_id(task_id)
        task = self._table.get(task_id)
        if task is None or task.state != TaskState.ACTIVE or task.lease_id != lease_id:
            raise LeaseLost(task_id, lease_id)
        return task

    def _finish_attempt(
        self, task: Task, now: datetime, error: str, retry_delay: timedelta, skip_retry: bool
    ) -> Task:
        exhausted = skip_retry or task.retried >= task.max_retry
        return self._table.put(
            replace(
                task,
                state=TaskState.ARCHIVED if exhausted else TaskState.RETRY,
                retried=task.retried + 1,
                last_error=error,
                available_at=task.available_at if exhausted else now + retry_delay,
                completed_at=now if exhausted else None,
                lease_id=None,
                lease_expires_at=None,
                updated_at=now,
            ),
            task,
        )

    # ------------------------------------------------------------------ enqueue

    async def enqueue(self, task: NewTask) -> EnqueueResult:
        """Store one task. Same as ``enqueue_batch([task])[0]``."""
        return (await self.enqueue_batch([task]))[0]

    async def enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        """Store up to MAX_BATCH tasks, all-or-nothing (see Broker.enqueue_batch)."""
        async with self._locked() as now:
            check_batch(tasks, max_batch=MAX_BATCH, max_payload=self._max_payload)
            staged: dict[str, Task] = {}
            claimed: dict[tuple[str, str], str] = {}
            results: list[EnqueueResult] = []
            # Bad input outranks a conflict, so a duplicate is raised only after every item
            # was checked for unknown dependencies.
            conflict: DuplicateTask | None = None
            # Everything is decided before anything is stored, so a raise stores nothing.
            for index, new in enumerate(tasks):
                if new.id is not None:
                    existing = staged.get(new.id) or self._table.get(new.id)
                    if existing is not None:
                        results.append(EnqueueResult(existing, created=False))
                        continue
                task_id = new.id or new_id(now)
                blocked = False
                for dep_id in new.depends_on:
                    dep = staged.get(dep_id) or self._table.get(dep_id)
                    if dep is None:
                        raise InvalidTask(f"task {index}: unknown dependency {dep_id!r}")
                    blocked = blocked or dep.state != TaskState.COMPLETED
                if new.unique_key is not None:
                    key = (new.queue, new.unique_key)
                    holder = claimed.get(key) or self._table.claim_holder(*key, now)
                    if holder is not None:
                        conflict = conflict or DuplicateTask(new.queue, new.unique_key, holder)
                    claimed[key] = task_id
                staged[task_id] = new_row(
                    task_id, new, now, blocked=blocked, max_retry=self._default_max_retry
                )
                results.append(EnqueueResult(staged[task_id], created=True))
            if conflict is not None:
                raise conflict
            for task in staged.values():
                self._table.put(task, None)
            return results

    # -------------------------------------------------------------------- lease

    async def lease(self, queue: str, limit: int, ttl: timedelta) -> list[Task]:
        """Lease up to ``limit`` due tasks of ``queue`` (see Broker.lease)."""
        async with self._locked() as now:
            check_queue(queue)
            check_limit(limit, upper=MAX_BATCH)
            _check_ttl("lease ttl", ttl)
            return self._lease(queue, limit, ttl, now)

    async def lease_many(
        self, wants: Sequence[tuple[str, int]], ttl: timedelta
    ) -> list[list[Task]]:
        """Lease for several queues at once (see Broker.lease_many)."""
        async with self._locked() as now:
            check_lease_wants(wants, upper=MAX_BATCH)
            _check_ttl("lease ttl", ttl)
            return [self._lease(queue, limit, ttl, now) for queue, limit in wants]

    def _lease(self, queue: str, limit: int, ttl: timedelta, now: datetime) -> list[Task]:
        due = [task for task in self._table.leasable(queue) if _is_due(task, now)]
        leased: list[Task] = []
        for task in heapq.nsmallest(limit, due, key=lambda t: (t.available_at, t.id)):
            leased.append(
                self._table.put(
                    replace(
                        task,
                        state=TaskState.ACTIVE,
                        lease_id=new_id(now),
                        lease_expires_at=now + ttl,
                        started_at=now,
                        progress=None,
                        updated_at=now,
                    ),
                    task,
                )
            )
        return leased

    async def extend_lease(self, task_id: str, lease_id: str, ttl: timedelta) -> datetime:
        """Set ``lease_expires_at = now + ttl`` and return it. Raises LeaseLost."""
        async with self._locked() as now:
            _check_ttl("lease ttl", ttl)
            task = self._leased(task_id, lease_id)
            self._table.put(replace(task, lease_expires_at=now + ttl, updated_at=now), task)
            return now + ttl

    async def extend_leases(self, leases: Sequence[LeaseRef], ttl: timedelta) -> list[LeaseRef]:
        """Extend many leases; return the lost ones in input order."""
        async with self._locked() as now:
            _check_ttl("lease ttl", ttl)
            _check_batch_size(leases)
            for ref in leases:
                check_task_id(ref.task_id)
            lost: list[LeaseRef] = []
            for ref in leases:
                try:
                    task = self._leased(ref.task_id, ref.lease_id)
                except LeaseLost:
                    lost.append(ref)
                    continue
                self._table.put(replace(task, lease_expires_at=now + ttl, updated_at=now), task)
            return lost

    async def set_progress(self, task_id: str, lease_id: str, progress: bytes) -> None:
        """Store the running task's progress. Raises LeaseLost."""
        async with self._locked() as now:
            task = self._leased(task_id, lease_id)
            self._table.put(replace(task, progress=bytes(progress), updated_at=now), task)

    # ----------------------------------------------------------------- outcomes

    async def ack(self, task_id: str, lease_id: str, result: bytes | None = None) -> Task:
        """ACTIVE -> COMPLETED, storing ``result``. Raises LeaseLost."""
        async with self._locked() as now:
            return self._complete(self._leased(task_id, lease_id), now, result)

    def _complete(self, task: Task, now: datetime, result: bytes | None) -> Task:
        return self._table.put(
            replace(
                task,
                state=TaskState.COMPLETED,
                result=None if result is None else bytes(result),
                completed_at=now,
                lease_id=None,
                lease_expires_at=None,
                updated_at=now,
            ),
            task,
        )

    async def ack_batch(self, items: Sequence[AckItem]) -> list[bool]:
        """Ack many tasks; False per item whose lease was lost."""
        async with self._locked() as now:
            _check_batch_size(items)
            for item in items:
                check_task_id(item.task_id)
            done: list[bool] = []
            for item in items:
                try:
                    task = self._leased(item.task_id, item.lease_id)
                except LeaseLost:
                    done.append(False)
                    continue
                self._complete(task, now, item.result)
                done.append(True)
            return done

    async def fail(
        self,
        task_id: str,
        lease_id: str,
        error: str,
        retry_delay: timedelta,
        *,
        skip_retry: bool = False,
    ) -> Task:
        """A failed attempt: RETRY after ``retry_delay``, or ARCHIVED when exhausted."""
        async with self._locked() as now:
            _check_not_negative("retry_delay", retry_delay)
            task = self._leased(task_id, lease_id)
            return self._finish_attempt(task, now, error, retry_delay, skip_retry)

    async def release(self, task_id: str, lease_id: str) -> Task:
        """ACTIVE -> PENDING, due now, ``retried`` unchanged. Raises LeaseLost."""
        async with self._locked() as now:
            task = self._leased(task_id, lease_id)
            return self._table.put(
                replace(
                    task,
                    state=TaskState.PENDING,
                    available_at=now,
                    lease_id=None,
                    lease_expires_at=None,
                    updated_at=now,
                ),
                task,
            )

    async def archive(self, task_id: str, lease_id: str, error: str) -> Task:
        """ACTIVE -> ARCHIVED at once with ``last_error = error``. Raises LeaseLost."""
        async with self._locked() as now:
            task = self._leased(task_id, lease_id)
            return self._archive(task, now, error)

    def _archive(self, task: Task, now: datetime, error: str) -> Task:
        return self._table.put(
            replace(
                task,
                state=TaskState.ARCHIVED,
                last_error=error,
                completed_at=now,
                lease_id=None,
                lease_expires_at=None,
                updated_at=now,
            ),
            task,
        )

    # -------------------------------------------------------- maintenance sweeps

    async def reap_expired_leases(
        self, limit: int = 1000, retry_delay: timedelta = timedelta(0)
    ) -> list[ReapedTask]:
        """Fail ACTIVE tasks whose lease expired with LEASE_EXPIRED_ERROR."""
        async with self._locked() as now:
            check_limit(limit, upper=MAX_BATCH)
            _check_not_negative("retry_delay", retry_delay)
            reaped: list[ReapedTask] = []
            for task in self._table.oldest([TaskState.ACTIVE], _lease_expiry, now, limit):
                done = self._finish_attempt(task, now, LEASE_EXPIRED_ERROR, retry_delay, False)
                reaped.append(ReapedTask(task_id=done.id, queue=done.queue, state=done.state))
            return reaped

    async def promote_scheduled(self, limit: int = 1000) -> dict[str, int]:
        """Due SCHEDULED tasks become PENDING; the number promoted per queue."""
        async with self._locked() as now:
            check_limit(limit, upper=MAX_BATCH)
            promoted: defaultdict[str, int] = defaultdict(int)
            for task in self._table.oldest([TaskState.SCHEDULED], _available, now, limit):
                self._table.put(replace(task, state=TaskState.PENDING, updated_at=now), task)
                promoted[task.queue] += 1
            return dict(promoted)

    async def purge_terminal(
        self,
        *,
        archive_retention: timedelta,
        default_retention: timedelta = timedelta(0),
        limit: int = 1000,
    ) -> int:
        """Delete terminal rows past their retention; return how many."""
        async with self._locked() as now:
            _check_not_negative("archive_retention", archive_retention)
            _check_not_negative("default_retention", default_retention)
            check_limit(limit, upper=MAX_BATCH)

            def purge_at(task: Task) -> datetime | None:
                # Oldest purge time goes first; rows not due yet are left out by oldest().
                if task.completed_at is None:  # pragma: no cover - terminal rows have it
                    return None
                if task.state == TaskState.COMPLETED:
                    keep = default_retention if task.retention is None else task.retention
                else:
                    keep = archive_retention
                return task.completed_at + keep

            doomed = self._table.oldest(TERMINAL_STATES, purge_at, now, limit)
            for task in doomed:
                self._table.drop(task, now, report=False)
            self._table.free_lapsed_claims(now)
            return len(doomed)

    async def archive_expired(self, limit: int = 1000) -> list[Task]:
        """Waiting tasks past ``expires_at`` become ARCHIVED with EXPIRED_ERROR."""
        async with self._locked() as now:
            check_limit(limit, upper=MAX_BATCH)
            expired = self._table.oldest(WAITING_STATES, _expires_at, now, limit)
            return [self._archive(task, now, EXPIRED_ERROR) for task in expired]

    # ------------------------------------------------------- inspection / admin

    async def pending_count(self, queue: str | None = None) -> dict[str, int]:
        """Due tasks per queue (what ``lease`` would pick now)."""
        async with self._locked() as now:
            if queue is not None:
                check_queue(queue)
            queues = self._table.leasable_queues() if queue is None else [queue]
            counts: dict[str, int] = {}
            for name in queues:
                due = sum(_is_due(task, now) for task in self._table.leasable(name))
                if due:
                    counts[name] = due
            return counts

    async def due_queues(self, *, after: str | None = None, limit: int = 1000) -> list[str]:
        """Queues with a due task, by name, named after ``after``, at most ``limit``."""
        async with self._locked() as now:
            if after is not None:
                check_queue(after)
            check_limit(limit, upper=MAX_BATCH)
            due = [
                name
                for name in self._table.leasable_queues()
                if (after is None or name > after)
                and any(_is_due(task, now) for task in self._table.leasable(name))
            ]
            return sorted(due)[:limit]

    async def queue_stats(self, queue: str | None = None) -> list[QueueStats]:
        """Per-state counts per queue, sorted by name."""
        async with self._locked():
            if queue is not None:
                check_queue(queue)
                names = [queue]
            else:
                names = sorted(self._table.queues() | set(self._paused))
            return [
                QueueStats(
                    queue=name,
                    paused=self._paused.get(name, False),
                    counts=MappingProxyType(self._table.counts(name)),
                )
                for name in names
            ]

    async def get_task(self, task_id: str) -> Task:
        """The stored task. Raises TaskNotFound."""
        async with self._locked():
            return self._get(task_id)

    async def list_tasks(
        self,
        *,
        queue: str | None = None,
        state: TaskState | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> TaskPage:
        """Tasks ordered by id, filtered; the cursor is the last id of the previous page."""
        async with self._locked():
            if queue is not None:
                check_queue(queue)
            check_limit(limit, upper=MAX_BATCH)
            if cursor is not None:
                try:
                    check_task_id(cursor)
                except InvalidTask:
                    raise InvalidTask(f"malformed cursor {cursor!r}") from None
            ids = [
                task_id
                for task_id in self._table.ids(state)
                if (cursor is None or task_id > cursor)
                and (queue is None or self._table[task_id].queue == queue)
            ]
            page = heapq.nsmallest(limit + 1, ids)
            more = len(page) > limit
            tasks = [self._table[task_id] for task_id in page[:limit]]
            return TaskPage(tasks=tasks, next_cursor=tasks[-1].id if more else None)

    async def cancel_task(self, task_id: str) -> Task:
        """Waiting -> CANCELED; ACTIVE -> ARCHIVED; terminal -> InvalidState."""
        async with self._locked() as now:
            task = self._get(task_id)
            if task.state == TaskState.ACTIVE:
                return self._archive(task, now, CANCELED_WHILE_RUNNING_ERROR)
            if task.state in TERMINAL_STATES:
                raise InvalidState(task_id, task.state, "cancel")
            return self._table.put(
                replace(task, state=TaskState.CANCELED, completed_at=now, updated_at=now), task
            )

    async def delete_task(self, task_id: str) -> None:
        """Delete a task that is not ACTIVE."""
        async with self._locked() as now:
            task = self._get(task_id)
            if task.state == TaskState.ACTIVE:
                raise InvalidState(task_id, task.state, "delete")
            self._table.drop(task, now, report=True)

    async def run_task_now(self, task_id: str) -> Task:
        """SCHEDULED, RETRY or PENDING -> PENDING, due now."""
        async with self._locked() as now:
            task = self._get(task_id)
            if task.state not in _RUNNABLE_NOW:
                raise InvalidState(task_id, task.state, "run now")
            return self._table.put(
                replace(task, state=TaskState.PENDING, available_at=now, updated_at=now), task
            )

    async def reschedule_task(self, task_id: str, process_at: datetime) -> Task:
        """PENDING, SCHEDULED or RETRY -> SCHEDULED at ``process_at`` (or PENDING now)."""
        async with self._locked() as now:
            if process_at.tzinfo is None:
                raise InvalidTask("process_at must be timezone-aware")
            task = self._get(task_id)
            if task.state not in _RUNNABLE_NOW:
                raise InvalidState(task_id, task.state, "reschedule")
            later = process_at > now
            return self._table.put(
                replace(
                    task,
                    state=TaskState.SCHEDULED if later else TaskState.PENDING,
                    available_at=process_at if later else now,
                    updated_at=now,
                ),
                task,
            )

    async def archive_task(self, task_id: str) -> Task:
        """A waiting task -> ARCHIVED with ARCHIVED_BY_ADMIN_ERROR."""
        async with self._locked() as now:
            task = self._get(task_id)
            if task.state not in WAITING_STATES:
                raise InvalidState(task_id, task.state, "archive")
            return self._archive(task, now, ARCHIVED_BY_ADMIN_ERROR)

    async def revive_task(self, task_id: str) -> Task:
        """ARCHIVED -> PENDING, due now, ``retried = 0``."""
        async with self._locked() as now:
            task = self._get(task_id)
            if task.state != TaskState.ARCHIVED:
                raise InvalidState(task_id, task.state, "revive")
            if task.unique_key is not None and (
                task.unique_until is None or task.unique_until > now
            ):
                holder = self._table.claim_holder(task.queue, task.unique_key, now)
                if holder is not None:
                    raise DuplicateTask(task.queue, task.unique_key, holder)
            return self._table.put(
                replace(
                    task,
                    state=TaskState.PENDING,
                    available_at=now,
                    retried=0,
                    completed_at=None,
                    updated_at=now,
                ),
                task,
            )

    async def set_queue_paused(self, queue: str, paused: bool) -> None:
        """Persist the pause flag of ``queue``."""
        async with self._locked():
            check_queue(queue)
            self._paused[queue] = paused

    async def queue_paused(self, queue: str) -> bool:
        """The stored pause flag (False for a queue never paused)."""
        async with self._locked():
            check_queue(queue)
            return self._paused.get(queue, False)

    async def info(self) -> BrokerInfo:
        """What this broker is: driver ``memory``, no schema."""
        async with self._locked():
            return BrokerInfo(driver="memory", version=_package_version())

    async def upkeep_storage(self) -> StorageUpkeep:
        """Nothing to keep up: no planner, no dead row versions."""
        async with self._locked():
            return StorageUpkeep()

    # ---------------------------------------------------- webhook registrations

    def _webhook(self, name: str) -> WebhookWorker:
        check_webhook_name(name)
        worker = self._webhooks.get(name)
        if worker is None:
            raise WebhookWorkerNotFound(name)
        return worker

    async def upsert_webhook_worker(self, spec: WebhookWorkerSpec) -> WebhookWorker:
        """Create or replace the registration ``spec.name`` (see
        Broker.upsert_webhook_worker)."""
        async with self._locked() as now:
            check_webhook_worker(spec)
            stored = self._webhooks.get(spec.name)
            if spec.secrets:
                secrets = tuple(spec.secrets)
            else:
                secrets = () if stored is None else stored.secrets
            worker = WebhookWorker(
                name=spec.name,
                url=spec.url,
                # A read-only copy: a snapshot must not change under the caller or the store.
                queues=MappingProxyType({q: int(w) for q, w in spec.queues.items()}),
                concurrency=int(spec.concurrency),
                timeout=spec.timeout,
                paused=bool(spec.paused),
                secrets=secrets,
                created_at=now if stored is None else stored.created_at,
                updated_at=now,
            )
            self._webhooks[spec.name] = worker
            return worker

    async def get_webhook_worker(self, name: str) -> WebhookWorker:
        """The registration ``name``. Raises WebhookWorkerNotFound."""
        async with self._locked():
            return self._webhook(name)

    async def list_webhook_workers(self) -> list[WebhookWorker]:
        """Every registration, by name."""
        async with self._locked():
            return [self._webhooks[name] for name in sorted(self._webhooks)]

    async def set_webhook_worker_paused(self, name: str, paused: bool) -> WebhookWorker:
        """Pause or resume a registration. Raises WebhookWorkerNotFound."""
        async with self._locked() as now:
            worker = replace(self._webhook(name), paused=paused, updated_at=now)
            self._webhooks[name] = worker
            return worker

    async def delete_webhook_worker(self, name: str) -> None:
        """Delete a registration. Raises WebhookWorkerNotFound."""
        async with self._locked():
            self._webhook(name)
            del self._webhooks[name]

    # --------------------------------------------------------------- lifecycle

    def set_event_sink(self, sink: EventSink | None) -> None:
        """Report every committed state change to ``sink`` (None stops reporting)."""
        self._sink = sink

    async def close(self) -> None:
        """Drop everything; later calls raise BrokerClosed."""
        async with self._lock:
            self._closed = True
            self._table = TaskTable()
            self._webhooks = {}


def _is_due(task: Task, now: datetime) -> bool:
    """What ``lease`` may pick, given the task is PENDING or RETRY."""
    return task.available_at <= now and (task.expires_at is None or task.expires_at > now)


def _lease_expiry(task: Task) -> datetime | None:
    return task.lease_expires_at


def _available(task: Task) -> datetime | None:
    return task.available_at


def _expires_at(task: Task) -> datetime | None:
    return task.expires_at
