"""EncryptedBroker: any broker, with what users put in a task encrypted at rest.

``EncryptedBroker(inner, keyring)`` is a :class:`~conveyor_broker.interface.Broker` whose
callers see plaintext while ``inner`` stores ciphertext, so a database dump, a replica or
a backup holds no payload. Sealed on the way in, opened on the way out: the **payload**,
every **header value**, the **result**, the **progress** and the **last error**, each in
the envelope of :mod:`conveyor_broker.keyring` (AES-256-GCM, a random nonce, the task id
and the field bound as associated data, the key id in clear).

A cron entry's task template (payload and header values) is sealed too, to the entry
rather than to a task; each slot's task is sealed again to its own id as it is made.

What the queries and the dispatcher work on stays clear: ids, queue, type, state, counters,
every time, unique keys, groups, dependencies, header *names*, webhook registrations.
Webhook signing secrets are not this class's: the api seals them with their own keys
(:mod:`conveyor_runtime.webhook_secrets`) before they reach a broker, and they pass
through as they come.

How it wraps: every public method is :class:`Broker`'s, so input is checked once, here,
against the plaintext; the work then goes straight to the inner broker's protected hook
(``inner._ack_batch``...), never through its public method, which would check the
ciphertext again (a sealed error is longer than an error may be, a sealed payload than a
payload may be). Batches stay batches: one inner call per call, one seal or open per
value.

A value that cannot be opened (its key is not configured, or it does not decrypt):

- a task being **leased** is failed at once with an error naming the key (it retries, or
  is archived when its retries are spent, like any failure) and left out of the lease;
  the other tasks of the batch are leased as usual;
- a **read** (``get_task``, ``list_tasks``) raises :class:`DecryptionError` naming the
  task, the field and the key id;
- a task returned by a **change that has committed** (an outcome, an admin action, a
  sweep, an idempotent re-enqueue) never turns the change into an error: the value comes
  back empty (payload, progress, result, header value) or as a note naming the key (last
  error), and a warning is logged; so do lifecycle events' errors.

Values stored before encryption was turned on read as they are, and so do the fixed
error texts the inner broker writes itself (``lease expired``, ``task expired before
dispatch``...): they are the server's words, not the user's. ``conveyor keys rotate``
(:mod:`conveyor_broker.postgres.rotation`) seals the former.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields, replace
from datetime import datetime, timedelta
from typing import Any, TypeVar

from conveyor_broker.backoff import Backoff
from conveyor_broker.ids import new_ids
from conveyor_broker.interface import Broker, DependencySink, EventSink
from conveyor_broker.keyring import (
    HEADER,
    LAST_ERROR,
    PAYLOAD,
    PROGRESS,
    RESULT,
    DecryptionError,
    Keyring,
    template_subject,
)
from conveyor_broker.types import (
    AckItem,
    Breaker,
    BreakerConfig,
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
    listed_size,
)
from conveyor_broker.validation import check_new_task, clean_error

logger = logging.getLogger(__name__)

__all__ = ["DecryptionError", "EncryptedBroker"]

_T = TypeVar("_T")


def _generated(name: str, source: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    exec(compile(source, f"<conveyor_broker.encrypted {name}>", "exec"), namespace)
    function: Callable[..., Any] = namespace[name]
    return function


def _copier(cls: type[_T], changed: Sequence[str]) -> Callable[..., _T]:
    """``copy(obj, *new_values)``: a copy of a frozen, slotted dataclass with the fields
    ``changed`` replaced, the same as ``dataclasses.replace(obj, **changes)``, several
    times faster: the hot path makes a copy per task. The copy's slots are set directly
    (the slot descriptors bypass the frozen ``__setattr__`` that ``__init__`` goes
    through once per keyword), one straight line of code per field, generated here for
    ``cls`` as dataclasses generates ``__init__``."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    params = [f"v{position}" for position in range(len(changed))]
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    lines = [f"def copy(obj, {', '.join(params)}):", "    c = _new(_cls)"]
    for position, name in enumerate(names):
        namespace[f"_set{position}"] = cls.__dict__[name].__set__
        value = params[changed.index(name)] if name in changed else f"obj.{name}"
        lines.append(f"    _set{position}(c, {value})")
    lines.append("    return c")
    return _generated("copy", "\n".join(lines) + "\n", namespace)


