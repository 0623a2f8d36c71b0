"""Many queues with work and no worker, through real processes (api, dispatcher,
maintenance, an SDK worker, Postgres, a private nats-server with its monitoring port).

Issue 11: with 10,000 queues holding due work that no worker serves, the reaper woke every
one every second, each wake made a dispatcher claim the queue (and keep it: the wakes
counted as activity), and the cluster spent thousands of NATS messages and ownership-key
writes a second on work that could go nowhere. Here 2,000 such queues must cost about
nothing, and a worker that connects for one of them must still get its task at once.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.js.errors
import pytest
from conveyor import AsyncClient, spec
from conveyor_runtime.embedded_nats import EmbeddedNats, free_port
from conveyor_runtime.nats_connect import NatsClient, close_nats, connect_nats
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.polling import wait_until
from nats.aio.msg import Msg

from tests.e2e.conftest import read_record
from tests.e2e.harness import POLL_INTERVAL, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

SUBJECTS = Subjects()
LONELY = 2000
#: Reaper passes the traffic is measured over.
PASSES = 5


@pytest.fixture
def monitor_port() -> int:
    return free_port()


@pytest.fixture
def nats_server(monitor_port: int) -> Iterator[EmbeddedNats]:
    """The test's nats-server, with its monitoring port (for its message counters)."""
    with EmbeddedNats(config=f'http: "127.0.0.1:{monitor_port}"') as server:
        yield server


def messages_in(monitor_port: int) -> int:
    """Messages the nats-server has received so far, from every client."""
    url = f"http://127.0.0.1:{monitor_port}/varz"
    with urllib.request.urlopen(url, timeout=5) as response:  # the loopback monitoring port
        return int(json.load(response)["in_msgs"])


async def owned_queues(nc: NatsClient) -> list[str]:
    """The queues that have an ownership key right now."""
    kv = await nc.jetstream().key_value(SUBJECTS.owners_bucket)
    try:
        return list(await kv.keys())
    except nats.js.errors.NoKeysError:
        return []


def started_at(record: Path, queue: str) -> int | None:
    """CLOCK_MONOTONIC ns at which a task of ``queue`` started, if one did."""
    for fields in read_record(record):
        if fields[0] == "start" and fields[4] == queue:
            return int(fields[5])
    return None


async def test_queues_nobody_serves_cost_no_claims_and_no_traffic(
    cluster: Cluster, nats_server: EmbeddedNats, monitor_port: int, tmp_path: Path
) -> None:
    target = await cluster.start_services()
    record = tmp_path / "record.txt"
    # The probe: a served queue that always has a due task (its one slot is taken by a
    # task that never ends), so the reaper wakes it on every pass: its wakes count passes.
    cluster.start_worker(target, queues={"held": 1}, concurrency=1, record=record, mode="block")
    observer = await connect_nats(nats_server.url, name="observer")
    held_wakes: list[float] = []
    registered: dict[str, int] = {}

    async def on_wake(msg: Msg) -> None:
        held_wakes.append(time.monotonic())

    async def on_register(msg: Msg) -> None:
        registered.setdefault(Subjects.queue_of(msg.subject), time.monotonic_ns())

    await observer.subscribe(SUBJECTS.wake("held"), cb=on_wake)
    await observer.subscribe(SUBJECTS.queue_wildcard("register"), cb=on_register)
    lonely = [f"lonely-{n:04d}" for n in range(LONELY)]
    try:
        async with AsyncClient(target) as client:
            for _ in range(2):
                await client.enqueue("e2e.noop", {}, queue="held")
            await wait_until(
                lambda: started_at(record, "held") is not None,
                within=30,
                interval=POLL_INTERVAL,
                message="the held task",
            )
            # One task in each lonely queue, through the api (which wakes each one).
            for first in range(0, LONELY, 1000):
                results = await client.enqueue_batch(
                    [spec("e2e.noop", {}, queue=q) for q in lonely[first : first + 1000]]
                )
                assert all(r.task is not None for r in results)

            # A few reaper passes to let the enqueue's wakes go by, then count over more.
            seen = len(held_wakes)
            await wait_until(
                lambda: len(held_wakes) >= seen + 2,
                within=30,
                interval=POLL_INTERVAL,
                message="reaper passes",
            )
            before, passes = messages_in(monitor_port), len(held_wakes)
            await wait_until(
                lambda: len(held_wakes) >= passes + PASSES,
                within=60,
                interval=POLL_INTERVAL,
                message="reaper passes",
            )
            sent = messages_in(monitor_port) - before
            print(f"{sent} NATS messages over {PASSES} reaper passes")
            owned = await owned_queues(observer)
            # Every message of the window, from every process: the probe's wakes, key
            # refreshes, registrations... Before the fix each pass woke all 2,000 queues,
            # and each owned one had its key rewritten every 1.7 s: over 10,000 here.
            assert sent < 100 * PASSES, f"{sent} NATS messages over {PASSES} reaper passes"
            assert owned == ["held"], f"{len(owned)} queues claimed"

            # A worker for one of them: its first registration brings the queue a
            # dispatcher, and its task starts at once.
            queue = lonely[1234]
            cluster.start_worker(target, queues={queue: 1}, concurrency=1, record=record)
            await wait_until(
                lambda: started_at(record, queue) is not None,
                within=30,
                interval=POLL_INTERVAL,
                message="the lonely queue's task",
            )
            start = started_at(record, queue)
            assert start is not None
            assert queue in registered
            waited = (start - registered[queue]) / 1e9
            print(f"the lonely queue's task started {waited:.3f} s after its registration")
            assert waited < 2.0, f"the task started {waited:.2f} s after its worker registered"
            assert sorted(await owned_queues(observer)) == ["held", queue]
    finally:
        await close_nats(observer)
