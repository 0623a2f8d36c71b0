"""TaskService over a real gRPC socket: enqueue, validation, idempotency, batches,
group commit and coalesced wakes."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import grpc
import pytest
from conveyor_api import ApiServer, task_service
from conveyor_api.broker_status import MAX_STATUS_MESSAGE, status_message
from conveyor_api.task_service import YIELD_EVERY
from conveyor_broker import FakeClock, TaskState
from conveyor_broker.ids import new_id
from conveyor_protos.v1 import cluster_pb2, service_pb2, service_pb2_grpc, task_pb2
from conveyor_runtime.bus import Bus
from conveyor_runtime.embedded_nats import EmbeddedNats
from conveyor_runtime.nats_connect import NatsClient, close_nats, connect_nats
from conveyor_runtime.settings import ApiSettings
from conveyor_runtime.subjects import Subjects
from conveyor_runtime.wire import requests
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.polling import wait_until
from conveyor_testkit.stream import MakeApi, Recorder
from google.protobuf.duration_pb2 import Duration

MAX_PAYLOAD = 1024 * 1024


def new(queue: str = "emails", type: str = "send", **fields: Any) -> task_pb2.NewTask:
    return task_pb2.NewTask(queue=queue, type=type, **fields)


def seconds(value: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(value * 1e9))
    return d


async def enqueue(tasks: Any, task: task_pb2.NewTask) -> service_pb2.EnqueueResponse:
    response: service_pb2.EnqueueResponse = await tasks.Enqueue(
        service_pb2.EnqueueRequest(task=task)
    )
    return response


async def stored_count(broker: CountingBroker) -> int:
    return sum(sum(s.counts.values()) for s in await broker.queue_stats())


async def test_enqueue_and_get_round_trip(
    tasks: Any, broker: CountingBroker, clock: FakeClock
) -> None:
    response = await enqueue(
        tasks,
        new(payload=b"hello", headers={"trace": "abc"}, options=task_pb2.TaskOptions(group="")),
    )
    assert response.created
    stored = await broker.get_task(response.task.id)
    assert stored.payload == b"hello"
    assert stored.headers == {"trace": "abc"}
    assert stored.state is TaskState.PENDING
    # Server defaults fill what the producer left unset.
    assert stored.max_retry == 25
    assert stored.retention == timedelta(days=1)

    got = await tasks.GetTask(service_pb2.GetTaskRequest(id=response.task.id))
    assert got.task.id == response.task.id
    assert got.task.payload == b"hello"
    assert got.task.state == task_pb2.TASK_STATE_PENDING
    assert got.task.max_retry == 25


async def test_process_in_is_relative_to_the_clock(
    tasks: Any, broker: CountingBroker, clock: FakeClock
) -> None:
    response = await enqueue(
        tasks, new(options=task_pb2.TaskOptions(process_in=seconds(90), max_retry=3))
    )
    stored = await broker.get_task(response.task.id)
    assert stored.state is TaskState.SCHEDULED
    assert stored.process_at == clock.now() + timedelta(seconds=90)
    assert stored.max_retry == 3


async def test_enqueue_is_idempotent_on_id(tasks: Any, clock: FakeClock) -> None:
    task_id = new_id(clock.now())
    first = await enqueue(tasks, new(id=task_id, payload=b"1"))
    second = await enqueue(tasks, new(id=task_id, payload=b"2"))
    assert first.created
    assert not second.created
    assert second.task.payload == b"1"


@pytest.mark.parametrize(
    ("task", "text"),
    [
        (new(queue="bad queue!"), "invalid queue name"),
        (new(queue=""), "invalid queue name"),
        (new(type=""), "task type"),
        (new(id="not-a-ulid"), "invalid task id"),
        (new(payload=b"x" * (MAX_PAYLOAD + 1)), "limit is"),
        (new(options=task_pb2.TaskOptions(timeout=seconds(-1))), "timeout"),
        (new(options=task_pb2.TaskOptions(retention=seconds(-5))), "retention"),
        (new(options=task_pb2.TaskOptions(process_in=seconds(-1))), "process_in"),
        (new(options=task_pb2.TaskOptions(max_retry=-1)), "max_retry"),
        (
            new(options=task_pb2.TaskOptions(process_in=seconds(1), process_at={"seconds": 1})),
            "process_in",
        ),
        (new(options=task_pb2.TaskOptions(depends_on=["nope"])), "invalid task id"),
    ],
)
async def test_bad_input_is_invalid_argument_and_stores_nothing(
    tasks: Any, broker: CountingBroker, task: task_pb2.NewTask, text: str
) -> None:
    before = await enqueue(tasks, new(queue="kept"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await enqueue(tasks, task)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert text in (info.value.details() or "")
    assert await stored_count(broker) == 1
    assert (await broker.get_task(before.task.id)).state is TaskState.PENDING


#: A name far past every limit: an error quoting it whole would not fit in a gRPC trailer.
HUGE = "x" * 70_000


async def test_errors_quoting_a_huge_input_are_cut_to_fit_a_status(
    tasks: Any, admin: Any, broker: CountingBroker
) -> None:
    # Found by the fuzz suite: the status message quoted the whole name, so the client got
    # RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit"), not the status.
    for call, request in [
        (tasks.Enqueue, service_pb2.EnqueueRequest(task=new(queue=HUGE))),
        (tasks.GetTask, service_pb2.GetTaskRequest(id=HUGE)),
        (admin.CancelTask, service_pb2.TaskActionRequest(id=HUGE)),
        (admin.GetWebhookWorker, service_pb2.GetWebhookWorkerRequest(name=HUGE)),
        (admin.ListQueues, service_pb2.ListQueuesRequest(cursor=HUGE)),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        details = info.value.details() or ""
        assert len(details.encode()) <= MAX_STATUS_MESSAGE
        assert details.endswith(" characters)"), details[-100:]
    batch = await tasks.EnqueueBatch(
        service_pb2.EnqueueBatchRequest(tasks=[new(queue=HUGE), new(type="\u00e9" * 70_000)])
    )
    for item in batch.results:
        assert item.error_code == "INVALID_ARGUMENT"
        assert len(item.error.encode()) <= MAX_STATUS_MESSAGE
    assert await stored_count(broker) == 0


def test_status_message_cuts_at_a_character_boundary() -> None:
    assert status_message("short") == "short"
    text = "\u00e9" * 2000  # two bytes each
    cut = status_message(text)
    assert len(cut.encode()) <= MAX_STATUS_MESSAGE
    assert cut.startswith("\u00e9" * 400)
    assert cut.endswith("... (cut: 2000 characters)")


async def test_an_option_that_is_not_built_is_unimplemented_and_stores_nothing(
    tasks: Any, broker: CountingBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every option is built today; the refusal of one that is not stays in place for the
    # next (its feature pretended missing here).
    monkeypatch.setattr(requests, "UNSUPPORTED_OPTIONS", (("group", "not built here"),))
    options, name = task_pb2.TaskOptions(group="digest"), "group"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await enqueue(tasks, new(options=options))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert name in (info.value.details() or "")

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tasks.EnqueueTx(service_pb2.EnqueueTxRequest(tasks=[new(), new(options=options)]))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "task 1" in (info.value.details() or "")
    assert await stored_count(broker) == 0

    # In a batch only that item fails; the others are stored.
    response = await tasks.EnqueueBatch(
        service_pb2.EnqueueBatchRequest(tasks=[new(payload=b"a"), new(options=options)])
    )
    ok, refused = response.results
    assert ok.created
    assert refused.error_code == "UNIMPLEMENTED"
    assert name in refused.error
    assert await stored_count(broker) == 1


async def test_payload_far_over_the_limit_is_refused_by_grpc(
    tasks: Any, broker: CountingBroker
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await enqueue(tasks, new(payload=b"x" * (MAX_PAYLOAD + 1024 * 1024)))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert await stored_count(broker) == 0


async def test_get_task_unknown_and_malformed_ids(tasks: Any, clock: FakeClock) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tasks.GetTask(service_pb2.GetTaskRequest(id=new_id(clock.now())))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tasks.GetTask(service_pb2.GetTaskRequest(id="x"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_duplicate_unique_key_reports_the_existing_id(tasks: Any) -> None:
    first = await enqueue(tasks, new(options=task_pb2.TaskOptions(unique_key="user-1")))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await enqueue(tasks, new(options=task_pb2.TaskOptions(unique_key="user-1")))
    err = info.value
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert first.task.id in (err.details() or "")
    trailers = dict(err.trailing_metadata() or ())
    assert trailers["conveyor-existing-id"] == first.task.id


async def test_enqueue_tx_is_all_or_nothing(tasks: Any, broker: CountingBroker) -> None:
    ok = await tasks.EnqueueTx(service_pb2.EnqueueTxRequest(tasks=[new(), new(queue="b")]))
    assert [t.queue for t in ok.tasks] == ["emails", "b"]

    held = await enqueue(tasks, new(options=task_pb2.TaskOptions(unique_key="k")))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tasks.EnqueueTx(
            service_pb2.EnqueueTxRequest(
                tasks=[new(queue="c"), new(options=task_pb2.TaskOptions(unique_key="k"))]
            )
        )
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert dict(info.value.trailing_metadata() or ())["conveyor-existing-id"] == held.task.id

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tasks.EnqueueTx(service_pb2.EnqueueTxRequest(tasks=[new(queue="c"), new(type="")]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "task 1" in (info.value.details() or "")
    # Neither failed transaction left anything behind.
    assert await stored_count(broker) == 3
    assert (await broker.queue_stats("c"))[0].count(TaskState.PENDING) == 0


async def test_batches_over_1000_are_refused(tasks: Any, broker: CountingBroker) -> None:
    many = [new() for _ in range(1001)]
    for call, request in (
        (tasks.EnqueueBatch, service_pb2.EnqueueBatchRequest(tasks=many)),
        (tasks.EnqueueTx, service_pb2.EnqueueTxRequest(tasks=many)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "1000" in (info.value.details() or "")
    assert await stored_count(broker) == 0


async def test_enqueue_batch_answers_per_item(tasks: Any, broker: CountingBroker) -> None:
    held = await enqueue(tasks, new(options=task_pb2.TaskOptions(unique_key="dup")))
    response = await tasks.EnqueueBatch(
        service_pb2.EnqueueBatchRequest(
            tasks=[
                new(payload=b"a"),
                new(queue="no good"),
                new(options=task_pb2.TaskOptions(unique_key="dup")),
                new(payload=b"d"),
            ]
        )
    )
    ok_a, bad, dup, ok_d = response.results
    assert ok_a.created
    assert ok_a.task.payload == b"a"
    assert not ok_a.error_code
    assert bad.error_code == "INVALID_ARGUMENT"
    assert "invalid queue name" in bad.error
    assert dup.error_code == "ALREADY_EXISTS"
    assert dup.existing_id == held.task.id
    assert ok_d.created
    assert ok_d.task.payload == b"d"
    assert await stored_count(broker) == 3


async def test_concurrent_enqueues_share_commits_and_wakes(
    make_api: MakeApi,
    broker: CountingBroker,
    nc: NatsClient,
    subjects: Subjects,
    bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first enqueue goes to the broker at once; those that arrive while its commit is
    in flight wait for it, then share the next commit. (The window, long here, only bounds
    that wait when a commit is slow.)"""
    api = await make_api(enqueue_batch_window=60, enqueue_batch_max=500)
    # The broker's commit stays in flight until the test lets it finish.
    commit_may_finish = asyncio.Event()
    commit = broker.enqueue_batch
    held: list[int] = []

    async def slow_commit(tasks: Any) -> Any:
        held.append(len(tasks))
        await commit_may_finish.wait()
        return await commit(tasks)

    monkeypatch.setattr(broker, "enqueue_batch", slow_commit)
    wakes = await Recorder(cluster_pb2.Wake).start(bus, queue="burst")
    n = 200
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        stub: Any = service_pb2_grpc.TaskServiceStub
        tasks = stub(ch)
        calls = asyncio.gather(
            *(enqueue(tasks, new(queue="burst", payload=str(i).encode())) for i in range(n))
        )
        try:
            # The first commit took what had arrived (usually one); the rest wait.
            await wait_until(
                lambda: bool(held) and held[0] + api.committer.queued == n,
                message="enqueues queued behind the first commit",
            )
        finally:
            commit_may_finish.set()
        responses = await asyncio.wait_for(calls, 30)
    assert all(r.created for r in responses)
    assert len({r.task.id for r in responses}) == n
    first = held[0]
    assert first < n // 2, held
    assert broker.enqueue_batch_sizes == [first, n - first]

    # A marker published after every response: everything before it has arrived. (By
    # hand: the bus would publish it on the marker queue's subject.)
    marker = cluster_pb2.Wake(queue="marker").SerializeToString()
    await nc.publish(
        subjects.wake("burst"), marker, headers=bus.auth.seal(subjects.wake("burst"), marker)
    )
    await wakes.wait_for(lambda m: m.queue == "marker")
    real = [m for m in wakes.messages if m.queue == "burst"]
    assert 1 <= len(real) <= len(broker.enqueue_batch_sizes)
    await wakes.stop()


