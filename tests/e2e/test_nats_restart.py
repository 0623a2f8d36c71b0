"""NATS restarts and failover under load (issue 11), through real processes: an api, a
dispatcher, a maintenance process and two SDK workers on a real Postgres and private
nats-servers.

While a producer enqueues a steady stream of tasks, nats-server is killed and started
again, with its store or with an empty one (a lost disk, a new pod); or it comes back
without JetStream; or, in a 3-node cluster, the node the dispatcher is on dies. Every
task must complete, none may run twice, and tasks must flow again within seconds of NATS
being back: the ownership and leaders buckets come back (on disk, replicated, or created
again), the services take their keys back, and the health files say meanwhile whether
each service can do its job.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conveyor import AsyncClient, spec
from conveyor_broker import TaskState
from conveyor_broker.postgres import PostgresBroker
from conveyor_runtime.embedded_nats import EmbeddedNats
from conveyor_runtime.health import is_fresh
from conveyor_testkit.nats_cluster import NatsCluster
from conveyor_testkit.polling import wait_until

from tests.e2e.conftest import read_record
from tests.e2e.harness import POLL_INTERVAL, Cluster, Proc

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

QUEUE = "steady"
#: Tasks per enqueue call, and enqueue calls a second (about 300 tasks a second).
BATCH = 10
PACE = 0.033
#: Tasks started after NATS is back that show dispatch has resumed.
RESUMED = 20
#: A health file older than this is stale (the beat rewrites it every 2 s).
STALE = 3.5


@dataclass
class Producer:
    """Enqueues BATCH tasks every PACE seconds until stopped; remembers each task's id
    and when its enqueue returned (monotonic ns, comparable with the workers' records)."""

    target: str
    enqueued: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        async with AsyncClient(self.target) as client:
            n = 0
            while not self._stop.is_set():
                specs = [spec("e2e.noop", {"n": n + i}, queue=QUEUE) for i in range(BATCH)]
                n += BATCH
                try:
                    results = await client.enqueue_batch(specs)
                except Exception:
                    self.failures += 1
                else:
                    now = time.monotonic_ns()
                    for result in results:
                        assert result.task is not None, result.error
                        self.enqueued[result.task.id] = now
                await asyncio.sleep(PACE)  # the producer's pace, not a wait for a condition

    def stop(self) -> None:
        self._stop.set()


@dataclass
class Stack:
    """The processes of one test, their health files and the workers' record."""

    cluster: Cluster
    target: str
    record: Path
    health: dict[str, Path]
    procs: dict[str, Proc]

    def runs(self) -> list[list[str]]:
        return [f for f in read_record(self.record) if f[0] == "start"]

    def done(self) -> int:
        return sum(1 for f in read_record(self.record) if f[0] == "done")

    def fresh(self, *names: str) -> bool:
        return all(is_fresh(str(self.health[n]), STALE) for n in names)

    def stale(self, *names: str) -> bool:
        return not any(is_fresh(str(self.health[n]), STALE) for n in names)


async def start_stack(cluster: Cluster, tmp_path: Path) -> Stack:
    health = {name: tmp_path / f"{name}.health" for name in ("api", "dispatcher", "maintenance")}

    def env(name: str) -> dict[str, str]:
        return {"CONVEYOR_HEALTH_FILE": str(health[name])}

    dispatcher = cluster.start_dispatcher(env("dispatcher"))
    maintenance = cluster.start_maintenance(env("maintenance"))
    api = await cluster.start_api(env("api"))
    target = f"127.0.0.1:{api.port}"
    record = tmp_path / "record.txt"
    for _ in range(2):
        cluster.start_worker(target, queues={QUEUE: 1}, concurrency=8, record=record, mode="work")
    stack = Stack(
        cluster,
        target,
        record,
        health,
        {"api": api, "dispatcher": dispatcher, "maintenance": maintenance},
    )
    await wait_until(
        lambda: stack.fresh("api", "dispatcher", "maintenance"),
        within=60,
        interval=POLL_INTERVAL,
        message="every service healthy",
    )
    return stack


@pytest.fixture
async def producing() -> AsyncIterator[list[tuple[Producer, asyncio.Task[None]]]]:
    """Producers a test starts: stopped and awaited at its end, whatever happens."""
    started: list[tuple[Producer, asyncio.Task[None]]] = []
    yield started
    for producer, task in started:
        producer.stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)


