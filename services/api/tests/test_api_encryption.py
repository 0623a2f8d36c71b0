"""The api over an encrypted broker: producers see plaintext, a task stored under a key
this server does not have is a clear FAILED_PRECONDITION naming the key, and the api
goes on serving."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from conveyor_broker import FakeClock, NewTask
from conveyor_broker.encrypted import EncryptedBroker
from conveyor_broker.keyring import BINARY_PREFIX, Keyring
from conveyor_protos.v1 import service_pb2, task_pb2
from conveyor_testkit.brokers import CountingBroker


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[EncryptedBroker]:
    """The api's broker: a counting memory broker inside an encrypted one."""
    b = EncryptedBroker(CountingBroker(clock), Keyring({"k2": os.urandom(32)}, "k2"))
    yield b
    await b.close()


async def test_producers_see_plaintext_and_storage_ciphertext(
    tasks: Any, admin: Any, broker: EncryptedBroker
) -> None:
    created = await tasks.Enqueue(
        service_pb2.EnqueueRequest(
            task=task_pb2.NewTask(queue="q", type="t", payload=b"card=4242", headers={"h": "v1"})
        )
    )
    assert created.task.payload == b"card=4242"
    raw = await broker.inner.get_task(created.task.id)
    assert raw.payload.startswith(BINARY_PREFIX)
    assert b"4242" not in raw.payload
    read = await tasks.GetTask(service_pb2.GetTaskRequest(id=created.task.id))
    assert (read.task.payload, dict(read.task.headers)) == (b"card=4242", {"h": "v1"})
    listed = await admin.ListTasks(service_pb2.ListTasksRequest(queue="q"))
    assert [t.payload for t in listed.tasks] == [b"card=4242"]


async def test_a_task_under_a_missing_key_is_failed_precondition_naming_it(
    tasks: Any, broker: EncryptedBroker
) -> None:
    elsewhere = EncryptedBroker(broker.inner, Keyring({"k1": os.urandom(32)}, "k1"))
    lost = (await elsewhere.enqueue(NewTask("q", "t", payload=b"x"))).task
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await tasks.GetTask(service_pb2.GetTaskRequest(id=lost.id))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"payload of task {lost.id} is encrypted with key 'k1'" in (info.value.details() or "")
    assert "which is not configured" in (info.value.details() or "")
    # The api goes on.
    fine = (await broker.enqueue(NewTask("q", "t", payload=b"y"))).task
    read = await tasks.GetTask(service_pb2.GetTaskRequest(id=fine.id))
    assert read.task.payload == b"y"
