"""Conformance: dependencies (enqueue rules, resolution and its policies, the sweep, the
dependency sink, listings)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import InvalidTask, TaskNotFound
from conveyor_broker.interface import MAX_BATCH, Broker
from conveyor_broker.testing.builders import (
    OTHER_QUEUE,
    QUEUE,
    TTL,
    TYPE,
    enqueue,
    enqueue_and_lease,
    lease_one,
    new_task,
    sorted_ids,
    unused_id,
)
from conveyor_broker.types import (
    AckItem,
    DependencyLink,
    DependencyListParams,
    DependencyOutcome,
    OnFailure,
    Resolution,
    Task,
    TaskEvent,
    TaskState,
    TerminalPurgeParams,
)
from conveyor_broker.validation import MAX_DEPENDENCIES

BLOCK, CONTINUE, CASCADE = OnFailure.BLOCK, OnFailure.CONTINUE, OnFailure.CASCADE_CANCEL


def _sink(broker: Broker) -> list[Resolution]:
    heard: list[Resolution] = []
    broker.set_dependency_sink(heard.append)
    return heard


async def _complete(broker: Broker, task: Task) -> Task:
    """Lease ``task`` (it must be the only due one of its queue) and ack it."""
    leased = await lease_one(broker, task.queue)
    assert leased.id == task.id
    return await broker.ack(leased.id, leased.lease_id or "", b"result")


async def _fail(broker: Broker, task: Task) -> Task:
    """Lease ``task`` (the only due one of its queue) and fail it for good."""
    leased = await lease_one(broker, task.queue)
    assert leased.id == task.id
    return await broker.fail(leased.id, leased.lease_id or "", "boom", TTL, skip_retry=True)


async def _state(broker: Broker, task: Task) -> TaskState:
    return (await broker.get_task(task.id)).state


async def _resolve_all(broker: Broker, *tasks: Task, limit: int = MAX_BATCH) -> Resolution:
    """Resolve ``tasks`` and whatever that leaves pending, until nothing is; the work of
    every pass added up."""
    promoted: dict[str, int] = {}
    canceled: list[str] = []
    edges = 0
    pending = [t.id for t in tasks]
    for _ in range(100):
        if not pending:
            return Resolution(promoted=promoted, canceled=tuple(canceled), edges=edges)
        done = await broker.resolve_dependents(pending, limit)
        for queue, n in done.promoted.items():
            promoted[queue] = promoted.get(queue, 0) + n
        canceled += done.canceled
        edges += done.edges
        pending = list(done.pending)
    raise AssertionError("resolution did not settle")


class DependencyTests:
    """Enqueue with dependencies, resolve_dependents, promote_ready_dependents,
    list_dependencies, the dependency sink, and what other calls do to dependencies."""

    # ------------------------------------------------------------------ enqueue

    @pytest.mark.parametrize(
        ("policy", "born"),
        [(BLOCK, TaskState.BLOCKED), (CONTINUE, TaskState.PENDING), (CASCADE, TaskState.CANCELED)],
    )
    async def test_a_failed_dependency_applies_the_policy_at_enqueue(
        self, broker: Broker, clock: FakeClock, policy: OnFailure, born: TaskState
    ) -> None:
        archived = await enqueue(broker)
        await broker.archive_task(archived.id)
        canceled = await enqueue(broker)
        await broker.cancel_task(canceled.id)
        clock.advance(timedelta(seconds=1))
        task = await enqueue(broker, depends_on=(canceled.id, archived.id), on_failure=policy)
        assert task.state == born
        if born == TaskState.CANCELED:
            assert task.completed_at == clock.now()
            # The smallest id of the dependencies that failed (two ids made in the same
            # millisecond order by their random part).
            first = min(archived.id, canceled.id)
            assert task.last_error == f"canceled: dependency {first} did not complete"
        else:
            assert task.completed_at is None
            assert task.last_error is None
        links = await broker.list_dependencies(DependencyListParams(task.id))
        assert {link.outcome for link in links.links} == {DependencyOutcome.FAILED}

    async def test_continue_waits_for_the_unfinished_dependencies(self, broker: Broker) -> None:
        failed = await enqueue(broker)
        await broker.archive_task(failed.id)
        running = await enqueue(broker, OTHER_QUEUE)
        task = await enqueue(broker, depends_on=(failed.id, running.id), on_failure=CONTINUE)
        assert task.state == TaskState.BLOCKED

    async def test_cascade_cancels_at_once_even_with_unfinished_dependencies(
        self, broker: Broker
    ) -> None:
        failed = await enqueue(broker)
        await broker.archive_task(failed.id)
        running = await enqueue(broker, OTHER_QUEUE)
        task = await enqueue(broker, depends_on=(running.id, failed.id), on_failure=CASCADE)
        assert task.state == TaskState.CANCELED

    async def test_all_completed_dependencies_start_as_without_any(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        done = await _complete(broker, await enqueue(broker))
        later = clock.now() + timedelta(minutes=5)
        assert (await enqueue(broker, depends_on=(done.id,), process_at=later)).state == (
            TaskState.SCHEDULED
        )
        assert (await enqueue(broker, depends_on=(done.id,), group="g")).state == (
            TaskState.AGGREGATING
        )

    async def test_a_dependency_may_be_a_later_item_of_the_batch(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        first, second = sorted_ids(clock, 2)
        results = await broker.enqueue_batch(
            [new_task(id=first, depends_on=(second,)), new_task(id=second)]
        )
        assert [r.task.state for r in results] == [TaskState.BLOCKED, TaskState.PENDING]
        assert all(r.created for r in results)

    async def test_a_cascade_at_enqueue_goes_through_the_batch(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        failed = await enqueue(broker)
        await broker.archive_task(failed.id)
        a, b, c = sorted_ids(clock, 3)
        # c waits for b waits for a waits for the failed task; listed out of order.
        results = await broker.enqueue_batch(
            [
                new_task(id=c, depends_on=(b,), on_failure=BLOCK),
                new_task(id=b, depends_on=(a,), on_failure=CASCADE),
                new_task(id=a, depends_on=(failed.id,), on_failure=CASCADE),
            ]
        )
        assert [r.task.state for r in results] == [
            TaskState.BLOCKED,
            TaskState.CANCELED,
            TaskState.CANCELED,
        ]
        assert results[1].task.last_error == f"canceled: dependency {a} did not complete"
        [link] = (await broker.list_dependencies(DependencyListParams(c))).links
        assert link.outcome == DependencyOutcome.FAILED

    async def test_a_task_born_canceled_takes_no_unique_claim(self, broker: Broker) -> None:
        failed = await enqueue(broker)
        await broker.archive_task(failed.id)
        canceled = await enqueue(
            broker, depends_on=(failed.id,), on_failure=CASCADE, unique_key="k"
        )
        assert canceled.state == TaskState.CANCELED
        assert (await enqueue(broker, unique_key="k")).state == TaskState.PENDING

    @pytest.mark.parametrize("length", [2, 3])
    async def test_a_cycle_in_the_batch_is_invalid_and_named(
        self, broker: Broker, clock: FakeClock, length: int
    ) -> None:
        ids = sorted_ids(clock, length)
        # Each waits for the next; the last for the first.
        batch = [new_task()] + [
            new_task(id=task_id, depends_on=(ids[(n + 1) % length],))
            for n, task_id in enumerate(ids)
        ]
        with pytest.raises(InvalidTask, match="dependency cycle") as caught:
            await broker.enqueue_batch(batch)
        for n, task_id in enumerate(ids, start=1):
            assert f"task {n} ({task_id})" in str(caught.value)
        assert (await broker.list_tasks()).tasks == []

    async def test_an_unknown_dependency_outranks_a_cycle(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        a, b = sorted_ids(clock, 2)
        missing = unused_id(clock)
        with pytest.raises(InvalidTask, match=f"task 1: unknown dependency '{missing}'"):
            await broker.enqueue_batch(
                [
                    new_task(id=a, depends_on=(b,)),
                    new_task(id=b, depends_on=(a, missing)),
                ]
            )

    async def test_too_many_dependencies_are_invalid(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        dep = await enqueue(broker)
        many = (dep.id,) * (MAX_DEPENDENCIES + 1)
        with pytest.raises(InvalidTask, match=f"at most {MAX_DEPENDENCIES}"):
            await broker.enqueue(new_task(depends_on=many))
        assert len((await broker.list_tasks()).tasks) == 1

    async def test_repeated_dependencies_count_once(self, broker: Broker) -> None:
        a = await enqueue(broker)
        b = await enqueue(broker, OTHER_QUEUE)
        task = await enqueue(broker, depends_on=(a.id, b.id, a.id), on_failure=CONTINUE)
        assert task.depends_on == (a.id, b.id)
        await _complete(broker, a)
        await _complete(broker, b)
        await _resolve_all(broker, a, b)
        assert await _state(broker, task) == TaskState.PENDING

    async def test_a_repeated_id_in_the_batch_is_the_first_occurrence(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        a, b = sorted_ids(clock, 2)
        results = await broker.enqueue_batch(
            [new_task(id=a), new_task(id=b, depends_on=(a,)), new_task(id=a, depends_on=(b,))]
        )
        assert [r.created for r in results] == [True, True, False]
        assert results[2].task.depends_on == ()

    # --------------------------------------------------------------- resolution

    async def test_completion_promotes_the_dependent(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        dep = await enqueue(broker)
        clock.advance(timedelta(seconds=1))
        task = await enqueue(broker, OTHER_QUEUE, depends_on=(dep.id,))
        await _complete(broker, dep)
        clock.advance(timedelta(seconds=1))
        done = await broker.resolve_dependents([dep.id])
        assert done == Resolution(promoted={OTHER_QUEUE: 1}, edges=1)
        stored = await broker.get_task(task.id)
        assert stored.state == TaskState.PENDING
        assert stored.available_at == task.available_at
        assert stored.updated_at == clock.now()
        assert (await lease_one(broker, OTHER_QUEUE)).id == task.id
        # Resolved once: a repeat finds nothing to do.
        assert await broker.resolve_dependents([dep.id]) == Resolution()

    async def test_unfinished_tasks_resolve_nothing(self, broker: Broker, clock: FakeClock) -> None:
        dep = await enqueue_and_lease(broker)
        task = await enqueue(broker, depends_on=(dep.id,))
        assert await broker.resolve_dependents([dep.id, unused_id(clock)]) == Resolution()
        assert await _state(broker, task) == TaskState.BLOCKED

    async def test_a_diamond_runs_its_join_after_both_branches(self, broker: Broker) -> None:
        top = await enqueue(broker)
        left = await enqueue(broker, "left", depends_on=(top.id,))
        right = await enqueue(broker, "right", depends_on=(top.id,))
        join = await enqueue(broker, "join", depends_on=(left.id, right.id))
        await _complete(broker, top)
        assert (await _resolve_all(broker, top)).promoted == {"left": 1, "right": 1}
        await _complete(broker, left)
        await _resolve_all(broker, left)
        assert await _state(broker, join) == TaskState.BLOCKED
        await _complete(broker, right)
        assert (await _resolve_all(broker, right)).promoted == {"join": 1}
        assert await _state(broker, join) == TaskState.PENDING

    async def test_a_fan_in_resolves_a_limited_number_of_edges_per_call(
        self, broker: Broker
    ) -> None:
        parents = [await enqueue(broker, f"p{n}") for n in range(5)]
        child = await enqueue(broker, depends_on=tuple(p.id for p in parents))
        for parent in parents:
            await _complete(broker, parent)
        ids = sorted(p.id for p in parents)
        first = await broker.resolve_dependents(ids, limit=2)
        assert first.edges == 2
        assert first.pending == tuple(ids[2:])
        assert await _state(broker, child) == TaskState.BLOCKED
        second = await broker.resolve_dependents(first.pending, limit=2)
        assert (second.edges, second.pending) == (2, tuple(ids[4:]))
        last = await broker.resolve_dependents(second.pending, limit=2)
        assert last == Resolution(promoted={QUEUE: 1}, edges=1)
        assert await _state(broker, child) == TaskState.PENDING

    async def test_a_fan_out_resolves_a_limited_number_of_edges_per_call(
        self, broker: Broker
    ) -> None:
        parent = await enqueue(broker, OTHER_QUEUE)
        children = [await enqueue(broker, depends_on=(parent.id,)) for _ in range(5)]
        children.sort(key=lambda t: t.id)
        await _complete(broker, parent)
        first = await broker.resolve_dependents([parent.id], limit=2)
        assert first == Resolution(promoted={QUEUE: 2}, pending=(parent.id,), edges=2)
        # The first ones by id.
        states = [await _state(broker, c) for c in children]
        assert states == [TaskState.PENDING] * 2 + [TaskState.BLOCKED] * 3
        assert (await broker.resolve_dependents([parent.id], limit=2)).pending == (parent.id,)
        assert await broker.resolve_dependents([parent.id], limit=2) == Resolution(
            promoted={QUEUE: 1}, edges=1
        )
        assert [await _state(broker, c) for c in children] == [TaskState.PENDING] * 5

    async def test_block_keeps_the_dependent_blocked(self, broker: Broker) -> None:
        dep = await enqueue(broker)
        task = await enqueue(broker, OTHER_QUEUE, depends_on=(dep.id,), on_failure=BLOCK)
        await _fail(broker, dep)
        assert await _resolve_all(broker, dep) == Resolution(edges=1)
        assert await _state(broker, task) == TaskState.BLOCKED
        [link] = (await broker.list_dependencies(DependencyListParams(task.id))).links
        assert link == DependencyLink(
            dep.id, DependencyOutcome.FAILED, QUEUE, TYPE, TaskState.ARCHIVED
        )

    async def test_continue_runs_once_every_dependency_has_ended(self, broker: Broker) -> None:
        failing = await enqueue(broker)
        slow = await enqueue(broker, "slow")
        task = await enqueue(
            broker, OTHER_QUEUE, depends_on=(failing.id, slow.id), on_failure=CONTINUE
        )
        await _fail(broker, failing)
        await _resolve_all(broker, failing)
        assert await _state(broker, task) == TaskState.BLOCKED
        await _complete(broker, slow)
        assert (await _resolve_all(broker, slow)).promoted == {OTHER_QUEUE: 1}
        assert await _state(broker, task) == TaskState.PENDING

    async def test_cascade_cancel_goes_down_three_levels(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        root = await enqueue(broker)
        one = await enqueue(broker, "one", depends_on=(root.id,), on_failure=CASCADE)
        two = await enqueue(broker, "two", depends_on=(one.id,), on_failure=CASCADE)
        three = await enqueue(broker, "three", depends_on=(two.id,), on_failure=CASCADE)
        held = await enqueue(broker, "held", depends_on=(three.id,), on_failure=BLOCK)
        await _fail(broker, root)
        clock.advance(timedelta(seconds=1))
        first = await broker.resolve_dependents([root.id])
        assert first == Resolution(pending=(one.id,), canceled=(one.id,), edges=1)
        done = await _resolve_all(broker, *(await _tasks(broker, first.pending)))
        assert done.canceled == (two.id, three.id)
        for task, cause in ((one, root), (two, one), (three, two)):
            stored = await broker.get_task(task.id)
            assert stored.state == TaskState.CANCELED
            assert stored.completed_at == clock.now()
            assert stored.last_error == f"canceled: dependency {cause.id} did not complete"
        assert await _state(broker, held) == TaskState.BLOCKED

    async def test_a_mixed_fan_in(self, broker: Broker) -> None:
        good = await enqueue(broker, "good")
        bad = await enqueue(broker, "bad")
        policies = (BLOCK, CONTINUE, CASCADE)
        waiting = {
            policy: await enqueue(
                broker, policy.value, depends_on=(good.id, bad.id), on_failure=policy
            )
            for policy in policies
        }
        await _complete(broker, good)
        await _fail(broker, bad)
        done = await _resolve_all(broker, good, bad)
        assert done.promoted == {CONTINUE.value: 1}
        assert done.canceled == (waiting[CASCADE].id,)
        assert [await _state(broker, waiting[p]) for p in policies] == [
            TaskState.BLOCKED,
            TaskState.PENDING,
            TaskState.CANCELED,
        ]

    async def test_promotion_keeps_a_delay_and_a_group(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        dep = await enqueue(broker)
        later = await enqueue(
            broker, depends_on=(dep.id,), process_at=clock.now() + timedelta(hours=1)
        )
        soon = await enqueue(
            broker, OTHER_QUEUE, depends_on=(dep.id,), process_at=clock.now() + TTL
        )
        grouped = await enqueue(broker, depends_on=(dep.id,), group="g")
        clock.advance(TTL)
        await _complete(broker, dep)
        assert (await _resolve_all(broker, dep)).promoted == {OTHER_QUEUE: 1}
        assert await _state(broker, later) == TaskState.SCHEDULED
        assert await _state(broker, soon) == TaskState.PENDING
        assert await _state(broker, grouped) == TaskState.AGGREGATING

    async def test_resolution_reports_events(self, broker: Broker, clock: FakeClock) -> None:
        dep = await enqueue(broker)
        runs = await enqueue(broker, OTHER_QUEUE, depends_on=(dep.id,))
        goes = await enqueue(broker, OTHER_QUEUE, depends_on=(dep.id,), on_failure=CASCADE)
        await _fail(broker, dep)
        events: list[TaskEvent] = []
        broker.set_event_sink(events.append)
        await _resolve_all(broker, dep)
        assert sorted(events, key=lambda e: e.task_id) == [
            TaskEvent(
                goes.id, OTHER_QUEUE, TYPE, TaskState.CANCELED, TaskState.BLOCKED, clock.now()
            )
        ]
        assert await _state(broker, runs) == TaskState.BLOCKED
        broker.set_event_sink(None)

    async def test_run_now_overrides_unmet_dependencies(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        dep = await enqueue(broker)
        task = await enqueue(broker, OTHER_QUEUE, depends_on=(dep.id,), on_failure=CASCADE)
        clock.advance(timedelta(seconds=1))
        ran = await broker.run_task_now(task.id)
        assert (ran.state, ran.available_at) == (TaskState.PENDING, clock.now())
        await _fail(broker, dep)
        assert await _resolve_all(broker, dep) == Resolution(edges=1)
        assert await _state(broker, task) == TaskState.PENDING

    async def test_reviving_a_failed_dependency_reopens_what_it_blocked(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        dep = await enqueue(broker)
        other = await enqueue(broker, "other")
        blocked = await enqueue(broker, "b", depends_on=(dep.id,))
        waits = await enqueue(broker, "w", depends_on=(dep.id, other.id), on_failure=CONTINUE)
        overridden = await enqueue(broker, "o", depends_on=(dep.id,))
        await _fail(broker, dep)
        await _resolve_all(broker, dep)
        await broker.run_task_now(overridden.id)
        clock.advance(timedelta(seconds=1))
        revived = await broker.revive_task(dep.id)
        assert revived.state == TaskState.PENDING
        for task in (blocked, waits):
            [link] = [
                link
                for link in (await broker.list_dependencies(DependencyListParams(task.id))).links
                if link.task_id == dep.id
            ]
            assert link.outcome == DependencyOutcome.OPEN
            assert (await broker.get_task(task.id)).updated_at == clock.now()
        [link] = (await broker.list_dependencies(DependencyListParams(overridden.id))).links
        assert link.outcome == DependencyOutcome.FAILED
        # Its next end is resolved for them: this time it completes.
        heard = _sink(broker)
        await _complete(broker, dep)
        assert heard == [Resolution(pending=(dep.id,))]
        assert (await _resolve_all(broker, dep)).promoted == {"b": 1}
        assert await _state(broker, waits) == TaskState.BLOCKED  # still waits for `other`
        await _complete(broker, other)
        assert (await _resolve_all(broker, other)).promoted == {"w": 1}
        broker.set_dependency_sink(None)

    async def test_resolve_dependents_refuses_bad_input(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        with pytest.raises(InvalidTask):
            await broker.resolve_dependents(["nope"])
        with pytest.raises(InvalidTask):
            await broker.resolve_dependents([unused_id(clock)], limit=0)
        with pytest.raises(InvalidTask):
            await broker.resolve_dependents([unused_id(clock)] * (MAX_BATCH + 1))
        with pytest.raises(InvalidTask):
            await broker.promote_ready_dependents(limit=MAX_BATCH + 1)
        with pytest.raises(InvalidTask):
            await broker.promote_ready_dependents(min_age=timedelta(seconds=-1))
        assert await broker.resolve_dependents([]) == Resolution()

    # ------------------------------------------------------------------- the sink

    async def test_the_sink_hears_of_every_end_with_dependents_waiting(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        heard = _sink(broker)
        lone = await enqueue(broker, "lone")
        await _complete(broker, lone)
        assert heard == []

        acked = await enqueue(broker, "acked")
        batch_acked = await enqueue(broker, "batch")
        failed = await enqueue(broker, "failed")
        archived = await enqueue(broker, "archived")
        reaped = await enqueue(broker, "reaped", max_retry=0)
        expiring = await enqueue(broker, "expiring", expires_at=clock.now() + TTL)
        canceled = await enqueue(broker, "canceled")
        archived_by_admin = await enqueue(broker, "by-admin")
        ends = [acked, batch_acked, failed, archived, reaped, expiring, canceled, archived_by_admin]
        for dep in ends:
            await enqueue(broker, OTHER_QUEUE, depends_on=(dep.id,))
        assert heard == []

        async def step(task: Task) -> None:
            assert heard == [Resolution(pending=(task.id,))], task.queue
            heard.clear()

        await _complete(broker, acked)
        await step(acked)
        leased = await lease_one(broker, "batch")
        assert await broker.ack_batch([AckItem(leased.id, leased.lease_id or "")]) == [True]
        await step(batch_acked)
        await _fail(broker, failed)
        await step(failed)
        leased = await lease_one(broker, "archived")
        await broker.archive(leased.id, leased.lease_id or "", "no")
        await step(archived)
        await lease_one(broker, "reaped")
        clock.advance(TTL)
        await broker.reap_expired_leases()
        await step(reaped)
        assert await broker.archive_expired() != []
        await step(expiring)
        await broker.cancel_task(canceled.id)
        await step(canceled)
        await broker.archive_task(archived_by_admin.id)
        await step(archived_by_admin)
        # A retry is no end.
        retried = await enqueue(broker, "retried", max_retry=3)
        await enqueue(broker, OTHER_QUEUE, depends_on=(retried.id,))
        leased = await lease_one(broker, "retried")
        await broker.fail(leased.id, leased.lease_id or "", "again", TTL)
        assert heard == []
        # Once resolved, its end is no news.
        await _resolve_all(broker, acked)
        broker.set_dependency_sink(None)

    async def test_a_failing_sink_does_not_undo_the_change(self, broker: Broker) -> None:
        def explode(resolution: Resolution) -> None:
            raise RuntimeError("sink down")

        dep = await enqueue(broker)
        await enqueue(broker, OTHER_QUEUE, depends_on=(dep.id,))
        broker.set_dependency_sink(explode)
        assert broker.dependency_sink is explode
        done = await _complete(broker, dep)
        assert done.state == TaskState.COMPLETED
        broker.set_dependency_sink(None)

    async def test_deleting_a_dependency_resolves_its_dependents_as_failed(
        self, broker: Broker
    ) -> None:
        heard = _sink(broker)
        dep = await enqueue(broker)
        blocked = await enqueue(broker, "b", depends_on=(dep.id,), on_failure=BLOCK)
        runs = await enqueue(broker, "c", depends_on=(dep.id,), on_failure=CONTINUE)
        goes = await enqueue(broker, "x", depends_on=(dep.id,), on_failure=CASCADE)
        after_goes = await enqueue(broker, "y", depends_on=(goes.id,))
        await broker.delete_task(dep.id)
        assert heard == [Resolution(promoted={"c": 1}, pending=(goes.id,))]
        assert [await _state(broker, t) for t in (blocked, runs, goes, after_goes)] == [
            TaskState.BLOCKED,
            TaskState.PENDING,
            TaskState.CANCELED,
            TaskState.BLOCKED,
        ]
        [link] = (await broker.list_dependencies(DependencyListParams(blocked.id))).links
        assert link == DependencyLink(dep.id, DependencyOutcome.FAILED, None, None, None)
        broker.set_dependency_sink(None)

    async def test_deleting_a_completed_dependency_not_yet_resolved_satisfies(
        self, broker: Broker
    ) -> None:
        dep = await enqueue(broker)
        task = await enqueue(broker, OTHER_QUEUE, depends_on=(dep.id,))
        await _complete(broker, dep)
        heard = _sink(broker)
        await broker.delete_task(dep.id)
        assert heard == [Resolution(promoted={OTHER_QUEUE: 1})]
        assert await _state(broker, task) == TaskState.PENDING
        broker.set_dependency_sink(None)

    # -------------------------------------------------------------------- the sweep

    async def test_the_sweep_finds_ended_tasks_left_unresolved(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        first = await enqueue(broker, "first")
        second = await enqueue(broker, "second")
        unfinished = await enqueue(broker, "unfinished")
        waits = [
            await enqueue(broker, OTHER_QUEUE, depends_on=(dep.id,))
            for dep in (first, second, unfinished)
        ]
        await _complete(broker, first)
        clock.advance(timedelta(seconds=5))
        await _fail(broker, second)
        # Too young for a sweep that leaves the last 5 s to the resolver.
        assert await broker.promote_ready_dependents(min_age=timedelta(seconds=6)) == Resolution()
        done = await broker.promote_ready_dependents(limit=1, min_age=timedelta(seconds=5))
        assert done == Resolution(promoted={OTHER_QUEUE: 1}, edges=1)
        assert await broker.promote_ready_dependents() == Resolution(edges=1)
        assert await broker.promote_ready_dependents() == Resolution()
        assert [await _state(broker, t) for t in waits] == [
            TaskState.PENDING,
            TaskState.BLOCKED,
            TaskState.BLOCKED,
        ]

    async def test_the_sweep_finishes_a_cascade_a_resolver_left(self, broker: Broker) -> None:
        root = await enqueue(broker)
        chain = [root]
        for n in range(3):
            chain.append(
                await enqueue(broker, f"l{n}", depends_on=(chain[-1].id,), on_failure=CASCADE)
            )
        await _fail(broker, root)
        # The resolver did one step and died: the sweep finds the rest.
        assert (await broker.resolve_dependents([root.id])).canceled == (chain[1].id,)
        for _ in range(3):
            await broker.promote_ready_dependents()
        assert [await _state(broker, t) for t in chain[1:]] == [TaskState.CANCELED] * 3
        assert await broker.promote_ready_dependents() == Resolution()

    async def test_purge_keeps_an_ended_task_until_its_dependents_resolve(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        dep = await enqueue(broker, retention=timedelta(0))
        task = await enqueue(broker, OTHER_QUEUE, depends_on=(dep.id,))
        await _complete(broker, dep)
        purge = TerminalPurgeParams(archive_retention=timedelta(0))
        assert await broker.purge_terminal(purge) == 0
        await _resolve_all(broker, dep)
        assert await broker.purge_terminal(purge) == 1
        [link] = (await broker.list_dependencies(DependencyListParams(task.id))).links
        assert link == DependencyLink(dep.id, DependencyOutcome.SATISFIED, None, None, None)
        # Purging the dependent takes its edges along.
        await _complete(broker, task)
        assert await broker.purge_terminal(purge) == 1
        with pytest.raises(TaskNotFound):
            await broker.list_dependencies(DependencyListParams(task.id))

    # -------------------------------------------------------------------- listings

    async def test_list_dependencies_both_ways_a_page_at_a_time(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        parents = [await enqueue(broker, f"p{n}") for n in range(3)]
        parents.sort(key=lambda t: t.id)
        child = await enqueue(broker, depends_on=tuple(p.id for p in reversed(parents)))
        other = await enqueue(broker, OTHER_QUEUE, depends_on=(parents[0].id,))
        await _complete(broker, parents[0])
        await _resolve_all(broker, parents[0])
        first = await broker.list_dependencies(DependencyListParams(child.id, limit=2))
        assert [link.task_id for link in first.links] == [p.id for p in parents[:2]]
        assert [link.outcome for link in first.links] == [
            DependencyOutcome.SATISFIED,
            DependencyOutcome.OPEN,
        ]
        assert first.links[0].state == TaskState.COMPLETED
        assert first.next_cursor == parents[1].id
        rest = await broker.list_dependencies(
            DependencyListParams(child.id, limit=2, cursor=first.next_cursor)
        )
        assert [link.task_id for link in rest.links] == [parents[2].id]
        assert rest.next_cursor is None
        dependents = await broker.list_dependencies(
            DependencyListParams(parents[0].id, dependents=True)
        )
        assert [(link.task_id, link.state) for link in dependents.links] == sorted(
            [(child.id, TaskState.BLOCKED), (other.id, TaskState.PENDING)]
        )
        assert (
            await broker.list_dependencies(DependencyListParams(other.id, dependents=True))
        ).links == []
        with pytest.raises(TaskNotFound):
            await broker.list_dependencies(DependencyListParams(unused_id(clock)))
        with pytest.raises(InvalidTask):
            await broker.list_dependencies(DependencyListParams(child.id, limit=0))
        with pytest.raises(InvalidTask):
            await broker.list_dependencies(DependencyListParams(child.id, cursor="x"))


async def _tasks(broker: Broker, ids: tuple[str, ...]) -> list[Task]:
    return [await broker.get_task(task_id) for task_id in ids]
