"""The Broker interface: the only durable state in Conveyor.

Every implementation (memory, postgres) passes the same conformance suite
(``conveyor_broker.testing``). Rules every implementation keeps:

- "now" comes from the injected :class:`~conveyor_broker.clock.Clock`, never from the
  system or the database;
- every method is safe to call concurrently;
- every batch method commits all-or-nothing;
- lease-scoped methods (``extend_lease``, ``set_progress``, ``ack``, ``fail``,
  ``release``, ``archive``; per item ``extend_leases`` and ``ack_batch``) match
  ``state == ACTIVE and lease_id == lease_id`` and raise
  :class:`~conveyor_broker.errors.LeaseLost` otherwise: also for an unknown task and for
  any lease id that does not match (malformed ones included). They do not look at
  ``lease_expires_at``: a lease past its expiry still works until the reaper takes it;
- every change of a task's state is reported to the event sink after it is committed and
  before the method returns: one event per task that was created (``previous_state``
  None), changed state, or was deleted (``state`` None). Changes that leave the state as it
  was (``extend_lease``, ``set_progress``, ``run_task_now`` of a PENDING task, a
  ``reschedule_task`` that stays SCHEDULED, an idempotent re-enqueue) report nothing.
  ``error`` is the task's ``last_error`` when the new state is RETRY or ARCHIVED, else
  None. An exception raised by the sink is logged and swallowed;
- dependencies (see :mod:`conveyor_broker.dependencies`): a change that ends a task
  (COMPLETED, ARCHIVED, CANCELED, or deleted) whose dependents are not resolved yet, or
  whose deletion settled some, reports that work to the dependency sink after the commit
  (:meth:`Broker.set_dependency_sink`), as a :class:`~conveyor_broker.types.Resolution`:
  who holds the sink resolves it (:meth:`Broker.resolve_dependents`) and wakes the
  queues of what was promoted. Nothing is lost if no one does: the sweep
  :meth:`Broker.promote_ready_dependents` finds every ended task with unresolved
  dependents. ``resolve_dependents`` and ``promote_ready_dependents`` report nothing
  there: they return their work.

Conventions of every method:

- a malformed task id (not a ULID) raises InvalidTask; a well-formed unknown one raises
  TaskNotFound, except in lease-scoped methods (LeaseLost, above);
- bad input raises InvalidTask before anything changes: invalid queue names, ``limit``
  outside 1..MAX_BATCH, lease ``ttl <= 0``, negative ``retry_delay`` or retention,
  naive datetimes, more than MAX_BATCH items in one batch;
- every change sets ``updated_at = now``; leaving ACTIVE clears ``lease_id`` and
  ``lease_expires_at``;
- a sweep with a ``limit`` takes the oldest rows first, then by id: by
  ``lease_expires_at`` (reap), ``available_at`` (promote), ``expires_at``
  (archive_expired), ``completed_at`` plus the retention that applies (purge);
- after ``close`` every method except ``close``, ``set_event_sink`` and
  ``set_dependency_sink`` raises BrokerClosed.

How the work is shared: :class:`Broker`'s public methods are the contract. Each one
raises BrokerClosed on a closed broker and InvalidTask for bad input, then hands the call
to a protected hook of the same name (``lease`` -> ``_lease``) that an implementation
provides and that may take its arguments as valid. So every implementation rejects the
same input the same way, and no implementation checks it again.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from importlib import metadata
from typing import ClassVar

from conveyor_broker.clock import Clock, SystemClock
from conveyor_broker.cron import CronSchedule
from conveyor_broker.dependencies import unique_dependencies
from conveyor_broker.errors import BrokerClosed, InvalidTask
from conveyor_broker.types import (
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
    DependencyListParams,
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
    TerminalPurgeParams,
    WebhookWorker,
    WebhookWorkerSpec,
)
from conveyor_broker.validation import (
    MAX_PAYLOAD,
    MAX_RETRY_CAP,
    MAX_TYPE_LEN,
    check_aware,
    check_batch,
    check_batch_size,
    check_breaker_config,
    check_concurrency_limit,
    check_cron_entry,
    check_cron_name,
    check_cursor,
    check_group_config,
    check_group_name,
    check_group_pattern,
    check_holder,
    check_holders,
    check_key_pattern,
    check_lease_ttl,
    check_lease_wants,
    check_limit,
    check_name_cursor,
    check_new_task,
    check_not_negative,
    check_queue,
    check_rate_limit,
    check_stored_secrets,
    check_task_id,
    check_text,
    check_type_pattern,
    check_webhook_name,
    check_webhook_worker,
    clean_error,
    unique_batch_types,
)

logger = logging.getLogger(__name__)

#: Called once per committed state change, in commit order. Must not block.
EventSink = Callable[[TaskEvent], None]
#: Called after a commit that left dependency work (see the module docstring). Must not
#: block.
DependencySink = Callable[[Resolution], None]
#: Makes the task a cron entry creates (entry name, task from the stored template): see
#: :meth:`Broker._cron_task`.
CronTaskHook = Callable[[str, NewTask], NewTask]

#: Most tasks one EnqueueBatch may carry.
MAX_BATCH = 1000
#: Default for NewTask.max_retry when it is None.
DEFAULT_MAX_RETRY = 25

#: Most task types one lease's ``exclude_types`` (or ``only_types``) may name.
MAX_TYPE_FILTER = 1000
#: The longest gateway name and worker id a stored breaker may carry.
MAX_BREAKER_NAME_LEN = 1024
_MILLISECOND = timedelta(milliseconds=1)

# What list_tasks and reap_expired_leases do when given no params.
_DEFAULT_LIST = TaskListParams()
_DEFAULT_REAP = LeaseReapParams()


def package_version() -> str:
    """The installed conveyor-broker version, for :meth:`Broker.info` ("0" from a bare
    checkout)."""
    try:
        return metadata.version("conveyor-broker")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0"


def check_task_type(name: str, task_type: str) -> None:
    """Raise InvalidTask unless ``task_type`` is a task type (1..MAX_TYPE_LEN characters,
    no control character), as ``name`` says in the message."""
    if not isinstance(task_type, str) or not 0 < len(task_type) <= MAX_TYPE_LEN:
        raise InvalidTask(f"{name} must be 1-{MAX_TYPE_LEN} characters, got {task_type!r}")
    check_text(name, task_type)


def type_filter(name: str, types: Collection[str]) -> tuple[str, ...]:
    """``types``, a lease's ``exclude_types`` or ``only_types``, checked (task types, at
    most :data:`MAX_TYPE_FILTER`) and in the form the hooks get: distinct, sorted.
    Raises InvalidTask."""
    if isinstance(types, str | bytes):
        raise InvalidTask(f"{name} is a collection of task types, not one type")
    if len(types) > MAX_TYPE_FILTER:
        raise InvalidTask(f"{name} names at most {MAX_TYPE_FILTER} types, got {len(types)}")
    for task_type in types:
        check_task_type(f"a type of {name}", task_type)
    return tuple(sorted(set(types)))


def _whole_ms(value: timedelta) -> timedelta:
    """``value`` to the millisecond below (what a stored breaker config keeps)."""
    return (value // _MILLISECOND) * _MILLISECOND


def _check_breaker_name(name: str, value: str) -> None:
    if not isinstance(value, str) or len(value) > MAX_BREAKER_NAME_LEN:
        raise InvalidTask(f"{name} is a text of at most {MAX_BREAKER_NAME_LEN} characters")
    check_text(name, value)


def check_breaker(breaker: Breaker) -> None:
    """Raise InvalidTask unless ``breaker`` is a breaker state a broker may store: a queue,
    a task type, a status, aware times, a whole ``failures >= 0``, a gateway and worker id
    (text, "" for none) and a holder ("" or a holder name)."""
    check_queue(breaker.queue)
    check_task_type("breaker type", breaker.type)
    if not isinstance(breaker.status, BreakerStatus):
        raise InvalidTask(f"status must be open or half_open, got {breaker.status!r}")
    for name in ("opened_at", "until"):
        value = getattr(breaker, name)
        if not isinstance(value, datetime):
            raise InvalidTask(f"{name} must be a datetime, got {value!r}")
        check_aware(name, value)
    n = breaker.failures
    if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n > 2**31 - 1:
        raise InvalidTask(f"failures must be a whole number 0..{2**31 - 1}, got {n!r}")
    _check_breaker_name("gateway", breaker.gateway)
    _check_breaker_name("worker_id", breaker.worker_id)
    if breaker.holder != "":
        check_holder(breaker.holder)


class Broker(abc.ABC):
    """The durable task store. See the module docstring for the rules.

    ``clock`` gives "now" (default: the system clock); ``max_payload`` caps one task's
    payload in bytes; ``default_max_retry`` is the ``max_retry`` of a task enqueued
    without one. ValueError for a negative ``max_payload`` or a ``default_max_retry``
    outside 0..MAX_RETRY_CAP.
    """

    #: True when every task a call returns is a new object that nothing else holds (no
    #: table, no cache keeps it; a repeated id in one ``enqueue_batch`` may return one
    #: object twice): a decorator may then set its fields in place rather than copy each
    #: task (:class:`~conveyor_broker.encrypted.EncryptedBroker` does, on the hot path).
    returns_fresh_tasks: ClassVar[bool] = False

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
        #: Set by ``close`` (each implementation's own), read by every public method.
        self._closed = False
        self._sink: EventSink | None = None
        self._dependency_sink: DependencySink | None = None
        self._cron_task_hook: CronTaskHook | None = None

    def _check_open(self) -> None:
        if self._closed:
            raise BrokerClosed("the broker is closed")

    def _emit(self, events: Iterable[TaskEvent]) -> None:
        """Report committed changes to the event sink, if there is one."""
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
                    "broker.event_sink_failed task_id=%s state=%s", event.task_id, event.state
                )

    def _report(self, resolution: Resolution) -> None:
        """Report dependency work a committed change left to the dependency sink."""
        sink = self._dependency_sink
        if sink is None or not resolution:
            return
        try:
            sink(resolution)
        except Exception:
            logger.exception("broker.dependency_sink_failed pending=%d", len(resolution.pending))

    # ------------------------------------------------------------------ enqueue

    async def enqueue(self, task: NewTask) -> EnqueueResult:
        """Store one task. Same as ``enqueue_batch([task])[0]``."""
        return (await self.enqueue_batch([task]))[0]

    async def enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        """Store up to MAX_BATCH tasks, all-or-nothing, and return them in order.

        Dependencies: ``depends_on`` names stored tasks or items of the same batch
        (earlier or later), each at most :data:`~conveyor_broker.validation.MAX_DEPENDENCIES`
        (repeats count once and are stored once). InvalidTask for an unknown id (the first,
        in batch order) or for a cycle among the batch's items (naming it). The initial
        state follows from the dependencies' states (see
        :func:`~conveyor_broker.dependencies.verdict`): CANCELED when one failed (ARCHIVED
        or CANCELED, or an item born CANCELED) and ``on_failure`` is CASCADE_CANCEL
        (``completed_at = now``, ``last_error`` naming the smallest such id); else BLOCKED
        while one has not ended, or when one failed and ``on_failure`` is BLOCK; else
        (every one COMPLETED, or ended and ``on_failure`` is CONTINUE) as without
        dependencies: AGGREGATING when ``group`` is set, else SCHEDULED when
        ``process_at`` is after now, else PENDING. A task born CANCELED takes no unique
        claim and is not checked against one. Items that name a repeated id refer to its
        first occurrence.

        ``available_at`` is ``process_at`` or now. ``max_retry`` None takes the broker's
        default; ``unique_until`` is ``now + unique_ttl`` (None without a ``unique_ttl``);
        ``created_at = updated_at = now``; ``retried`` is 0; the other execution fields are
        None.

        Idempotent on id: a task whose id is already stored is returned as stored, with
        ``created=False``, and nothing about it changes (the new request is not compared
        with it, and its unique key is not checked). Raises InvalidTask for bad input
        (see ``conveyor_broker.validation``) or an unknown dependency or a cycle,
        DuplicateTask when a unique key is held by a live task (or twice within the
        batch). InvalidTask wins when a batch has both. With several conflicts,
        ``existing_id`` names the holder of one of them (a stored task or an earlier item
        of the batch).

        Unique claims: a task holds the claim on ``(queue, unique_key)`` while its state is
        not terminal and ``unique_until`` is None or after now. So a claim lapses at
        ``unique_until`` and is freed when its holder completes, is archived or canceled,
        or is deleted. Freeing a claim never changes the holder's ``unique_key`` or
        ``unique_until`` as read back. Nothing is stored when anything raises.
        """
        self._check_open()
        check_batch(tasks, max_batch=MAX_BATCH, max_payload=self._max_payload)
        if not tasks:
            return []
        tasks = [
            task
            if len(task.depends_on) < 2 or len(set(task.depends_on)) == len(task.depends_on)
            else replace(task, depends_on=unique_dependencies(task.depends_on))
            for task in tasks
        ]
        return await self._enqueue_batch(tasks)

    # -------------------------------------------------------------------- lease

    async def lease(
        self,
        queue: str,
        limit: int,
        ttl: timedelta,
        *,
        holders: Sequence[str] = (),
        exclude_types: Collection[str] = (),
        only_types: Collection[str] | None = None,
    ) -> list[Task]:
        """Lease up to ``limit`` due tasks of ``queue`` in one round trip.

        Due: state PENDING or RETRY, ``available_at <= now`` and ``expires_at`` None or
        after now. Oldest ``available_at`` first, then id. Each leased task becomes ACTIVE
        with a new ``lease_id`` (a ULID), ``lease_expires_at = now + ttl``,
        ``started_at = now`` and ``progress`` None (a new attempt reports afresh).
        ``retried`` and ``last_error`` are unchanged. Concurrent callers never receive the
        same task. Pause is the dispatcher's business: lease does not look at it.

        ``holders`` names who holds the leases (see :meth:`release_dead_holders`): when
        k tasks are leased, each is held by one of the first k entries, each entry used
        once, in no particular order (``Task.holder`` tells which); "" or no entry
        (``holders`` may be shorter than ``limit``, not longer): by nobody.

        Type filters (what circuit breakers need, :mod:`conveyor_broker.breakers`): only
        tasks whose ``type`` is not in ``exclude_types`` and, when ``only_types`` is given
        (not None), is in it are leased; the others are left as they are, as if they
        were not there (they are not parked by a concurrency limit either). Each names at
        most :data:`MAX_TYPE_FILTER` task types; InvalidTask otherwise.
        """
        self._check_open()
        check_queue(queue)
        check_limit(limit, upper=MAX_BATCH)
        check_lease_ttl(ttl)
        check_holders(holders, limit=limit)
        exclude = type_filter("exclude_types", exclude_types)
        only = None if only_types is None else type_filter("only_types", only_types)
        return await self._lease(queue, limit, ttl, tuple(holders), exclude, only)

    async def lease_many(
        self,
        wants: Sequence[tuple[str, int]],
        ttl: timedelta,
        *,
        holders: Sequence[Sequence[str]] = (),
    ) -> list[list[Task]]:
        """:meth:`lease` for several queues in one round trip: ``wants`` pairs a queue
        with its limit; the result holds each queue's leased tasks, in the order of
        ``wants``, each list as ``lease`` would return it. Queues must be distinct and the
        limits add up to at most MAX_BATCH; InvalidTask otherwise (nothing leased).
        ``holders[i]`` is the ``holders`` of ``wants[i]`` (fewer entries than ``wants``:
        the rest are held by nobody).
        """
        self._check_open()
        check_lease_wants(wants, upper=MAX_BATCH)
        check_lease_ttl(ttl)
        if len(holders) > len(wants):
            raise InvalidTask(f"{len(holders)} holder lists for {len(wants)} queues")
        for (_, limit), queue_holders in zip(wants, holders, strict=False):
            check_holders(queue_holders, limit=limit)
        if not wants:
            return []
        padded = [tuple(h) for h in holders] + [()] * (len(wants) - len(holders))
        return await self._lease_many(wants, ttl, padded)

    async def extend_lease(self, task_id: str, lease_id: str, ttl: timedelta) -> datetime:
        """Set ``lease_expires_at = now + ttl`` and return it. Raises LeaseLost."""
        self._check_open()
        check_lease_ttl(ttl)
        check_task_id(task_id)
        return await self._extend_lease(task_id, lease_id, ttl)

    async def extend_leases(self, leases: Sequence[LeaseRef], ttl: timedelta) -> list[LeaseRef]:
        """Extend many leases in one round trip; return the ones that are lost, in input
        order. The others get ``lease_expires_at = now + ttl``."""
        self._check_open()
        check_lease_ttl(ttl)
        check_batch_size(leases, upper=MAX_BATCH)
        for ref in leases:
            check_task_id(ref.task_id)
        if not leases:
            return []
        return await self._extend_leases(leases, ttl)

    async def set_progress(self, task_id: str, lease_id: str, progress: bytes) -> None:
        """Store the running task's progress. Raises LeaseLost."""
        self._check_open()
        check_task_id(task_id)
        await self._set_progress(task_id, lease_id, progress)

    # ----------------------------------------------------------------- outcomes

    async def ack(self, task_id: str, lease_id: str, result: bytes | None = None) -> Task:
        """ACTIVE -> COMPLETED, storing ``result``; ``completed_at = now``. Raises LeaseLost."""
        self._check_open()
        check_task_id(task_id)
        return await self._ack(task_id, lease_id, result)

    async def ack_batch(self, items: Sequence[AckItem]) -> list[bool]:
        """Ack many tasks in one transaction. Returns, per item, False when its lease was
        lost (that item is skipped; the others still complete). Items are applied in
        order, so a repeated item is lost the second time."""
        self._check_open()
        check_batch_size(items, upper=MAX_BATCH)
        for item in items:
            check_task_id(item.task_id)
        if not items:
            return []
        return await self._ack_batch(items)

    async def fail(
        self,
        task_id: str,
        lease_id: str,
        error: str,
        retry_delay: timedelta,
        *,
        skip_retry: bool = False,
    ) -> Task:
        """A failed attempt. ``retried`` goes up by one and ``last_error = error`` (as
        :func:`~conveyor_broker.validation.clean_error` mends it: cut to MAX_ERROR_LEN
        characters, NUL replaced; this holds for ``archive`` too).

        When ``skip_retry`` or ``retried`` (before the increment) ``>= max_retry``: ARCHIVED
        with ``completed_at = now``. Otherwise RETRY with ``available_at = now +
        retry_delay`` (a member of an aggregation group: back to AGGREGATING, so its group
        delivers it again, once it is due). The lease is cleared; ``progress`` is kept.
        Raises LeaseLost;
        InvalidTask for a negative ``retry_delay``.
        """
        self._check_open()
        check_not_negative("retry_delay", retry_delay)
        check_task_id(task_id)
        return await self._fail(task_id, lease_id, clean_error(error), retry_delay, skip_retry)

    async def release(self, task_id: str, lease_id: str) -> Task:
        """Give a task back untouched: ACTIVE -> PENDING (a group's member: AGGREGATING),
        due now (``available_at = now``), ``retried`` and ``last_error`` unchanged. Raises
        LeaseLost."""
        self._check_open()
        check_task_id(task_id)
        return await self._release(task_id, lease_id)

    async def archive(self, task_id: str, lease_id: str, error: str) -> Task:
        """ACTIVE -> ARCHIVED at once (skip-retry): ``last_error = error``,
        ``completed_at = now``, ``retried`` unchanged. Raises LeaseLost."""
        self._check_open()
        check_task_id(task_id)
        return await self._archive(task_id, lease_id, clean_error(error))

    # -------------------------------------------------------- maintenance sweeps

    async def reap_expired_leases(
        self, params: LeaseReapParams = _DEFAULT_REAP
    ) -> list[ReapedTask]:
        """ACTIVE tasks with ``lease_expires_at <= now`` fail with LEASE_EXPIRED_ERROR:
        RETRY (due after ``params.retry_delay``; a group's member AGGREGATING) or ARCHIVED
        when exhausted, exactly like ``fail`` (``retried`` goes up by one). At most ``params.limit``; returns them,
        oldest ``lease_expires_at`` first."""
        self._check_open()
        check_limit(params.limit, upper=MAX_BATCH)
        check_not_negative("retry_delay", params.retry_delay)
        return await self._reap_expired_leases(params)

    async def beat_holder(self, holder: str) -> None:
        """Record that ``holder`` is alive now (its last beat: now).

        A holder is a process whose gateways hold leases (an api process): the dispatcher
        names it when it leases (``lease(holders=...)``), and once it stops beating, the
        tasks it held are released by :meth:`release_dead_holders` instead of waiting for
        their leases to expire. InvalidTask for a malformed name (see
        :func:`~conveyor_broker.validation.check_holder`).
        """
        self._check_open()
        check_holder(holder)
        await self._beat_holder(holder)

    async def release_dead_holders(self, params: HolderReleaseParams) -> list[ReleasedTask]:
        """Release the tasks of dead holders.

        A holder is dead when its last beat is at or before ``now - params.silence`` and
        it is not in ``params.alive``; a holder that never beat (or was forgotten) is not
        dead: its tasks wait for their leases to expire. The ACTIVE tasks held by dead
        holders go back as :meth:`release` gives a task back: PENDING, due now, ``retried``
        and ``last_error`` unchanged, lease cleared: the worker did not fail, its holder
        went away, so no attempt is spent (a worker's late outcome finds its lease lost);
        a group's member goes back to AGGREGATING.
        At most ``params.limit``, oldest ``lease_expires_at`` first, then id; returns them
        in that order.

        A dead holder that holds no ACTIVE task when the call begins is forgotten (so the
        call after the one that released its last task forgets it); a later beat makes it
        alive again. InvalidTask for ``silence <= 0``, a ``limit`` outside 1..MAX_BATCH or
        a malformed name in ``alive``.

        The stored circuit breakers held by dead holders (``Breaker.holder``: the
        WORKER-scope breakers of a process that died) are dropped too, all of them
        whatever ``limit`` says: they died with their gateways.
        """
        self._check_open()
        if params.silence <= timedelta(0):
            raise InvalidTask(f"silence must be > 0, got {params.silence}")
        check_limit(params.limit, upper=MAX_BATCH)
        for holder in params.alive:
            check_holder(holder)
        return await self._release_dead_holders(params)

    async def promote_scheduled(self, limit: int = 1000) -> dict[str, int]:
        """SCHEDULED tasks with ``available_at <= now`` become PENDING (``available_at``
        unchanged). Returns the number promoted per queue (queues with none are left
        out)."""
        self._check_open()
        check_limit(limit, upper=MAX_BATCH)
        return await self._promote_scheduled(limit)

    async def purge_terminal(self, params: TerminalPurgeParams) -> int:
        """Delete terminal rows past their retention and return how many.

        COMPLETED rows go when ``completed_at + retention <= now``, where a task's own
        ``retention`` (zero included) wins over ``params.default_retention`` when it is
        set; ARCHIVED and CANCELED rows when ``completed_at + params.archive_retention <=
        now``. Rows in other states are never purged, nor ended rows whose dependents are
        not resolved yet (they wait for :meth:`resolve_dependents` or the sweep). A
        purged task's edges to the tasks it waited for go with it; edges of tasks that
        waited for it stay (with their outcome). With more rows past their retention
        than ``params.limit``, the ones whose purge time (``completed_at`` plus the
        retention that applies) is oldest go first, then by id, whatever their state.
        Purged rows report no events. An implementation may also drop lapsed unique claims
        here (housekeeping; not observable).
        """
        self._check_open()
        check_not_negative("archive_retention", params.archive_retention)
        check_not_negative("default_retention", params.default_retention)
        check_limit(params.limit, upper=MAX_BATCH)
        return await self._purge_terminal(params)

    async def archive_expired(self, limit: int = 1000) -> list[Task]:
        """Waiting tasks (any of WAITING_STATES) with ``expires_at <= now`` become ARCHIVED
        with ``last_error = EXPIRED_ERROR`` and ``completed_at = now``. Returns them,
        oldest ``expires_at`` first. ACTIVE tasks are left alone."""
        self._check_open()
        check_limit(limit, upper=MAX_BATCH)
        return await self._archive_expired(limit)

    # ------------------------------------------------------------- dependencies

    async def resolve_dependents(self, task_ids: Sequence[str], limit: int = 1000) -> Resolution:
        """Settle the edges of the tasks that wait for ``task_ids`` (up to MAX_BATCH ids),
        at most ``limit`` edges (1..MAX_BATCH) in one transaction.

        Only ended tasks (COMPLETED, ARCHIVED, CANCELED) whose dependents are not all
        resolved take part; other ids are ignored. Their open edges are taken by
        dependency id, then dependent id, the first ``limit``: each becomes SATISFIED
        (the dependency completed) or FAILED, and the dependent's counters follow. A
        dependent still BLOCKED then follows its :func:`~conveyor_broker.dependencies.verdict`:
        RUN promotes it (AGGREGATING when ``group`` is set, else SCHEDULED when
        ``process_at`` is after now, else PENDING; ``available_at`` unchanged), CANCEL
        cancels it (``completed_at = now``, ``last_error`` naming the smallest dependency
        id that failed among the edges settled here for it), WAIT leaves it BLOCKED.
        Dependents in other states (run now, canceled by an operator) only have their
        edges settled. Every change sets ``updated_at = now`` on the dependent.

        Returns the work done and left: ``promoted`` (PENDING, per queue), ``canceled``,
        ``edges`` (settled), and ``pending``: the ids whose edges are not all settled yet
        and the canceled tasks that have dependents of their own, in id order (call again
        with them). A resolution repeated (a notification heard twice, the sweep after
        the resolver) settles nothing twice. Events are reported as always.
        """
        self._check_open()
        check_batch_size(task_ids, upper=MAX_BATCH)
        for task_id in task_ids:
            check_task_id(task_id)
        check_limit(limit, upper=MAX_BATCH)
        if not task_ids:
            return Resolution()
        return await self._resolve_dependents(sorted(set(task_ids)), limit)

    async def promote_ready_dependents(
        self, limit: int = 1000, *, min_age: timedelta = timedelta(0)
    ) -> Resolution:
        """The sweep behind resolution: find up to ``limit`` ended tasks whose dependents
        are not all resolved and that ended at least ``min_age`` ago (oldest
        ``completed_at`` first, then id), and :meth:`resolve_dependents` them (at most
        ``limit`` edges). Catches what a lost notification or a resolver that died
        mid-cascade left. Bounded: an index walk of ``limit`` rows, never a scan."""
        self._check_open()
        check_limit(limit, upper=MAX_BATCH)
        check_not_negative("min_age", min_age)
        return await self._promote_ready_dependents(limit, min_age)

    async def list_dependencies(self, params: DependencyListParams) -> DependencyPage:
        """A page of the edges of task ``params.task_id``: to the tasks it waits for, or
        (``params.dependents``) from the tasks that wait for it, by the other task's id
        after ``params.cursor``, at most ``params.limit`` (1..MAX_BATCH). Each names how
        the edge stands and the other task's queue, type and state (None when it is no
        longer stored). Raises TaskNotFound for an unknown task; InvalidTask for bad
        input."""
        self._check_open()
        check_task_id(params.task_id)
        check_limit(params.limit, upper=MAX_BATCH)
        check_cursor(params.cursor)
        return await self._list_dependencies(params)

    # ------------------------------------------------------- inspection / admin

    async def pending_count(self, queue: str | None = None) -> dict[str, int]:
        """Due tasks (what ``lease`` would pick now) per queue; queues with none are left
        out. With ``queue``, only that queue."""
        self._check_open()
        if queue is not None:
            check_queue(queue)
        return await self._pending_count(queue)

    async def due_count(self, queue: str, *, cap: int) -> int:
        """``queue``'s due tasks (what ``lease`` would pick now), counted up to ``cap``:
        ``min(cap, due)``. Its cost follows ``cap`` rather than the backlog, so it can be
        asked often (the api's enqueue admission does). InvalidTask for a bad queue name
        or a ``cap`` below 1."""
        self._check_open()
        check_queue(queue)
        if cap < 1:
            raise InvalidTask(f"cap must be at least 1, got {cap}")
        return await self._due_count(queue, cap)

    async def due_queues(self, *, after: str | None = None, limit: int = 1000) -> list[str]:
        """Queues that have a due task (what ``lease`` would pick now): the keys of
        ``pending_count()``, without counting. Sorted by name; only names after ``after``
        (a queue name, e.g. the last one of the previous page; any stored name works,
        even one the current rules refuse), at most ``limit`` (1..MAX_BATCH).
        InvalidTask for a bad ``after`` or ``limit``.

        For sweeps that only need to know where there is work, so its cost follows the
        number of queues rather than the number of due tasks.
        """
        self._check_open()
        if after is not None:
            check_name_cursor(after)
        check_limit(limit, upper=MAX_BATCH)
        return await self._due_queues(after, limit)

    async def due_among(self, queues: Sequence[str]) -> list[str]:
        """Which of ``queues`` have a due task (what ``lease`` would pick now), sorted by
        name, each once. At most MAX_BATCH names, each a valid queue name (InvalidTask
        otherwise; duplicates are fine).

        :meth:`due_queues` for a known set of queues (the ones some worker serves): its
        cost follows the number of names asked about, not the number of queues that
        hold work.
        """
        self._check_open()
        check_batch_size(queues, upper=MAX_BATCH)
        for queue in queues:
            check_queue(queue)
        if not queues:
            return []
        return await self._due_among(sorted(set(queues)))

    async def oldest_due(self, queues: Sequence[str]) -> dict[str, datetime]:
        """When the oldest due task (what ``lease`` would pick first now) of each of
        ``queues`` fell due, its ``available_at``, for the queues that have one (the
        others are left out), by name. The same input rules as :meth:`due_among`.

        :meth:`due_among` with the time, at the same cost: one probe of the due index per
        name (maintenance's sweep of the served queues, which gives the oldest due age of
        each to the metrics for nothing).
        """
        self._check_open()
        check_batch_size(queues, upper=MAX_BATCH)
        for queue in queues:
            check_queue(queue)
        if not queues:
            return {}
        return await self._oldest_due(sorted(set(queues)))

    async def queue_stats(self, queue: str | None = None) -> list[QueueStats]:
        """Per-state counts for every queue that has tasks (in any state) or a stored
        pause flag, sorted by name; with ``queue``, a single entry (all zeros for an
        unknown queue). ``counts`` maps every TaskState, zeros included."""
        self._check_open()
        if queue is not None:
            check_queue(queue)
        return await self._queue_stats(queue)

    async def list_queues(self, *, after: str | None = None, limit: int = 100) -> QueuePage:
        """:meth:`queue_stats` a page at a time: the queues (as ``queue_stats()`` lists
        them) whose names come after ``after`` (the ``next_cursor`` of the previous page;
        None: from the start), at most ``limit`` (1..MAX_BATCH), by name. ``next_cursor``
        is None exactly when no queue follows the page. InvalidTask for a bad ``after``
        or ``limit``."""
        self._check_open()
        if after is not None:
            check_name_cursor(after)
        check_limit(limit, upper=MAX_BATCH)
        return await self._list_queues(after, limit)

    async def get_task(self, task_id: str) -> Task:
        """The stored task. Raises TaskNotFound."""
        self._check_open()
        check_task_id(task_id)
        return await self._get_task(task_id)

    async def get_tasks(self, task_ids: Sequence[str]) -> list[Task]:
        """The stored tasks among ``task_ids`` (at most MAX_BATCH), in the order given,
        each once; unknown ids are left out. One round trip."""
        self._check_open()
        check_batch_size(task_ids, upper=MAX_BATCH)
        for task_id in task_ids:
            check_task_id(task_id)
        if not task_ids:
            return []
        return await self._get_tasks(list(dict.fromkeys(task_ids)))

    async def list_tasks(self, params: TaskListParams = _DEFAULT_LIST) -> TaskPage:
        """Tasks ordered by id, filtered by ``params.queue`` and ``params.state``.
        ``params.cursor`` is the ``next_cursor`` of the previous page (an opaque string);
        ``next_cursor`` is None exactly when no matching task follows the page.
        ``params.limit`` in 1..1000 (InvalidTask otherwise); a malformed cursor raises
        InvalidTask. ``params.max_bytes`` (>= 1) ends a page early, by
        :func:`~conveyor_broker.types.listed_size`; ``params.omit_payloads`` leaves out
        payloads, progress and results (see :class:`TaskListParams`)."""
        self._check_open()
        if params.queue is not None:
            check_queue(params.queue)
        check_limit(params.limit, upper=MAX_BATCH)
        check_cursor(params.cursor)
        if params.max_bytes is not None and params.max_bytes < 1:
            raise InvalidTask(f"max_bytes must be >= 1, got {params.max_bytes}")
        return await self._list_tasks(params)

    async def cancel_task(self, task_id: str) -> Task:
        """Waiting -> CANCELED (``completed_at = now``). ACTIVE -> ARCHIVED with
        CANCELED_WHILE_RUNNING_ERROR and ``completed_at = now`` (the lease is gone, so the
        worker's result will be dropped; the caller tells the worker to stop).
        ``retried`` is unchanged. Terminal -> InvalidState."""
        self._check_open()
        check_task_id(task_id)
        return await self._cancel_task(task_id)

    async def delete_task(self, task_id: str) -> None:
        """Delete a task that is not ACTIVE (InvalidState if it is). Its unique claim,
        if any, is freed. Tasks that wait for it are resolved first, in the same
        transaction, as if it had failed (or completed, when it had): a deleted task
        never completes. What that promoted, or left to resolve, goes to the dependency
        sink."""
        self._check_open()
        check_task_id(task_id)
        await self._delete_task(task_id)

    async def run_task_now(self, task_id: str) -> Task:
        """SCHEDULED, RETRY, PENDING or BLOCKED -> PENDING, due now (``available_at =
        now``). A BLOCKED task runs despite its unmet dependencies (an operator's
        override): their later outcomes settle its edges but no longer move it. Other
        states: InvalidState."""
        self._check_open()
        check_task_id(task_id)
        return await self._run_task_now(task_id)

    async def reschedule_task(self, task_id: str, process_at: datetime) -> Task:
        """PENDING, SCHEDULED or RETRY -> SCHEDULED with ``available_at = process_at``;
        when ``process_at`` is not after now, PENDING with ``available_at = now``. The
        task's ``process_at`` option is left as enqueued. Other states: InvalidState; a
        naive ``process_at``: InvalidTask."""
        self._check_open()
        check_aware("process_at", process_at)
        check_task_id(task_id)
        return await self._reschedule_task(task_id, process_at)

    async def archive_task(self, task_id: str) -> Task:
        """A waiting task -> ARCHIVED with ARCHIVED_BY_ADMIN_ERROR and ``completed_at =
        now``. Other states: InvalidState."""
        self._check_open()
        check_task_id(task_id)
        return await self._archive_task(task_id)

    async def revive_task(self, task_id: str) -> Task:
        """ARCHIVED -> PENDING, due now, ``retried = 0``, ``completed_at`` cleared
        (``last_error`` is kept as history). Other states: InvalidState. Raises
        DuplicateTask when another live task holds its (unlapsed) unique claim.

        Tasks still BLOCKED because it had failed (``on_failure`` BLOCK, or CONTINUE
        waiting for others) wait for its new outcome: their edges to it are open again
        (``updated_at = now`` on each), resolved when it ends next. This is how an
        operator repairs a blocked pipeline: fix the cause, revive what failed."""
        self._check_open()
        check_task_id(task_id)
        return await self._revive_task(task_id)

    async def set_queue_paused(self, queue: str, paused: bool) -> None:
        """Persist the pause flag of ``queue`` (the queue need not have tasks). Any call,
        ``paused=False`` included, stores a flag, so the queue shows in ``queue_stats``."""
        self._check_open()
        check_queue(queue)
        await self._set_queue_paused(queue, paused)

    async def queue_paused(self, queue: str) -> bool:
        """The stored pause flag (False for a queue never paused)."""
        self._check_open()
        check_queue(queue)
        return await self._queue_paused(queue)

    async def info(self) -> BrokerInfo:
        """What this broker is."""
        self._check_open()
        return await self._info()

    async def upkeep_storage(self) -> StorageUpkeep:
        """Keep the storage's query plans and indexes fit for the work it now holds.

        A task queue's table swings between empty and huge in seconds, faster than a
        database's own background upkeep follows. A broker whose storage has a query
        planner refreshes its statistics and removes dead row versions here when they
        have drifted far enough to matter; the maintenance service's storage role calls
        it every ``storage_tick``.
        Cheap when there is nothing to do. Storage without a planner (the memory broker)
        never has anything to do and reports so.
        """
        self._check_open()
        return await self._upkeep_storage()

    # ---------------------------------------------------- webhook registrations

    async def upsert_webhook_worker(self, spec: WebhookWorkerSpec) -> WebhookWorker:
        """Create or replace the registration ``spec.name`` and return it as stored.

        ``created_at`` is kept on replace; ``updated_at = now``. Empty ``spec.secrets``
        keeps the stored secrets (none on create). ``spec.batch_types`` replace the stored
        ones, each stored once (the first occurrence's order). Raises InvalidTask for bad
        input (see :func:`conveyor_broker.validation.check_webhook_worker`); nothing
        changes then.
        """
        self._check_open()
        check_webhook_worker(spec)
        batch_types = unique_batch_types(spec.batch_types)
        if batch_types != spec.batch_types:
            spec = replace(spec, batch_types=batch_types)
        return await self._upsert_webhook_worker(spec)

    async def get_webhook_worker(self, name: str) -> WebhookWorker:
        """The registration ``name``. Raises WebhookWorkerNotFound."""
        self._check_open()
        check_webhook_name(name)
        return await self._get_webhook_worker(name)

    async def list_webhook_workers(self) -> list[WebhookWorker]:
        """Every registration, by name."""
        self._check_open()
        return await self._list_webhook_workers()

    async def set_webhook_worker_paused(self, name: str, paused: bool) -> WebhookWorker:
        """Pause or resume a registration (``updated_at = now``). Raises
        WebhookWorkerNotFound."""
        self._check_open()
        check_webhook_name(name)
        return await self._set_webhook_worker_paused(name, paused)

    async def delete_webhook_worker(self, name: str) -> None:
        """Delete a registration. Raises WebhookWorkerNotFound."""
        self._check_open()
        check_webhook_name(name)
        await self._delete_webhook_worker(name)

    async def replace_webhook_secrets(
        self, name: str, expected: Sequence[str], secrets: Sequence[str]
    ) -> bool:
        """Store ``secrets`` for registration ``name`` if its stored secrets are still
        exactly ``expected`` (compare and set); True when they were replaced. False when
        they changed meanwhile or the registration is gone. Nothing else changes,
        ``updated_at`` included: this re-encrypts secrets (the webhook leader's upkeep),
        it is no operator's edit. Raises InvalidTask for bad input."""
        self._check_open()
        check_webhook_name(name)
        if not secrets:
            raise InvalidTask("replace_webhook_secrets needs at least one secret")
        check_stored_secrets(secrets)
        return await self._replace_webhook_secrets(name, tuple(expected), tuple(secrets))

    # ------------------------------------------------------- aggregation groups

    async def set_group_config(self, config: GroupConfig) -> GroupConfig:
        """Create or replace the config of ``config.queue`` and ``config.pattern``; return
        it as stored. InvalidTask for bad input (see
        :func:`conveyor_broker.validation.check_group_config`)."""
        self._check_open()
        check_group_config(config)
        return await self._set_group_config(config)

    async def delete_group_config(self, queue: str, pattern: str = "*") -> None:
        """Delete a config (its groups take the next matching one, or the defaults).
        Raises GroupConfigNotFound."""
        self._check_open()
        check_queue(queue)
        check_group_pattern(pattern)
        await self._delete_group_config(queue, pattern)

    async def list_group_configs(self, queue: str | None = None) -> list[GroupConfig]:
        """The stored configs (of ``queue``), by queue then pattern (code point order)."""
        self._check_open()
        if queue is not None:
            check_queue(queue)
        return await self._list_group_configs(queue)

    async def group_stats(self, queue: str | None = None, limit: int = 1000) -> list[GroupStats]:
        """The groups with waiting (AGGREGATING) members (of ``queue``), by queue then
        group (code point order), at most ``limit`` (1..MAX_BATCH)."""
        self._check_open()
        if queue is not None:
            check_queue(queue)
        check_limit(limit, upper=MAX_BATCH)
        return await self._group_stats(queue, limit)

    async def due_groups(self, limit: int = 100) -> list[DueGroup]:
        """The groups past a threshold (counting the members due now: one back from a
        failed attempt waits out its retry delay) of the config that applies to them
        (:func:`conveyor_broker.groups.config_for`, :func:`~conveyor_broker.groups.trigger`)
        at now, the oldest first member first (then queue, group), at most ``limit``
        (1..MAX_BATCH). ``max_size`` is the applying config's: how many members one
        delivery takes."""
        self._check_open()
        check_limit(limit, upper=MAX_BATCH)
        return await self._due_groups(limit)

    async def lease_group(
        self, queue: str, group: str, limit: int, ttl: timedelta, holder: str = ""
    ) -> list[Task]:
        """Lease up to ``limit`` AGGREGATING members of ``group`` in ``queue`` (those due,
        ``available_at <= now``, and not past their ``expires_at``), the earliest ``created_at`` first (then id), as one
        delivery: each becomes ACTIVE under the same new ``lease_id``, with
        ``lease_expires_at = now + ttl``, ``started_at = now`` and ``progress`` None.
        Concurrent callers never receive the same member. Outcomes stay per task.
        ``holder`` names who holds the lease, as :meth:`lease`'s ``holders`` do ("":
        nobody)."""
        self._check_open()
        check_queue(queue)
        check_group_name(group)
        check_limit(limit, upper=MAX_BATCH)
        check_lease_ttl(ttl)
        if holder:
            check_holder(holder)
        return await self._lease_group(queue, group, limit, ttl, holder)

    # -------------------------------------------------------------- rate limits

    async def set_rate_limit(self, limit: RateLimit) -> RateLimit:
        """Create or replace the rate limit of ``limit.queue``; return it as stored. A new
        bucket starts full (``burst`` tokens); a replaced one keeps the tokens it holds
        now, at most the new burst, so changing a limit never mints a fresh burst.
        InvalidTask for bad input (:func:`conveyor_broker.validation.check_rate_limit`)."""
        self._check_open()
        check_rate_limit(limit)
        return await self._set_rate_limit(
            RateLimit(limit.queue, float(limit.per_second), limit.burst)
        )

    async def get_rate_limit(self, queue: str) -> RateLimit | None:
        """The rate limit of ``queue``, or None when it has none."""
        self._check_open()
        check_queue(queue)
        return await self._get_rate_limit(queue)

    async def list_rate_limits(self) -> list[RateLimit]:
        """Every stored rate limit, by queue (code point order)."""
        self._check_open()
        return await self._list_rate_limits()

    async def delete_rate_limit(self, queue: str) -> None:
        """Delete the rate limit of ``queue`` (its tasks flow unlimited again). Raises
        RateLimitNotFound."""
        self._check_open()
        check_queue(queue)
        await self._delete_rate_limit(queue)

    async def take_rate_tokens(self, queue: str, want: int) -> RateGrant:
        """Spend up to ``want`` (1..MAX_BATCH) whole tokens of ``queue``'s bucket, refilled
        to now first (:mod:`conveyor_broker.rates`), atomically: concurrent callers (two
        dispatchers during a failover) never spend the same token. A queue with no limit
        grants ``want``. When it grants fewer, the grant says how long until the next
        token. The dispatcher takes tokens before it leases and gives back, with
        :meth:`return_rate_tokens`, those it leased no task for."""
        self._check_open()
        check_queue(queue)
        check_limit(want, upper=MAX_BATCH)
        return await self._take_rate_tokens(queue, want)

    async def return_rate_tokens(self, queue: str, count: int) -> None:
        """Give ``count`` (1..MAX_BATCH) tokens taken with :meth:`take_rate_tokens` back to
        ``queue``'s bucket (at most its burst); nothing when the queue has no limit."""
        self._check_open()
        check_queue(queue)
        check_limit(count, upper=MAX_BATCH)
        await self._return_rate_tokens(queue, count)

    # -------------------------------------------------------- concurrency limits

    async def set_concurrency_limit(self, limit: ConcurrencyLimit) -> ConcurrencyLimit:
        """Create or replace the concurrency limit of ``limit.queue`` for the keys that
        match ``limit.pattern``; return it as stored. From the next lease on, a task of a
        limited key is leased only while fewer than the key's limit are ACTIVE, else it is
        HELD (:mod:`conveyor_broker.concurrency`); tasks already ACTIVE are left running.
        HELD tasks whose key now has room are PENDING again at once. InvalidTask for bad
        input (:func:`conveyor_broker.validation.check_concurrency_limit`)."""
        self._check_open()
        check_concurrency_limit(limit)
        return await self._set_concurrency_limit(limit)

    async def list_concurrency_limits(self, queue: str | None = None) -> list[ConcurrencyLimit]:
        """The stored concurrency limits (of ``queue``, or of every queue), by queue and
        pattern (code point order)."""
        self._check_open()
        if queue is not None:
            check_queue(queue)
        return await self._list_concurrency_limits(queue)

    async def delete_concurrency_limit(self, queue: str, pattern: str = "*") -> None:
        """Delete the concurrency limit of ``queue`` for ``pattern``: the keys it limited
        take another pattern's limit or none, and their HELD tasks that now have room are
        PENDING again. Raises ConcurrencyLimitNotFound."""
        self._check_open()
        check_queue(queue)
        check_key_pattern(pattern)
        await self._delete_concurrency_limit(queue, pattern)

    # ---------------------------------------------------------- circuit breakers

    async def set_breaker_config(self, config: BreakerConfig) -> BreakerConfig:
        """Create or replace the circuit breaker config of ``config.queue`` for the task
        types that match ``config.pattern`` (:func:`conveyor_broker.breakers.config_for`
        picks a type's); return it as stored: ``window`` and ``cooldown`` to the
        millisecond below. The gateways read the configs and run the breakers
        (:class:`conveyor_broker.breakers.BreakerMachine`); a change applies from their
        next reload. InvalidTask for bad input
        (:func:`conveyor_broker.validation.check_breaker_config`); nothing changes then."""
        self._check_open()
        check_breaker_config(config)
        return await self._set_breaker_config(
            BreakerConfig(
                queue=config.queue,
                pattern=config.pattern,
                failures=config.failures,
                window=_whole_ms(config.window),
                cooldown=_whole_ms(config.cooldown),
                scope=BreakerScope(config.scope),
            )
        )

    async def list_breaker_configs(self, queue: str | None = None) -> list[BreakerConfig]:
        """The stored breaker configs (of ``queue``, or of every queue), by queue and
        pattern (code point order)."""
        self._check_open()
        if queue is not None:
            check_queue(queue)
        return await self._list_breaker_configs(queue)

    async def delete_breaker_config(self, queue: str, pattern: str = "*") -> None:
        """Delete the breaker config of ``queue`` for ``pattern`` (the types it covered
        take another pattern's config or none). Stored breakers are left: their gateways
        close them. Raises BreakerConfigNotFound."""
        self._check_open()
        check_queue(queue)
        check_type_pattern(pattern)
        await self._delete_breaker_config(queue, pattern)

    async def put_breaker(self, breaker: Breaker) -> None:
        """Store the state of a breaker that is not closed, replacing the one stored for
        its (queue, type, gateway): a gateway's own breaker (WORKER scope), or with gateway
        "" the queue-wide one (QUEUE scope) that the dispatchers obey. InvalidTask for bad
        input (:func:`check_breaker`)."""
        self._check_open()
        check_breaker(breaker)
        await self._put_breaker(breaker)

    async def drop_breaker(self, queue: str, task_type: str, gateway: str = "") -> bool:
        """Delete the stored breaker of (``queue``, ``task_type``, ``gateway``) (it closed,
        or its gateway went away); True when there was one."""
        self._check_open()
        check_queue(queue)
        check_task_type("task_type", task_type)
        _check_breaker_name("gateway", gateway)
        return await self._drop_breaker(queue, task_type, gateway)

    async def list_breakers(self, queue: str | None = None) -> list[Breaker]:
        """The stored breakers (of ``queue``, or of every queue), by queue, type and
        gateway (code point order)."""
        self._check_open()
        if queue is not None:
            check_queue(queue)
        return await self._list_breakers(queue)

    async def take_probe(self, queue: str, task_type: str, until: datetime) -> bool:
        """Take the probe of the queue-wide breaker of (``queue``, ``task_type``): when
        that breaker (gateway "") is stored and its ``until`` is at or before now (an OPEN
        one's cool-down is over, or a HALF_OPEN one's probe chance lapsed), make it
        HALF_OPEN with ``until`` (when this probe's chance lapses) and return True: the
        caller sends one task of the type as the probe. False otherwise (no such breaker,
        or it is not due): nothing changes.

        Atomic: of concurrent callers, exactly one takes a due probe (as long as ``until``
        is after now; one at or before it leaves the probe due at once)."""
        self._check_open()
        check_queue(queue)
        check_task_type("task_type", task_type)
        if not isinstance(until, datetime):
            raise InvalidTask(f"until must be a datetime, got {until!r}")
        check_aware("until", until)
        return await self._take_probe(queue, task_type, until)

    # ------------------------------------------------------------- cron entries

    async def upsert_cron_entry(self, spec: CronEntrySpec) -> CronEntry:
        """Create or replace the cron entry ``spec.name`` and return it as stored.

        ``next_run_at`` is the first slot after now, or None while paused. A replace keeps
        ``created_at``, ``last_run_at`` and, when the schedule, time zone and pause flag
        are unchanged, ``next_run_at`` (so applying the same entries again, say at every
        start of an application, never skips or repeats a slot); ``updated_at = now``.
        Raises InvalidTask for bad input (see
        :func:`conveyor_broker.validation.check_cron_entry`) and for a schedule that never
        fires (``0 0 31 2 *``); nothing changes then.
        """
        self._check_open()
        check_cron_entry(spec, max_payload=self._max_payload)
        schedule = CronSchedule.parse(spec.schedule, spec.timezone)
        if schedule.next_after(self._clock.now()) is None:
            raise InvalidTask(f"cron schedule {schedule.schedule!r} never fires")
        # Stored in a normal form, so that an entry applied again compares equal.
        spec = replace(spec, schedule=schedule.schedule, timezone=schedule.zone.key)
        return await self._upsert_cron_entry(spec)

    async def get_cron_entry(self, name: str) -> CronEntry:
        """The cron entry ``name``. Raises CronEntryNotFound."""
        self._check_open()
        check_cron_name(name)
        return await self._get_cron_entry(name)

    async def list_cron_entries(self) -> list[CronEntry]:
        """Every cron entry, by name."""
        self._check_open()
        return await self._list_cron_entries()

    async def list_due_cron_entries(self, limit: int = 100) -> list[CronEntry]:
        """Entries whose ``next_run_at`` is at or before now (paused ones have none), at
        most ``limit`` (1..MAX_BATCH), the earliest ``next_run_at`` first, then by name."""
        self._check_open()
        check_limit(limit, upper=MAX_BATCH)
        return await self._list_due_cron_entries(limit)

    async def set_cron_paused(self, name: str, paused: bool) -> CronEntry:
        """Pause an entry (``next_run_at`` becomes None: the slots that pass while it is
        paused never fire) or resume it (``next_run_at`` is the first slot after now).
        Setting the flag it already has changes nothing. Raises CronEntryNotFound."""
        self._check_open()
        check_cron_name(name)
        return await self._set_cron_paused(name, bool(paused))

    async def delete_cron_entry(self, name: str) -> None:
        """Delete an entry (the tasks it created stay). Raises CronEntryNotFound."""
        self._check_open()
        check_cron_name(name)
        await self._delete_cron_entry(name)

    async def fire_cron_entry(
        self,
        name: str,
        expected: datetime,
        next_run_at: datetime | None,
        slot: datetime | None,
    ) -> CronFired:
        """The scheduler's step: a compare-and-set of the entry's next run, and the task
        of ``slot``, in one transaction.

        Applies only when the entry exists, and its ``next_run_at`` is ``expected`` (so not
        paused); ``applied`` is False and nothing changes otherwise. When it applies,
        ``next_run_at`` becomes the given one (None: the schedule never fires again) and,
        with a ``slot``, the slot's task (:func:`conveyor_broker.cron.slot_task`, from the
        stored template) is enqueued and ``last_run_at = slot``. A slot task that is
        already stored (same id) is returned with ``created`` False; one whose unique key
        a live task holds is not created (``task`` None). ``next_run_at`` must be after
        ``expected``; InvalidTask otherwise, or for naive times, or when the template no
        longer makes a valid task (a lowered payload limit): then nothing changes.
        """
        self._check_open()
        check_cron_name(name)
        check_aware("expected", expected)
        check_aware("next_run_at", next_run_at)
        check_aware("slot", slot)
        if next_run_at is not None and next_run_at <= expected:
            raise InvalidTask("next_run_at must be after the expected next run")
        return await self._fire_cron_entry(name, expected, next_run_at, slot)

    async def trigger_cron_entry(self, name: str) -> EnqueueResult:
        """Enqueue entry ``name``'s task now, outside its schedule (a fresh id, no unique
        key, the slot header "manual"); its schedule and ``last_run_at`` are unchanged,
        and a paused entry can be triggered. Raises CronEntryNotFound."""
        self._check_open()
        check_cron_name(name)
        return await self._trigger_cron_entry(name)

    def _cron_next_run(
        self, spec: CronEntrySpec, stored: CronEntry | None, now: datetime
    ) -> datetime | None:
        """The ``next_run_at`` an upsert of ``spec`` over ``stored`` stores (see
        :meth:`upsert_cron_entry`); for implementations."""
        if spec.paused:
            return None
        if (
            stored is not None
            and not stored.paused
            and stored.schedule == spec.schedule
            and stored.timezone == spec.timezone
        ):
            return stored.next_run_at
        return CronSchedule.parse(spec.schedule, spec.timezone).next_after(now)

    def _cron_resumed(self, entry: CronEntry, now: datetime) -> datetime | None:
        """The ``next_run_at`` of ``entry`` resumed at ``now``; for implementations."""
        return CronSchedule.parse(entry.schedule, entry.timezone).next_after(now)

    def _cron_task(self, name: str, task: NewTask) -> NewTask:
        """The task entry ``name`` creates (a slot's or a trigger's), made from its template
        as stored, checked and in the form it is stored in; for implementations, called
        inside the transaction that reads the template. Raises InvalidTask when the
        template no longer makes a valid task (a lowered payload limit).

        The cron task hook (:meth:`set_cron_task_hook`) of a broker that wraps this one
        does both: the encrypted broker opens a template sealed to its entry, checks the
        plaintext and seals it again to the task's own id."""
        hook = self._cron_task_hook
        if hook is not None:
            return hook(name, task)
        check_new_task(task, max_payload=self._max_payload)
        return task

    def set_cron_task_hook(self, hook: CronTaskHook | None) -> None:
        """Make the tasks of cron entries with ``hook`` (see :meth:`_cron_task`); None:
        as the template says."""
        self._cron_task_hook = hook

    # --------------------------------------------------------------- lifecycle

    def set_event_sink(self, sink: EventSink | None) -> None:
        """Report every committed state change to ``sink`` (None stops reporting)."""
        self._sink = sink

    def set_dependency_sink(self, sink: DependencySink | None) -> None:
        """Report the dependency work that committed changes leave to ``sink`` (None stops
        reporting): see the module docstring."""
        self._dependency_sink = sink

    @property
    def dependency_sink(self) -> DependencySink | None:
        """The dependency sink set now, if any."""
        return self._dependency_sink

    @abc.abstractmethod
    async def close(self) -> None:
        """Release resources and set ``_closed``: later calls raise BrokerClosed; closing
        twice is harmless."""

    # ------------------------------------------------------------------- hooks
    # What an implementation provides: each public method's work, given an open broker
    # and arguments the public method has checked (batches are not empty).

    @abc.abstractmethod
    async def _enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]: ...

    @abc.abstractmethod
    async def _lease(
        self,
        queue: str,
        limit: int,
        ttl: timedelta,
        holders: tuple[str, ...],
        exclude_types: tuple[str, ...] = (),
        only_types: tuple[str, ...] | None = None,
    ) -> list[Task]: ...

    @abc.abstractmethod
    async def _lease_many(
        self,
        wants: Sequence[tuple[str, int]],
        ttl: timedelta,
        holders: Sequence[tuple[str, ...]],
    ) -> list[list[Task]]: ...

    @abc.abstractmethod
    async def _extend_lease(self, task_id: str, lease_id: str, ttl: timedelta) -> datetime: ...

    @abc.abstractmethod
    async def _extend_leases(
        self, leases: Sequence[LeaseRef], ttl: timedelta
    ) -> list[LeaseRef]: ...

    @abc.abstractmethod
    async def _set_progress(self, task_id: str, lease_id: str, progress: bytes) -> None: ...

    @abc.abstractmethod
    async def _ack(self, task_id: str, lease_id: str, result: bytes | None) -> Task: ...

    @abc.abstractmethod
    async def _ack_batch(self, items: Sequence[AckItem]) -> list[bool]: ...

    @abc.abstractmethod
    async def _fail(
        self, task_id: str, lease_id: str, error: str, retry_delay: timedelta, skip_retry: bool
    ) -> Task: ...

    @abc.abstractmethod
    async def _release(self, task_id: str, lease_id: str) -> Task: ...

    @abc.abstractmethod
    async def _archive(self, task_id: str, lease_id: str, error: str) -> Task: ...

    @abc.abstractmethod
    async def _reap_expired_leases(self, params: LeaseReapParams) -> list[ReapedTask]: ...

    @abc.abstractmethod
    async def _beat_holder(self, holder: str) -> None: ...

    @abc.abstractmethod
    async def _release_dead_holders(self, params: HolderReleaseParams) -> list[ReleasedTask]: ...

    @abc.abstractmethod
    async def _promote_scheduled(self, limit: int) -> dict[str, int]: ...

    @abc.abstractmethod
    async def _purge_terminal(self, params: TerminalPurgeParams) -> int: ...

    @abc.abstractmethod
    async def _archive_expired(self, limit: int) -> list[Task]: ...

    @abc.abstractmethod
    async def _resolve_dependents(self, task_ids: Sequence[str], limit: int) -> Resolution: ...

    @abc.abstractmethod
    async def _promote_ready_dependents(self, limit: int, min_age: timedelta) -> Resolution: ...

    @abc.abstractmethod
    async def _list_dependencies(self, params: DependencyListParams) -> DependencyPage: ...

    @abc.abstractmethod
    async def _pending_count(self, queue: str | None) -> dict[str, int]: ...

    @abc.abstractmethod
    async def _due_queues(self, after: str | None, limit: int) -> list[str]: ...

    @abc.abstractmethod
    async def _due_count(self, queue: str, cap: int) -> int: ...

    async def _due_among(self, queues: list[str]) -> list[str]:
        """``queues``: distinct valid names, sorted, at least one. This default pages
        through :meth:`_due_queues` (up to the last name asked about), for a broker that
        has nothing better; the memory and Postgres brokers look up the names instead."""
        wanted = set(queues)
        found: list[str] = []
        after: str | None = None
        while True:
            page = await self._due_queues(after, MAX_BATCH)
            found += [queue for queue in page if queue in wanted]
            if len(page) < MAX_BATCH or page[-1] >= queues[-1]:
                return found
            after = page[-1]

    @abc.abstractmethod
    async def _oldest_due(self, queues: list[str]) -> dict[str, datetime]:
        """``queues``: distinct valid names, sorted, at least one."""

    @abc.abstractmethod
    async def _queue_stats(self, queue: str | None) -> list[QueueStats]: ...

    @abc.abstractmethod
    async def _get_task(self, task_id: str) -> Task: ...

    @abc.abstractmethod
    async def _get_tasks(self, task_ids: Sequence[str]) -> list[Task]: ...

    @abc.abstractmethod
    async def _list_tasks(self, params: TaskListParams) -> TaskPage: ...

    @abc.abstractmethod
    async def _list_queues(self, after: str | None, limit: int) -> QueuePage: ...

    @abc.abstractmethod
    async def _cancel_task(self, task_id: str) -> Task: ...

    @abc.abstractmethod
    async def _delete_task(self, task_id: str) -> None: ...

    @abc.abstractmethod
    async def _run_task_now(self, task_id: str) -> Task: ...

    @abc.abstractmethod
    async def _reschedule_task(self, task_id: str, process_at: datetime) -> Task: ...

    @abc.abstractmethod
    async def _archive_task(self, task_id: str) -> Task: ...

    @abc.abstractmethod
    async def _revive_task(self, task_id: str) -> Task: ...

    @abc.abstractmethod
    async def _set_queue_paused(self, queue: str, paused: bool) -> None: ...

    @abc.abstractmethod
    async def _queue_paused(self, queue: str) -> bool: ...

    @abc.abstractmethod
    async def _info(self) -> BrokerInfo: ...

    @abc.abstractmethod
    async def _upkeep_storage(self) -> StorageUpkeep: ...

    @abc.abstractmethod
    async def _upsert_webhook_worker(self, spec: WebhookWorkerSpec) -> WebhookWorker: ...

    @abc.abstractmethod
    async def _get_webhook_worker(self, name: str) -> WebhookWorker: ...

    @abc.abstractmethod
    async def _list_webhook_workers(self) -> list[WebhookWorker]: ...

    @abc.abstractmethod
    async def _set_webhook_worker_paused(self, name: str, paused: bool) -> WebhookWorker: ...

    @abc.abstractmethod
    async def _delete_webhook_worker(self, name: str) -> None: ...

    @abc.abstractmethod
    async def _replace_webhook_secrets(
        self, name: str, expected: tuple[str, ...], secrets: tuple[str, ...]
    ) -> bool: ...

    @abc.abstractmethod
    async def _upsert_cron_entry(self, spec: CronEntrySpec) -> CronEntry: ...

    @abc.abstractmethod
    async def _get_cron_entry(self, name: str) -> CronEntry: ...

    @abc.abstractmethod
    async def _list_cron_entries(self) -> list[CronEntry]: ...

    @abc.abstractmethod
    async def _list_due_cron_entries(self, limit: int) -> list[CronEntry]: ...

    @abc.abstractmethod
    async def _set_cron_paused(self, name: str, paused: bool) -> CronEntry: ...

    @abc.abstractmethod
    async def _delete_cron_entry(self, name: str) -> None: ...

    @abc.abstractmethod
    async def _fire_cron_entry(
        self,
        name: str,
        expected: datetime,
        next_run_at: datetime | None,
        slot: datetime | None,
    ) -> CronFired: ...

    @abc.abstractmethod
    async def _trigger_cron_entry(self, name: str) -> EnqueueResult: ...

    @abc.abstractmethod
    async def _set_group_config(self, config: GroupConfig) -> GroupConfig: ...

    @abc.abstractmethod
    async def _delete_group_config(self, queue: str, pattern: str) -> None: ...

    @abc.abstractmethod
    async def _list_group_configs(self, queue: str | None) -> list[GroupConfig]: ...

    @abc.abstractmethod
    async def _group_stats(self, queue: str | None, limit: int) -> list[GroupStats]: ...

    @abc.abstractmethod
    async def _due_groups(self, limit: int) -> list[DueGroup]: ...

    @abc.abstractmethod
    async def _lease_group(
        self, queue: str, group: str, limit: int, ttl: timedelta, holder: str
    ) -> list[Task]: ...

    @abc.abstractmethod
    async def _set_rate_limit(self, limit: RateLimit) -> RateLimit: ...

    @abc.abstractmethod
    async def _get_rate_limit(self, queue: str) -> RateLimit | None: ...

    @abc.abstractmethod
    async def _list_rate_limits(self) -> list[RateLimit]: ...

    @abc.abstractmethod
    async def _delete_rate_limit(self, queue: str) -> None: ...

    @abc.abstractmethod
    async def _take_rate_tokens(self, queue: str, want: int) -> RateGrant: ...

    @abc.abstractmethod
    async def _return_rate_tokens(self, queue: str, count: int) -> None: ...

    @abc.abstractmethod
    async def _set_concurrency_limit(self, limit: ConcurrencyLimit) -> ConcurrencyLimit: ...

    @abc.abstractmethod
    async def _list_concurrency_limits(self, queue: str | None) -> list[ConcurrencyLimit]: ...

    @abc.abstractmethod
    async def _delete_concurrency_limit(self, queue: str, pattern: str) -> None: ...

    @abc.abstractmethod
    async def _set_breaker_config(self, config: BreakerConfig) -> BreakerConfig: ...

    @abc.abstractmethod
    async def _list_breaker_configs(self, queue: str | None) -> list[BreakerConfig]: ...

    @abc.abstractmethod
    async def _delete_breaker_config(self, queue: str, pattern: str) -> None: ...

    @abc.abstractmethod
    async def _put_breaker(self, breaker: Breaker) -> None: ...

    @abc.abstractmethod
    async def _drop_breaker(self, queue: str, task_type: str, gateway: str) -> bool: ...

    @abc.abstractmethod
    async def _list_breakers(self, queue: str | None) -> list[Breaker]: ...

    @abc.abstractmethod
    async def _take_probe(self, queue: str, task_type: str, until: datetime) -> bool: ...
