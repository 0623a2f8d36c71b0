"""The in-memory broker: the whole store in dicts, guarded by one asyncio lock.

For development (``conveyor dev``) and as the reference the Postgres broker is checked
against. Stored tasks are frozen :class:`~conveyor_broker.types.Task` values; every change
stores a new value (``dataclasses.replace``), so what a caller holds is a snapshot.
"""

from __future__ import annotations

import asyncio
import heapq
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from types import MappingProxyType

from conveyor_broker import concurrency, cron, groups, rates
from conveyor_broker.clock import Clock
from conveyor_broker.dependencies import (
    BatchItem,
    Verdict,
    dependency_failed_error,
    edge_outcome,
    plan_starts,
    verdict,
)
from conveyor_broker.errors import (
    BreakerConfigNotFound,
    BrokerClosed,
    ConcurrencyLimitNotFound,
    CronEntryNotFound,
    DuplicateTask,
    GroupConfigNotFound,
    InvalidState,
    LeaseLost,
    RateLimitNotFound,
    TaskNotFound,
    WebhookWorkerNotFound,
)
from conveyor_broker.ids import new_id
from conveyor_broker.interface import DEFAULT_MAX_RETRY, MAX_BATCH, Broker, package_version
from conveyor_broker.memory_graph import DependencyGraph
from conveyor_broker.memory_table import TaskTable, new_row
from conveyor_broker.types import (
    ARCHIVED_BY_ADMIN_ERROR,
    CANCELED_WHILE_RUNNING_ERROR,
    EXPIRED_ERROR,
    LEASE_EXPIRED_ERROR,
    TERMINAL_STATES,
    WAITING_STATES,
    AckItem,
    Breaker,
    BreakerConfig,
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
    TaskListParams,
    TaskPage,
    TaskState,
    TerminalPurgeParams,
    WebhookWorker,
    WebhookWorkerSpec,
    cron_template,
    listed_size,
    without_payloads,
)
from conveyor_broker.validation import MAX_PAYLOAD

_RESCHEDULABLE = frozenset({TaskState.PENDING, TaskState.SCHEDULED, TaskState.RETRY})
_RUNNABLE_NOW = _RESCHEDULABLE | {TaskState.BLOCKED, TaskState.HELD}