def _in_place(cls: type[_T], changed: Sequence[str]) -> Callable[..., _T]:
    """``set(obj, *new_values)``: sets the fields ``changed`` of an object nothing else
    holds, in place, and returns it; far cheaper than a :func:`_copier` copy, for a task
    that the inner broker built for this one call (:attr:`Broker.returns_fresh_tasks`)."""
    params = [f"v{position}" for position in range(len(changed))]
    namespace: dict[str, Any] = {}
    lines = [f"def set_in_place(obj, {', '.join(params)}):"]
    for position, name in enumerate(changed):
        # The slot descriptors bypass the frozen dataclass's __setattr__.
        namespace[f"_set{position}"] = cls.__dict__[name].__set__
        lines.append(f"    _set{position}(obj, {params[position]})")
    lines.append("    return obj")
    return _generated("set_in_place", "\n".join(lines) + "\n", namespace)


#: A new task with its id, payload and headers replaced (sealed).
_sealed_new = _copier(NewTask, ("id", "payload", "headers"))
#: A stored task with its sealed values replaced (opened).
_opened = _copier(Task, ("payload", "headers", "progress", "result", "last_error"))
#: A task just created, with its payload and headers as given (plaintext).
_as_given = _copier(Task, ("payload", "headers"))
#: The same two, in place.
_opened_in_place = _in_place(Task, ("payload", "headers", "progress", "result", "last_error"))
_as_given_in_place = _in_place(Task, ("payload", "headers"))


