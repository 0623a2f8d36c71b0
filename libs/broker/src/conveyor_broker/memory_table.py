"""The memory broker's task table: frozen Task values plus the indexes kept beside them.

Also :func:`new_row`, the Task a NewTask becomes.

Every write goes through :meth:`TaskTable.put` or :meth:`TaskTable.drop`, which keep the
indexes (by state, leasable per queue, per-queue counts, unique claims) in step and queue
the lifecycle event of the change. Not thread- or task-safe on its own: the broker holds
its lock around every use.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import datetime
from types import MappingProxyType

from conveyor_broker.dependencies import Start
from conveyor_broker.types import (
    INCOMPLETE_STATES,
    LEASABLE_STATES,
    TERMINAL_STATES,
    NewTask,
    Task,
    TaskEvent,
    TaskState,
)

_ERROR_STATES = frozenset({TaskState.RETRY, TaskState.ARCHIVED})


def new_row(
    task_id: str, new: NewTask, now: datetime, *, start: Start | None, max_retry: int
) -> Task:
    """The Task that enqueuing ``new`` stores (see Broker.enqueue_batch for the rules).

    ``start`` is how its dependencies settled it (None: it has none); ``max_retry`` is the
    broker's default, used when ``new.max_retry`` is None.
    """
    canceled = start is not None and start.state is TaskState.CANCELED
    if start is not None and start.state is not None:
        state = start.state
    elif new.group is not None:
        state = TaskState.AGGREGATING
    elif new.process_at is not None and new.process_at > now:
        state = TaskState.SCHEDULED
    else:
        state = TaskState.PENDING
    return Task(
        id=task_id,
        queue=new.queue,
        type=new.type,
        payload=bytes(new.payload),
        # A read-only copy: a snapshot must not change under the caller or the store.
        headers=MappingProxyType(dict(new.headers)),
        state=state,
        max_retry=max_retry if new.max_retry is None else new.max_retry,
        retried=0,
        timeout=new.timeout,
        deadline=new.deadline,
        process_at=new.process_at,
        expires_at=new.expires_at,
        retention=new.retention,
        unique_key=new.unique_key,
        unique_until=None if new.unique_ttl is None else now + new.unique_ttl,
        group=new.group,
        depends_on=tuple(new.depends_on),
        on_failure=new.on_failure,
        concurrency_key=new.concurrency_key,
        available_at=new.process_at or now,
        lease_id=None,
        lease_expires_at=None,
        progress=None,
        result=None,
        last_error=start.error if start is not None else None,
        created_at=now,
        updated_at=now,
        started_at=None,
        completed_at=now if canceled else None,
    )


class TaskTable:
    """Stored tasks by id, with the indexes the broker's queries need."""

    def __init__(self) -> None:
        self._tasks: dict[str, Task] = {}
        self._by_state: dict[TaskState, set[str]] = {state: set() for state in TaskState}
        self._leasable: defaultdict[str, set[str]] = defaultdict(set)
        self._counts: defaultdict[str, dict[TaskState, int]] = defaultdict(
            lambda: dict.fromkeys(TaskState, 0)
        )
        # (queue, unique_key) -> id of the task that last took the claim. The holder may
        # have lapsed since; claim_holder checks.
        self._claims: dict[tuple[str, str], str] = {}
        self._events: list[TaskEvent] = []
        # (queue, concurrency key) -> ids of its HELD tasks; -> how many are ACTIVE.
        self._held: defaultdict[tuple[str, str], set[str]] = defaultdict(set)
        self._active_keys: defaultdict[tuple[str, str], int] = defaultdict(int)
        # Queue -> keys an ACTIVE task of it left since the queue's last take_freed.
        self._freed: defaultdict[str, set[str]] = defaultdict(set)

    # ------------------------------------------------------------------ reading

    def get(self, task_id: str) -> Task | None:
        """The stored task, or None."""
        return self._tasks.get(task_id)

    def __getitem__(self, task_id: str) -> Task:
        return self._tasks[task_id]

    def ids(self, state: TaskState | None = None) -> Iterable[str]:
        """Ids of every task, or of the tasks in ``state`` (unordered)."""
        return self._tasks.keys() if state is None else self._by_state[state]

    def leasable(self, queue: str) -> list[Task]:
        """The PENDING and RETRY tasks of ``queue``, due or not (unordered)."""
        return [self._tasks[task_id] for task_id in self._leasable.get(queue, ())]

    def leasable_queues(self) -> list[str]:
        """Queues that may have PENDING or RETRY tasks."""
        return list(self._leasable)

    def queues(self) -> set[str]:
        """Queues that have tasks."""
        return set(self._counts)

    def counts(self, queue: str) -> dict[TaskState, int]:
        """Tasks of ``queue`` per state, every state included."""
        counts = self._counts.get(queue)
        return dict(counts) if counts is not None else dict.fromkeys(TaskState, 0)

    def oldest(
        self,
        states: Iterable[TaskState],
        when: Callable[[Task], datetime | None],
        now: datetime,
        limit: int,
    ) -> list[Task]:
        """Up to ``limit`` tasks in ``states`` whose ``when(task)`` is set and <= now,
        oldest ``when`` first, then by id."""
        candidates: list[tuple[datetime, str]] = []
        for state in states:
            for task_id in self._by_state[state]:
                at = when(self._tasks[task_id])
                if at is not None and at <= now:
                    candidates.append((at, task_id))
        return [self._tasks[task_id] for _, task_id in heapq.nsmallest(limit, candidates)]

    def held(self, queue: str, key: str) -> list[Task]:
        """The HELD tasks of ``queue`` with concurrency key ``key`` (unordered)."""
        return [self._tasks[task_id] for task_id in self._held.get((queue, key), ())]

    def held_keys(self, queue: str) -> list[str]:
        """The concurrency keys of ``queue`` that have HELD tasks."""
        return [key for (q, key), ids in self._held.items() if q == queue and ids]

    def active_with_key(self, queue: str, key: str) -> int:
        """How many tasks of ``queue`` with concurrency key ``key`` are ACTIVE."""
        return self._active_keys.get((queue, key), 0)

    def take_freed(self, queue: str) -> set[str]:
        """The keys of ``queue`` whose ACTIVE tasks left ACTIVE since the last call."""
        return self._freed.pop(queue, set())

    def claim_holder(self, queue: str, unique_key: str, now: datetime) -> str | None:
        """The id of the live task holding (queue, unique_key) now, if any."""
        key = (queue, unique_key)
        holder_id = self._claims.get(key)
        if holder_id is None:
            return None
        holder = self._tasks[holder_id]
        if holder.unique_until is not None and holder.unique_until <= now:
            del self._claims[key]
            return None
        return holder_id

    # ------------------------------------------------------------------ writing

    def put(self, task: Task, previous: Task | None) -> Task:
        """Store ``task`` (replacing ``previous``); queue an event if its state changed."""
        if previous is not None:
            self._unindex(previous)
        self._tasks[task.id] = task
        self._by_state[task.state].add(task.id)
        if task.state in LEASABLE_STATES:
            self._leasable[task.queue].add(task.id)
        self._counts[task.queue][task.state] += 1
        if task.concurrency_key is not None:
            keyed = (task.queue, task.concurrency_key)
            if task.state is TaskState.HELD:
                self._held[keyed].add(task.id)
            elif task.state is TaskState.ACTIVE:
                self._active_keys[keyed] += 1
        if task.unique_key is not None:
            key = (task.queue, task.unique_key)
            if task.state not in INCOMPLETE_STATES:
                if self._claims.get(key) == task.id:
                    del self._claims[key]
            elif (previous is None or previous.state in TERMINAL_STATES) and (
                task.unique_until is None or task.unique_until > task.updated_at
            ):
                # Only entering a live state with an unlapsed claim takes it: a lapsed
                # task must never take the key back from a newer holder.
                self._claims[key] = task.id
        if previous is None or previous.state != task.state:
            self._events.append(
                TaskEvent(
                    task_id=task.id,
                    queue=task.queue,
                    type=task.type,
                    state=task.state,
                    previous_state=None if previous is None else previous.state,
                    at=task.updated_at,
                    error=task.last_error if task.state in _ERROR_STATES else None,
                )
            )
        return task

    def drop(self, task: Task, now: datetime, *, report: bool) -> None:
        """Delete ``task``; queue a deletion event when ``report``."""
        self._unindex(task)
        del self._tasks[task.id]
        if task.unique_key is not None:
            key = (task.queue, task.unique_key)
            if self._claims.get(key) == task.id:
                del self._claims[key]
        if not any(self._counts[task.queue].values()):
            del self._counts[task.queue]
            self._leasable.pop(task.queue, None)
        if report:
            self._events.append(TaskEvent(task.id, task.queue, task.type, None, task.state, now))

    def free_lapsed_claims(self, now: datetime) -> None:
        """Forget every claim that has lapsed (housekeeping; not observable)."""
        for queue, unique_key in list(self._claims):
            self.claim_holder(queue, unique_key, now)

    def take_events(self) -> list[TaskEvent]:
        """The events queued since the last call, in the order of the changes."""
        events, self._events = self._events, []
        return events

    def _unindex(self, task: Task) -> None:
        self._by_state[task.state].discard(task.id)
        self._leasable[task.queue].discard(task.id)
        self._counts[task.queue][task.state] -= 1
        if task.concurrency_key is not None:
            keyed = (task.queue, task.concurrency_key)
            if task.state is TaskState.HELD:
                held = self._held[keyed]
                held.discard(task.id)
                if not held:
                    del self._held[keyed]
            elif task.state is TaskState.ACTIVE:
                self._active_keys[keyed] -= 1
                if not self._active_keys[keyed]:
                    del self._active_keys[keyed]
                # Left ACTIVE (put re-adds it when it stays): its key may have room.
                self._freed[task.queue].add(task.concurrency_key)
