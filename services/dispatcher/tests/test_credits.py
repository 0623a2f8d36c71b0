"""CreditBook: registration, refills, replies, expiry and weighted hand-out; and how an
offer is cut into DispatchRequests that fit in a NATS message."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from conveyor_broker import FakeClock, NewTask, Task
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.memory_table import new_row
from conveyor_dispatcher.credits import CreditBook
from conveyor_dispatcher.queue import assign, fit_offer, split_offer
from conveyor_protos.v1 import cluster_pb2, task_pb2
from conveyor_runtime.wire import task_to_envelope


def test_register_sets_credits_to_capacity_minus_in_flight() -> None:
    book = CreditBook()
    entry = book.register("g1", capacity=10, weight=2, in_flight=3, now=0.0)
    assert (entry.capacity, entry.weight, entry.credits) == (10, 2, 7)
    assert book.total == 7
    # A re-registration is authoritative, whatever was counted before.
    book.take(7)
    assert book.total == 0
    book.register("g1", capacity=10, weight=2, in_flight=1, now=1.0)
    assert book.total == 9


def test_register_clamps_nonsense() -> None:
    book = CreditBook()
    entry = book.register("g", capacity=2, weight=0, in_flight=5, now=0.0)
    assert (entry.credits, entry.weight) == (0, 1)
    entry = book.register("g", capacity=-1, weight=1, in_flight=-4, now=0.0)
    assert (entry.capacity, entry.credits) == (0, 0)


def test_refill_adds_credits_capped_at_capacity() -> None:
    book = CreditBook()
    book.register("g", capacity=4, weight=1, in_flight=4, now=0.0)
    assert book.refill("g", 3)
    assert book.total == 3
    assert book.refill("g", 10)
    assert book.total == 4
    assert not book.refill("unknown", 1)
    assert book.total == 4


def test_set_credits_follows_the_gateway_reply_clamped() -> None:
    book = CreditBook()
    book.register("g", capacity=5, weight=1, in_flight=0, now=0.0)
    book.set_credits("g", 2, returned=0)
    assert book.total == 2
    book.set_credits("g", 99, returned=0)
    assert book.total == 5
    book.set_credits("g", -1, returned=0)
    assert book.total == 0
    book.set_credits("unknown", 3, returned=0)  # ignored
    assert book.total == 0


def test_a_done_handled_before_an_older_reply_keeps_its_slot() -> None:
    """The gateway (capacity 1) accepted a task and replied "0 free, 3 given back in
    all"; the task finished and its Done ("4 in all") was handled first. The reply must
    not take that slot away again."""
    book = CreditBook()
    book.register("g", capacity=1, weight=1, in_flight=0, now=0.0, returned=3)
    assert book.take(1) == {"g": 1}
    assert book.refill("g", 1, returned=4)
    assert book.total == 1
    book.set_credits("g", 0, returned=3)  # the older snapshot
    assert book.total == 1


def test_a_done_a_reply_already_counted_adds_nothing() -> None:
    """The reply was read after the slot came back ("1 free, 4 given back"); the Done
    for that slot ("4 in all") arrives after it and must not count it twice."""
    book = CreditBook()
    book.register("g", capacity=2, weight=1, in_flight=0, now=0.0, returned=3)
    assert book.take(2) == {"g": 2}
    book.set_credits("g", 1, returned=4)
    assert book.total == 1
    assert book.refill("g", 1, returned=4)
    assert book.total == 1
    assert book.refill("g", 1, returned=5)  # a later one counts
    assert book.total == 2


def test_a_lost_done_is_made_up_by_the_next_total() -> None:
    book = CreditBook()
    book.register("g", capacity=5, weight=1, in_flight=5, now=0.0, returned=10)
    book.refill("g", 2, returned=14)  # the Done for 11-12 never arrived
    assert book.total == 4


def test_a_registration_older_than_counted_dones_adds_them_back() -> None:
    book = CreditBook()
    book.register("g", capacity=3, weight=1, in_flight=0, now=0.0, returned=1)
    book.take(3)
    book.refill("g", 1, returned=2)
    # Read when 3 were held and 1 given back: the Done for the 2nd came after it.
    entry = book.register("g", capacity=3, weight=1, in_flight=3, now=1.0, returned=1)
    assert (entry.credits, entry.returned) == (1, 2)


def test_a_gateway_that_did_not_answer_gets_nothing_more_but_keeps_its_total() -> None:
    book = CreditBook()
    book.register("g", capacity=4, weight=1, in_flight=0, now=0.0, returned=3)
    book.refill("g", 1, returned=4)
    book.block("g")
    assert book.total == 0
    book.refill("g", 1, returned=4)  # already counted: still nothing
    assert book.total == 0
    book.refill("g", 1, returned=5)
    assert book.total == 1


def test_gateways_that_do_not_count_keep_the_old_rules() -> None:
    book = CreditBook()
    book.register("g", capacity=4, weight=1, in_flight=4, now=0.0)
    assert book.refill("g", 2)
    assert book.total == 2
    book.set_credits("g", 1, returned=0)
    assert book.total == 1


def test_take_splits_by_weight_and_spends_credits() -> None:
    book = CreditBook()
    book.register("heavy", capacity=100, weight=3, in_flight=0, now=0.0)
    book.register("light", capacity=100, weight=1, in_flight=0, now=0.0)
    shares = book.take(40)
    assert shares == {"heavy": 30, "light": 10}
    heavy = book.get("heavy")
    assert heavy is not None
    assert heavy.credits == 70
    assert book.total == 160


def test_take_skips_gateways_without_credits_and_stops_when_all_are_spent() -> None:
    book = CreditBook()
    book.register("a", capacity=2, weight=10, in_flight=0, now=0.0)
    book.register("b", capacity=3, weight=1, in_flight=0, now=0.0)
    book.register("c", capacity=5, weight=1, in_flight=5, now=0.0)
    shares = book.take(100)
    assert shares == {"a": 2, "b": 3}
    assert book.total == 0
    assert book.take(5) == {}


def test_forget_and_expire() -> None:
    book = CreditBook()
    book.register("old", capacity=1, weight=1, in_flight=0, now=0.0)
    book.register("new", capacity=1, weight=1, in_flight=0, now=10.0)
    assert book.expire(now=15.0, max_age=15.0) == ["old"]
    assert "old" not in book
    assert "new" in book
    assert book.forget("new")
    assert not book.forget("new")
    assert len(book) == 0


async def _offer(*sizes: int) -> list[tuple[Task, task_pb2.TaskEnvelope]]:
    """Leased tasks with payloads of ``sizes`` bytes, in that order, and their envelopes."""
    broker = MemoryBroker(FakeClock())
    out = []
    for size in sizes:
        await broker.enqueue(NewTask("q", "t", payload=b"x" * size))
        (task,) = await broker.lease("q", 1, timedelta(seconds=30))
        out.append((task, task_to_envelope(task)))
    return out


async def test_fit_offer_sets_apart_what_no_message_could_carry() -> None:
    offer = await _offer(300, 5000, 300)
    ids = [task.id for task, _ in offer]
    small = offer[0][1].ByteSize() + 8  # an envelope with its framing
    fit, oversized = fit_offer(offer, 1024 + 3 * small)
    assert [task.id for task, _ in fit] == [ids[0], ids[2]]
    assert [task.id for task, _ in oversized] == [ids[1]]
    assert oversized[0][1] > 5000


async def test_split_offer_keeps_order_and_every_piece_under_the_target() -> None:
    offer = await _offer(300, 300, 300, 5000, 300)
    ids = [task.id for task, _ in offer]
    small = offer[0][1].ByteSize() + 8
    target = 1024 + 2 * small
    pieces = split_offer(offer, target)
    # The big one goes alone; the others two by two, in order.
    assert [[task.id for task, _ in piece] for piece in pieces] == [
        ids[:2],
        [ids[2]],
        [ids[3]],
        [ids[4]],
    ]
    for piece in pieces:
        if len(piece) > 1:
            request = cluster_pb2.DispatchRequest(
                queue="q", dispatcher="d" * 64, tasks=[env for _, env in piece]
            )
            assert request.ByteSize() <= target


def test_split_offer_of_nothing_is_nothing() -> None:
    assert split_offer([], 1 << 20) == []
    assert fit_offer([], 1 << 20) == ([], [])


# ------------------------------------------------------------ holders


def test_take_slots_picks_slot_by_slot_and_refund_gives_back() -> None:
    book = CreditBook()
    book.register("heavy", capacity=10, weight=3, in_flight=0, now=0.0, holder="api~1")
    book.register("light", capacity=10, weight=1, in_flight=0, now=0.0, holder="api~2")
    slots = book.take_slots(8)
    # Smooth: any first slots are split by weight too.
    assert slots[:4].count("heavy") == 3
    assert slots.count("heavy") == 6
    assert book.total == 12
    assert (book.holder_of("heavy"), book.holder_of("light"), book.holder_of("gone")) == (
        "api~1",
        "api~2",
        "",
    )
    book.refund(["heavy", "heavy", "light", "gone"])
    assert (book.credits_of("heavy"), book.credits_of("light")) == (6, 9)
    book.refund(["light"] * 5)  # never past capacity
    assert book.credits_of("light") == 10


def _leased(holders: list[str | None]) -> list[tuple[Task, task_pb2.TaskEnvelope]]:
    """Leased tasks held by ``holders`` (None: nobody), as an offer."""
    now = datetime(2030, 1, 1, tzinfo=UTC)
    tasks = [
        replace(new_row(f"t{i}", NewTask("q", "t"), now, start=None, max_retry=0), holder=h)
        for i, h in enumerate(holders)
    ]
    return [(task, task_pb2.TaskEnvelope(id=task.id)) for task in tasks]


def test_assign_gives_each_task_a_slot_of_its_holder_in_pick_order() -> None:
    holder_of = {"a1": "A", "a2": "A", "b1": "B", "none": ""}.__getitem__
    slots = ["a1", "b1", "a2", "a1", "none", "b1"]
    holders = [holder_of(gw) for gw in slots]
    # Three tasks: the broker named the holders of the first three slots (A, B, A).
    offer = _leased(["A", "A", "B"])
    plan, left = assign(offer, slots, holders)
    assert {gw: len(batch) for gw, batch in plan.items()} == {"a1": 1, "a2": 1, "b1": 1}
    assert all(holder_of(gw) == t.holder for gw, batch in plan.items() for t, _ in batch)
    assert left == ["a1", "none", "b1"]
    # A task leased for nobody takes a slot of a gateway that names nobody.
    plan, left = assign(_leased([None]), ["a1", "none"], ["A", ""])
    assert list(plan) == ["none"]
    assert left == ["a1"]


def test_assign_falls_back_to_the_first_slots_left_when_holders_do_not_match() -> None:
    """A broker of an older release names no holder: the tasks still go out, to the
    first slots, and the rest is given back."""
    plan, left = assign(_leased([None, None]), ["b", "a", "b"], ["B", "A", "B"])
    assert {gw: len(batch) for gw, batch in plan.items()} == {"b": 1, "a": 1}
    assert left == ["b"]
