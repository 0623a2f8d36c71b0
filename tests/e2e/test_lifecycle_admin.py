"""Operator actions through real processes with the SDK's AsyncAdminClient: listing and
stats, cancel / run now / delete / reschedule / archive / revive (one by one and in
batches), pause and resume on a live dispatcher, progress of a running task, and
WatchEvents filtered by queue and state."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from conveyor import (
    AsyncAdminClient,
    AsyncClient,
    FailedPrecondition,
    InvalidArgument,
    TaskEvent,
    TaskNotFound,
    TaskState,
)
from conveyor_broker.types import ARCHIVED_BY_ADMIN_ERROR, CANCELED_WHILE_RUNNING_ERROR
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster
from tests.e2e.lifecycle import Stack, start_stack, wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

P, S, A, C = TaskState.PENDING, TaskState.SCHEDULED, TaskState.ACTIVE, TaskState.COMPLETED
X, K = TaskState.ARCHIVED, TaskState.CANCELED
UNKNOWN_ID = "01ARZ3NDEKTSV4RRFFQ69G5FAV"


async def check_listing_and_single_actions(client: AsyncClient, admin: AsyncAdminClient) -> None:
    """On an unserved queue, so that nothing moves but what the operator does."""
    parked = sorted(
        [(await client.enqueue("e2e.noop", {"i": i}, queue="parked")).id for i in range(5)]
    )
    pages = [await admin.list_tasks(queue="parked", limit=2)]
    while pages[-1].next_cursor is not None:
        pages.append(await admin.list_tasks(queue="parked", limit=2, cursor=pages[-1].next_cursor))
    assert [len(p.tasks) for p in pages] == [2, 2, 1]
    assert [t.id for p in pages for t in p.tasks] == parked
    assert [
        t.id async for t in admin.iter_tasks(queue="parked", state="pending", page_size=3)
    ] == parked
    stats = await admin.queue_stats("parked")
    assert (stats.name, stats.paused, stats.count(P), stats.total) == ("parked", False, 5, 5)
    assert {"parked", "live"} <= {q.name async for q in admin.iter_queues()}

    canceled = await admin.cancel_task(parked[0])
    assert (canceled.state, canceled.completed_at is not None) == (K, True)
    with pytest.raises(FailedPrecondition, match="cannot cancel"):
        await admin.cancel_task(parked[0])

    archived = await admin.archive_task(parked[1])
    assert (archived.state, archived.last_error) == (X, ARCHIVED_BY_ADMIN_ERROR)
    revived = await admin.revive_task(parked[1])
    assert (revived.state, revived.retried, revived.completed_at) == (P, 0, None)
    with pytest.raises(FailedPrecondition, match="cannot revive"):
        await admin.revive_task(parked[1])

    later = datetime.now(UTC) + timedelta(hours=1)
    moved = await admin.reschedule_task(parked[2], later)
    assert (moved.state, moved.next_process_at) == (S, later)
    assert (
        await admin.reschedule_task(parked[2], datetime.now(UTC) - timedelta(minutes=1))
    ).state is P

    await admin.delete_task(parked[3])
    with pytest.raises(TaskNotFound) as info:
        await admin.get_task(parked[3])
    assert info.value.task_id == parked[3]
    with pytest.raises(InvalidArgument, match="ULID"):
        await admin.get_task("not-a-task-id")
    with pytest.raises(TaskNotFound):
        await admin.run_task_now(UNKNOWN_ID)


async def check_batches(client: AsyncClient, admin: AsyncAdminClient) -> None:
    ids = [(await client.enqueue("e2e.noop", {}, queue="batch")).id for _ in range(4)]
    done = await admin.cancel_tasks([ids[0], ids[1], UNKNOWN_ID])
    assert done.affected == 2
    assert list(done.failures) == [UNKNOWN_ID]
    assert "not found" in done.failures[UNKNOWN_ID]
    again = await admin.cancel_tasks([ids[0]])
    assert (again.affected, list(again.failures)) == (0, [ids[0]])

    later = datetime.now(UTC) + timedelta(hours=1)
    assert (await admin.reschedule_tasks(later, queue="batch", state="pending")).affected == 2
    assert (await admin.queue_stats("batch")).count(S) == 2
    assert (await admin.run_tasks_now(queue="batch", state=S)).affected == 2
    assert (await admin.archive_tasks(queue="batch", state="pending")).affected == 2
    assert (await admin.revive_tasks(queue="batch", state="archived")).affected == 2
    assert (await admin.delete_tasks(queue="batch")).affected == 4
    assert (await admin.list_tasks(queue="batch")).tasks == []

    with pytest.raises(InvalidArgument, match="at most 1000"):
        await admin.delete_tasks([UNKNOWN_ID] * 1001)
    with pytest.raises(InvalidArgument, match="not both"):
        await admin.delete_tasks([UNKNOWN_ID], queue="batch")


async def check_running_task(stack: Stack, client: AsyncClient, admin: AsyncAdminClient) -> None:
    """Progress is visible while a task runs; an operator cancel stops its handler and
    archives it; the worker's slot (live has one) is given back."""
    running = await client.enqueue("e2e.progress", {}, queue="live")

    async def progress_visible() -> bool:
        task = await admin.get_task(running.id)
        return task.state is A and task.progress == {"step": 1}

    await wait_until(
        progress_visible, within=30, interval=POLL_INTERVAL, message="progress of the running task"
    )
    with pytest.raises(FailedPrecondition, match="cannot delete"):
        await admin.delete_task(running.id)
    aborted = await admin.cancel_task(running.id)
    assert (aborted.state, aborted.last_error) == (X, CANCELED_WHILE_RUNNING_ERROR)
    await wait_until(
        lambda: stack.lines("cancelled", running.id) != [],
        within=30,
        interval=POLL_INTERVAL,
        message="handler cancelled",
    )
    [line] = stack.lines("cancelled", running.id)
    assert "canceled_by_an_operator_while_running" in line[3]
    after = await client.enqueue("e2e.noop", {}, queue="live")
    await wait_state(admin, after.id, C)
    assert (await admin.get_task(running.id)).state is X

    # Run now and revive hand the task straight back to the worker.
    scheduled = await client.enqueue("e2e.noop", {}, queue="live", process_in=3600)
    assert scheduled.state is S
    assert (await admin.run_task_now(scheduled.id)).state is P
    await wait_state(admin, scheduled.id, C)
    skipped = await client.enqueue("e2e.skip", {}, queue="live")
    await wait_state(admin, skipped.id, X)
    assert (await admin.revive_task(skipped.id)).state is P
    await wait_until(
        lambda: len(stack.lines("start", skipped.id)) == 2,
        within=30,
        interval=POLL_INTERVAL,
        message="revived task ran",
    )
    assert (await wait_state(admin, skipped.id, X)).retried == 0


