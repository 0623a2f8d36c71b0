"""What a gateway holds: every delivery by lease id, the lease of each task, the count per
queue, and the timer of each bounded attempt.

The ledger is changed only in synchronous code, so no two coroutines ever see it half
updated; broker calls happen after it changed and never hold it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from conveyor_broker import Task
from conveyor_broker.clock import Clock
from conveyor_protos.v1 import task_pb2
from conveyor_runtime import metrics, wire

from conveyor_gateway.attempt_bounds import AttemptBound, AttemptTimers, envelope_bounds
from conveyor_gateway.tracing import DeliveryTraces


@dataclass(frozen=True, slots=True)
class Held:
    """One delivery: its task, lease and queue, the retries before this attempt, the
    task's deadline (None: none), whether it has a concurrency key, its type ("" when
    unknown), and whether it is a half-open circuit breaker's probe.

    An aggregation group's batch is one delivery too: one lease and one slot for all its
    members. Its ``members`` are a delivery apiece (the lease shared), the first of them
    also named by ``task_id``, ``type`` and ``retried``; a single task has none."""

    task_id: str
    lease_id: str
    queue: str
    retried: int
    deadline: datetime | None = None
    keyed: bool = False
    type: str = ""
    probe: bool = False
    #: When this gateway took the delivery (``time.monotonic``), for the run-time metric.
    started: float = field(default_factory=time.monotonic, compare=False)
    #: A batch's members (empty: a single task).
    members: tuple[Held, ...] = field(default=(), compare=False)
    #: A batch's group ("" for a single task).
    group: str = ""

    @property
    def tasks(self) -> tuple[Held, ...]:
        """The deliveries an outcome applies to: a batch's members, else itself."""
        return self.members or (self,)


def _member(env: task_pb2.TaskEnvelope, queue: str) -> Held:
    return Held(
        env.id,
        env.lease_id,
        queue,
        max(0, env.attempt - 1),
        wire.from_timestamp(env.deadline) if env.HasField("deadline") else None,
        keyed=bool(env.concurrency_key),
        type=env.type,
    )


