"""Encryption at rest through real processes: api, dispatcher, maintenance and an SDK
worker over Postgres, every service given CONVEYOR_ENCRYPTION_KEYS."""

from __future__ import annotations

from pathlib import Path

import pytest
from conveyor import AsyncAdminClient, AsyncClient, FailedPrecondition, TaskState
from conveyor_broker import SystemClock
from conveyor_broker import TaskState as StoredState
from conveyor_broker.encrypted import EncryptedBroker
from conveyor_broker.keyring import Keyring, generate_key
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.types import NewTask
from conveyor_testkit.polling import wait_until

from tests.e2e.harness import POLL_INTERVAL, Cluster
from tests.e2e.lifecycle import start_stack, wait_state

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]

Q = "sealed"
#: The services' key, and one they never get.
SERVICE_KEY = generate_key("k2")
GONE_KEY = generate_key("gone")


def material(key: str) -> str:
    return key.partition(":")[2]


async def test_a_task_under_a_missing_key_fails_alone_and_nothing_crashes(
    cluster: Cluster, migrated_dsn: str, tmp_path: Path
) -> None:
    stack = await start_stack(
        cluster, tmp_path, queues={Q: 1}, env={"CONVEYOR_ENCRYPTION_KEYS": SERVICE_KEY}
    )
    # A task written by a deployment whose key these services were never given.
    store = await PostgresBroker.connect(migrated_dsn, SystemClock(), max_size=2)
    elsewhere = EncryptedBroker(store, Keyring.parse(GONE_KEY))
    both = EncryptedBroker(store, Keyring.parse(f"*{SERVICE_KEY},{GONE_KEY}"))
    try:
        async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
            before = await client.enqueue("e2e.result", {"result": "before"}, queue=Q)
            lost = (
                await elsewhere.enqueue(NewTask(Q, "e2e.result", payload=b"{}", max_retry=0))
            ).task
            after = await client.enqueue("e2e.result", {"result": "after"}, queue=Q)
            for task in (before, after):
                done = await wait_state(admin, task.id, TaskState.COMPLETED, within=60)
                assert done.result in ("before", "after")

            # The unreadable task failed (archived: no retries left) with an error naming
            # the key; it is all there for an operator who has the key.
            async def archived() -> bool:
                return (await store.get_task(lost.id)).state == StoredState.ARCHIVED

            await wait_until(
                archived, within=60, interval=POLL_INTERVAL, message="unreadable task archived"
            )
            stored = await both.get_task(lost.id)
            assert stored.payload == b"{}"
            assert stored.last_error is not None
            assert "is encrypted with key 'gone', which is not configured" in stored.last_error
            # Reading it through the api is a clear error, not garbage.
            with pytest.raises(FailedPrecondition, match="key 'gone'"):
                await admin.get_task(lost.id)

            # Nothing crashed, and work goes on.
            assert all(proc.alive() for proc in cluster.procs), cluster.logs()
            again = await client.enqueue("e2e.result", {"result": "still"}, queue=Q)
            assert (await wait_state(admin, again.id, TaskState.COMPLETED)).result == "still"
    finally:
        await store.close()
    logs = "\n".join(proc.log() for proc in cluster.procs)
    assert "broker.lease_decrypt_failed" in logs
    assert "key_id=gone" in logs
    assert "broker.encrypted primary_key=k2 keys=k2" in logs
    for key in (SERVICE_KEY, GONE_KEY):
        assert material(key) not in logs
