"""What a worker's Result does to its task in the broker.

- SUCCESS: ack (through the group-commit :class:`~conveyor_gateway.group_commit.AckBatcher`);
  a result over ``max_result`` fails the attempt instead.
- FAILURE: fail, retried after the Result's ``retry_after`` or the backoff; archived when
  the retries are used up (the broker's call) or the retry could only start past the
  task's deadline.
- SKIP_RETRY: archive.
- RELEASE: give the task back untouched and wake its queue.

Every call is scoped to the delivery's lease, which the broker checks: a lost lease
changes nothing. :class:`Outcomes` needs no running gateway, so it also answers Results
for leases no gateway holds (:meth:`Outcomes.resolve`).
"""

from __future__ import annotations

import logging
from collections.abc import Container
from datetime import timedelta

from conveyor_broker import AckItem, Broker, LeaseLost, TaskNotFound, TaskState
from conveyor_protos.v1 import service_pb2
from conveyor_runtime import wire

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


#: The message of a STATUS_INVALID ``WebhookCallbackReply`` with which a gateway says that
#: applying an out-of-band Result or heartbeat failed in the broker (nothing changed): the
#: api ends the endpoint's call UNAVAILABLE, for it to retry.
BROKER_UNAVAILABLE = "broker unavailable: retry"


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
    ) -> None:
        self.name = name
        self._broker = broker
        self._acks = acks
        self._wakes = wakes
        self._config = config

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
        elif outcome == service_pb2.OUTCOME_FAILURE:
            delay = self._retry_delay(held, result)
            await self.fail(held, result.error or "handler failed", delay)
        elif outcome == service_pb2.OUTCOME_SKIP_RETRY:
            await broker.archive(task_id, lease_id, result.error or "handler asked to skip retries")
        else:
            await broker.release(task_id, lease_id)
            self._wakes.wake(held.queue)

    async def complete(self, held: Held, result: service_pb2.Result) -> None:
        """:meth:`apply`, logging a lost lease or a broker failure instead of raising (the
        task then stays ACTIVE until its lease expires, and the reaper retries it)."""
        try:
            await self.apply(held, result)
        except LeaseLost:
            logger.info(
                "gateway.lease_lost gateway=%s task=%s lease=%s queue=%s",
                self.name,
                held.task_id,
                held.lease_id,
                held.queue,
            )
        except Exception:
            logger.exception(
                "gateway.outcome_failed gateway=%s task=%s lease=%s queue=%s",
                self.name,
                held.task_id,
                held.lease_id,
                held.queue,
            )

    async def ack_all(self, acks: list[tuple[Held, AckItem]]) -> None:
        """Ack successes together (one ack round trip for a frame's worth), logging each
        lost lease; a broker failure is logged (the reaper retries those tasks)."""
        try:
            acked = await self._acks.ack_many([item for _, item in acks])
        except Exception:
            logger.exception("gateway.ack_failed gateway=%s count=%d", self.name, len(acks))
            acked = [True] * len(acks)  # nothing more to log per task
        for (held, _), ok in zip(acks, acked, strict=True):
            if not ok:
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
            return
        task = await self._broker.fail(held.task_id, held.lease_id, error, delay)
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
        deadline, else failed with the backoff. Logs rather than raises."""
        try:
            if bound.by_deadline:
                await self._broker.archive(held.task_id, held.lease_id, DEADLINE_EXCEEDED_ERROR)
            else:
                await self.fail(held, SERVER_TIMEOUT_ERROR, self.backoff(held))
        except LeaseLost:
            logger.info("gateway.lease_lost gateway=%s task=%s", self.name, held.task_id)
        except Exception:
            # Its lease is no longer extended: the reaper takes the task back.
            logger.exception("gateway.give_up_failed gateway=%s task=%s", self.name, held.task_id)

    def _retry_delay(self, held: Held, result: service_pb2.Result) -> timedelta:
        if result.HasField("retry_after"):
            try:
                requested: timedelta | None = wire.from_duration(result.retry_after)
            except (ValueError, OverflowError):
                requested = None
            if requested is not None and requested >= timedelta(0):
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
        stranger = Held(task.id, result.lease_id, task.queue, task.retried, task.deadline)
        try:
            await self.apply(stranger, result)
        except LeaseLost:
            return False
        return True
