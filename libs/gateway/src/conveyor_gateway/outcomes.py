"""What a worker's Result does to its task in the broker.

- SUCCESS: ack (through the group-commit :class:`~conveyor_gateway.group_commit.AckBatcher`);
  a result over ``max_result`` fails the attempt instead.
- FAILURE: fail, retried after the Result's ``retry_after`` or the backoff; archived when
  the retries are used up (the broker's call) or the retry could only start past the
  task's deadline.
- SKIP_RETRY: archive.
- RELEASE: give the task back untouched and wake its queue.

Every call is scoped to the delivery's lease, which the broker checks: a lost lease
changes nothing.

An outcome whose commit fails (the broker unreachable, a connection cut) is not dropped:
it is retried, with a short doubling backoff, until it commits or the broker says its
lease is gone (:class:`~conveyor_broker.LeaseLost`, or an ack answered False). Meanwhile
the retry keeps extending its lease (every quarter of the lease TTL), although the
worker's slot was freed, so the reaper never takes back a task whose outcome is on its
way. The outcomes being retried are the gateway's *backlog* (:attr:`Outcomes.backlog`;
``on_backlog`` hears of every change); a lease-scoped call repeated after a commit whose
answer was lost finds the lease gone, so no outcome is applied twice. :class:`Outcomes` needs no running gateway, so it also answers Results
for leases no gateway holds (:meth:`Outcomes.resolve`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Container, Sequence
from datetime import timedelta

from conveyor_broker import (
    AckItem,
    Broker,
    BrokerError,
    LeaseLost,
    LeaseRef,
    TaskNotFound,
    TaskState,
)
from conveyor_protos.v1 import service_pb2
from conveyor_runtime import metrics, wire

from conveyor_gateway.attempt_bounds import (
    DEADLINE_EXCEEDED_ERROR,
    SERVER_TIMEOUT_ERROR,
    AttemptBound,
    deadline_error,
    retry_misses_deadline,
)
from conveyor_gateway.config import GatewayConfig
from conveyor_gateway.group_commit import AckBatcher
from conveyor_gateway.hints import WakePublisher
from conveyor_gateway.holdings import Held

logger = logging.getLogger(__name__)

#: The outcomes a Result may carry.
FINAL_OUTCOMES = frozenset(
    {
        service_pb2.OUTCOME_SUCCESS,
        service_pb2.OUTCOME_FAILURE,
        service_pb2.OUTCOME_SKIP_RETRY,
        service_pb2.OUTCOME_RELEASE,
    }
)


#: The longest ``retry_after`` a Result may ask for; a longer one (or a negative one, or
#: one that is no valid Duration) gets the server's backoff, as a webhook answer's does.
MAX_RETRY_AFTER = timedelta(days=3650)


#: The message of a STATUS_INVALID ``WebhookCallbackReply`` with which a gateway says that
#: applying an out-of-band Result or heartbeat failed in the broker (nothing changed): the
#: api ends the endpoint's call UNAVAILABLE, for it to retry.
BROKER_UNAVAILABLE = "broker unavailable: retry"


#: Commits what it can of a batch of outcomes; returns the deliveries whose lease is lost.
#: Raises when the broker failed (nothing of the batch is known to be committed).
Attempt = Callable[[list[Held]], Awaitable[list[Held]]]


def _count(counter: metrics.Bound, batch: Sequence[Held]) -> None:
    """Add ``batch`` to ``counter`` by queue and type (one increment per label pair)."""
    counts: dict[tuple[str, str], int] = {}
    for held in batch:
        key = (held.queue, held.type)
        counts[key] = counts.get(key, 0) + 1
    for (queue, type_), n in counts.items():
        counter(queue, type_).inc(n)


def is_well_formed(result: service_pb2.Result) -> bool:
    """True when ``result`` names a task and a lease and carries a final outcome."""
    return bool(result.task_id and result.lease_id and result.outcome in FINAL_OUTCOMES)


class Outcomes:
    """Applies Results in the broker, for the gateway (or webhook registration) ``name``
    (which the log lines carry)."""

    def __init__(
        self,
        name: str,
        *,
        broker: Broker,
        acks: AckBatcher,
        wakes: WakePublisher,
        config: GatewayConfig,
        on_backlog: Callable[[int], None] | None = None,
    ) -> None:
        self.name = name
        self._broker = broker
        self._acks = acks
        self._wakes = wakes
        self._config = config
        self._on_backlog = on_backlog
        #: The deliveries whose outcome is being retried, by task and lease id (a batch's
        #: members share their lease).
        self._pending: dict[tuple[str, str], Held] = {}
        #: The retry loops running (kept apart from the gateway's tasks: a gateway may
        #: close while its outcomes are still being retried; they end when the process
        #: does, the leases of what is left then expiring).
        self._retries: set[asyncio.Task[None]] = set()
        #: Outcomes retried since start (one per delivery per attempt), for metrics.
        self.retried = 0

    @property
    def backlog(self) -> int:
        """Outcomes whose commit failed and that are being retried."""
        return len(self._pending)

    def pending(self, task_id: str, lease_id: str) -> bool:
        """True while the outcome of ``task_id`` under ``lease_id`` is being retried."""
        return (task_id, lease_id) in self._pending

    async def apply(self, held: Held, result: service_pb2.Result) -> None:
        """Apply ``result`` to the delivery ``held``; LeaseLost when its lease is lost."""
        broker, task_id, lease_id = self._broker, held.task_id, held.lease_id
        outcome = result.outcome
        max_result = self._config.max_result
        if outcome == service_pb2.OUTCOME_SUCCESS:
            if len(result.result) > max_result:
                error = f"result is {len(result.result)} bytes; the limit is {max_result}"
                await self.fail(held, error, self.backoff(held))
                return
            acked = await self._acks.ack(AckItem(task_id, lease_id, result.result or None))
            if not acked:
                raise LeaseLost(task_id, lease_id)
            _count(metrics.completed, [held])
        elif outcome == service_pb2.OUTCOME_FAILURE:
            delay = self._retry_delay(held, result)
            await self.fail(held, result.error or "handler failed", delay)
        elif outcome == service_pb2.OUTCOME_SKIP_RETRY:
            await broker.archive(task_id, lease_id, result.error or "handler asked to skip retries")
            _count(metrics.failed, [held])
            _count(metrics.archived, [held])
        else:
            await broker.release(task_id, lease_id)
            self._wakes.wake(held.queue)

    async def complete(self, held: Held, result: service_pb2.Result) -> None:
        """:meth:`apply`, logging a lost lease instead of raising; when the broker fails,
        the outcome is retried in the background until it commits or its lease is gone."""
        await self._settle([held], self._one(lambda h: self.apply(h, result)), "outcome")

    async def ack_all(self, acks: list[tuple[Held, AckItem]]) -> None:
        """Ack successes together (one ack round trip for a frame's worth), logging each
        lost lease; when the broker fails, the acks are retried in the background until
        they commit or their leases are gone."""
        items = {(held.task_id, held.lease_id): item for held, item in acks}

        async def ack(batch: list[Held]) -> list[Held]:
            acked = await self._acks.ack_many([items[h.task_id, h.lease_id] for h in batch])
            _count(metrics.completed, [h for h, ok in zip(batch, acked, strict=True) if ok])
            return [h for h, ok in zip(batch, acked, strict=True) if not ok]

        await self._settle([held for held, _ in acks], ack, "ack")

    def _one(self, apply: Callable[[Held], Awaitable[None]]) -> Attempt:
        """An :data:`Attempt` applying ``apply`` to each delivery of the batch."""

        async def attempt(batch: list[Held]) -> list[Held]:
            lost: list[Held] = []
            for held in batch:
                try:
                    await apply(held)
                except LeaseLost:
                    lost.append(held)
            return lost

        return attempt

    async def _settle(self, batch: list[Held], attempt: Attempt, what: str) -> None:
        """Run ``attempt`` once; when the broker fails, hand the batch to a retry loop."""
        try:
            lost = await attempt(batch)
        except BrokerError:
            # The broker refused on purpose (closed, say): trying again cannot help; the
            # leases expire and the reaper takes the tasks back.
            self._refused(batch, what)
            return
        except Exception as exc:
            logger.warning(
                "gateway.%s_failed gateway=%s count=%d error=%r retrying",
                what,
                self.name,
                len(batch),
                exc,
            )
            self._hold(batch)
            task = asyncio.get_running_loop().create_task(self._retry(batch, attempt, what))
            self._retries.add(task)
            task.add_done_callback(self._retries.discard)
            return
        for held in lost:
            self._lease_lost(held)
        self._wake_keyed(batch)

    def _wake_keyed(self, batch: Sequence[Held]) -> None:
        """Wake the queues of committed outcomes of tasks with a concurrency key: each
        freed its key's slot, and the queue's next lease gives a HELD task of that key
        its turn (the Done for the slot may reach the dispatcher before this commit, so
        its lease may have come too early to see the slot free)."""
        for queue in {held.queue for held in batch if held.keyed}:
            self._wakes.wake(queue)

    def _refused(self, batch: Sequence[Held], what: str) -> None:
        logger.exception(
            "gateway.%s_refused gateway=%s count=%d tasks=%s",
            what,
            self.name,
            len(batch),
            ",".join(h.task_id for h in batch[:10]),
        )

    def _hold(self, batch: Sequence[Held]) -> None:
        for held in batch:
            self._pending[held.task_id, held.lease_id] = held
        self._backlog_changed()

    def _drop(self, batch: Sequence[Held]) -> None:
        for held in batch:
            self._pending.pop((held.task_id, held.lease_id), None)
        self._backlog_changed()

    def _backlog_changed(self) -> None:
        if self._on_backlog is not None:
            self._on_backlog(len(self._pending))

    async def _retry(self, batch: list[Held], attempt: Attempt, what: str) -> None:
        """Retry ``attempt`` on ``batch`` until it commits or every lease is gone,
        extending the leases meanwhile (the worker's heartbeat no longer covers them)."""
        config = self._config
        ttl = config.lease_ttl
        delay = config.outcome_retry_first
        extended_at: float | None = None
        tries = 1
        try:
            while batch:
                await asyncio.sleep(delay)
                delay = min(delay * 2, config.outcome_retry_max)
                now = time.monotonic()
                if extended_at is None or now - extended_at >= ttl.total_seconds() / 4:
                    gone = await self._extend(batch)
                    if gone is not None:
                        extended_at = now
                        self._drop(gone)
                        batch = [h for h in batch if h not in gone]
                        if not batch:
                            return
                tries += 1
                self.retried += len(batch)
                try:
                    lost = await attempt(batch)
                except BrokerError:
                    self._refused(batch, what)
                    return
                except Exception as exc:
                    logger.warning(
                        "gateway.%s_retry_failed gateway=%s count=%d tries=%d error=%r",
                        what,
                        self.name,
                        len(batch),
                        tries,
                        exc,
                    )
                    continue
                for held in lost:
                    self._lease_lost(held)
                self._wake_keyed(batch)
                logger.info(
                    "gateway.%s_committed_after_retry gateway=%s count=%d tries=%d",
                    what,
                    self.name,
                    len(batch) - len(lost),
                    tries,
                )
                self._drop(batch)
                batch = []
        finally:
            # Refused, or cancelled (the process is stopping): the leases expire, and the
            # reaper takes the tasks back.
            if batch:
                self._drop(batch)

    async def _extend(self, batch: list[Held]) -> list[Held] | None:
        """Extend the leases of ``batch``; the deliveries whose lease is gone (logged), or
        None when the broker failed."""
        refs = [LeaseRef(h.task_id, h.lease_id) for h in batch]
        try:
            lost = await self._broker.extend_leases(refs, self._config.lease_ttl)
        except Exception as exc:
            logger.warning(
                "gateway.pending_extend_failed gateway=%s count=%d error=%r",
                self.name,
                len(batch),
                exc,
            )
            return None
        gone = {(ref.task_id, ref.lease_id) for ref in lost}
        dropped = [h for h in batch if (h.task_id, h.lease_id) in gone]
        for held in dropped:
            self._lease_lost(held)
        return dropped

    def _lease_lost(self, held: Held) -> None:
        logger.info(
            "gateway.lease_lost gateway=%s task=%s lease=%s queue=%s",
            self.name,
            held.task_id,
            held.lease_id,
            held.queue,
        )

    def backoff(self, held: Held) -> timedelta:
        """The server's retry delay after the attempt of ``held`` failed."""
        return self._config.backoff.delay(held.retried)

    async def fail(self, held: Held, error: str, delay: timedelta) -> None:
        """Fail the attempt: retry after ``delay``, or archive at once when that retry
        could only start past the task's deadline. LeaseLost when the lease is lost."""
        now = self._config.clock.now()
        if retry_misses_deadline(held.deadline, now, delay):
            await self._broker.archive(held.task_id, held.lease_id, deadline_error(error))
            _count(metrics.failed, [held])
            _count(metrics.archived, [held])
            return
        task = await self._broker.fail(held.task_id, held.lease_id, error, delay)
        _count(metrics.failed, [held])
        _count(metrics.archived if task.state == TaskState.ARCHIVED else metrics.retried, [held])
        # A retry wakes its queue when due rather than at the reaper's next sweep.
        self._wakes.when_due(task, self._config.clock.now())

    async def abandon(self, held: Held, error: str) -> None:
        """Fail the attempt of ``held`` with ``error`` and the backoff, for a delivery its
        worker stopped answering for. A lost lease is fine (the reaper or a Result came
        first); a broker failure is logged (the lease is no longer extended, so the reaper
        takes the task back)."""
        try:
            await self.fail(held, error, self.backoff(held))
        except LeaseLost:
            pass
        except Exception:
            logger.exception("gateway.drop_failed gateway=%s task=%s", self.name, held.task_id)

    async def give_up(self, held: Held, bound: AttemptBound) -> None:
        """End an attempt that overran ``bound`` without a Result: archived at its
        deadline, else failed with the backoff. Logs rather than raises; a broker failure
        is retried like a worker's outcome."""

        async def end(h: Held) -> None:
            if bound.by_deadline:
                await self._broker.archive(h.task_id, h.lease_id, DEADLINE_EXCEEDED_ERROR)
            else:
                await self.fail(h, SERVER_TIMEOUT_ERROR, self.backoff(h))

        await self._settle([held], self._one(end), "give_up")

    def _retry_delay(self, held: Held, result: service_pb2.Result) -> timedelta:
        if result.HasField("retry_after"):
            try:
                requested: timedelta | None = wire.from_duration(result.retry_after)
            except (ValueError, OverflowError):
                requested = None
            if requested is not None and timedelta(0) <= requested <= MAX_RETRY_AFTER:
                return requested
        return self.backoff(held)

    async def resolve(
        self, result: service_pb2.Result, *, queue: str = "", served: Container[str]
    ) -> bool:
        """Apply ``result`` for a lease no gateway here holds (one made before a restart,
        say): only the lease-scoped broker call is made, which the broker refuses unless
        the lease is still current.

        True when the outcome was applied; False when the lease is lost (or the task is
        not on ``queue``, when given). Raises ValueError for a malformed result or a task
        on a queue not in ``served``; a broker failure propagates (the task then stays
        leased until it expires).
        """
        if not is_well_formed(result):
            raise ValueError("a result needs a task id, a lease id and a final outcome")
        try:
            task = await self._broker.get_task(result.task_id)
        except TaskNotFound:
            return False
        if task.state != TaskState.ACTIVE or task.lease_id != result.lease_id:
            return False
        if queue and queue != task.queue:
            return False
        if task.queue not in served:
            raise ValueError(f"task {task.id} is on queue {task.queue!r}, which is not served here")
        stranger = Held(
            task.id,
            result.lease_id,
            task.queue,
            task.retried,
            task.deadline,
            keyed=task.concurrency_key is not None,
        )
        try:
            await self.apply(stranger, result)
        except LeaseLost:
            return False
        return True