class EncryptedBroker(Broker):
    """``inner`` with payloads, header values, results, progress and errors sealed under
    ``keyring`` (see the module docstring). It shares the inner broker's clock and
    limits; closing it closes the inner broker. ``backoff`` spaces the retries of a task
    failed because it cannot be decrypted."""

    def __init__(self, inner: Broker, keyring: Keyring, *, backoff: Backoff | None = None) -> None:
        super().__init__(
            inner._clock,
            max_payload=inner._max_payload,
            default_max_retry=inner._default_max_retry,
        )
        self._inner = inner
        self._keyring = keyring
        self._backoff = backoff or Backoff()
        # Tasks the inner broker built for one call are opened in place, not copied.
        fresh = inner.returns_fresh_tasks
        self._open_task = _opened_in_place if fresh else _opened
        self._give_back = _as_given_in_place if fresh else _as_given
        inner.set_cron_task_hook(self._cron_slot_task)

    @property
    def inner(self) -> Broker:
        """The broker that stores the ciphertext."""
        return self._inner

    @property
    def keyring(self) -> Keyring:
        """The keys values are sealed and opened with."""
        return self._keyring

    # ------------------------------------------------------------ seal and open

    def _seal_headers(self, task_id: str, headers: Mapping[str, str]) -> Mapping[str, str]:
        if not headers:
            return headers
        seal = self._keyring.seal_text
        return {name: seal(task_id, HEADER + name, value) for name, value in headers.items()}

    def _seal_new(self, task: NewTask, task_id: str) -> NewTask:
        return _sealed_new(
            task,
            task_id,
            self._keyring.seal_bytes(task_id, PAYLOAD, bytes(task.payload)),
            self._seal_headers(task_id, task.headers),
        )

    def _seal_error(self, task_id: str, error: str) -> str:
        return self._keyring.seal_text(task_id, LAST_ERROR, error)

    def _open(self, task: Task) -> Task:
        """``task`` with every sealed value opened (in place when the inner broker made it
        for this call: every value is opened before any is set, so a DecryptionError
        leaves it as it was). Raises DecryptionError."""
        keyring, tid = self._keyring, task.id
        headers = task.headers
        if headers:
            headers = {
                name: keyring.open_text(tid, HEADER + name, value)
                for name, value in headers.items()
            }
        return self._open_task(
            task,
            keyring.open_bytes(tid, PAYLOAD, task.payload),
            headers,
            None if task.progress is None else keyring.open_bytes(tid, PROGRESS, task.progress),
            None if task.result is None else keyring.open_bytes(tid, RESULT, task.result),
            None
            if task.last_error is None
            else keyring.open_text(tid, LAST_ERROR, task.last_error),
        )

    def _open_committed(self, task: Task) -> Task:
        """``task``, returned by a change that has committed, opened; a value that does
        not open is left empty (or, the last error, replaced by a note) and logged."""
        try:
            return self._open(task)
        except DecryptionError:
            pass
        keyring, tid = self._keyring, task.id

        def binary(field: str, value: bytes | None) -> bytes | None:
            if value is None:
                return None
            try:
                return keyring.open_bytes(tid, field, value)
            except DecryptionError as exc:
                self._log_unreadable(exc)
                return b""

        def text(field: str, value: str) -> str:
            try:
                return keyring.open_text(tid, field, value)
            except DecryptionError as exc:
                self._log_unreadable(exc)
                return "" if field != LAST_ERROR else f"(not readable: {exc})"

        return replace(
            task,
            payload=binary(PAYLOAD, task.payload) or b"",
            headers={name: text(HEADER + name, value) for name, value in task.headers.items()},
            progress=binary(PROGRESS, task.progress),
            result=binary(RESULT, task.result),
            last_error=None if task.last_error is None else text(LAST_ERROR, task.last_error),
        )

    def _open_all_committed(self, tasks: Iterable[Task]) -> list[Task]:
        return [self._open_committed(task) for task in tasks]

    @staticmethod
    def _log_unreadable(exc: DecryptionError) -> None:
        logger.warning(
            "broker.decrypt_failed task_id=%s field=%s key_id=%s",
            exc.task_id,
            exc.field,
            exc.key_id,
            extra={"task_id": exc.task_id, "key_id": exc.key_id},
        )

    # ------------------------------------------------------------------- events

    def set_event_sink(self, sink: EventSink | None) -> None:
        """Report every committed state change to ``sink``: the inner broker's events,
        their errors opened."""
        self._sink = sink
        self._inner.set_event_sink(None if sink is None else self._relay)

    def set_dependency_sink(self, sink: DependencySink | None) -> None:
        """Report the dependency work the inner broker's commits leave to ``sink`` (ids and
        queues only: nothing sealed)."""
        super().set_dependency_sink(sink)
        self._inner.set_dependency_sink(sink)

    def _relay(self, event: TaskEvent) -> None:
        if event.error is not None:
            try:
                error = self._keyring.open_text(event.task_id, LAST_ERROR, event.error)
            except DecryptionError as exc:
                self._log_unreadable(exc)
                error = f"(not readable: {exc})"
            event = replace(event, error=error)
        self._emit((event,))

    # ------------------------------------------------------------------ enqueue

    async def _enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        # The ids are bound into the ciphertext, so they are chosen here (as the inner
        # broker would: ULIDs of now).
        missing = sum(1 for task in tasks if task.id is None)
        fresh = iter(new_ids(self._clock.now(), missing) if missing else ())
        ids = [task.id if task.id is not None else next(fresh) for task in tasks]
        sealed = [self._seal_new(task, task_id) for task, task_id in zip(tasks, ids, strict=True)]
        results = await self._inner._enqueue_batch(sealed)
        opened: list[EnqueueResult] = []
        # A repeated id within the batch returns its first task again: open each once.
        seen: dict[int, Task] = {}
        for task, result in zip(tasks, results, strict=True):
            stored = result.task
            again = seen.get(id(stored))
            if again is not None:
                stored = again
            elif result.created:
                # Just written from this very plaintext: no need to decrypt it back.
                stored = seen[id(stored)] = self._give_back(
                    stored, bytes(task.payload), dict(task.headers)
                )
            else:
                stored = seen[id(stored)] = self._open_committed(stored)
            # Opened in place, the inner broker's result already holds the plaintext task.
            opened.append(
                result if stored is result.task else EnqueueResult(stored, result.created)
            )
        return opened

    # -------------------------------------------------------------------- lease

    async def _leased(self, tasks: list[Task]) -> list[Task]:
        """The leased ``tasks`` opened; the ones that do not open are failed (their error
        names the key) and left out."""
        opened: list[Task] = []
        for task in tasks:
            try:
                opened.append(self._open(task))
            except DecryptionError as exc:
                await self._fail_unreadable(task, exc)
        return opened

    async def _fail_unreadable(self, task: Task, exc: DecryptionError) -> None:
        logger.error(
            "broker.lease_decrypt_failed task_id=%s queue=%s field=%s key_id=%s: the task fails",
            task.id,
            task.queue,
            exc.field,
            exc.key_id,
            extra={"task_id": task.id, "queue": task.queue, "key_id": exc.key_id},
        )
        error = self._seal_error(task.id, clean_error(f"cannot decrypt the task: {exc}"))
        try:
            await self._inner._fail(
                task.id,
                task.lease_id or "",
                error,
                self._backoff.delay(task.retried),
                False,
            )
        except Exception:
            # Its lease runs out and the reaper takes it back: nothing is lost.
            logger.exception("broker.lease_decrypt_fail_failed task_id=%s", task.id)

    async def _lease(
        self,
        queue: str,
        limit: int,
        ttl: timedelta,
        holders: tuple[str, ...],
        exclude_types: tuple[str, ...] = (),
        only_types: tuple[str, ...] | None = None,
    ) -> list[Task]:
        # Types stay clear: the inner broker filters them. Unfiltered, the call is the one
        # it always was (the hot path).
        if not exclude_types and only_types is None:
            return await self._leased(await self._inner._lease(queue, limit, ttl, holders))
        return await self._leased(
            await self._inner._lease(queue, limit, ttl, holders, exclude_types, only_types)
        )

    async def _lease_many(
        self,
        wants: Sequence[tuple[str, int]],
        ttl: timedelta,
        holders: Sequence[tuple[str, ...]],
    ) -> list[list[Task]]:
        leased = await self._inner._lease_many(wants, ttl, holders)
        return [await self._leased(tasks) for tasks in leased]

    async def _beat_holder(self, holder: str) -> None:
        await self._inner._beat_holder(holder)

    async def _release_dead_holders(self, params: HolderReleaseParams) -> list[ReleasedTask]:
        return await self._inner._release_dead_holders(params)

    async def _extend_lease(self, task_id: str, lease_id: str, ttl: timedelta) -> datetime:
        return await self._inner._extend_lease(task_id, lease_id, ttl)

    async def _extend_leases(self, leases: Sequence[LeaseRef], ttl: timedelta) -> list[LeaseRef]:
        return await self._inner._extend_leases(leases, ttl)

    async def _set_progress(self, task_id: str, lease_id: str, progress: bytes) -> None:
        sealed = self._keyring.seal_bytes(task_id, PROGRESS, bytes(progress))
        await self._inner._set_progress(task_id, lease_id, sealed)

    # ----------------------------------------------------------------- outcomes

    def _seal_result(self, task_id: str, result: bytes | None) -> bytes | None:
        if result is None:
            return None
        return self._keyring.seal_bytes(task_id, RESULT, bytes(result))

    async def _ack(self, task_id: str, lease_id: str, result: bytes | None) -> Task:
        sealed = self._seal_result(task_id, result)
        return self._open_committed(await self._inner._ack(task_id, lease_id, sealed))

    async def _ack_batch(self, items: Sequence[AckItem]) -> list[bool]:
        sealed = [
            AckItem(item.task_id, item.lease_id, self._seal_result(item.task_id, item.result))
            for item in items
        ]
        return await self._inner._ack_batch(sealed)

    async def _fail(
        self, task_id: str, lease_id: str, error: str, retry_delay: timedelta, skip_retry: bool
    ) -> Task:
        sealed = self._seal_error(task_id, error)
        task = await self._inner._fail(task_id, lease_id, sealed, retry_delay, skip_retry)
        return self._open_committed(task)

    async def _release(self, task_id: str, lease_id: str) -> Task:
        return self._open_committed(await self._inner._release(task_id, lease_id))

    async def _archive(self, task_id: str, lease_id: str, error: str) -> Task:
        sealed = self._seal_error(task_id, error)
        return self._open_committed(await self._inner._archive(task_id, lease_id, sealed))

    # -------------------------------------------------------- maintenance sweeps

    async def _reap_expired_leases(self, params: LeaseReapParams) -> list[ReapedTask]:
        return await self._inner._reap_expired_leases(params)

    async def _promote_scheduled(self, limit: int) -> dict[str, int]:
        return await self._inner._promote_scheduled(limit)

    async def _purge_terminal(self, params: TerminalPurgeParams) -> int:
        return await self._inner._purge_terminal(params)

    async def _archive_expired(self, limit: int) -> list[Task]:
        return self._open_all_committed(await self._inner._archive_expired(limit))

    # ------------------------------------------------------- inspection / admin

    async def _pending_count(self, queue: str | None) -> dict[str, int]:
        return await self._inner._pending_count(queue)

    async def _due_queues(self, after: str | None, limit: int) -> list[str]:
        return await self._inner._due_queues(after, limit)

    async def _due_count(self, queue: str, cap: int) -> int:
        return await self._inner._due_count(queue, cap)

    async def _queue_stats(self, queue: str | None) -> list[QueueStats]:
        return await self._inner._queue_stats(queue)

    async def _list_queues(self, after: str | None, limit: int) -> QueuePage:
        return await self._inner._list_queues(after, limit)

    async def _get_task(self, task_id: str) -> Task:
        return self._open(await self._inner._get_task(task_id))

    async def _get_tasks(self, task_ids: Sequence[str]) -> list[Task]:
        return [self._open(task) for task in await self._inner._get_tasks(task_ids)]

    async def _list_tasks(self, params: TaskListParams) -> TaskPage:
        if params.max_bytes is None:
            page = await self._inner._list_tasks(params)
            return TaskPage([self._open(task) for task in page.tasks], page.next_cursor)
        # The byte budget counts plaintext, the inner broker's ciphertext, which is never
        # smaller. So an inner page given the budget still left holds no more than fits
        # (all of it fits, but for its first task, which an inner page always holds): ask
        # again for the rest of the budget until the limit, the budget or the tasks run
        # out. Each round fills most of what is left, so there are few.
        tasks: list[Task] = []
        left = params.max_bytes
        cursor = params.cursor
        while True:
            page = await self._inner._list_tasks(
                replace(params, cursor=cursor, limit=params.limit - len(tasks), max_bytes=left)
            )
            for position, stored in enumerate(page.tasks):
                task = self._open(stored)
                size = listed_size(task, omit_payloads=params.omit_payloads)
                if tasks and size > left:
                    # The page ends before this task (a cursor is the last task's id).
                    return TaskPage(tasks, cursor if position == 0 else tasks[-1].id)
                tasks.append(task)
                left -= size
            if page.next_cursor is None or len(tasks) >= params.limit or left <= 0:
                return TaskPage(tasks, page.next_cursor)
            cursor = page.next_cursor

    async def _cancel_task(self, task_id: str) -> Task:
        return self._open_committed(await self._inner._cancel_task(task_id))

    async def _delete_task(self, task_id: str) -> None:
        await self._inner._delete_task(task_id)

    async def _run_task_now(self, task_id: str) -> Task:
        return self._open_committed(await self._inner._run_task_now(task_id))

    async def _reschedule_task(self, task_id: str, process_at: datetime) -> Task:
        return self._open_committed(await self._inner._reschedule_task(task_id, process_at))

    async def _archive_task(self, task_id: str) -> Task:
        return self._open_committed(await self._inner._archive_task(task_id))

    async def _revive_task(self, task_id: str) -> Task:
        return self._open_committed(await self._inner._revive_task(task_id))

    async def _set_queue_paused(self, queue: str, paused: bool) -> None:
        await self._inner._set_queue_paused(queue, paused)

    async def _queue_paused(self, queue: str) -> bool:
        return await self._inner._queue_paused(queue)

    async def _info(self) -> BrokerInfo:
        info = await self._inner._info()
        return replace(info, driver=f"{info.driver}+encrypted")

    async def _upkeep_storage(self) -> StorageUpkeep:
        return await self._inner._upkeep_storage()

    # ---------------------------------------------------- webhook registrations
    # Registrations hold nothing of a task; their secrets arrive sealed by the api.

    async def _upsert_webhook_worker(self, spec: WebhookWorkerSpec) -> WebhookWorker:
        return await self._inner._upsert_webhook_worker(spec)

    async def _get_webhook_worker(self, name: str) -> WebhookWorker:
        return await self._inner._get_webhook_worker(name)

    async def _list_webhook_workers(self) -> list[WebhookWorker]:
        return await self._inner._list_webhook_workers()

    async def _set_webhook_worker_paused(self, name: str, paused: bool) -> WebhookWorker:
        return await self._inner._set_webhook_worker_paused(name, paused)

    async def _delete_webhook_worker(self, name: str) -> None:
        await self._inner._delete_webhook_worker(name)

    async def _replace_webhook_secrets(
        self, name: str, expected: tuple[str, ...], secrets: tuple[str, ...]
    ) -> bool:
        return await self._inner._replace_webhook_secrets(name, expected, secrets)

    # ----------------------------------------------------------------- lifecycle

    # ------------------------------------------------------------ dependencies

    async def _resolve_dependents(self, task_ids: Sequence[str], limit: int) -> Resolution:
        return await self._inner._resolve_dependents(task_ids, limit)

    async def _promote_ready_dependents(self, limit: int, min_age: timedelta) -> Resolution:
        return await self._inner._promote_ready_dependents(limit, min_age)

    async def _list_dependencies(self, params: DependencyListParams) -> DependencyPage:
        return await self._inner._list_dependencies(params)

    # ---------------------------------------------------------------- due work

    async def _due_among(self, queues: list[str]) -> list[str]:
        return await self._inner._due_among(queues)

    async def _oldest_due(self, queues: list[str]) -> dict[str, datetime]:
        return await self._inner._oldest_due(queues)

    # -------------------------------------------------------------------- cron
    #
    # A cron entry's template (payload and header values) is sealed to the entry
    # (:func:`template_subject`), not to a task: each slot's task is made by the inner
    # broker inside the transaction that reads the template, and the cron task hook set
    # on it opens the template there, checks the plaintext and seals it again to the
    # task's own id. So a slot's task is stored like any other task, and a template moved
    # to another entry does not open.

    def _seal_template(self, name: str, task: NewTask) -> NewTask:
        subject = template_subject(name)
        return replace(
            task,
            payload=self._keyring.seal_bytes(subject, PAYLOAD, bytes(task.payload)),
            headers=self._seal_headers(subject, task.headers),
        )

    def _open_template(self, name: str, task: NewTask) -> NewTask:
        """``task`` (entry ``name``'s template, or a task made from it) opened. Raises
        DecryptionError."""
        keyring, subject = self._keyring, template_subject(name)
        return replace(
            task,
            payload=keyring.open_bytes(subject, PAYLOAD, bytes(task.payload)),
            headers={
                header: keyring.open_text(subject, HEADER + header, value)
                for header, value in task.headers.items()
            },
        )

    def _open_entry(self, entry: CronEntry, *, strict: bool = False) -> CronEntry:
        """``entry`` with its template opened. A template that does not open raises
        DecryptionError when ``strict`` (a read of the entry); otherwise it comes back
        with an empty payload and header values, and a warning is logged."""
        try:
            return replace(entry, task=self._open_template(entry.name, entry.task))
        except DecryptionError as exc:
            if strict:
                raise
            self._log_unreadable(exc)
            return replace(
                entry,
                task=replace(
                    entry.task, payload=b"", headers=dict.fromkeys(entry.task.headers, "")
                ),
            )

    def _cron_slot_task(self, name: str, task: NewTask) -> NewTask:
        """The inner broker's cron task hook: ``task`` (made from entry ``name``'s sealed
        template) opened, checked, and sealed to its own id. A template that does not open
        is stored as it is, so the task fails at its lease with an error naming the key
        (like any task that does not decrypt) and the schedule goes on."""
        assert task.id is not None  # a slot's id, or a trigger's fresh one
        try:
            plain = self._open_template(name, task)
        except DecryptionError as exc:
            self._log_unreadable(exc)
            return task
        check_new_task(plain, max_payload=self._max_payload)
        return self._seal_new(plain, task.id)

    async def _upsert_cron_entry(self, spec: CronEntrySpec) -> CronEntry:
        sealed = replace(spec, task=self._seal_template(spec.name, spec.task))
        return self._open_entry(await self._inner._upsert_cron_entry(sealed))

    async def _get_cron_entry(self, name: str) -> CronEntry:
        return self._open_entry(await self._inner._get_cron_entry(name), strict=True)

    async def _list_cron_entries(self) -> list[CronEntry]:
        return [self._open_entry(entry) for entry in await self._inner._list_cron_entries()]

    async def _list_due_cron_entries(self, limit: int) -> list[CronEntry]:
        due = await self._inner._list_due_cron_entries(limit)
        return [self._open_entry(entry) for entry in due]

    async def _set_cron_paused(self, name: str, paused: bool) -> CronEntry:
        return self._open_entry(await self._inner._set_cron_paused(name, paused))

    async def _delete_cron_entry(self, name: str) -> None:
        await self._inner._delete_cron_entry(name)

    def _opened_result(self, result: EnqueueResult) -> EnqueueResult:
        return EnqueueResult(self._open_committed(result.task), result.created)

    async def _fire_cron_entry(
        self,
        name: str,
        expected: datetime,
        next_run_at: datetime | None,
        slot: datetime | None,
    ) -> CronFired:
        fired = await self._inner._fire_cron_entry(name, expected, next_run_at, slot)
        return CronFired(
            applied=fired.applied,
            entry=None if fired.entry is None else self._open_entry(fired.entry),
            task=None if fired.task is None else self._opened_result(fired.task),
        )

    async def _trigger_cron_entry(self, name: str) -> EnqueueResult:
        return self._opened_result(await self._inner._trigger_cron_entry(name))

    # ------------------------------------------------------------------ groups

    async def _set_group_config(self, config: GroupConfig) -> GroupConfig:
        return await self._inner._set_group_config(config)

    async def _delete_group_config(self, queue: str, pattern: str) -> None:
        await self._inner._delete_group_config(queue, pattern)

    async def _list_group_configs(self, queue: str | None) -> list[GroupConfig]:
        return await self._inner._list_group_configs(queue)

    async def _group_stats(self, queue: str | None, limit: int) -> list[GroupStats]:
        return await self._inner._group_stats(queue, limit)

    async def _due_groups(self, limit: int) -> list[DueGroup]:
        return await self._inner._due_groups(limit)

    async def _lease_group(
        self, queue: str, group: str, limit: int, ttl: timedelta, holder: str
    ) -> list[Task]:
        return await self._leased(await self._inner._lease_group(queue, group, limit, ttl, holder))

    # ------------------------------------------------------ concurrency limits

    async def _set_concurrency_limit(self, limit: ConcurrencyLimit) -> ConcurrencyLimit:
        return await self._inner._set_concurrency_limit(limit)

    async def _list_concurrency_limits(self, queue: str | None) -> list[ConcurrencyLimit]:
        return await self._inner._list_concurrency_limits(queue)

    async def _delete_concurrency_limit(self, queue: str, pattern: str) -> None:
        await self._inner._delete_concurrency_limit(queue, pattern)

    # -------------------------------------------------------- circuit breakers
    # Queues, types, gateways and times: nothing here is a user's, all of it stays clear.

    async def _set_breaker_config(self, config: BreakerConfig) -> BreakerConfig:
        return await self._inner._set_breaker_config(config)

    async def _list_breaker_configs(self, queue: str | None) -> list[BreakerConfig]:
        return await self._inner._list_breaker_configs(queue)

    async def _delete_breaker_config(self, queue: str, pattern: str) -> None:
        await self._inner._delete_breaker_config(queue, pattern)

    async def _put_breaker(self, breaker: Breaker) -> None:
        await self._inner._put_breaker(breaker)

    async def _drop_breaker(self, queue: str, task_type: str, gateway: str) -> bool:
        return await self._inner._drop_breaker(queue, task_type, gateway)

    async def _list_breakers(self, queue: str | None) -> list[Breaker]:
        return await self._inner._list_breakers(queue)

    async def _take_probe(self, queue: str, task_type: str, until: datetime) -> bool:
        return await self._inner._take_probe(queue, task_type, until)

    # ------------------------------------------------------------- rate limits

    async def _set_rate_limit(self, limit: RateLimit) -> RateLimit:
        return await self._inner._set_rate_limit(limit)

    async def _get_rate_limit(self, queue: str) -> RateLimit | None:
        return await self._inner._get_rate_limit(queue)

    async def _list_rate_limits(self) -> list[RateLimit]:
        return await self._inner._list_rate_limits()

    async def _delete_rate_limit(self, queue: str) -> None:
        await self._inner._delete_rate_limit(queue)

    async def _take_rate_tokens(self, queue: str, want: int) -> RateGrant:
        return await self._inner._take_rate_tokens(queue, want)

    async def _return_rate_tokens(self, queue: str, count: int) -> None:
        await self._inner._return_rate_tokens(queue, count)

    async def close(self) -> None:
        """Close this broker and the inner one. Idempotent."""
        self._closed = True
        await self._inner.close()
