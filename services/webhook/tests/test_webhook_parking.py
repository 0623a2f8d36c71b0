"""ParkedDeliveries on its own: which leases are parked, their known expiries and their
lapse timers (on the event loop; the expiries read from a FakeClock)."""

from __future__ import annotations

from datetime import timedelta

from conveyor_broker import FakeClock
from conveyor_testkit.polling import wait_until
from conveyor_webhook.parking import ParkedDeliveries

SOON = timedelta(milliseconds=50)


def parking(clock: FakeClock) -> tuple[ParkedDeliveries, list[str]]:
    due: list[str] = []
    return ParkedDeliveries(clock, due.append), due


async def test_a_parked_lease_is_known_before_its_expiry_is(clock: FakeClock) -> None:
    parked, _ = parking(clock)
    parked.park("l1")

    assert "l1" in parked
    assert "l2" not in parked
    assert (len(parked), parked.watched, set(parked.leases)) == (1, 0, {"l1"})
    assert parked.get("l1") is None

    expires = clock.now() + timedelta(seconds=30)
    parked.watch("l1", "t1", expires)
    record = parked.get("l1")
    assert record is not None
    assert (record.task_id, record.expires, parked.watched) == ("t1", expires, 1)
    parked.watch("l1", "t1", expires)
    assert parked.get("l1") is not record  # a new record each time
    parked.clear()


async def test_the_lapse_timer_fires_once_the_known_expiry_passes(clock: FakeClock) -> None:
    parked, due = parking(clock)
    parked.park("late")
    parked.park("soon")
    parked.watch("late", "t1", clock.now() + timedelta(seconds=60))
    parked.watch("late", "t1", clock.now() + SOON)  # watched again: the new expiry counts
    parked.watch("soon", "t2", clock.now() + SOON * 2)

    await wait_until(lambda: due == ["late", "soon"])
    assert "late" in parked  # the timer only tells; forgetting is the caller's call


async def test_forget_cancels_the_timer(clock: FakeClock) -> None:
    parked, due = parking(clock)
    for lease in ("forgotten", "kept"):
        parked.park(lease)
    parked.watch("forgotten", "t1", clock.now() + SOON)
    parked.watch("kept", "t2", clock.now() + SOON * 2)

    assert parked.forget("forgotten")
    assert not parked.forget("forgotten")
    assert not parked.forget("never-parked")

    await wait_until(lambda: due == ["kept"])  # the forgotten one, due first, never fired
    assert "forgotten" not in parked
    assert parked.get("forgotten") is None


async def test_clear_lets_every_parked_lease_go(clock: FakeClock) -> None:
    parked, due = parking(clock)
    for lease in ("a", "b", "c"):
        parked.park(lease)
    parked.watch("a", "t1", clock.now() + SOON)
    parked.watch("b", "t2", clock.now() + SOON * 2)

    assert sorted(parked.clear()) == ["a", "b", "c"]
    assert (len(parked), parked.watched) == (0, 0)
    parked.park("d")
    parked.watch("d", "t3", clock.now() + SOON * 3)
    await wait_until(lambda: due == ["d"])  # a and b, due first, never fired


async def test_the_gateways_own_extensions_are_kept_until_forgotten(clock: FakeClock) -> None:
    parked, _ = parking(clock)
    early = clock.now() + timedelta(seconds=10)
    later = early + timedelta(seconds=10)

    parked.note_extended(["open", "other"], later)
    parked.note_extended(["open"], early)  # an older extension reported late
    assert parked.extended_until("open") == later
    assert parked.extended_until("unknown") is None

    assert not parked.forget("open")  # never parked, but what was known goes
    assert parked.extended_until("open") is None
    assert parked.extended_until("other") == later
