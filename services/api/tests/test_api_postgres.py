"""The api over the real Postgres broker: group commit, uniqueness and the worker session's
transitions commit as real transactions. (The other modules run the same server over the
memory broker.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import Any

import asyncpg
import grpc
import pytest
from conveyor_broker import EnqueueResult, FakeClock, NewTask, TaskListParams, TaskState
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.testing.schemas import DATA_TABLES, migrated_schema
from conveyor_protos.v1 import cluster_pb2, service_pb2, service_pb2_grpc, task_pb2
from conveyor_runtime import wire
from conveyor_runtime.bus import Bus
from conveyor_runtime.wire import requests
from conveyor_testkit.polling import wait_until
from conveyor_testkit.stream import MakeApi, Recorder, WorkerStream, dispatch

pytestmark = pytest.mark.postgres

SCHEMA = "conveyor_api_tests"
TTL = timedelta(seconds=30)


class CountingPostgresBroker(PostgresBroker):
    """Counts the enqueue transactions the api opens."""

    enqueue_batch_sizes: list[int]

    async def enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        self.enqueue_batch_sizes.append(len(tasks))
        return await super().enqueue_batch(tasks)


@pytest.fixture(scope="module")
async def api_pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool[asyncpg.Record]]:
    dsn = await migrated_schema(pg_dsn, SCHEMA)
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=8)
    yield pool
    await pool.close()


@pytest.fixture
async def broker(
    clock: FakeClock, api_pool: asyncpg.Pool[asyncpg.Record]
) -> AsyncIterator[CountingPostgresBroker]:
    """Overrides the memory broker of conftest for this module."""
    await api_pool.execute(f"TRUNCATE {DATA_TABLES}")
    b = CountingPostgresBroker(api_pool, clock)
    b.enqueue_batch_sizes = []
    yield b
    await b.close()


async def test_group_commit_and_uniqueness_on_postgres(
    make_api: MakeApi, broker: CountingPostgresBroker
) -> None:
    api = await make_api(enqueue_batch_window=0.05)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        stub: Any = service_pb2_grpc.TaskServiceStub
        tasks = stub(ch)

        def request(**options: Any) -> service_pb2.EnqueueRequest:
            return service_pb2.EnqueueRequest(
                task=task_pb2.NewTask(queue="pg", type="t", options=task_pb2.TaskOptions(**options))
            )

        outcomes = await asyncio.gather(
            *(tasks.Enqueue(request()) for _ in range(100)),
            *(tasks.Enqueue(request(unique_key="one")) for _ in range(3)),
            return_exceptions=True,
        )
    created = [o for o in outcomes if isinstance(o, service_pb2.EnqueueResponse)]
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(created) == 101
    assert [e.code() for e in refused] == [grpc.StatusCode.ALREADY_EXISTS] * 2
    holder = next(o.task.id for o in created if o.task.options.unique_key == "one")
    assert all(dict(e.trailing_metadata() or ())["conveyor-existing-id"] == holder for e in refused)
    assert (await broker.queue_stats("pg"))[0].count(TaskState.PENDING) == 101
    # Concurrent enqueues shared transactions (how many depends on arrival timing; the
    # refused batch is retried in halves down to single items).
    sizes = broker.enqueue_batch_sizes
    assert max(sizes) > 1, sizes
    assert len(sizes) < 103, sizes


async def test_an_item_postgres_refuses_fails_alone_in_its_group_commit(
    make_api: MakeApi, broker: CountingPostgresBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Validation now refuses a NUL before any commit. Should anything it misses reach the
    # database anyway, only its own caller may fail, not everyone sharing its commit: so
    # here both the api's and the broker's validation are skipped, and Postgres refuses.
    monkeypatch.setattr(requests, "check_new_task", lambda task, **_: None)

    async def unchecked(tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        broker.enqueue_batch_sizes.append(len(tasks))
        return await broker._enqueue_batch(tasks)

    monkeypatch.setattr(broker, "enqueue_batch", unchecked)
    api = await make_api(enqueue_batch_window=0.05)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        stub: Any = service_pb2_grpc.TaskServiceStub
        tasks = stub(ch)

        def request(task_type: str) -> service_pb2.EnqueueRequest:
            return service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue="pg", type=task_type))

        # A commit in flight, so the next producers gather behind it into one batch.
        first = asyncio.ensure_future(tasks.Enqueue(request("first")))
        outcomes = await asyncio.gather(
            *(tasks.Enqueue(request(f"good-{n}")) for n in range(40)),
            tasks.Enqueue(request("bad\x00")),
            *(tasks.Enqueue(request(f"good-{n}")) for n in range(40, 80)),
            return_exceptions=True,
        )
        await first
    refused = outcomes.pop(40)
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "the database refused a value" in (refused.details() or "")
    assert all(isinstance(o, service_pb2.EnqueueResponse) and o.created for o in outcomes)
    stored = {t.type for t in (await broker.list_tasks(TaskListParams(limit=1000))).tasks}
    assert stored == {"first"} | {f"good-{n}" for n in range(80)}
    sizes = broker.enqueue_batch_sizes
    assert max(sizes) > 1, sizes  # the bad item shared a commit with others...
    assert len(sizes) < 40, sizes  # ...which was split in halves, not item by item


async def test_worker_session_on_postgres(
    make_api: MakeApi, broker: CountingPostgresBroker, bus: Bus
) -> None:
    api = await make_api()
    registers = await Recorder(cluster_pb2.Register).start(bus, queue="pgq")
    await broker.enqueue_batch([NewTask(queue="pgq", type="job") for _ in range(4)])
    envs = [wire.task_to_envelope(t) for t in await broker.lease("pgq", 4, TTL)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        worker = WorkerStream(ch)
        welcome = await worker.hello({"pgq": 1}, 4)
        await registers.wait_for(lambda m: m.gateway == welcome.session_id)
        reply = await dispatch(bus, welcome.session_id, "pgq", envs)
        assert len(reply.accepted) == 4
        for _ in envs:
            await worker.read_kind("dispatch")
        ok, failed, skipped, kept = envs
        await worker.result(ok, service_pb2.OUTCOME_SUCCESS, result=b"done")
        await worker.result(failed, service_pb2.OUTCOME_FAILURE, error="boom")
        await worker.result(skipped, service_pb2.OUTCOME_SKIP_RETRY, error="no")

        async def states() -> list[TaskState]:
            return [(await broker.get_task(e.id)).state for e in envs]

        async def settled() -> bool:
            return (await states())[:3] == [
                TaskState.COMPLETED,
                TaskState.RETRY,
                TaskState.ARCHIVED,
            ]

        await wait_until(settled, message="outcomes committed")
        assert (await broker.get_task(ok.id)).result == b"done"
        await worker.close()

        async def released() -> bool:
            return (await broker.get_task(kept.id)).state is TaskState.PENDING

        await wait_until(released, message="held task released at stream end")
    await registers.stop()


async def test_group_configs_and_stats_on_postgres(
    admin: Any, broker: CountingPostgresBroker, clock: FakeClock
) -> None:
    config = service_pb2.GroupConfig(
        queue="pg-digests", pattern="user:?", max_size=7, max_delay=wire.duration(TTL)
    )
    stored = await admin.SetGroupConfig(service_pb2.SetGroupConfigRequest(config=config))
    assert stored.config.pattern == "user:?"
    assert stored.config.max_size == 7
    listed = await admin.ListGroupConfigs(service_pb2.ListGroupConfigsRequest(queue="pg-digests"))
    assert list(listed.configs) == [stored.config]

    first = clock.now()
    await broker.enqueue(NewTask(type="digest", queue="pg-digests", group="user:1"))
    clock.advance(timedelta(seconds=3))
    await broker.enqueue(NewTask(type="digest", queue="pg-digests", group="user:1"))
    stats = await admin.GetGroupStats(service_pb2.GetGroupStatsRequest(queue="pg-digests"))
    [group] = stats.groups
    assert (group.group, group.size) == ("user:1", 2)
    assert wire.from_timestamp(group.oldest_at) == first
    assert wire.from_timestamp(group.newest_at) == first + timedelta(seconds=3)

    await admin.DeleteGroupConfig(
        service_pb2.DeleteGroupConfigRequest(queue="pg-digests", pattern="user:?")
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await admin.DeleteGroupConfig(
            service_pb2.DeleteGroupConfigRequest(queue="pg-digests", pattern="user:?")
        )
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
