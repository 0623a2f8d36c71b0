"""Conformance: inspection and admin operations, pause flags, info and close."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import (
    BrokerClosed,
    DuplicateTask,
    InvalidState,
    InvalidTask,
    LeaseLost,
    TaskNotFound,
)
from conveyor_broker.interface import MAX_BATCH, Broker
from conveyor_broker.testing.builders import (
    OTHER_QUEUE,
    QUEUE,
    TTL,
    enqueue,
    enqueue_and_lease,
    lease_one,
    new_task,
    sorted_ids,
    unused_id,
)
from conveyor_broker.types import (
    ARCHIVED_BY_ADMIN_ERROR,
    CANCELED_WHILE_RUNNING_ERROR,
    LISTED_OVERHEAD,
    Task,
    TaskListParams,
    TaskState,
    listed_size,
    without_payloads,
)


async def _completed(broker: Broker) -> Task:
    """A COMPLETED task (the default queue must have no other due task)."""
    task = await enqueue_and_lease(broker)
    return await broker.ack(task.id, task.lease_id or "")


class AdminTests:
    """get_task, list_tasks, queue_stats, the admin task operations, pause, info, close."""

    async def test_get_task_errors(self, broker: Broker, clock: FakeClock) -> None:
        missing = unused_id(clock)
        with pytest.raises(TaskNotFound) as caught:
            await broker.get_task(missing)
        assert caught.value.task_id == missing
        with pytest.raises(InvalidTask):
            await broker.get_task("not-a-ulid")

    async def test_list_tasks_pages_in_id_order(self, broker: Broker, clock: FakeClock) -> None:
        ids = sorted_ids(clock, 5)
        await broker.enqueue_batch([new_task(id=i) for i in reversed(ids)])
        first = await broker.list_tasks(TaskListParams(limit=2))
        assert [t.id for t in first.tasks] == ids[:2]
        assert first.next_cursor is not None
        second = await broker.list_tasks(TaskListParams(limit=2, cursor=first.next_cursor))
        assert [t.id for t in second.tasks] == ids[2:4]
        assert second.next_cursor is not None
        last = await broker.list_tasks(TaskListParams(limit=2, cursor=second.next_cursor))
        assert [t.id for t in last.tasks] == ids[4:]
        assert last.next_cursor is None

    async def test_list_tasks_exact_last_page_has_no_cursor(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        await broker.enqueue_batch([new_task() for _ in range(4)])
        first = await broker.list_tasks(TaskListParams(limit=2))
        second = await broker.list_tasks(TaskListParams(limit=2, cursor=first.next_cursor))
        assert len(second.tasks) == 2
        assert second.next_cursor is None
        everything = await broker.list_tasks()
        assert len(everything.tasks) == 4
        assert everything.next_cursor is None

    async def test_list_tasks_filters(self, broker: Broker, clock: FakeClock) -> None:
        a, b, c, d = sorted_ids(clock, 4)
        await broker.enqueue_batch(
            [
                new_task(id=a),
                new_task(id=b, process_at=clock.now() + TTL),
                new_task(OTHER_QUEUE, id=c),
                new_task(id=d),
            ]
        )
        by_queue = await broker.list_tasks(TaskListParams(queue=QUEUE))
        assert [t.id for t in by_queue.tasks] == [a, b, d]
        by_state = await broker.list_tasks(TaskListParams(state=TaskState.PENDING))
        assert [t.id for t in by_state.tasks] == [a, c, d]
        both = await broker.list_tasks(
            TaskListParams(queue=QUEUE, state=TaskState.PENDING, limit=1)
        )
        assert [t.id for t in both.tasks] == [a]
        rest = await broker.list_tasks(
            TaskListParams(queue=QUEUE, state=TaskState.PENDING, limit=1, cursor=both.next_cursor)
        )
        assert [t.id for t in rest.tasks] == [d]
        assert rest.next_cursor is None
        assert (await broker.list_tasks(TaskListParams(queue="empty"))).tasks == []

    @pytest.mark.parametrize(
        "kwargs",
        [{"limit": 0}, {"limit": MAX_BATCH + 1}, {"cursor": "%%not-a-cursor%%"}, {"queue": "a.b"}],
        ids=["zero-limit", "limit-over-max", "malformed-cursor", "bad-queue"],
    )
    async def test_list_tasks_rejects_bad_input(
        self, broker: Broker, kwargs: dict[str, object]
    ) -> None:
        with pytest.raises(InvalidTask):
            await broker.list_tasks(TaskListParams(**kwargs))  # type: ignore[arg-type]

    async def test_queue_stats(self, broker: Broker, clock: FakeClock) -> None:
        await _completed(broker)
        await broker.enqueue_batch([new_task(), new_task(), new_task(OTHER_QUEUE)])
        await enqueue(broker, process_at=clock.now() + TTL)
        await broker.set_queue_paused("flagged", True)
        stats = await broker.queue_stats()
        assert [s.queue for s in stats] == sorted([QUEUE, OTHER_QUEUE, "flagged"])
        by_name = {s.queue: s for s in stats}
        default = by_name[QUEUE]
        assert default.count(TaskState.PENDING) == 2
        assert default.count(TaskState.SCHEDULED) == 1
        assert default.count(TaskState.COMPLETED) == 1
        assert default.count(TaskState.ACTIVE) == 0
        assert set(default.counts) == set(TaskState)
        assert not default.paused
        assert by_name[OTHER_QUEUE].count(TaskState.PENDING) == 1
        flagged = by_name["flagged"]
        assert flagged.paused
        assert sum(flagged.counts.values()) == 0

    async def test_list_queues_pages_by_name(self, broker: Broker) -> None:
        names = [f"q{n:02d}" for n in range(7)]
        await broker.enqueue_batch([new_task(name) for name in names[1:]])
        await broker.enqueue(new_task(names[3]))
        # A queue known only by its flag is listed too, in its place.
        await broker.set_queue_paused(names[0], True)
        seen: list[str] = []
        cursor: str | None = None
        pages = 0
        while True:
            page = await broker.list_queues(after=cursor, limit=3)
            pages += 1
            assert len(page.queues) <= 3
            seen += [stats.queue for stats in page.queues]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert seen == names
        assert pages == 3
        assert await broker.list_queues(limit=1000) == await broker.list_queues(limit=7)
        everything = (await broker.list_queues(limit=1000)).queues
        assert everything == await broker.queue_stats()
        assert everything[0].paused
        assert everything[3].count(TaskState.PENDING) == 2

    async def test_list_queues_exact_last_page_has_no_cursor(self, broker: Broker) -> None:
        await broker.enqueue_batch([new_task(QUEUE), new_task(OTHER_QUEUE)])
        page = await broker.list_queues(limit=2)
        assert len(page.queues) == 2
        assert page.next_cursor is None
        assert (await broker.list_queues(after=page.queues[-1].queue)).queues == []
        first = await broker.list_queues(limit=1)
        assert first.next_cursor == first.queues[0].queue

    @pytest.mark.parametrize(
        "kwargs",
        [{"limit": 0}, {"limit": MAX_BATCH + 1}, {"after": ""}, {"after": "a\x00"}],
        ids=["zero-limit", "limit-over-max", "empty-cursor", "nul-cursor"],
    )
    async def test_list_queues_rejects_bad_input(
        self, broker: Broker, kwargs: dict[str, object]
    ) -> None:
        with pytest.raises(InvalidTask):
            await broker.list_queues(**kwargs)  # type: ignore[arg-type]

    async def test_list_queues_pages_past_any_stored_name(self, broker: Broker) -> None:
        # A name stored before names were matched whole ("0\n") must not stop paging.
        await broker.enqueue(new_task("1"))
        page = await broker.list_queues(after="0\n")
        assert [stats.queue for stats in page.queues] == ["1"]
        assert await broker.due_queues(after="0\n") == ["1"]

    async def test_list_tasks_ends_a_page_at_its_byte_budget(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        ids = sorted_ids(clock, 5)
        sizes = [100, 3000, 200, 5000, 50]
        await broker.enqueue_batch(
            [
                new_task(id=i, payload=b"x" * size, headers={"k": "v" * n})
                for n, (i, size) in enumerate(zip(ids, sizes, strict=True))
            ]
        )
        listed = [listed_size(await broker.get_task(i)) for i in ids]
        assert listed == [LISTED_OVERHEAD + size + 1 + n for n, size in enumerate(sizes)]
        budget = listed[0] + listed[1] + listed[2]
        first = await broker.list_tasks(TaskListParams(max_bytes=budget))
        assert [t.id for t in first.tasks] == ids[:3]
        assert first.next_cursor == ids[2]
        # The task that would pass the budget starts the next page, alone if it must be.
        second = await broker.list_tasks(TaskListParams(max_bytes=budget, cursor=ids[2]))
        assert [t.id for t in second.tasks] == [ids[3]]
        assert second.tasks[0].payload == b"x" * 5000
        assert second.next_cursor == ids[3]
        last = await broker.list_tasks(TaskListParams(max_bytes=budget, cursor=ids[3]))
        assert [t.id for t in last.tasks] == [ids[4]]
        assert last.next_cursor is None
        tiny = await broker.list_tasks(TaskListParams(max_bytes=1))
        assert [t.id for t in tiny.tasks] == [ids[0]]
        assert tiny.next_cursor == ids[0]
        # The limit still cuts first.
        assert len((await broker.list_tasks(TaskListParams(max_bytes=10**9, limit=2))).tasks) == 2
        with pytest.raises(InvalidTask):
            await broker.list_tasks(TaskListParams(max_bytes=0))

    async def test_list_tasks_can_leave_payloads_out(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue_and_lease(broker, payload=b"p" * 4000)
        await broker.set_progress(task.id, task.lease_id or "", b"progress")
        done = await broker.ack(task.id, task.lease_id or "", b"r" * 4000)
        other = (await broker.enqueue(new_task(OTHER_QUEUE, payload=b"q" * 4000))).task
        stored = sorted([done, other], key=lambda t: t.id)
        page = await broker.list_tasks(TaskListParams(omit_payloads=True))
        assert page.tasks == [without_payloads(t) for t in stored]
        listed_done = next(t for t in page.tasks if t.id == done.id)
        assert listed_done.payload == b""
        assert listed_done.result is None
        assert listed_done.progress is None
        assert listed_done.state == TaskState.COMPLETED
        # Left out, they do not count against the budget either.
        small = listed_size(done, omit_payloads=True)
        assert small == LISTED_OVERHEAD
        both = await broker.list_tasks(TaskListParams(omit_payloads=True, max_bytes=2 * small))
        assert len(both.tasks) == 2
        assert both.next_cursor is None
        full = await broker.list_tasks(TaskListParams(max_bytes=2 * small))
        assert full.tasks == stored[:1]
        assert full.next_cursor == stored[0].id

    async def test_queue_stats_for_one_queue(self, broker: Broker) -> None:
        await enqueue(broker)
        [one] = await broker.queue_stats(QUEUE)
        assert one.queue == QUEUE
        assert one.count(TaskState.PENDING) == 1
        [unknown] = await broker.queue_stats("nobody")
        assert unknown.queue == "nobody"
        assert not unknown.paused
        assert sum(unknown.counts.values()) == 0
        with pytest.raises(InvalidTask):
            await broker.queue_stats("not valid")

    async def test_queue_stats_forgets_a_queue_without_tasks(self, broker: Broker) -> None:
        task = await enqueue(broker)
        await broker.delete_task(task.id)
        assert await broker.queue_stats() == []
        await broker.set_queue_paused(QUEUE, False)
        assert [s.queue for s in await broker.queue_stats()] == [QUEUE]

    async def test_cancel_waiting_task(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue(broker, process_at=clock.now() + TTL)
        clock.advance(timedelta(seconds=1))
        canceled = await broker.cancel_task(task.id)
        assert canceled.state == TaskState.CANCELED
        assert canceled.completed_at == clock.now()
        assert canceled.updated_at == clock.now()
        assert await broker.get_task(task.id) == canceled
        clock.advance(TTL)
        assert await broker.promote_scheduled() == {}

    async def test_cancel_running_task_archives_it_and_loses_the_lease(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue_and_lease(broker)
        canceled = await broker.cancel_task(task.id)
        assert canceled.state == TaskState.ARCHIVED
        assert canceled.last_error == CANCELED_WHILE_RUNNING_ERROR
        assert canceled.completed_at == clock.now()
        assert canceled.lease_id is None
        assert canceled.retried == 0
        with pytest.raises(LeaseLost):
            await broker.ack(task.id, task.lease_id or "")

    async def test_cancel_terminal_or_unknown(self, broker: Broker, clock: FakeClock) -> None:
        done = await _completed(broker)
        with pytest.raises(InvalidState) as caught:
            await broker.cancel_task(done.id)
        assert caught.value.task_id == done.id
        canceled = await enqueue(broker)
        await broker.cancel_task(canceled.id)
        with pytest.raises(InvalidState):
            await broker.cancel_task(canceled.id)
        with pytest.raises(TaskNotFound):
            await broker.cancel_task(unused_id(clock))

    async def test_delete_task(self, broker: Broker, clock: FakeClock) -> None:
        done = await _completed(broker)
        waiting = await enqueue(broker)
        await broker.delete_task(waiting.id)
        await broker.delete_task(done.id)
        for task_id in (waiting.id, done.id):
            with pytest.raises(TaskNotFound):
                await broker.get_task(task_id)
        with pytest.raises(TaskNotFound):
            await broker.delete_task(waiting.id)
        with pytest.raises(InvalidTask):
            await broker.delete_task("bad")

    async def test_delete_active_task_is_invalid(self, broker: Broker) -> None:
        task = await enqueue_and_lease(broker)
        with pytest.raises(InvalidState):
            await broker.delete_task(task.id)
        assert (await broker.get_task(task.id)).state == TaskState.ACTIVE

    async def test_run_task_now(self, broker: Broker, clock: FakeClock) -> None:
        scheduled = await enqueue(broker, process_at=clock.now() + timedelta(hours=1))
        leased = await enqueue_and_lease(broker, OTHER_QUEUE)
        retry = await broker.fail(leased.id, leased.lease_id or "", "boom", timedelta(hours=1))
        clock.advance(timedelta(seconds=3))
        for task in (scheduled, retry):
            ran = await broker.run_task_now(task.id)
            assert ran.state == TaskState.PENDING
            assert ran.available_at == clock.now()
        assert ran.retried == 1
        assert [t.id for t in await broker.lease(QUEUE, 5, TTL)] == [scheduled.id]
        assert [t.id for t in await broker.lease(OTHER_QUEUE, 5, TTL)] == [retry.id]

    async def test_run_pending_task_now_moves_it_up(self, broker: Broker, clock: FakeClock) -> None:
        first, second = sorted_ids(clock, 2)
        await broker.enqueue_batch([new_task(id=first), new_task(id=second)])
        clock.advance(timedelta(seconds=1))
        ran = await broker.run_task_now(first)
        assert ran.state == TaskState.PENDING
        assert ran.available_at == clock.now()
        assert (await lease_one(broker)).id == second

    async def test_get_tasks_returns_the_stored_ones_in_order(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        a = await enqueue(broker)
        b = await enqueue(broker, OTHER_QUEUE)
        missing = unused_id(clock)
        got = await broker.get_tasks([b.id, missing, a.id, b.id])
        assert [t.id for t in got] == [b.id, a.id]
        assert got[0] == await broker.get_task(b.id)
        assert await broker.get_tasks([]) == []
        with pytest.raises(InvalidTask):
            await broker.get_tasks(["nope"])
        with pytest.raises(InvalidTask):
            await broker.get_tasks([a.id] * (MAX_BATCH + 1))

    async def test_run_task_now_invalid_states(self, broker: Broker, clock: FakeClock) -> None:
        active = await enqueue_and_lease(broker)
        done = await _completed(broker)
        canceled = await enqueue(broker, OTHER_QUEUE)
        await broker.cancel_task(canceled.id)
        for task in (active, done, canceled):
            with pytest.raises(InvalidState):
                await broker.run_task_now(task.id)
        with pytest.raises(TaskNotFound):
            await broker.run_task_now(unused_id(clock))

    async def test_reschedule_task(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue(broker)
        at = clock.now() + timedelta(minutes=10)
        moved = await broker.reschedule_task(task.id, at)
        assert moved.state == TaskState.SCHEDULED
        assert moved.available_at == at
        assert moved.process_at is None
        assert await broker.lease(QUEUE, 1, TTL) == []
        clock.advance(timedelta(minutes=10))
        assert await broker.promote_scheduled() == {QUEUE: 1}

    async def test_reschedule_to_the_past_is_pending_now(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue(broker, process_at=clock.now() + timedelta(hours=1))
        clock.advance(timedelta(seconds=5))
        moved = await broker.reschedule_task(task.id, clock.now() - timedelta(hours=1))
        assert moved.state == TaskState.PENDING
        assert moved.available_at == clock.now()

    async def test_reschedule_task_errors(self, broker: Broker, clock: FakeClock) -> None:
        active = await enqueue_and_lease(broker)
        later = clock.now() + TTL
        with pytest.raises(InvalidState):
            await broker.reschedule_task(active.id, later)
        with pytest.raises(InvalidState):
            await broker.reschedule_task((await _completed(broker)).id, later)
        waiting = await enqueue(broker)
        with pytest.raises(InvalidTask):
            await broker.reschedule_task(waiting.id, datetime(2031, 1, 1))
        with pytest.raises(TaskNotFound):
            await broker.reschedule_task(unused_id(clock), later)

    async def test_archive_task(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue(broker, group="g")
        archived = await broker.archive_task(task.id)
        assert archived.state == TaskState.ARCHIVED
        assert archived.last_error == ARCHIVED_BY_ADMIN_ERROR
        assert archived.completed_at == clock.now()
        with pytest.raises(InvalidState):
            await broker.archive_task(task.id)
        active = await enqueue_and_lease(broker)
        with pytest.raises(InvalidState):
            await broker.archive_task(active.id)
        with pytest.raises(TaskNotFound):
            await broker.archive_task(unused_id(clock))

    async def test_revive_task(self, broker: Broker, clock: FakeClock) -> None:
        task = await enqueue_and_lease(broker, max_retry=0)
        await broker.fail(task.id, task.lease_id or "", "boom", timedelta(0))
        clock.advance(timedelta(seconds=4))
        revived = await broker.revive_task(task.id)
        assert revived.state == TaskState.PENDING
        assert revived.retried == 0
        assert revived.completed_at is None
        assert revived.available_at == clock.now()
        assert revived.last_error == "boom"
        assert (await lease_one(broker)).id == task.id

    async def test_revive_task_errors(self, broker: Broker, clock: FakeClock) -> None:
        done = await _completed(broker)
        waiting = await enqueue(broker)
        for task in (done, waiting):
            with pytest.raises(InvalidState):
                await broker.revive_task(task.id)
        with pytest.raises(TaskNotFound):
            await broker.revive_task(unused_id(clock))

    async def test_revive_when_the_claim_is_taken(self, broker: Broker) -> None:
        old = await enqueue(broker, unique_key="k")
        await broker.archive_task(old.id)
        newcomer = await enqueue(broker, unique_key="k")
        with pytest.raises(DuplicateTask) as caught:
            await broker.revive_task(old.id)
        assert caught.value.existing_id == newcomer.id
        assert (await broker.get_task(old.id)).state == TaskState.ARCHIVED
        await broker.cancel_task(newcomer.id)
        assert (await broker.revive_task(old.id)).state == TaskState.PENDING
        with pytest.raises(DuplicateTask):
            await broker.enqueue(new_task(unique_key="k"))

    async def test_revived_task_with_a_lapsed_claim_takes_no_key(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        old = await enqueue(broker, unique_key="k", unique_ttl=timedelta(seconds=5))
        await broker.archive_task(old.id)
        clock.advance(timedelta(seconds=5))
        newcomer = await enqueue(broker, unique_key="k")
        assert (await broker.revive_task(old.id)).state == TaskState.PENDING
        with pytest.raises(DuplicateTask) as caught:
            await broker.enqueue(new_task(unique_key="k"))
        assert caught.value.existing_id == newcomer.id
        await broker.cancel_task(newcomer.id)
        await enqueue(broker, unique_key="k")

    async def test_pause_flags(self, broker: Broker) -> None:
        assert not await broker.queue_paused(QUEUE)
        await broker.set_queue_paused(QUEUE, True)
        assert await broker.queue_paused(QUEUE)
        assert not await broker.queue_paused(OTHER_QUEUE)
        await broker.set_queue_paused(QUEUE, False)
        assert not await broker.queue_paused(QUEUE)
        with pytest.raises(InvalidTask):
            await broker.set_queue_paused("a b", True)
        with pytest.raises(InvalidTask):
            await broker.queue_paused("")

    async def test_info(self, broker: Broker) -> None:
        info = await broker.info()
        assert info.driver
        assert info.version

    async def test_upkeep_storage_on_a_quiet_store_does_nothing(self, broker: Broker) -> None:
        # The first pass may catch up with what earlier tests left in a shared store's
        # counters (they are not reset with the rows, and autovacuum may lag): after it,
        # a store that only gained one row has nothing to do.
        await broker.upkeep_storage()
        await enqueue(broker)
        report = await broker.upkeep_storage()
        assert not report.analyzed
        assert not report.vacuumed

    async def test_close_makes_every_later_call_fail(self, broker: Broker) -> None:
        task = await enqueue(broker)
        await broker.close()
        with pytest.raises(BrokerClosed):
            await broker.enqueue(new_task())
        with pytest.raises(BrokerClosed):
            await broker.get_task(task.id)
        with pytest.raises(BrokerClosed):
            await broker.lease(QUEUE, 1, TTL)
        with pytest.raises(BrokerClosed):
            await broker.queue_stats()
        with pytest.raises(BrokerClosed):
            await broker.reap_expired_leases()
        with pytest.raises(BrokerClosed):
            await broker.info()
        with pytest.raises(BrokerClosed):
            await broker.upkeep_storage()
        await broker.close()