async def test_a_lone_enqueue_does_not_wait_for_the_window(make_api: MakeApi) -> None:
    api = await make_api(enqueue_batch_window=60)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        stub: Any = service_pb2_grpc.TaskServiceStub
        tasks = stub(ch)
        for _ in range(3):
            response = await asyncio.wait_for(enqueue(tasks, new()), 10)
            assert response.created


async def test_a_refused_group_commit_still_answers_each_caller(
    make_api: MakeApi, broker: CountingBroker
) -> None:
    api = await make_api(enqueue_batch_window=0.05)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as ch:
        stub: Any = service_pb2_grpc.TaskServiceStub
        tasks = stub(ch)
        outcomes = await asyncio.gather(
            *(
                enqueue(tasks, new(options=task_pb2.TaskOptions(unique_key="same")))
                for _ in range(5)
            ),
            *(enqueue(tasks, new(payload=b"free")) for _ in range(5)),
            return_exceptions=True,
        )
    created = [o for o in outcomes if isinstance(o, service_pb2.EnqueueResponse)]
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(created) == 6
    assert len(refused) == 4
    assert all(e.code() == grpc.StatusCode.ALREADY_EXISTS for e in refused)
    assert await stored_count(broker) == 6


async def test_wake_only_for_due_work(
    api: ApiServer, tasks: Any, nc: NatsClient, subjects: Subjects, bus: Bus
) -> None:
    wakes = await Recorder(cluster_pb2.Wake).start(bus)
    await enqueue(tasks, new(queue="later", options=task_pb2.TaskOptions(process_in=seconds(60))))
    await enqueue(tasks, new(queue="now"))
    await wakes.wait_for(lambda m: m.queue == "now")
    # A marker on the subject of "later" (by hand: the bus would publish it on its own).
    marker = cluster_pb2.Wake(queue="marker").SerializeToString()
    await nc.publish(
        subjects.wake("later"), marker, headers=bus.auth.seal(subjects.wake("later"), marker)
    )
    await wakes.wait_for(lambda m: m.queue == "marker")
    assert [m.queue for m in wakes.messages] == ["now", "marker"]
    await wakes.stop()


