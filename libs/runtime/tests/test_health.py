"""Health signals: a streak of failures becomes a problem only when it lasts, and the
health beat touches its file only while there is none."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conveyor_broker import FakeClock
from conveyor_broker.memory import MemoryBroker
from conveyor_runtime.health import Health, Streak, beat, is_fresh
from conveyor_testkit.polling import wait_until


class Ticks:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_streak_is_a_problem_only_after_its_limit() -> None:
    t = Ticks()
    streak = Streak("kv bucket owners", limit=15.0, now=t)
    assert streak.problem() is None
    streak.failed(TimeoutError())
    t.now += 10
    streak.failed(TimeoutError())
    assert streak.problem() is None  # a blip of 10 s is not a problem yet
    t.now += 6
    streak.failed(TimeoutError("no answer"))
    problem = streak.problem()
    assert problem is not None
    assert problem.startswith("kv bucket owners failing for 16s")
    assert "no answer" in problem


def test_one_success_ends_the_streak() -> None:
    t = Ticks()
    streak = Streak("leaders", limit=15.0, now=t)
    streak.failed("down")
    t.now += 14
    streak.succeeded()
    t.now += 1
    streak.failed("down again")
    t.now += 14
    streak.failed("down again")
    # 14 s since the streak began again: the first 14 s do not count.
    assert streak.problem() is None
    t.now += 2
    streak.failed("down again")
    assert streak.problem() is not None


def test_a_streak_without_recent_failures_is_no_evidence() -> None:
    # A dependency nobody called for a while may well be fine again: only a failure
    # within the limit keeps the problem up.
    t = Ticks()
    streak = Streak("owners", limit=15.0, now=t)
    streak.failed("down")
    t.now += 16
    streak.failed("down")
    assert streak.problem() is not None
    t.now += 14
    assert streak.problem() is not None
    t.now += 2
    assert streak.problem() is None


def test_health_lists_the_problems_of_every_streak() -> None:
    t = Ticks()
    health = Health(now=t)
    owners = health.streak("owners", 5.0)
    leaders = health.streak("leaders", 5.0)
    owners.failed("x")
    leaders.succeeded()
    assert health.problems() == []
    t.now += 6
    owners.failed("x")
    leaders.failed("y")
    assert [p.split(" ")[0] for p in health.problems()] == ["owners"]
    with pytest.raises(ValueError, match="limit"):
        health.streak("never", 0)


class _Nats:
    """What the beat reads of a NATS client."""

    is_connected = True


async def test_the_beat_touches_the_file_only_while_healthy(tmp_path: Path) -> None:
    path = tmp_path / "health"
    t = Ticks()
    health = Health(now=t)
    streak = health.streak("owners", 5.0)
    nc = _Nats()
    task = asyncio.create_task(
        beat(str(path), nc, MemoryBroker(FakeClock()), interval=0.05, health=health)  # type: ignore[arg-type]
    )
    try:
        await wait_until(lambda: path.exists(), within=5)

        def untouched_for(seconds: float) -> bool:
            return not is_fresh(str(path), seconds)

        # A lasting failure: the file goes stale.
        streak.failed("no answer")
        t.now += 6
        streak.failed("no answer")
        await wait_until(lambda: untouched_for(0.5), within=5)
        # It works again: fresh again.
        streak.succeeded()
        await wait_until(lambda: is_fresh(str(path), 0.2), within=5)
        # NATS gone: stale again.
        nc.is_connected = False
        await wait_until(lambda: untouched_for(0.5), within=5)
        nc.is_connected = True
        await wait_until(lambda: is_fresh(str(path), 0.2), within=5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
