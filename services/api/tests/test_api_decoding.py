"""A request whose bytes are not a valid protobuf message gets INVALID_ARGUMENT naming the
message type, on every service, through the interceptors, and changes nothing stored."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import grpc
import pytest
from conveyor_api import ApiServer
from conveyor_api.session import MALFORMED_FRAME
from conveyor_broker import NewTask, TaskState
from conveyor_protos.v1 import cluster_pb2, service_pb2, service_pb2_grpc, task_pb2
from conveyor_runtime import wire
from conveyor_runtime.bus import Bus
from conveyor_runtime.decoding import (
    Undecodable,
    add_service,
    malformed_message,
    tolerant_deserializer,
)
from conveyor_testkit.brokers import CountingBroker
from conveyor_testkit.polling import wait_until
from conveyor_testkit.stream import MakeApi, Recorder, dispatch
from google.protobuf.descriptor import MethodDescriptor

TOKEN = "s3cret-token-of-the-tests"
#: An unfinished varint tag: no message type parses it.
GARBAGE = b"\xff\xff\xff\xff"
SERVICES = ("TaskService", "WorkerService", "AdminService", "WebhookService")
UNARY_REQUEST_METHODS = [
    method
    for name in SERVICES
    for method in service_pb2.DESCRIPTOR.services_by_name[name].methods
    if not method.client_streaming
]


def raw(data: Any) -> Any:
    """Serializer/deserializer that passes bytes through (or serializes a message)."""
    return data if isinstance(data, bytes) else data.SerializeToString()


async def call_raw(
    channel: grpc.aio.Channel,
    method: MethodDescriptor,
    body: bytes,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> grpc.aio.AioRpcError:
    """Call ``method`` with ``body`` as its request bytes; the error it ends with."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    if method.server_streaming:
        stream = channel.unary_stream(path, request_serializer=raw, response_deserializer=raw)
        call = stream(body, metadata=metadata, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call.read()
        return info.value
    unary = channel.unary_unary(path, request_serializer=raw, response_deserializer=raw)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await unary(body, metadata=metadata, timeout=10)
    return info.value


def open_raw_session(channel: grpc.aio.Channel) -> Any:
    """A Session call that can write raw bytes as well as WorkerFrames."""
    session = channel.stream_stream(
        "/conveyor.v1.WorkerService/Session",
        request_serializer=raw,
        response_deserializer=service_pb2.ServerFrame.FromString,
    )
    return session()


async def end_status(call: Any) -> tuple[grpc.StatusCode, str]:
    """Read the stream to its end; its status code and message."""
    try:
        while (await call.read()) is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return await call.code(), await call.details()


async def snapshot(broker: CountingBroker, task_id: str) -> Any:
    """What is stored: one task, every queue's counts, and the enqueue calls made."""
    return (
        await broker.get_task(task_id),
        await broker.queue_stats(),
        list(broker.enqueue_batch_sizes),
    )


@pytest.fixture
async def kept(broker: CountingBroker) -> str:
    """A task stored before the bad requests arrive."""
    [result] = await broker.enqueue_batch([NewTask(queue="kept", type="t", payload=b"p")])
    return result.task.id


# --------------------------------------------------------------- the deserializer


def test_tolerant_deserializer_parses_valid_bytes_and_marks_garbage() -> None:
    deserialize = tolerant_deserializer(service_pb2.EnqueueRequest)
    request = service_pb2.EnqueueRequest(task=task_pb2.NewTask(queue="q", type="t"))
    assert deserialize(request.SerializeToString()) == request
    assert deserialize(b"") == service_pb2.EnqueueRequest()
    bad = deserialize(GARBAGE)
    assert isinstance(bad, Undecodable)
    assert bad.type_name == "conveyor.v1.EnqueueRequest"
    assert bad.message == "malformed request: not a valid conveyor.v1.EnqueueRequest message"
    assert isinstance(deserialize(b"\x0a\x05ab"), Undecodable)  # truncated field


# --------------------------------------------------------------- unary requests


@pytest.mark.parametrize("method", UNARY_REQUEST_METHODS, ids=lambda m: m.full_name)
async def test_every_method_refuses_garbage_with_invalid_argument(
    channel: grpc.aio.Channel, broker: CountingBroker, kept: str, method: MethodDescriptor
) -> None:
    before = await snapshot(broker, kept)
    error = await call_raw(channel, method, GARBAGE)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == malformed_message(method.input_type.full_name)
    assert await snapshot(broker, kept) == before


async def test_valid_bytes_still_reach_the_servicer(
    channel: grpc.aio.Channel, broker: CountingBroker, kept: str
) -> None:
    get = channel.unary_unary(
        "/conveyor.v1.AdminService/GetTask",
        request_serializer=raw,
        response_deserializer=service_pb2.GetTaskResponse.FromString,
    )
    response = await get(service_pb2.GetTaskRequest(id=kept).SerializeToString())
    assert response.task.id == kept


async def test_auth_still_comes_first(make_api: MakeApi) -> None:
    api = await make_api(auth_tokens=[f"tests:admin:{TOKEN}"], allow_unauthenticated=False)
    enqueue = service_pb2.DESCRIPTOR.services_by_name["TaskService"].methods_by_name["Enqueue"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        anonymous = await call_raw(channel, enqueue, GARBAGE)
        assert anonymous.code() is grpc.StatusCode.UNAUTHENTICATED
        signed = await call_raw(
            channel, enqueue, GARBAGE, metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
        assert signed.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert signed.details() == malformed_message("conveyor.v1.EnqueueRequest")


async def test_read_only_still_refuses_mutations(make_api: MakeApi) -> None:
    api = await make_api(read_only=True)
    admin = service_pb2.DESCRIPTOR.services_by_name["AdminService"]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        pause = await call_raw(channel, admin.methods_by_name["PauseQueue"], GARBAGE)
        assert pause.code() is grpc.StatusCode.PERMISSION_DENIED
        read = await call_raw(channel, admin.methods_by_name["GetTask"], GARBAGE)
        assert read.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_an_unimplemented_method_stays_unimplemented() -> None:
    # The generated base servicer's stubs are plain functions: served as generated code would.
    server = grpc.aio.server()
    servicer: Any = service_pb2_grpc.WebhookServiceServicer()
    add_service(server, service_pb2.DESCRIPTOR.services_by_name["WebhookService"], servicer)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        heartbeat = service_pb2.DESCRIPTOR.services_by_name["WebhookService"].methods[0]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            error = await call_raw(channel, heartbeat, b"")
        assert error.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop(None)


# --------------------------------------------------------------- the Session stream


async def test_garbage_first_frame_ends_the_session(channel: grpc.aio.Channel) -> None:
    call = open_raw_session(channel)
    await call.write(GARBAGE)
    code, details = await end_status(call)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details == MALFORMED_FRAME == malformed_message("conveyor.v1.WorkerFrame")


async def test_garbage_frame_ends_the_session_and_releases_its_tasks(
    api: ApiServer, broker: CountingBroker, bus: Bus
) -> None:
    registers = await Recorder(cluster_pb2.Register).start(bus, queue="q")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{api.port}") as channel:
        call = open_raw_session(channel)
        hello = service_pb2.Hello(queues={"q": 1}, concurrency=2, sdk_version="0.1.0")
        await call.write(service_pb2.WorkerFrame(hello=hello))
        welcome = (await call.read()).welcome
        await registers.wait_for(lambda m: m.gateway == welcome.session_id)
        await broker.enqueue_batch([NewTask(queue="q", type="t", payload=b"p")] * 2)
        tasks = await broker.lease("q", 2, timedelta(seconds=30))
        envelopes = [wire.task_to_envelope(t) for t in tasks]
        reply = await dispatch(bus, welcome.session_id, "q", envelopes)
        assert len(reply.accepted) == 2
        for _ in envelopes:
            assert (await call.read()).HasField("dispatch")

        await call.write(GARBAGE)
        code, details = await end_status(call)
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert details == "malformed request: not a valid conveyor.v1.WorkerFrame message"
    for task in tasks:
        stored = await broker.get_task(task.id)
        assert stored.state is TaskState.PENDING
        assert stored.retried == 0
    await registers.wait_for(lambda m: m.gateway == welcome.session_id and m.closing)
    await wait_until(lambda: not api.registry.gateways, message="session gone")
    await registers.stop()