async def test_a_big_batch_lets_worker_sessions_run_while_it_converts(
    tasks: Any, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Converting a thousand items takes milliseconds; the api's worker sessions share its
    event loop, so the conversion yields every YIELD_EVERY items instead of holding it."""
    ticks = 0
    seen: list[int] = []
    running = True

    async def other_work() -> None:
        nonlocal ticks
        while running:
            ticks += 1
            await asyncio.sleep(0)

    convert = requests.new_task_from_request

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen.append(ticks)  # once per item converted
        return convert(*args, **kwargs)

    monkeypatch.setattr(task_service, "new_task_from_request", counted)
    ticker = asyncio.create_task(other_work())
    try:
        response = await tasks.EnqueueBatch(
            service_pb2.EnqueueBatchRequest(tasks=[new() for _ in range(1000)])
        )
    finally:
        running = False
        await ticker
    assert len(response.results) == 1000
    assert all(item.HasField("task") for item in response.results)
    # Without the yields every item would see the same tick count.
    assert YIELD_EVERY <= 200
    assert len(set(seen[:1000])) >= 5


async def test_a_task_no_nats_message_could_dispatch_is_refused(
    broker: CountingBroker, clock: FakeClock, subjects: Subjects
) -> None:
    """On a NATS server that carries 64 kB a message, a task whose dispatch would not fit
    is refused at the door (it could never run), naming both sizes; smaller ones pass."""
    with EmbeddedNats(max_payload=64 * 1024) as server:
        nc = await connect_nats(server.url, name="test-small")
        settings = ApiSettings(
            host="127.0.0.1",
            port=0,
            nats_url=server.url,
            subject_prefix=subjects.prefix,
            broker="memory",
            allow_unauthenticated=True,
        )
        api = ApiServer(settings, broker, nc, clock)
        await api.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
                make_stub: Any = service_pb2_grpc.TaskServiceStub
                stub = make_stub(channel)
                kept = await enqueue(stub, new(payload=b"x" * 30_000))
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await enqueue(stub, new(payload=b"x" * 70_000))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "65536" in (info.value.details() or "")
                big_headers = new(headers={f"h{n}": "v" * 4000 for n in range(16)})
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await enqueue(stub, big_headers)
                assert "max_payload" in (info.value.details() or "")
            assert await stored_count(broker) == 1
            assert (await broker.get_task(kept.task.id)).state is TaskState.PENDING
        finally:
            await api.stop(grace=1.0)
            await close_nats(nc)
