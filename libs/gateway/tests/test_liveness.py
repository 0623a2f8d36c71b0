"""HolderBeat: a holder beats in the broker and on NATS every tick, each way on its own,
so the reaper never takes a live holder for dead (against the session's nats-server)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from functools import partial

from conveyor_broker import FakeClock, HolderReleaseParams, NewTask, TaskState
from conveyor_broker.memory import MemoryBroker
from conveyor_gateway import HolderBeat, holder_name
from conveyor_protos.v1 import cluster_pb2
from conveyor_runtime.bus import Bus
from conveyor_testkit.polling import wait_until

TTL = timedelta(seconds=30)
SILENCE = timedelta(seconds=3)


class HangingBroker(MemoryBroker):
    """A broker whose beats never come back (a wedged database connection)."""

    async def _beat_holder(self, holder: str) -> None:
        await asyncio.Event().wait()


def test_holder_names_are_unique_to_each_run() -> None:
    first, second = holder_name("api-1"), holder_name("api-1")
    assert first != second
    assert first.startswith("api-1~")


async def test_a_beating_holder_keeps_its_tasks_and_a_stopped_one_loses_them(bus: Bus) -> None:
    clock = FakeClock()
    broker = MemoryBroker(clock)
    heard: list[str] = []
    await bus.subscribe(cluster_pb2.HolderBeat, lambda beat: heard.append(beat.holder))
    await bus.nc.flush()
    beat = HolderBeat(holder_name("api"), broker=broker, bus=bus, tick=0.05)
    beat.start()
    await wait_until(lambda: beat.stored >= 1 and bool(heard), within=5)
    assert set(heard) == {beat.holder}
    await broker.enqueue(NewTask("q", "t"))
    [task] = await broker.lease("q", 1, TTL, holders=[beat.holder])

    def more(than: int) -> bool:
        return beat.stored > than

    # Time passes in the broker; each stored beat is as of the clock's now.
    for _ in range(3):
        clock.advance(SILENCE)
        await wait_until(partial(more, beat.stored), within=5)
        assert await broker.release_dead_holders(HolderReleaseParams(silence=SILENCE)) == []
    await beat.stop()
    stored, sent = beat.stored, beat.sent
    clock.advance(SILENCE)
    released = await broker.release_dead_holders(HolderReleaseParams(silence=SILENCE))
    assert [r.task_id for r in released] == [task.id]
    assert (await broker.get_task(task.id)).state == TaskState.PENDING
    await asyncio.sleep(0.2)  # stopped beats stay stopped
    assert (beat.stored, beat.sent) == (stored, sent)


async def test_a_hanging_database_beat_does_not_hold_up_the_nats_beats(bus: Bus) -> None:
    heard: list[str] = []
    await bus.subscribe(cluster_pb2.HolderBeat, lambda beat: heard.append(beat.holder))
    await bus.nc.flush()
    beat = HolderBeat("api~1", broker=HangingBroker(), bus=bus, tick=0.05)
    beat.start()
    await wait_until(lambda: len(heard) >= 5, within=5)
    assert beat.stored == 0
    await beat.stop()
