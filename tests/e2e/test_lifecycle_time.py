"""Time bounds through real processes: per-attempt timeouts and deadlines (enforced by the
SDK and, for a worker that ignores them, by the server), the pre-dispatch TTL
(``expires_at``), unique keys with a TTL, and bad time input."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from conveyor import AlreadyExists, AsyncAdminClient, AsyncClient, InvalidArgument, TaskState
from conveyor_broker.types import EXPIRED_ERROR
from conveyor_gateway.attempt_bounds import DEADLINE_EXCEEDED_ERROR, SERVER_TIMEOUT_ERROR
from conveyor_testkit.polling import wait_until
from conveyor_testkit.stream import WorkerStream

from tests.e2e.harness import POLL_INTERVAL, Cluster
from tests.e2e.lifecycle import Stack, start_stack, wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

X, C = TaskState.ARCHIVED, TaskState.COMPLETED


def soon(seconds: float) -> datetime:
    return datetime.now(UTC) + timedelta(seconds=seconds)


async def check_sdk_cancels_at_timeout_and_deadline(
    stack: Stack, client: AsyncClient, admin: AsyncAdminClient
) -> None:
    """The SDK cancels the handler (async: the asyncio task; sync: a flag) at its bound."""
    sleeper = await client.enqueue(
        "e2e.sleep", {"seconds": 60}, queue="time", timeout=0.5, max_retry=0
    )
    poller = await client.enqueue(
        "e2e.sync_poll", {"seconds": 60}, queue="time", timeout=0.5, max_retry=0
    )
    deaf = await client.enqueue(
        "e2e.sync_ignore", {"seconds": 4}, queue="time", timeout=0.5, max_retry=1
    )
    late = await client.enqueue(
        "e2e.sleep", {"seconds": 60}, queue="time", deadline=soon(1.5), max_retry=5
    )
    broken = await client.enqueue("e2e.fail", {}, queue="time", deadline=soon(3), max_retry=25)

    for task in (sleeper, poller):
        archived = await wait_state(admin, task.id, X)
        assert archived.last_error == "timed out"
    assert [f[3] for f in stack.lines("cancelled", sleeper.id)] == ["timed_out"]
    assert [f[3] for f in stack.lines("cancelled", poller.id)] == ["timed_out"]

    # A sync handler deaf to ctx.cancelled: its attempt still fails at the timeout,
    # while the handler itself runs on.
    async def first_attempt_failed() -> bool:
        return (await admin.get_task(deaf.id)).retried >= 1

    await wait_until(
        first_attempt_failed,
        within=30,
        interval=POLL_INTERVAL,
        message="the deaf handler's attempt failed",
    )
    assert stack.lines("finished", deaf.id) == []  # ... while its handler still runs
    assert (await admin.get_task(deaf.id)).last_error == "timed out"
    assert (await wait_state(admin, deaf.id, X)).retried == 2
    await wait_until(
        lambda: len(stack.lines("finished", deaf.id)) == 2,
        within=30,
        interval=POLL_INTERVAL,
        message="deaf handlers end",
    )
    assert [f[3] for f in stack.lines("finished", deaf.id)] == ["True", "True"]

    # Past the deadline the task is archived, not retried.
    archived = await wait_state(admin, late.id, X)
    assert archived.last_error == f"{DEADLINE_EXCEEDED_ERROR} (not retried): timed out"
    assert len(stack.lines("start", late.id)) == 1
    archived = await wait_state(admin, broken.id, X)
    # Its last attempt failed on its own, or (dispatched just past the deadline) timed out.
    assert archived.last_error in {
        f"{DEADLINE_EXCEEDED_ERROR} (not retried): RuntimeError: boom",
        f"{DEADLINE_EXCEEDED_ERROR} (not retried): timed out",
    }
    assert 1 <= archived.retried < 5


async def check_server_enforces_bounds(
    target: str, client: AsyncClient, admin: AsyncAdminClient
) -> None:
    """A worker that ignores Cancel and never reports: the server takes the task back at
    its timeout (then retries) or deadline (then archives). Leases are 30 s here, so
    lease expiry plays no part."""
    async with grpc.aio.insecure_channel(target) as channel:
        rogue = WorkerStream(channel)
        await rogue.hello({"rogue": 1}, 1, worker_id="rogue")
        slow = await client.enqueue("e2e.noop", {}, queue="rogue", timeout=0.5, max_retry=1)
        for attempt in (1, 2):
            dispatch = (await rogue.read_kind("dispatch", within=10)).dispatch.task
            assert (dispatch.id, dispatch.attempt) == (slow.id, attempt)
            cancel = (await rogue.read_kind("cancel", within=10)).cancel
            assert (cancel.task_id, cancel.lease_id, cancel.reason) == (
                slow.id,
                dispatch.lease_id,
                "timed out",
            )
        archived = await wait_state(admin, slow.id, X)
        assert (archived.retried, archived.last_error) == (2, SERVER_TIMEOUT_ERROR)

        doomed = await client.enqueue("e2e.noop", {}, queue="rogue", deadline=soon(1), max_retry=10)
        assert (await rogue.read_kind("dispatch", within=10)).dispatch.task.id == doomed.id
        cancel = (await rogue.read_kind("cancel", within=10)).cancel
        assert (cancel.task_id, cancel.reason) == (doomed.id, "deadline exceeded")
        archived = await wait_state(admin, doomed.id, X)
        assert (archived.retried, archived.last_error) == (0, DEADLINE_EXCEEDED_ERROR)
        rogue.cancel()


async def check_expiry_and_unique_keys(
    stack: Stack, client: AsyncClient, admin: AsyncAdminClient
) -> None:
    # expires_at: a task still waiting past it is archived and never runs. It waits on a
    # queue no worker serves: a pause takes effect when the queue's dispatcher hears of it,
    # and a task enqueued in between may still be dispatched.
    await admin.pause_queue("ttl")
    stale = await client.enqueue("e2e.noop", {}, queue="ttl-unserved", expires_at=soon(1))
    fresh = await client.enqueue("e2e.noop", {}, queue="ttl", expires_at=soon(3600))
    expired = await wait_state(admin, stale.id, X)
    assert expired.last_error == EXPIRED_ERROR
    await admin.resume_queue("ttl")
    await wait_state(admin, fresh.id, C)
    assert stack.lines("start", stale.id) == []

    # Unique keys: a duplicate of a live key names the holder; a lapsed claim is freed.
    holder = await client.enqueue("e2e.noop", {}, queue="parked", unique_key="k", unique_ttl=1.5)
    with pytest.raises(AlreadyExists) as info:
        await client.enqueue("e2e.noop", {}, queue="parked", unique_key="k")
    assert info.value.existing_id == holder.id
    assert holder.id in info.value.message
    ids: list[str] = []

    async def claim_lapsed() -> bool:
        try:
            ids.append((await client.enqueue("e2e.noop", {}, queue="parked", unique_key="k")).id)
        except AlreadyExists:
            return False
        return True

    await wait_until(claim_lapsed, within=10, interval=0.1, message="the unique claim lapses")
    assert ids[0] != holder.id
    # ... and a claim is freed as soon as its holder completes.
    first = await client.enqueue("e2e.noop", {}, queue="ttl", unique_key="once")
    await wait_state(admin, first.id, C)
    again = await client.enqueue("e2e.noop", {}, queue="ttl", unique_key="once")
    assert again.id != first.id


async def check_bad_time_input(client: AsyncClient) -> None:
    with pytest.raises(InvalidArgument, match=r"deadline .* is not in the future"):
        await client.enqueue("e2e.noop", {}, queue="time", deadline=soon(-5))
    with pytest.raises(InvalidArgument, match=r"expires_at .* must be after process_at"):
        await client.enqueue("e2e.noop", {}, queue="time", process_in=60, expires_at=soon(30))
    with pytest.raises(InvalidArgument, match="unique_ttl must be > 0"):
        await client.enqueue("e2e.noop", {}, queue="time", unique_key="k", unique_ttl=-1)
    with pytest.raises(InvalidArgument, match="timeout must be > 0"):
        await client.enqueue("e2e.noop", {}, queue="time", timeout=-1)


async def test_timeouts_deadlines_expiry_and_unique_keys(cluster: Cluster, tmp_path: Path) -> None:
    # Long leases: only the bounds under test can take a task back.
    stack = await start_stack(
        cluster,
        tmp_path,
        queues={"time": 3, "ttl": 1},
        concurrency=12,
        env={"CONVEYOR_LEASE_TTL": "30"},
    )
    async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
        await check_bad_time_input(client)
        # Independent queues: the three run side by side.
        await asyncio.gather(
            check_server_enforces_bounds(stack.target, client, admin),
            check_expiry_and_unique_keys(stack, client, admin),
            check_sdk_cancels_at_timeout_and_deadline(stack, client, admin),
        )


async def test_a_delayed_task_starts_when_due_not_at_the_schedulers_next_tick(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The api hints the scheduler when a delayed task falls due. With the scheduler's
    own pass a minute apart (and the reaper's sweep five), nothing else would promote it
    in time."""
    stack = await start_stack(
        cluster,
        tmp_path,
        queues={"time": 1},
        env={"CONVEYOR_PROMOTE_TICK": "60", "CONVEYOR_REAP_TICK": "300"},
    )
    async with AsyncAdminClient(stack.target) as admin, AsyncClient(stack.target) as client:
        delayed = await client.enqueue("e2e.noop", {}, queue="time", process_in=0.5)
        assert delayed.state is TaskState.SCHEDULED
        moved = await client.enqueue("e2e.noop", {}, queue="time", process_in=3600)
        await admin.reschedule_task(moved.id, soon(0.5))
        for task in (delayed, moved):
            done = await wait_state(admin, task.id, C, within=20)
            assert done.started_at is not None