def produce(
    stack: Stack, producers: list[tuple[Producer, asyncio.Task[None]]]
) -> tuple[Producer, asyncio.Task[None]]:
    """Start a Producer on ``stack``'s api."""
    producer = Producer(stack.target)
    started = (producer, asyncio.create_task(producer.run()))
    producers.append(started)
    return started


async def drained(
    stack: Stack, store: PostgresBroker, producer: Producer, task: asyncio.Task[None]
) -> None:
    """Stop producing, then wait for every task enqueued to complete; check that each
    ran exactly once."""
    producer.stop()
    await task
    total = len(producer.enqueued)

    async def all_completed() -> bool:
        (stats,) = await store.queue_stats(QUEUE)
        return stats.count(TaskState.COMPLETED) == total

    await wait_until(all_completed, within=90, interval=0.2, message=f"{total} tasks completed")
    runs = Counter(f[1] for f in stack.runs())
    assert set(runs) == set(producer.enqueued)
    twice = {task_id: n for task_id, n in runs.items() if n > 1}
    assert twice == {}, f"{len(twice)} tasks ran more than once"


def resumed_after(stack: Stack, back: int) -> float | None:
    """Seconds from ``back`` (monotonic ns) until RESUMED tasks have started since; None
    while fewer have."""
    starts = sorted(at for f in stack.runs() if (at := int(f[5])) > back)
    return (starts[RESUMED - 1] - back) / 1e9 if len(starts) >= RESUMED else None


@pytest.mark.parametrize("keep_store", [True, False], ids=["same-store", "empty-store"])
async def test_a_nats_restart_under_load_loses_and_repeats_nothing(
    keep_store: bool,
    cluster: Cluster,
    nats_server: EmbeddedNats,
    store: PostgresBroker,
    tmp_path: Path,
    producing: list[tuple[Producer, asyncio.Task[None]]],
) -> None:
    stack = await start_stack(cluster, tmp_path)
    producer, task = produce(stack, producing)
    await wait_until(
        lambda: stack.done() >= 300, within=60, interval=POLL_INTERVAL, message="tasks flowing"
    )

    nats_server.kill()
    if not keep_store:
        nats_server.clear_store()
    # NATS stays down long enough for every lease in the buckets to run out and for the
    # health checks to notice.
    await wait_until(
        lambda: stack.stale("api", "dispatcher", "maintenance"),
        within=30,
        interval=POLL_INTERVAL,
        message="health files stale while NATS is down",
    )
    nats_server.start()
    back = time.monotonic_ns()
    await wait_until(
        lambda: resumed_after(stack, back) is not None,
        within=30,
        interval=POLL_INTERVAL,
        message="tasks started after the restart",
    )
    resumed = resumed_after(stack, back)
    assert resumed is not None
    await wait_until(
        lambda: stack.fresh("api", "dispatcher", "maintenance"),
        within=30,
        interval=POLL_INTERVAL,
        message="every service healthy again",
    )
    healthy = (time.monotonic_ns() - back) / 1e9
    print(
        f"nats restart ({'same' if keep_store else 'empty'} store): tasks flowed again "
        f"{resumed:.2f}s after NATS was back, every health file fresh after {healthy:.2f}s"
    )
    # Tasks flow again within 5 s of NATS being back (about 1 s measured: the clients
    # reconnect within a second, the services claim at once).
    assert resumed < 5
    await drained(stack, store, producer, task)
    assert producer.failures == 0
    if not keep_store:
        for name in ("dispatcher", "maintenance"):
            assert "ownership.bucket_recreated" in stack.procs[name].log(), name


