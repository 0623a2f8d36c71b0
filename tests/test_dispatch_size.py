"""The api's estimate of a task's dispatch size never falls short of what the dispatcher
measures: a task the api accepts for a NATS limit is never one the dispatcher finds too
big for that limit (it would be archived)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from conveyor_broker import FakeClock, NewTask
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.validation import MAX_HEADER_LEN, MAX_HEADERS, MAX_KEY_LEN
from conveyor_dispatcher.queue import fit_offer
from conveyor_runtime.wire import dispatch_size, task_to_envelope

LIMIT = 8 * 1024 * 1024


async def test_the_largest_task_the_api_accepts_fits_the_dispatchers_measure() -> None:
    clock = FakeClock()
    wide = "\U0001f600"  # four bytes in UTF-8
    headers = {f"{n:02d}": wide * (MAX_HEADER_LEN - 2) for n in range(MAX_HEADERS)}
    task = NewTask(
        queue="q" * 128,
        type="t" * 256,
        headers=headers,
        concurrency_key="c" * MAX_KEY_LEN,
        unique_key="u" * MAX_KEY_LEN,
        unique_ttl=timedelta(hours=1),
        timeout=timedelta(seconds=30),
        deadline=clock.now() + timedelta(days=1),
        max_retry=25,
        retention=timedelta(days=1),
    )
    task = replace(task, payload=b"x" * (LIMIT - dispatch_size(task)))
    assert dispatch_size(task) == LIMIT
    broker = MemoryBroker(clock, max_payload=LIMIT)
    await broker.enqueue(task)
    (leased,) = await broker.lease(task.queue, 1, timedelta(seconds=30))
    fit, oversized = fit_offer([(leased, task_to_envelope(leased))], LIMIT)
    assert oversized == []
    assert [t.id for t, _ in fit] == [leased.id]