class Holdings:
    """The deliveries one gateway holds.

    ``on_overrun(lease_id, bound)`` runs on the event loop when a bounded attempt outlives
    its bound while still held (see :class:`~conveyor_gateway.attempt_bounds.AttemptTimers`).
    """

    def __init__(
        self,
        *,
        grace: timedelta,
        clock: Clock,
        on_overrun: Callable[[str, AttemptBound], None],
    ) -> None:
        #: Lease id -> the delivery.
        self.by_lease: dict[str, Held] = {}
        #: Task id -> the lease it is held under.
        self.lease_of: dict[str, str] = {}
        #: Deliveries held per queue (no entry: none).
        self.per_queue: Counter[str] = Counter()
        #: Lease id -> when the lease runs out as far as the gateway knows (from the
        #: dispatch, then each extension it made); absent: unknown.
        self.expires: dict[str, datetime] = {}
        #: The timers of the bounded attempts, by lease id.
        self.timers = AttemptTimers(grace=grace, clock=clock, on_overrun=on_overrun)
        #: The push spans of the sampled deliveries (empty while tracing is off).
        self.traces = DeliveryTraces()
        self._clock = clock

    def __len__(self) -> int:
        return len(self.by_lease)

    def hold(self, env: task_pb2.TaskEnvelope, queue: str, *, probe: bool = False) -> None:
        """Hold the dispatched ``env`` of ``queue``, arming its attempt bound if it has one;
        ``probe``: it is a breaker's probe (as well as when the envelope says so)."""
        bounded = env.HasField("timeout") or env.HasField("deadline")
        timeout, deadline = envelope_bounds(env) if bounded else (None, None)
        held = Held(
            env.id,
            env.lease_id,
            queue,
            max(0, env.attempt - 1),
            deadline,
            keyed=bool(env.concurrency_key),
            type=env.type,
            probe=probe or env.probe,
        )
        if held.lease_id not in self.by_lease:
            metrics.HELD.add(1)
        self.by_lease[held.lease_id] = held
        self.lease_of[held.task_id] = held.lease_id
        self.per_queue[queue] += 1
        if env.HasField("lease_expires_at"):
            self.expires[held.lease_id] = wire.from_timestamp(env.lease_expires_at)
        if bounded:
            self.timers.arm(held.lease_id, timeout, deadline)

    def hold_batch(self, envs: Sequence[task_pb2.TaskEnvelope], queue: str, group: str) -> Held:
        """Hold an aggregation group's batch ``envs`` (every one under the same lease) of
        ``queue`` as one delivery; its attempt is bounded by the smallest timeout and the
        earliest deadline of its members. Returns the batch."""
        members = tuple(_member(env, queue) for env in envs)
        first = members[0]
        timeouts = [envelope_bounds(env)[0] for env in envs if env.HasField("timeout")]
        deadlines = [m.deadline for m in members if m.deadline is not None]
        timeout = min((t for t in timeouts if t is not None), default=None)
        deadline = min(deadlines, default=None)
        held = replace(first, deadline=deadline, members=members, group=group)
        lease_id = held.lease_id
        if lease_id not in self.by_lease:
            metrics.HELD.add(1)
        self.by_lease[lease_id] = held
        for member in members:
            self.lease_of[member.task_id] = lease_id
        self.per_queue[queue] += 1
        if envs[0].HasField("lease_expires_at"):
            self.expires[lease_id] = wire.from_timestamp(envs[0].lease_expires_at)
        if timeout is not None or deadline is not None:
            self.timers.arm(lease_id, timeout, deadline)
        return held

    def hold_task(self, task: Task, lease_id: str) -> Held:
        """Hold ``task``, an attempt that started elsewhere under ``lease_id``; its bound is
        armed with what is left of its timeout (a bound at once when nothing is) and its
        deadline."""
        held = Held(
            task.id,
            lease_id,
            task.queue,
            task.retried,
            task.deadline,
            keyed=task.concurrency_key is not None,
            type=task.type,
        )
        if lease_id not in self.by_lease:
            metrics.HELD.add(1)
        self.by_lease[lease_id] = held
        self.lease_of[task.id] = lease_id
        self.per_queue[task.queue] += 1
        if task.lease_expires_at is not None:
            self.expires[lease_id] = task.lease_expires_at
        timeout = task.timeout
        if timeout is not None and task.started_at is not None:
            elapsed = self._clock.now() - task.started_at
            timeout = max(timeout - elapsed, timedelta(microseconds=1))
        if timeout is not None or task.deadline is not None:
            self.timers.arm(lease_id, timeout, task.deadline)
        return held

    def take(self, lease_id: str) -> Held | None:
        """Stop holding ``lease_id`` (its timer disarmed); the delivery, or None when it was
        not held."""
        held = self.by_lease.pop(lease_id, None)
        if held is None:
            return None
        metrics.HELD.add(-1)
        self.expires.pop(lease_id, None)
        if self.timers:
            self.timers.disarm(lease_id)
        if self.traces.spans:
            self.traces.drop(lease_id)
        lease_of = self.lease_of
        for task in held.tasks:
            if lease_of.get(task.task_id) == lease_id:
                del lease_of[task.task_id]
        per_queue = self.per_queue
        per_queue[held.queue] -= 1
        if per_queue[held.queue] <= 0:
            del per_queue[held.queue]
        return held

    def clear(self) -> list[Held]:
        """Stop holding anything (every timer disarmed); what was held."""
        held = list(self.by_lease.values())
        metrics.HELD.add(-len(held))
        self.by_lease.clear()
        self.expires.clear()
        self.timers.clear()
        self.traces.clear()
        self.lease_of.clear()
        self.per_queue.clear()
        return held