async def test_a_service_that_cannot_use_its_bucket_turns_unhealthy(
    cluster: Cluster,
    nats_server: EmbeddedNats,
    store: PostgresBroker,
    tmp_path: Path,
    producing: list[tuple[Producer, asyncio.Task[None]]],
) -> None:
    # Short leases, so that "failing for 3 TTLs" is 3 s.
    cluster.settings_env.update({"CONVEYOR_OWNER_TTL": "1", "CONVEYOR_LEADER_TTL": "1"})
    stack = await start_stack(cluster, tmp_path)
    producer, task = produce(stack, producing)
    await wait_until(
        lambda: stack.done() >= 100, within=60, interval=POLL_INTERVAL, message="tasks flowing"
    )

    # nats-server comes back at once, but without JetStream: every service is connected
    # again, and neither the dispatcher nor maintenance can claim anything.
    nats_server.kill()
    nats_server.jetstream = False
    nats_server.start()
    dispatcher, maintenance = stack.procs["dispatcher"], stack.procs["maintenance"]
    await wait_until(
        lambda: all(
            "nats.reconnected" in p.log() for p in (dispatcher, maintenance, stack.procs["api"])
        ),
        within=30,
        interval=POLL_INTERVAL,
        message="every service connected again",
    )
    reconnected = time.monotonic()
    # The api can do its job (it needs no bucket): healthy again. The other two stay
    # unhealthy although connected: their health files are not touched for seconds after
    # they reconnected.
    await wait_until(
        lambda: (
            time.monotonic() - reconnected > STALE + 1
            and stack.fresh("api")
            and stack.stale("dispatcher", "maintenance")
        ),
        within=30,
        interval=POLL_INTERVAL,
        message="dispatcher and maintenance unhealthy while connected",
    )
    assert "reasons=kv bucket conveyor_owners failing" in dispatcher.log()
    assert "reasons=kv bucket conveyor_leaders failing" in maintenance.log()

    # JetStream back: healthy again, and every task completes once.
    nats_server.kill()
    nats_server.jetstream = True
    nats_server.start()
    await wait_until(
        lambda: stack.fresh("api", "dispatcher", "maintenance"),
        within=30,
        interval=POLL_INTERVAL,
        message="every service healthy again",
    )
    await drained(stack, store, producer, task)


def connected_port(proc: Proc) -> int:
    """The client port of the NATS node ``proc`` connected to last (from its log)."""
    ports = re.findall(
        r"nats\.(?:connected|reconnected) name=\S+ server=127\.0\.0\.1:(\d+)", proc.log()
    )
    assert ports, proc.log()
    return int(ports[-1])


async def test_a_nats_cluster_loses_the_node_a_dispatcher_is_on_under_load(
    migrated_dsn: str,
    store: PostgresBroker,
    tmp_path: Path,
    producing: list[tuple[Producer, asyncio.Task[None]]],
) -> None:
    with NatsCluster(3) as nats:
        await nats.ready()
        cluster = Cluster(
            dsn=migrated_dsn,
            nats_url=nats.url,
            workdir=tmp_path,
            settings_env={"CONVEYOR_NATS_REPLICAS": "3"},
        )
        try:
            stack = await start_stack(cluster, tmp_path)
            producer, task = produce(stack, producing)
            await wait_until(
                lambda: stack.done() >= 300,
                within=60,
                interval=POLL_INTERVAL,
                message="tasks flowing",
            )
            dispatcher = stack.procs["dispatcher"]
            victim = connected_port(dispatcher)
            nats.node(victim).kill()
            killed = time.monotonic_ns()
            await wait_until(
                lambda: "nats.reconnected" in dispatcher.log(),
                within=30,
                interval=POLL_INTERVAL,
                message="the dispatcher on another node",
            )
            assert connected_port(dispatcher) != victim
            await wait_until(
                lambda: resumed_after(stack, killed) is not None,
                within=30,
                interval=POLL_INTERVAL,
                message="tasks started after the node died",
            )
            resumed = resumed_after(stack, killed)
            assert resumed is not None
            print(f"nats cluster lost a node: tasks flowed again {resumed:.2f}s after")
            assert resumed < 5
            await drained(stack, store, producer, task)
            assert producer.failures == 0
            # Three replicas: the buckets never went missing, they only moved leader.
            for name in ("dispatcher", "maintenance"):
                assert "ownership.bucket_missing" not in stack.procs[name].log(), name
            assert stack.fresh("api", "dispatcher", "maintenance")
        except BaseException:
            print(cluster.logs())
            raise
        finally:
            cluster.stop_all()
