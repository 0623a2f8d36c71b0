"""Conformance: enqueue and enqueue_batch (initial states, idempotency, uniqueness, input)."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest

from conveyor_broker.clock import FakeClock
from conveyor_broker.errors import DuplicateTask, InvalidTask
from conveyor_broker.ids import is_ulid
from conveyor_broker.interface import DEFAULT_MAX_RETRY, MAX_BATCH, Broker
from conveyor_broker.testing.builders import (
    OTHER_QUEUE,
    QUEUE,
    TYPE,
    enqueue,
    enqueue_and_lease,
    lease_one,
    new_task,
    sorted_ids,
    unused_id,
)
from conveyor_broker.types import OnFailure, TaskState
from conveyor_broker.validation import MAX_PAYLOAD

_NAIVE = datetime(2030, 1, 1)

#: (description, NewTask options) pairs that every broker must reject with InvalidTask.
_BAD_TASKS: list[tuple[str, dict[str, Any]]] = [
    ("empty queue", {"queue": ""}),
    ("queue with a dot", {"queue": "a.b"}),
    ("queue with a space", {"queue": "a b"}),
    ("queue starting with dash", {"queue": "-a"}),
    ("queue too long", {"queue": "q" * 129}),
    ("empty type", {"type": ""}),
    ("id not a ULID", {"id": "not-a-ulid"}),
    ("zero timeout", {"timeout": timedelta(0)}),
    ("negative timeout", {"timeout": timedelta(seconds=-1)}),
    ("zero unique_ttl", {"unique_key": "k", "unique_ttl": timedelta(0)}),
    ("negative retention", {"retention": timedelta(seconds=-1)}),
    ("unique_ttl without key", {"unique_ttl": timedelta(seconds=5)}),
    ("negative max_retry", {"max_retry": -1}),
    ("naive process_at", {"process_at": _NAIVE}),
    ("naive expires_at", {"expires_at": _NAIVE}),
    ("empty header key", {"headers": {"": "v"}}),
    ("malformed dependency", {"depends_on": ("nope",)}),
    # Names are matched whole: a trailing newline is not an end of line.
    ("queue with a trailing newline", {"queue": "0\n"}),
    ("queue with a NUL", {"queue": "a\x00"}),
    ("queue with a Cyrillic a", {"queue": "\u0430bc"}),
    ("queue with a fullwidth letter", {"queue": "\uff31"}),
    ("queue with a superscript digit", {"queue": "q\u00b2"}),
    ("queue with a zero-width space", {"queue": "q\u200b"}),
    # No control characters in any text field (Postgres cannot store a NUL in text).
    ("NUL in type", {"type": "t\x00"}),
    ("newline in type", {"type": "t\n"}),
    ("C1 control in type", {"type": "t\x85"}),
    ("lone surrogate in type", {"type": "t\ud800"}),
    ("NUL in unique_key", {"unique_key": "k\x00"}),
    ("NUL in header key", {"headers": {"k\x00": "v"}}),
    ("NUL in header value", {"headers": {"k": "v\x00"}}),
    ("DEL in header value", {"headers": {"k": "\x7f"}}),
    ("NUL in concurrency_key", {"concurrency_key": "c\x00"}),
    ("NUL in group", {"group": "g\x00"}),
    ("trailing newline in id", {"id": "01J9Z3K6N8Q2R4T6V8X0Z2B4D6\n"}),
]


class EnqueueTests:
    """enqueue / enqueue_batch."""

    async def test_enqueue_stores_a_pending_task_with_defaults(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        result = await broker.enqueue(new_task(payload=b"hello", headers={"trace": "t1"}))
        task = result.task
        now = clock.now()
        assert result.created
        assert is_ulid(task.id)
        assert (task.queue, task.type, task.payload) == (QUEUE, TYPE, b"hello")
        assert dict(task.headers) == {"trace": "t1"}
        assert task.state == TaskState.PENDING
        assert task.max_retry == DEFAULT_MAX_RETRY
        assert task.retried == 0
        assert task.available_at == now
        assert task.created_at == now
        assert task.updated_at == now
        for empty in (
            task.lease_id,
            task.lease_expires_at,
            task.started_at,
            task.completed_at,
            task.last_error,
            task.result,
            task.progress,
            task.unique_until,
        ):
            assert empty is None
        assert await broker.get_task(task.id) == task

    async def test_enqueue_keeps_every_option(self, broker: Broker, clock: FakeClock) -> None:
        now = clock.now()
        [task_id] = sorted_ids(clock, 1)
        options: dict[str, Any] = {
            "id": task_id,
            "payload": b"\x00\xffbinary",
            "headers": {"a": "1", "b": "2"},
            "max_retry": 3,
            "timeout": timedelta(seconds=90),
            "deadline": now + timedelta(hours=2),
            "expires_at": now + timedelta(hours=1),
            "retention": timedelta(days=1),
            "unique_key": "u-1",
            "unique_ttl": timedelta(minutes=10),
            "on_failure": OnFailure.CASCADE_CANCEL,
            "concurrency_key": "customer-7",
        }
        task = await enqueue(broker, **options)
        stored = await broker.get_task(task_id)
        assert stored == task
        assert stored.id == task_id
        assert stored.payload == b"\x00\xffbinary"
        assert dict(stored.headers) == {"a": "1", "b": "2"}
        assert stored.max_retry == 3
        assert stored.timeout == timedelta(seconds=90)
        assert stored.deadline == now + timedelta(hours=2)
        assert stored.expires_at == now + timedelta(hours=1)
        assert stored.retention == timedelta(days=1)
        assert stored.unique_key == "u-1"
        assert stored.unique_until == now + timedelta(minutes=10)
        assert stored.on_failure == OnFailure.CASCADE_CANCEL
        assert stored.concurrency_key == "customer-7"
        assert stored.process_at is None
        assert stored.group is None
        assert stored.depends_on == ()

    async def test_max_retry_zero_is_kept(self, broker: Broker) -> None:
        task = await enqueue(broker, max_retry=0)
        assert (await broker.get_task(task.id)).max_retry == 0

    async def test_future_process_at_is_scheduled(self, broker: Broker, clock: FakeClock) -> None:
        at = clock.now() + timedelta(minutes=5)
        task = await enqueue(broker, process_at=at)
        assert task.state == TaskState.SCHEDULED
        assert task.available_at == at
        assert task.process_at == at

    async def test_past_or_present_process_at_is_pending(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        past = clock.now() - timedelta(minutes=5)
        early = await enqueue(broker, process_at=past)
        present = await enqueue(broker, process_at=clock.now())
        assert early.state == TaskState.PENDING
        assert early.available_at == past
        assert present.state == TaskState.PENDING

    async def test_group_is_aggregating_even_when_delayed(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        task = await enqueue(broker, group="g1", process_at=clock.now() + timedelta(hours=1))
        assert task.state == TaskState.AGGREGATING
        assert task.group == "g1"

    async def test_unfinished_dependency_blocks(self, broker: Broker) -> None:
        dep = await enqueue(broker)
        task = await enqueue(broker, depends_on=(dep.id,), group="g")
        assert task.state == TaskState.BLOCKED
        assert task.depends_on == (dep.id,)

    async def test_completed_dependency_does_not_block(self, broker: Broker) -> None:
        dep = await enqueue_and_lease(broker)
        await broker.ack(dep.id, dep.lease_id or "")
        task = await enqueue(broker, depends_on=(dep.id,))
        assert task.state == TaskState.PENDING

    async def test_archived_dependency_blocks_by_default(self, broker: Broker) -> None:
        # BLOCK is the default policy; CONTINUE and CASCADE_CANCEL apply at once too (see
        # testing.dependencies).
        dep = await enqueue(broker)
        await broker.archive_task(dep.id)
        task = await enqueue(broker, depends_on=(dep.id,))
        assert task.state == TaskState.BLOCKED
        assert task.on_failure == OnFailure.BLOCK

    async def test_unknown_dependency_is_invalid(self, broker: Broker, clock: FakeClock) -> None:
        with pytest.raises(InvalidTask):
            await broker.enqueue(new_task(depends_on=(unused_id(clock),)))
        assert (await broker.list_tasks()).tasks == []

    async def test_dependency_on_an_earlier_item_of_the_batch(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        first, second = sorted_ids(clock, 2)
        results = await broker.enqueue_batch(
            [new_task(id=first), new_task(id=second, depends_on=(first,))]
        )
        assert [r.task.state for r in results] == [TaskState.PENDING, TaskState.BLOCKED]

    async def test_enqueue_is_idempotent_on_id(self, broker: Broker, clock: FakeClock) -> None:
        [task_id] = sorted_ids(clock, 1)
        first = await enqueue(broker, id=task_id, payload=b"one")
        clock.advance(timedelta(seconds=5))
        again = await broker.enqueue(new_task(id=task_id, payload=b"two", queue=OTHER_QUEUE))
        assert not again.created
        assert again.task == first
        assert await broker.get_task(task_id) == first
        assert len((await broker.list_tasks()).tasks) == 1

    async def test_idempotent_id_returns_current_state(self, broker: Broker) -> None:
        task = await enqueue_and_lease(broker)
        again = await broker.enqueue(new_task(id=task.id))
        assert not again.created
        assert again.task.state == TaskState.ACTIVE
        assert again.task.lease_id == task.lease_id

    async def test_repeated_id_in_one_batch_is_stored_once(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        [task_id] = sorted_ids(clock, 1)
        results = await broker.enqueue_batch(
            [new_task(id=task_id, payload=b"a"), new_task(id=task_id, payload=b"b")]
        )
        assert [r.created for r in results] == [True, False]
        assert results[1].task == results[0].task
        assert (await broker.get_task(task_id)).payload == b"a"

    async def test_batch_returns_results_in_order(self, broker: Broker, clock: FakeClock) -> None:
        ids = sorted_ids(clock, 3)
        results = await broker.enqueue_batch([new_task(id=i) for i in reversed(ids)])
        assert [r.task.id for r in results] == list(reversed(ids))
        assert all(r.created for r in results)

    async def test_empty_batch(self, broker: Broker) -> None:
        assert await broker.enqueue_batch([]) == []

    async def test_duplicate_unique_key_names_the_holder(self, broker: Broker) -> None:
        holder = await enqueue(broker, unique_key="report-1")
        with pytest.raises(DuplicateTask) as caught:
            await broker.enqueue(new_task(unique_key="report-1"))
        assert caught.value.existing_id == holder.id
        assert caught.value.queue == QUEUE
        assert caught.value.unique_key == "report-1"
        assert [t.id for t in (await broker.list_tasks()).tasks] == [holder.id]

    async def test_unique_key_is_per_queue(self, broker: Broker) -> None:
        await enqueue(broker, unique_key="k")
        await enqueue(broker, OTHER_QUEUE, unique_key="k")

    async def test_active_task_still_holds_its_claim(self, broker: Broker) -> None:
        await enqueue_and_lease(broker, unique_key="k")
        with pytest.raises(DuplicateTask):
            await broker.enqueue(new_task(unique_key="k"))

    async def test_unique_key_twice_in_one_batch(self, broker: Broker, clock: FakeClock) -> None:
        first, second = sorted_ids(clock, 2)
        with pytest.raises(DuplicateTask) as caught:
            await broker.enqueue_batch(
                [new_task(id=first, unique_key="k"), new_task(id=second, unique_key="k")]
            )
        assert caught.value.existing_id == first
        assert (await broker.list_tasks()).tasks == []

    async def test_lapsed_unique_ttl_frees_the_claim(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        holder = await enqueue(broker, unique_key="k", unique_ttl=timedelta(seconds=60))
        clock.advance(timedelta(seconds=59))
        with pytest.raises(DuplicateTask):
            await broker.enqueue(new_task(unique_key="k"))
        clock.advance(timedelta(seconds=1))
        newcomer = await enqueue(broker, unique_key="k")
        assert newcomer.id != holder.id
        # Freeing the claim leaves the old task's options as they were.
        old = await broker.get_task(holder.id)
        assert old.state == TaskState.PENDING
        assert old.unique_key == "k"
        # The newcomer holds the claim now.
        with pytest.raises(DuplicateTask) as caught:
            await broker.enqueue(new_task(unique_key="k"))
        assert caught.value.existing_id == newcomer.id

    async def test_lapsed_holder_does_not_take_the_claim_back(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        lapsed = await enqueue(broker, unique_key="k", unique_ttl=timedelta(seconds=1))
        clock.advance(timedelta(seconds=2))
        newcomer = await enqueue(broker, unique_key="k")
        # The lapsed task moving on (leased, then back to waiting) changes nothing.
        leased = await lease_one(broker)
        assert leased.id == lapsed.id
        await broker.release(leased.id, leased.lease_id or "")
        with pytest.raises(DuplicateTask) as caught:
            await broker.enqueue(new_task(unique_key="k"))
        assert caught.value.existing_id == newcomer.id

    async def test_terminal_task_frees_the_claim(self, broker: Broker) -> None:
        done = await enqueue_and_lease(broker, unique_key="k")
        await broker.ack(done.id, done.lease_id or "")
        canceled = await enqueue(broker, unique_key="k")
        await broker.cancel_task(canceled.id)
        archived = await enqueue(broker, unique_key="k")
        await broker.archive_task(archived.id)
        await enqueue(broker, unique_key="k")

    async def test_deleting_the_holder_frees_the_claim(self, broker: Broker) -> None:
        holder = await enqueue(broker, unique_key="k")
        await broker.delete_task(holder.id)
        await enqueue(broker, unique_key="k")

    async def test_idempotent_id_skips_the_unique_check(self, broker: Broker) -> None:
        holder = await enqueue(broker, unique_key="k")
        again = await broker.enqueue(new_task(id=holder.id, unique_key="k"))
        assert not again.created

    @pytest.mark.parametrize(
        "options", [options for _, options in _BAD_TASKS], ids=[name for name, _ in _BAD_TASKS]
    )
    async def test_bad_input_is_invalid_and_stores_nothing(
        self, broker: Broker, options: dict[str, Any]
    ) -> None:
        options = dict(options)
        queue = options.pop("queue", QUEUE)
        with pytest.raises(InvalidTask):
            await broker.enqueue(new_task(queue, **options))
        assert (await broker.list_tasks()).tasks == []

    async def test_a_bad_item_refuses_its_whole_batch(self, broker: Broker) -> None:
        with pytest.raises(InvalidTask, match=r"task 1: .*control character"):
            await broker.enqueue_batch([new_task(), new_task(type="t\x00"), new_task()])
        assert (await broker.list_tasks()).tasks == []

    async def test_printable_unicode_is_stored_as_given(self, broker: Broker) -> None:
        task = (
            await broker.enqueue(
                new_task(
                    type="e-mail.envoyé ✉",
                    unique_key="clé 🔑",
                    headers={"naïve": "zero\u200bwidth, tab-free, émoji 🎉"},
                )
            )
        ).task
        assert await broker.get_task(task.id) == task
        assert task.headers == {"naïve": "zero\u200bwidth, tab-free, émoji 🎉"}

    async def test_self_dependency_is_invalid(self, broker: Broker, clock: FakeClock) -> None:
        [task_id] = sorted_ids(clock, 1)
        with pytest.raises(InvalidTask):
            await broker.enqueue(new_task(id=task_id, depends_on=(task_id,)))

    async def test_oversized_payload_is_invalid(self, broker: Broker) -> None:
        with pytest.raises(InvalidTask):
            await broker.enqueue(new_task(payload=b"x" * (MAX_PAYLOAD + 1)))
        assert (await broker.list_tasks()).tasks == []

    async def test_batch_over_max_batch_is_invalid(self, broker: Broker) -> None:
        with pytest.raises(InvalidTask):
            await broker.enqueue_batch([new_task() for _ in range(MAX_BATCH + 1)])
        assert (await broker.list_tasks()).tasks == []

    async def test_batch_with_an_invalid_item_stores_nothing(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        first, second = sorted_ids(clock, 2)
        with pytest.raises(InvalidTask):
            await broker.enqueue_batch(
                [new_task(id=first), new_task(id=second, timeout=timedelta(seconds=-1))]
            )
        assert (await broker.list_tasks()).tasks == []

    async def test_batch_with_a_duplicate_stores_nothing(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        holder = await enqueue(broker, unique_key="taken")
        first, second, third = sorted_ids(clock, 3)
        with pytest.raises(DuplicateTask):
            await broker.enqueue_batch(
                [new_task(id=first), new_task(id=second, unique_key="taken"), new_task(id=third)]
            )
        assert [t.id for t in (await broker.list_tasks()).tasks] == [holder.id]

    async def test_bad_input_outranks_a_duplicate(self, broker: Broker, clock: FakeClock) -> None:
        await enqueue(broker, unique_key="taken")
        missing = unused_id(clock)
        with pytest.raises(InvalidTask):
            await broker.enqueue_batch(
                [
                    new_task(unique_key="k"),
                    new_task(unique_key="k"),
                    new_task(unique_key="taken"),
                    new_task(depends_on=(missing,)),
                ]
            )
        assert len((await broker.list_tasks()).tasks) == 1

    async def test_batch_with_an_unknown_dependency_stores_nothing(
        self, broker: Broker, clock: FakeClock
    ) -> None:
        first, missing = sorted_ids(clock, 2)
        with pytest.raises(InvalidTask):
            await broker.enqueue_batch([new_task(id=first), new_task(depends_on=(missing,))])
        assert (await broker.list_tasks()).tasks == []
