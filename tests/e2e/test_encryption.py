"""Encryption at rest through real processes: api, dispatcher, maintenance and an SDK
worker over Postgres, every service given CONVEYOR_ENCRYPTION_KEYS."""

from __future__ import annotations

from pathlib import Path

import asyncpg
import pytest
from conveyor import AsyncAdminClient, AsyncClient, FailedPrecondition, TaskSpec, TaskState
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


async def test_postgres_rows_hold_no_plaintext_payload_result_or_secret(
    cluster: Cluster, migrated_dsn: str, tmp_path: Path
) -> None:
    marks = {
        "payload": "PAYLOAD-MARK-7f3a",
        "header": "HEADER-MARK-91c2",
        "result": "RESULT-MARK-5d0e",
        "error": "ERROR-MARK-c4b8",
        "secret": "SECRET-MARK-2e6f-at-least-24-chars",
        "progress": "step",  # the worker's progress: {"step": 1}
        "cron payload": "CRON-PAYLOAD-MARK-a81d",
        "cron header": "CRON-HEADER-MARK-3b7c",
    }
    stack = await start_stack(
        cluster, tmp_path, queues={Q: 1}, env={"CONVEYOR_ENCRYPTION_KEYS": SERVICE_KEY}
    )
    async with AsyncClient(stack.target) as client, AsyncAdminClient(stack.target) as admin:
        result = await client.enqueue(
            "e2e.result",
            {"result": marks["result"], "note": marks["payload"]},
            queue=Q,
            headers={"h": marks["header"]},
        )
        failed_once = await client.enqueue(
            "e2e.fail", {"fails": 1, "error": marks["error"]}, queue=Q, max_retry=3
        )
        running = await client.enqueue("e2e.progress", {}, queue=Q)
        await admin.upsert_cron_entry(
            "sealed-cron",
            "0 3 * * *",
            TaskSpec(
                "e2e.result",
                {"result": marks["cron payload"]},
                queue=Q,
                headers={"h": marks["cron header"]},
            ),
        )
        entry = await admin.get_cron_entry("sealed-cron")
        assert entry.task.payload == {"result": marks["cron payload"]}
        # A trigger makes the entry's task from its sealed template, sealed to itself.
        fired = await admin.trigger_cron_entry("sealed-cron")
        ran = await wait_state(admin, fired.id, TaskState.COMPLETED, within=60)
        assert ran.result == marks["cron payload"]
        assert ran.headers["h"] == marks["cron header"]
        await admin.upsert_webhook_worker(
            "sealed-hook", "http://127.0.0.1:9/hook", ["hooks"], secrets=[marks["secret"]]
        )
        # What the api reads back is the plaintext (so the marks were stored).
        done = await wait_state(admin, result.id, TaskState.COMPLETED, within=60)
        assert done.result == marks["result"]
        assert done.payload == {"result": marks["result"], "note": marks["payload"]}
        assert dict(done.headers) == {"h": marks["header"]}
        retried = await wait_state(admin, failed_once.id, TaskState.COMPLETED, within=60)
        assert marks["error"] in (retried.last_error or "")

        async def reported() -> bool:
            return (await admin.get_task(running.id)).progress is not None

        await wait_until(reported, within=60, interval=POLL_INTERVAL, message="progress")
        assert (await admin.get_task(running.id)).progress == {"step": 1}

        conn = await asyncpg.connect(migrated_dsn)
        try:
            tasks = await conn.fetchval("SELECT string_agg(t::text, ' ') FROM conveyor_tasks t")
            hooks = await conn.fetchval(
                "SELECT string_agg(w::text, ' ') FROM conveyor_webhook_workers w"
            )
            crons = await conn.fetchval(
                "SELECT string_agg(c::text, ' ') FROM conveyor_cron_entries c"
            )
        finally:
            await conn.close()
        await admin.cancel_task(running.id)
    dump = f"{tasks} {hooks} {crons}"
    assert "sealed-hook" in dump  # the rows were read
    assert "sealed-cron" in dump
    for name, mark in marks.items():
        assert mark not in dump, name
        assert mark.encode().hex() not in dump, name  # bytea reads as hex
    # The secret is sealed by the api under the webhook secret key (test id "test"),
    # the task values under the encryption key.
    assert "enc:v1:test:" in hooks
    assert "enc:v1:k2:" in tasks