async def check_pause_and_resume(
    cluster: Cluster, stack: Stack, client: AsyncClient, admin: AsyncAdminClient
) -> None:
    """Pause stops the live dispatcher of ``live`` at once; resume restarts it. Only the
    completions of ``live`` reach a watcher filtered on them."""
    events: list[TaskEvent] = []
    async with admin.watch_events(queues=["live"], states=[C]) as watch:

        async def collect() -> None:
            async for event in watch:
                events.append(event)

        collector = asyncio.create_task(collect())
        await admin.pause_queue("live")
        assert (await admin.queue_stats("live")).paused
        [dispatcher] = [p for p in cluster.procs if p.name.startswith("dispatcher")]
        line = "dispatcher.pause_changed queue=live paused=True"
        await wait_until(
            lambda: line in dispatcher.log(),
            within=30,
            interval=POLL_INTERVAL,
            message="the live dispatcher paused",
        )
        held = [(await client.enqueue("e2e.noop", {}, queue="live")).id for _ in range(3)]
        # Work on another queue of the same worker and dispatcher still flows meanwhile.
        other = await client.enqueue("e2e.noop", {}, queue="other")
        await wait_state(admin, other.id, C)
        assert {(await admin.get_task(i)).state for i in held} == {P}
        assert all(stack.lines("start", i) == [] for i in held)

        await admin.resume_queue("live")
        for task_id in held:
            await wait_state(admin, task_id, C)
        await wait_until(
            lambda: {e.task_id for e in events} >= set(held),
            within=30,
            interval=POLL_INTERVAL,
            message="3 completions",
        )
        watch.close()
        with contextlib.suppress(asyncio.CancelledError):
            await collector
    assert {(e.queue, e.state, e.previous_state) for e in events} == {("live", C, A)}


async def test_admin_operations(cluster: Cluster, tmp_path: Path) -> None:
    stack = await start_stack(cluster, tmp_path, queues={"live": 1, "other": 1}, concurrency=2)
    async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
        await asyncio.gather(
            check_listing_and_single_actions(client, admin),
            check_batches(client, admin),
            check_running_task(stack, client, admin),
        )
        await check_pause_and_resume(cluster, stack, client, admin)