class MemoryBroker(Broker):
    """A Broker that keeps everything in process memory. Nothing survives a restart.

    The arguments are :class:`~conveyor_broker.interface.Broker`'s.
    """

    def __init__(
        self,
        clock: Clock | None = None,
        *,
        max_payload: int = MAX_PAYLOAD,
        default_max_retry: int = DEFAULT_MAX_RETRY,
    ) -> None:
        super().__init__(clock, max_payload=max_payload, default_max_retry=default_max_retry)
        self._lock = asyncio.Lock()
        self._table = TaskTable()
        self._graph = DependencyGraph()
        self._paused: dict[str, bool] = {}
        self._webhooks: dict[str, WebhookWorker] = {}
        self._cron_entries: dict[str, CronEntry] = {}
        self._group_configs: dict[tuple[str, str], GroupConfig] = {}
        # Queue -> its rate limit, the tokens its bucket held and when.
        self._rates: dict[str, tuple[RateLimit, float, datetime]] = {}
        # Queue -> its concurrency limits by pattern.
        self._concurrency: dict[str, dict[str, ConcurrencyLimit]] = {}
        # Holder -> its last beat.
        self._beats: dict[str, datetime] = {}
        # Circuit breakers: the configs by (queue, pattern), the stored breakers by
        # (queue, type, gateway).
        self._breaker_configs: dict[tuple[str, str], BreakerConfig] = {}
        self._breakers: dict[tuple[str, str, str], Breaker] = {}
        # Dependency work the call holding the lock leaves for the sink (besides the ended
        # tasks its events name), and whether it returns its work instead.
        self._left_promoted: dict[str, int] = {}
        self._returns_resolution = False

    # ---------------------------------------------------------------- plumbing

    @asynccontextmanager
    async def _locked(self) -> AsyncIterator[datetime]:
        """Hold the lock on an open broker; yield "now"; report events on the way out.

        Events go out under the lock so that they reach the sink in commit order. The
        broker was open when the call began, but a close may have taken the lock first.
        """
        async with self._lock:
            if self._closed:
                raise BrokerClosed("the broker is closed")
            try:
                yield self._clock.now()
            finally:
                events = self._table.take_events()
                self._emit(events)
                promoted, self._left_promoted = self._left_promoted, {}
                returned, self._returns_resolution = self._returns_resolution, False
                if not returned:
                    pending = self._graph.pending
                    ended = {
                        e.task_id
                        for e in events
                        if e.state in TERMINAL_STATES and e.task_id in pending
                    }
                    self._report(Resolution(promoted=promoted, pending=tuple(sorted(ended))))

    def _promote_held(self, keys: Iterable[tuple[str, str]], now: datetime) -> None:
        for queue, key in sorted(set(keys)):
            held = self._table.held(queue, key)
            if not held:
                continue
            per_key = concurrency.limit_for(key, self._concurrency.get(queue, {}).values())
            room = (
                len(held)
                if per_key is None
                else max(0, per_key - self._table.active_with_key(queue, key))
            )
            for task in heapq.nsmallest(room, held, key=lambda t: (t.available_at, t.id)):
                self._table.put(replace(task, state=TaskState.PENDING, updated_at=now), task)

    def _get(self, task_id: str) -> Task:
        task = self._table.get(task_id)
        if task is None:
            raise TaskNotFound(task_id)
        return task

    def _leased(self, task_id: str, lease_id: str) -> Task:
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
                state=TaskState.ARCHIVED if exhausted else _waiting(task, TaskState.RETRY),
                retried=task.retried + 1,
                last_error=error,
                available_at=task.available_at if exhausted else now + retry_delay,
                completed_at=now if exhausted else None,
                lease_id=None,
                lease_expires_at=None,
                holder=None,
                updated_at=now,
            ),
            task,
        )

    # ------------------------------------------------------------------ enqueue

    async def _enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        async with self._locked() as now:
            return self._store(tasks, now)

    def _store(self, tasks: Sequence[NewTask], now: datetime) -> list[EnqueueResult]:
        """Enqueue ``tasks`` (the lock held): all or nothing."""
        # Everything is decided before anything is stored, so a raise stores nothing.
        ids: list[str] = []
        first: dict[str, int] = {}
        items: list[BatchItem] = []
        for index, new in enumerate(tasks):
            task_id = new.id or new_id(now)
            ids.append(task_id)
            if task_id not in first:
                first[task_id] = index
                if self._table.get(task_id) is None:
                    items.append(BatchItem(index, task_id, new))
        stored = {
            dep: task.state
            for item in items
            for dep in item.task.depends_on
            if (task := self._table.get(dep)) is not None
        }
        # Unknown dependencies and cycles are bad input: they outrank a conflict.
        starts = plan_starts(items, stored)
        staged: dict[str, Task] = {}
        claimed: dict[tuple[str, str], str] = {}
        conflict: DuplicateTask | None = None
        for item in items:
            new, task_id = item.task, item.task_id
            start = starts.get(task_id)
            born_canceled = start is not None and start.state is TaskState.CANCELED
            if new.unique_key is not None and not born_canceled:
                key = (new.queue, new.unique_key)
                holder = claimed.get(key) or self._table.claim_holder(*key, now)
                if holder is not None:
                    conflict = conflict or DuplicateTask(new.queue, new.unique_key, holder)
                claimed[key] = task_id
            staged[task_id] = new_row(
                task_id, new, now, start=start, max_retry=self._default_max_retry
            )
        if conflict is not None:
            raise conflict
        for task in staged.values():
            self._table.put(task, None)
            start = starts.get(task.id)
            if start is not None:
                self._graph.add(task.id, start)
        results: list[EnqueueResult] = []
        for index, task_id in enumerate(ids):
            if task_id in staged:
                results.append(EnqueueResult(staged[task_id], created=first[task_id] == index))
            else:
                results.append(EnqueueResult(self._table[task_id], created=False))
        return results

    # -------------------------------------------------------------------- lease

    async def _lease(
        self,
        queue: str,
        limit: int,
        ttl: timedelta,
        holders: tuple[str, ...],
        exclude_types: tuple[str, ...] = (),
        only_types: tuple[str, ...] | None = None,
    ) -> list[Task]:
        async with self._locked() as now:
            return self._lease_queue(
                queue, limit, ttl, now, holders, frozenset(exclude_types), only_types
            )

    async def _lease_many(
        self,
        wants: Sequence[tuple[str, int]],
        ttl: timedelta,
        holders: Sequence[tuple[str, ...]],
    ) -> list[list[Task]]:
        async with self._locked() as now:
            return [
                self._lease_queue(queue, limit, ttl, now, queue_holders)
                for (queue, limit), queue_holders in zip(wants, holders, strict=True)
            ]

    def _lease_queue(
        self,
        queue: str,
        limit: int,
        ttl: timedelta,
        now: datetime,
        holders: tuple[str, ...],
        exclude: frozenset[str] = frozenset(),
        only: Iterable[str] | None = None,
    ) -> list[Task]:
        allowed = None if only is None else frozenset(only)

        def leasable() -> list[Task]:
            due = [task for task in self._table.leasable(queue) if _is_due(task, now)]
            if exclude:
                due = [task for task in due if task.type not in exclude]
            if allowed is not None:
                due = [task for task in due if task.type in allowed]
            return due

        due = leasable()
        leased: list[Task] = []
        limits = list(self._concurrency.get(queue, {}).values())
        freed = self._table.take_freed(queue)
        if limits:
            # The HELD tasks of keys with room again are PENDING first, as Postgres's
            # lease makes them (from what its triggers noted).
            if freed:
                self._promote_held(((queue, key) for key in freed), now)
                due = leasable()
            # Every due task in lease order: those parked make way for the ones behind.
            candidates = sorted(due, key=lambda t: (t.available_at, t.id))
            keys = [t.concurrency_key for t in candidates]
            active = {
                key: self._table.active_with_key(queue, key) for key in set(keys) if key is not None
            }
            plan = concurrency.plan_lease(keys, limits, active, limit)
            for index in plan.park:
                task = candidates[index]
                self._table.put(replace(task, state=TaskState.HELD, updated_at=now), task)
            ordered = [candidates[index] for index in plan.lease]
        else:
            ordered = heapq.nsmallest(limit, due, key=lambda t: (t.available_at, t.id))
        for n, task in enumerate(ordered):
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
                        holder=holders[n] or None if n < len(holders) else None,
                    ),
                    task,
                )
            )
        return leased

    async def _extend_lease(self, task_id: str, lease_id: str, ttl: timedelta) -> datetime:
        async with self._locked() as now:
            task = self._leased(task_id, lease_id)
            self._table.put(replace(task, lease_expires_at=now + ttl, updated_at=now), task)
            return now + ttl

    async def _extend_leases(self, leases: Sequence[LeaseRef], ttl: timedelta) -> list[LeaseRef]:
        async with self._locked() as now:
            lost: list[LeaseRef] = []
            for ref in leases:
                try:
                    task = self._leased(ref.task_id, ref.lease_id)
                except LeaseLost:
                    lost.append(ref)
                    continue
                self._table.put(replace(task, lease_expires_at=now + ttl, updated_at=now), task)
            return lost

    async def _set_progress(self, task_id: str, lease_id: str, progress: bytes) -> None:
        async with self._locked() as now:
            task = self._leased(task_id, lease_id)
            self._table.put(replace(task, progress=bytes(progress), updated_at=now), task)

    # ----------------------------------------------------------------- outcomes

    async def _ack(self, task_id: str, lease_id: str, result: bytes | None) -> Task:
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
                holder=None,
                updated_at=now,
            ),
            task,
        )

    async def _ack_batch(self, items: Sequence[AckItem]) -> list[bool]:
        async with self._locked() as now:
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

    async def _fail(
        self, task_id: str, lease_id: str, error: str, retry_delay: timedelta, skip_retry: bool
    ) -> Task:
        async with self._locked() as now:
            task = self._leased(task_id, lease_id)
            return self._finish_attempt(task, now, error, retry_delay, skip_retry)

    async def _release(self, task_id: str, lease_id: str) -> Task:
        async with self._locked() as now:
            task = self._leased(task_id, lease_id)
            return self._table.put(
                replace(
                    task,
                    state=_waiting(task, TaskState.PENDING),
                    available_at=now,
                    lease_id=None,
                    lease_expires_at=None,
                    holder=None,
                    updated_at=now,
                ),
                task,
            )

    async def _archive(self, task_id: str, lease_id: str, error: str) -> Task:
        async with self._locked() as now:
            return self._archived(self._leased(task_id, lease_id), now, error)

    def _archived(self, task: Task, now: datetime, error: str) -> Task:
        return self._table.put(
            replace(
                task,
                state=TaskState.ARCHIVED,
                last_error=error,
                completed_at=now,
                lease_id=None,
                lease_expires_at=None,
                holder=None,
                updated_at=now,
            ),
            task,
        )

    # -------------------------------------------------------- maintenance sweeps

    async def _reap_expired_leases(self, params: LeaseReapParams) -> list[ReapedTask]:
        async with self._locked() as now:
            reaped: list[ReapedTask] = []
            expired = self._table.oldest([TaskState.ACTIVE], _lease_expiry, now, params.limit)
            for task in expired:
                done = self._finish_attempt(
                    task, now, LEASE_EXPIRED_ERROR, params.retry_delay, False
                )
                reaped.append(ReapedTask(task_id=done.id, queue=done.queue, state=done.state))
            return reaped

    async def _beat_holder(self, holder: str) -> None:
        async with self._locked() as now:
            self._beats[holder] = now

    async def _release_dead_holders(self, params: HolderReleaseParams) -> list[ReleasedTask]:
        async with self._locked() as now:
            cutoff = now - params.silence
            dead = {
                holder
                for holder, beat in self._beats.items()
                if beat <= cutoff and holder not in params.alive
            }
            if not dead:
                return []
            orphans = [
                task
                for task_id in self._table.ids(TaskState.ACTIVE)
                if (task := self._table[task_id]).holder in dead
            ]
            for holder in dead - {task.holder for task in orphans}:
                del self._beats[holder]  # dead and holding nothing: forgotten
            for key in [key for key, b in self._breakers.items() if b.holder in dead]:
                del self._breakers[key]  # a dead process's gateways' breakers
            released: list[ReleasedTask] = []
            for task in heapq.nsmallest(params.limit, orphans, key=_lease_order):
                self._table.put(
                    replace(
                        task,
                        state=_waiting(task, TaskState.PENDING),
                        available_at=now,
                        lease_id=None,
                        lease_expires_at=None,
                        holder=None,
                        updated_at=now,
                    ),
                    task,
                )
                released.append(ReleasedTask(task.id, task.queue, task.holder or ""))
            return released

    async def _promote_scheduled(self, limit: int) -> dict[str, int]:
        async with self._locked() as now:
            promoted: defaultdict[str, int] = defaultdict(int)
            for task in self._table.oldest([TaskState.SCHEDULED], _available, now, limit):
                self._table.put(replace(task, state=TaskState.PENDING, updated_at=now), task)
                promoted[task.queue] += 1
            return dict(promoted)

    async def _purge_terminal(self, params: TerminalPurgeParams) -> int:
        async with self._locked() as now:

            def purge_at(task: Task) -> datetime | None:
                # Oldest purge time goes first; rows not due yet are left out by oldest().
                if task.completed_at is None:  # pragma: no cover - terminal rows have it
                    return None
                if task.id in self._graph.pending:
                    return None  # its dependents are not resolved yet
                if task.state == TaskState.COMPLETED:
                    keep = params.default_retention if task.retention is None else task.retention
                else:
                    keep = params.archive_retention
                return task.completed_at + keep

            doomed = self._table.oldest(TERMINAL_STATES, purge_at, now, params.limit)
            for task in doomed:
                self._table.drop(task, now, report=False)
                self._graph.drop(task.id)
            self._table.free_lapsed_claims(now)
            return len(doomed)

    async def _archive_expired(self, limit: int) -> list[Task]:
        async with self._locked() as now:
            expired = self._table.oldest(WAITING_STATES, _expires_at, now, limit)
            return [self._archived(task, now, EXPIRED_ERROR) for task in expired]

    # ------------------------------------------------------------- dependencies

    async def _resolve_dependents(self, task_ids: Sequence[str], limit: int) -> Resolution:
        async with self._locked() as now:
            self._returns_resolution = True
            return self._resolve(self._ended(task_ids), limit, now)

    async def _promote_ready_dependents(self, limit: int, min_age: timedelta) -> Resolution:
        async with self._locked() as now:
            self._returns_resolution = True
            ended: list[tuple[datetime, str]] = []
            for task_id in self._graph.pending:
                task = self._table.get(task_id)
                if (
                    task is not None
                    and task.state in TERMINAL_STATES
                    and task.completed_at is not None
                    and task.completed_at <= now - min_age
                ):
                    ended.append((task.completed_at, task_id))
            found = [task_id for _, task_id in heapq.nsmallest(limit, ended)]
            if not found:
                return Resolution()
            return self._resolve(self._ended(sorted(found)), limit, now)

    def _ended(self, task_ids: Sequence[str]) -> dict[str, TaskState]:
        """The ended tasks among ``task_ids`` whose dependents are not all resolved, with
        their states, in the order given."""
        ended: dict[str, TaskState] = {}
        for task_id in task_ids:
            task = self._table.get(task_id)
            if (
                task is not None
                and task.state in TERMINAL_STATES
                and task_id in self._graph.pending
            ):
                ended[task_id] = task.state
        return ended

    def _resolve(self, ended: Mapping[str, TaskState], limit: int, now: datetime) -> Resolution:
        """Settle at most ``limit`` open edges of the tasks ``ended`` (by id: ended, with
        their dependents not all resolved; each with the state it ended in); see
        Broker.resolve_dependents."""
        graph = self._graph
        picked = [
            (dep, waiting) for dep in ended for waiting in graph.open_dependents(dep, limit + 1)
        ]
        picked.sort()
        settled, beyond = picked[:limit], picked[limit:]
        unfinished = {dep for dep, _ in beyond}
        # Per dependent: edges closed, of which failed, and the smallest failed dependency.
        tally: dict[str, tuple[int, int, str | None]] = {}
        for dep, waiting in settled:
            outcome = edge_outcome(ended[dep])
            graph.settle(waiting, dep, outcome)
            closed, failed, first = tally.get(waiting, (0, 0, None))
            if outcome is DependencyOutcome.FAILED:
                failed += 1
                first = dep if first is None else min(first, dep)
            tally[waiting] = (closed + 1, failed, first)
        for dep in ended:
            if dep not in unfinished:
                graph.pending.discard(dep)
        promoted: dict[str, int] = {}
        canceled: list[str] = []
        left = set(unfinished)
        for waiting in sorted(tally):
            task = self._table.get(waiting)
            if task is None or task.state is not TaskState.BLOCKED:
                continue
            closed, failed, first = tally[waiting]
            open_count, failed_count = graph.counts(waiting)
            open_count, failed_count = open_count - closed, failed_count + failed
            graph.set_counts(waiting, open_count, failed_count)
            match verdict(open_count, failed_count, task.on_failure):
                case Verdict.CANCEL:
                    self._table.put(
                        replace(
                            task,
                            state=TaskState.CANCELED,
                            completed_at=now,
                            last_error=dependency_failed_error(first or ""),
                            updated_at=now,
                        ),
                        task,
                    )
                    canceled.append(waiting)
                    if waiting in graph.pending:
                        left.add(waiting)
                case Verdict.RUN:
                    state = _promoted_state(task, now)
                    self._table.put(replace(task, state=state, updated_at=now), task)
                    if state is TaskState.PENDING:
                        promoted[task.queue] = promoted.get(task.queue, 0) + 1
                case Verdict.WAIT:
                    self._table.put(replace(task, updated_at=now), task)
        return Resolution(
            promoted=promoted,
            pending=tuple(sorted(left)),
            canceled=tuple(canceled),
            edges=len(settled),
        )

    async def _list_dependencies(self, params: DependencyListParams) -> DependencyPage:
        async with self._locked():
            self._get(params.task_id)
            if params.dependents:
                edges = self._graph.dependents(params.task_id)
            else:
                edges = self._graph.dependencies(params.task_id)
            after = params.cursor or ""
            ids = heapq.nsmallest(params.limit + 1, (i for i in edges if i > after))
            links = []
            for other in ids[: params.limit]:
                task = self._table.get(other)
                links.append(
                    DependencyLink(
                        task_id=other,
                        outcome=edges[other],
                        queue=None if task is None else task.queue,
                        type=None if task is None else task.type,
                        state=None if task is None else task.state,
                    )
                )
            more = len(ids) > params.limit
            return DependencyPage(links, links[-1].task_id if more else None)

    # ------------------------------------------------------- inspection / admin

    async def _pending_count(self, queue: str | None) -> dict[str, int]:
        async with self._locked() as now:
            queues = self._table.leasable_queues() if queue is None else [queue]
            counts: dict[str, int] = {}
            for name in queues:
                due = sum(_is_due(task, now) for task in self._table.leasable(name))
                if due:
                    counts[name] = due
            return counts

    async def _due_count(self, queue: str, cap: int) -> int:
        async with self._locked() as now:
            return min(cap, sum(_is_due(task, now) for task in self._table.leasable(queue)))

    async def _due_queues(self, after: str | None, limit: int) -> list[str]:
        async with self._locked() as now:
            due = [
                name
                for name in self._table.leasable_queues()
                if (after is None or name > after)
                and any(_is_due(task, now) for task in self._table.leasable(name))
            ]
            return sorted(due)[:limit]

    async def _due_among(self, queues: list[str]) -> list[str]:
        async with self._locked() as now:
            return [
                name
                for name in queues
                if any(_is_due(task, now) for task in self._table.leasable(name))
            ]

    async def _oldest_due(self, queues: list[str]) -> dict[str, datetime]:
        async with self._locked() as now:
            found: dict[str, datetime] = {}
            for name in queues:
                due = [t.available_at for t in self._table.leasable(name) if _is_due(t, now)]
                if due:
                    found[name] = min(due)
            return found

    async def _queue_stats(self, queue: str | None) -> list[QueueStats]:
        async with self._locked():
            if queue is not None:
                names = [queue]
            else:
                names = sorted(self._table.queues() | set(self._paused))
            return [self._stats(name) for name in names]

    async def _list_queues(self, after: str | None, limit: int) -> QueuePage:
        async with self._locked():
            names = sorted(
                name
                for name in self._table.queues() | set(self._paused)
                if after is None or name > after
            )
            page = [self._stats(name) for name in names[:limit]]
            more = len(names) > limit
            return QueuePage(page, page[-1].queue if more else None)

    def _stats(self, name: str) -> QueueStats:
        return QueueStats(
            queue=name,
            paused=self._paused.get(name, False),
            counts=MappingProxyType(self._table.counts(name)),
        )

    async def _get_task(self, task_id: str) -> Task:
        async with self._locked():
            return self._get(task_id)

    async def _get_tasks(self, task_ids: Sequence[str]) -> list[Task]:
        async with self._locked():
            return [task for task_id in task_ids if (task := self._table.get(task_id))]

    async def _list_tasks(self, params: TaskListParams) -> TaskPage:
        # The cursor is the last id of the previous page.
        queue, state, limit, cursor = params.queue, params.state, params.limit, params.cursor
        async with self._locked():
            ids = [
                task_id
                for task_id in self._table.ids(state)
                if (cursor is None or task_id > cursor)
                and (queue is None or self._table[task_id].queue == queue)
            ]
            page = heapq.nsmallest(limit + 1, ids)
            tasks: list[Task] = []
            budget = params.max_bytes
            for task_id in page[:limit]:
                task = self._table[task_id]
                if budget is not None:
                    budget -= listed_size(task, omit_payloads=params.omit_payloads)
                    if budget < 0 and tasks:
                        break
                tasks.append(without_payloads(task) if params.omit_payloads else task)
            more = len(page) > len(tasks)
            return TaskPage(tasks=tasks, next_cursor=tasks[-1].id if more else None)

    async def _cancel_task(self, task_id: str) -> Task:
        async with self._locked() as now:
            task = self._get(task_id)
            if task.state == TaskState.ACTIVE:
                return self._archived(task, now, CANCELED_WHILE_RUNNING_ERROR)
            if task.state in TERMINAL_STATES:
                raise InvalidState(task_id, task.state, "cancel")
            return self._table.put(
                replace(task, state=TaskState.CANCELED, completed_at=now, updated_at=now), task
            )

    async def _delete_task(self, task_id: str) -> None:
        async with self._locked() as now:
            task = self._get(task_id)
            if task.state == TaskState.ACTIVE:
                raise InvalidState(task_id, task.state, "delete")
            promoted: dict[str, int] = {}
            # Those that wait for it resolve as if it had failed (or completed, when it
            # had): it never will now.
            ended = {task_id: task.state if task.state in TERMINAL_STATES else TaskState.CANCELED}
            while task_id in self._graph.pending:
                done = self._resolve(ended, MAX_BATCH, now)
                for queue, n in done.promoted.items():
                    promoted[queue] = promoted.get(queue, 0) + n
            self._table.drop(task, now, report=True)
            self._graph.drop(task_id)
            self._left_promoted = promoted

    async def _run_task_now(self, task_id: str) -> Task:
        async with self._locked() as now:
            task = self._get(task_id)
            if task.state not in _RUNNABLE_NOW:
                raise InvalidState(task_id, task.state, "run now")
            return self._table.put(
                replace(task, state=TaskState.PENDING, available_at=now, updated_at=now), task
            )

    async def _reschedule_task(self, task_id: str, process_at: datetime) -> Task:
        async with self._locked() as now:
            task = self._get(task_id)
            if task.state not in _RESCHEDULABLE:
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

    async def _archive_task(self, task_id: str) -> Task:
        async with self._locked() as now:
            task = self._get(task_id)
            if task.state not in WAITING_STATES:
                raise InvalidState(task_id, task.state, "archive")
            return self._archived(task, now, ARCHIVED_BY_ADMIN_ERROR)

    async def _revive_task(self, task_id: str) -> Task:
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
            # Those still BLOCKED on its failure wait for its new outcome.
            for waiting in self._graph.failed_dependents(task_id):
                dependent = self._table.get(waiting)
                if dependent is None or dependent.state is not TaskState.BLOCKED:
                    continue
                self._graph.settle(waiting, task_id, DependencyOutcome.OPEN)
                open_count, failed = self._graph.counts(waiting)
                self._graph.set_counts(waiting, open_count + 1, failed - 1)
                self._graph.pending.add(task_id)
                self._table.put(replace(dependent, updated_at=now), dependent)
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

    async def _set_queue_paused(self, queue: str, paused: bool) -> None:
        async with self._locked():
            self._paused[queue] = paused

    async def _queue_paused(self, queue: str) -> bool:
        async with self._locked():
            return self._paused.get(queue, False)

    async def _info(self) -> BrokerInfo:
        # Driver ``memory``, no schema.
        async with self._locked():
            return BrokerInfo(driver="memory", version=package_version())

    async def _upkeep_storage(self) -> StorageUpkeep:
        # Nothing to keep up: no planner, no dead row versions.
        async with self._locked():
            return StorageUpkeep()

    # ---------------------------------------------------- webhook registrations

    def _webhook(self, name: str) -> WebhookWorker:
        worker = self._webhooks.get(name)
        if worker is None:
            raise WebhookWorkerNotFound(name)
        return worker

    async def _upsert_webhook_worker(self, spec: WebhookWorkerSpec) -> WebhookWorker:
        async with self._locked() as now:
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
                batch_types=tuple(spec.batch_types),
            )
            self._webhooks[spec.name] = worker
            return worker

    async def _get_webhook_worker(self, name: str) -> WebhookWorker:
        async with self._locked():
            return self._webhook(name)

    async def _list_webhook_workers(self) -> list[WebhookWorker]:
        async with self._locked():
            return [self._webhooks[name] for name in sorted(self._webhooks)]

    async def _set_webhook_worker_paused(self, name: str, paused: bool) -> WebhookWorker:
        async with self._locked() as now:
            worker = replace(self._webhook(name), paused=paused, updated_at=now)
            self._webhooks[name] = worker
            return worker

    async def _delete_webhook_worker(self, name: str) -> None:
        async with self._locked():
            self._webhook(name)
            del self._webhooks[name]

    async def _replace_webhook_secrets(
        self, name: str, expected: tuple[str, ...], secrets: tuple[str, ...]
    ) -> bool:
        async with self._locked():
            stored = self._webhooks.get(name)
            if stored is None or stored.secrets != expected:
                return False
            self._webhooks[name] = replace(stored, secrets=secrets)
            return True

    # ------------------------------------------------------- aggregation groups

    async def _set_group_config(self, config: GroupConfig) -> GroupConfig:
        async with self._locked():
            stored = replace(config)
            self._group_configs[(config.queue, config.pattern)] = stored
            return stored

    async def _delete_group_config(self, queue: str, pattern: str) -> None:
        async with self._locked():
            if self._group_configs.pop((queue, pattern), None) is None:
                raise GroupConfigNotFound(queue, pattern)

    async def _list_group_configs(self, queue: str | None) -> list[GroupConfig]:
        async with self._locked():
            keys = sorted(k for k in self._group_configs if queue is None or k[0] == queue)
            return [self._group_configs[k] for k in keys]

    def _groups(self, queue: str | None, due_at: datetime | None = None) -> list[GroupStats]:
        """The groups with AGGREGATING members (of ``queue``); with ``due_at``, counting
        only the members due by then."""
        members: dict[tuple[str, str], list[Task]] = defaultdict(list)
        for task_id in self._table.ids(TaskState.AGGREGATING):
            task = self._table[task_id]
            if due_at is not None and task.available_at > due_at:
                continue
            if task.group is not None and (queue is None or task.queue == queue):
                members[(task.queue, task.group)].append(task)
        return [
            GroupStats(
                queue=key[0],
                group=key[1],
                size=len(tasks),
                oldest_at=min(t.created_at for t in tasks),
                newest_at=max(t.created_at for t in tasks),
            )
            for key, tasks in sorted(members.items())
        ]

    async def _group_stats(self, queue: str | None, limit: int) -> list[GroupStats]:
        async with self._locked():
            return self._groups(queue)[:limit]

    async def _due_groups(self, limit: int) -> list[DueGroup]:
        async with self._locked() as now:
            due: list[tuple[datetime, DueGroup]] = []
            for stats in self._groups(None, due_at=now):
                configs = [c for (q, _), c in self._group_configs.items() if q == stats.queue]
                config = groups.config_for(stats.group, configs)
                why = groups.trigger(stats, config, now)
                if why is not None:
                    found = DueGroup(stats.queue, stats.group, stats.size, why, config.max_size)
                    due.append((stats.oldest_at, found))
            due.sort(key=lambda pair: (pair[0], pair[1].queue, pair[1].group))
            return [found for _, found in due[:limit]]

    async def _lease_group(
        self, queue: str, group: str, limit: int, ttl: timedelta, holder: str
    ) -> list[Task]:
        async with self._locked() as now:
            members = [
                self._table[task_id]
                for task_id in self._table.ids(TaskState.AGGREGATING)
                if self._table[task_id].queue == queue and self._table[task_id].group == group
            ]
            live = [
                t
                for t in members
                if t.available_at <= now and (t.expires_at is None or t.expires_at > now)
            ]
            lease_id = new_id(now)
            return [
                self._table.put(
                    replace(
                        task,
                        state=TaskState.ACTIVE,
                        lease_id=lease_id,
                        lease_expires_at=now + ttl,
                        started_at=now,
                        progress=None,
                        updated_at=now,
                        holder=holder or None,
                    ),
                    task,
                )
                for task in heapq.nsmallest(limit, live, key=lambda t: (t.created_at, t.id))
            ]

    # -------------------------------------------------------- concurrency limits

    async def _set_concurrency_limit(self, limit: ConcurrencyLimit) -> ConcurrencyLimit:
        async with self._locked() as now:
            self._concurrency.setdefault(limit.queue, {})[limit.pattern] = limit
            self._promote_held(
                ((limit.queue, key) for key in self._table.held_keys(limit.queue)), now
            )
            return limit

    async def _list_concurrency_limits(self, queue: str | None) -> list[ConcurrencyLimit]:
        async with self._locked():
            return [
                self._concurrency[q][pattern]
                for q in sorted(self._concurrency)
                if queue is None or q == queue
                for pattern in sorted(self._concurrency[q])
            ]

    async def _delete_concurrency_limit(self, queue: str, pattern: str) -> None:
        async with self._locked() as now:
            limits = self._concurrency.get(queue, {})
            if limits.pop(pattern, None) is None:
                raise ConcurrencyLimitNotFound(queue, pattern)
            if not limits:
                del self._concurrency[queue]
            self._promote_held(((queue, key) for key in self._table.held_keys(queue)), now)

    # --------------------------------------------------------- circuit breakers

    async def _set_breaker_config(self, config: BreakerConfig) -> BreakerConfig:
        async with self._locked():
            self._breaker_configs[config.queue, config.pattern] = config
            return config

    async def _list_breaker_configs(self, queue: str | None) -> list[BreakerConfig]:
        async with self._locked():
            return [
                self._breaker_configs[key]
                for key in sorted(self._breaker_configs)
                if queue is None or key[0] == queue
            ]

    async def _delete_breaker_config(self, queue: str, pattern: str) -> None:
        async with self._locked():
            if self._breaker_configs.pop((queue, pattern), None) is None:
                raise BreakerConfigNotFound(queue, pattern)

    async def _put_breaker(self, breaker: Breaker) -> None:
        async with self._locked():
            self._breakers[breaker.queue, breaker.type, breaker.gateway] = breaker

    async def _drop_breaker(self, queue: str, task_type: str, gateway: str) -> bool:
        async with self._locked():
            return self._breakers.pop((queue, task_type, gateway), None) is not None

    async def _list_breakers(self, queue: str | None) -> list[Breaker]:
        async with self._locked():
            return [
                self._breakers[key]
                for key in sorted(self._breakers)
                if queue is None or key[0] == queue
            ]

    async def _take_probe(self, queue: str, task_type: str, until: datetime) -> bool:
        async with self._locked() as now:
            key = (queue, task_type, "")
            breaker = self._breakers.get(key)
            if breaker is None or breaker.until > now:
                return False
            self._breakers[key] = replace(breaker, status=BreakerStatus.HALF_OPEN, until=until)
            return True

    # -------------------------------------------------------------- rate limits

    def _bucket(self, queue: str, now: datetime) -> tuple[RateLimit, float] | None:
        stored = self._rates.get(queue)
        if stored is None:
            return None
        limit, tokens, at = stored
        return limit, rates.refilled(limit, tokens, at, now)

    def _keep(self, limit: RateLimit, tokens: float, now: datetime) -> None:
        at = self._rates[limit.queue][2] if limit.queue in self._rates else now
        # Time never runs backwards for a bucket (see conveyor_broker.rates).
        self._rates[limit.queue] = (limit, tokens, max(at, now))

    async def _set_rate_limit(self, limit: RateLimit) -> RateLimit:
        async with self._locked() as now:
            bucket = self._bucket(limit.queue, now)
            tokens = float(limit.burst) if bucket is None else min(bucket[1], limit.burst)
            self._keep(limit, tokens, now)
            return limit

    async def _get_rate_limit(self, queue: str) -> RateLimit | None:
        async with self._locked():
            stored = self._rates.get(queue)
            return None if stored is None else stored[0]

    async def _list_rate_limits(self) -> list[RateLimit]:
        async with self._locked():
            return [self._rates[queue][0] for queue in sorted(self._rates)]

    async def _delete_rate_limit(self, queue: str) -> None:
        async with self._locked():
            if self._rates.pop(queue, None) is None:
                raise RateLimitNotFound(queue)

    async def _take_rate_tokens(self, queue: str, want: int) -> RateGrant:
        async with self._locked() as now:
            bucket = self._bucket(queue, now)
            if bucket is None:
                return RateGrant(want)
            limit, tokens = bucket
            grant, left = rates.take(limit, tokens, want)
            self._keep(limit, left, now)
            return grant

    async def _return_rate_tokens(self, queue: str, count: int) -> None:
        async with self._locked() as now:
            bucket = self._bucket(queue, now)
            if bucket is not None:
                limit, tokens = bucket
                self._keep(limit, min(float(limit.burst), tokens + count), now)

    # ------------------------------------------------------------- cron entries

    def _cron(self, name: str) -> CronEntry:
        entry = self._cron_entries.get(name)
        if entry is None:
            raise CronEntryNotFound(name)
        return entry

    async def _upsert_cron_entry(self, spec: CronEntrySpec) -> CronEntry:
        async with self._locked() as now:
            stored = self._cron_entries.get(spec.name)
            entry = CronEntry(
                name=spec.name,
                schedule=spec.schedule,
                timezone=spec.timezone,
                task=cron_template(spec.task),
                paused=bool(spec.paused),
                misfire=spec.misfire,
                next_run_at=self._cron_next_run(spec, stored, now),
                last_run_at=None if stored is None else stored.last_run_at,
                created_at=now if stored is None else stored.created_at,
                updated_at=now,
            )
            self._cron_entries[spec.name] = entry
            return entry

    async def _get_cron_entry(self, name: str) -> CronEntry:
        async with self._locked():
            return self._cron(name)

    async def _list_cron_entries(self) -> list[CronEntry]:
        async with self._locked():
            return [self._cron_entries[name] for name in sorted(self._cron_entries)]

    async def _list_due_cron_entries(self, limit: int) -> list[CronEntry]:
        async with self._locked() as now:
            due = [
                entry
                for entry in self._cron_entries.values()
                if entry.next_run_at is not None and entry.next_run_at <= now
            ]
            due.sort(key=lambda entry: (entry.next_run_at or now, entry.name))
            return due[:limit]

    async def _set_cron_paused(self, name: str, paused: bool) -> CronEntry:
        async with self._locked() as now:
            entry = self._cron(name)
            if entry.paused == paused:
                return entry
            entry = replace(
                entry,
                paused=paused,
                next_run_at=None if paused else self._cron_resumed(entry, now),
                updated_at=now,
            )
            self._cron_entries[name] = entry
            return entry

    async def _delete_cron_entry(self, name: str) -> None:
        async with self._locked():
            self._cron(name)
            del self._cron_entries[name]

    async def _fire_cron_entry(
        self,
        name: str,
        expected: datetime,
        next_run_at: datetime | None,
        slot: datetime | None,
    ) -> CronFired:
        async with self._locked() as now:
            entry = self._cron_entries.get(name)
            if entry is None or entry.next_run_at != expected:
                return CronFired(applied=False)
            result: EnqueueResult | None = None
            if slot is not None:
                task = self._cron_task(name, cron.slot_task(name, entry.task, slot))
                try:
                    result = self._store([task], now)[0]
                except DuplicateTask:
                    result = None  # a live task holds the slot's key: the slot has its task
            entry = replace(
                entry,
                next_run_at=next_run_at,
                last_run_at=entry.last_run_at if slot is None else slot,
            )
            self._cron_entries[name] = entry
            return CronFired(applied=True, entry=entry, task=result)

    async def _trigger_cron_entry(self, name: str) -> EnqueueResult:
        async with self._locked() as now:
            task = self._cron_task(name, cron.triggered_task(name, self._cron(name).task, now))
            return self._store([task], now)[0]

    # --------------------------------------------------------------- lifecycle

    async def close(self) -> None:
        """Drop everything; later calls raise BrokerClosed."""
        async with self._lock:
            self._closed = True
            self._table = TaskTable()
            self._graph = DependencyGraph()
            self._webhooks = {}
            self._cron_entries = {}
            self._group_configs = {}
            self._rates = {}
            self._breaker_configs = {}
            self._breakers = {}


def _waiting(task: Task, state: TaskState) -> TaskState:
    """Where an attempt that did not end ``task`` leaves it: ``state`` (RETRY or PENDING),
    or AGGREGATING for a group's member (its group is delivered whole again)."""
    return TaskState.AGGREGATING if task.group is not None else state


def _promoted_state(task: Task, now: datetime) -> TaskState:
    """Where a BLOCKED task goes once its dependencies let it run."""
    if task.group is not None:
        return TaskState.AGGREGATING
    if task.process_at is not None and task.process_at > now:
        return TaskState.SCHEDULED
    return TaskState.PENDING


def _is_due(task: Task, now: datetime) -> bool:
    """What ``lease`` may pick, given the task is PENDING or RETRY."""
    return task.available_at <= now and (task.expires_at is None or task.expires_at > now)


def _lease_order(task: Task) -> tuple[datetime, str]:
    """Where an ACTIVE task comes in a sweep by lease expiry."""
    assert task.lease_expires_at is not None
    return task.lease_expires_at, task.id


def _lease_expiry(task: Task) -> datetime | None:
    return task.lease_expires_at


def _available(task: Task) -> datetime | None:
    return task.available_at


def _expires_at(task: Task) -> datetime | None:
    return task.expires_at
