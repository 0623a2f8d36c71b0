"""Key rotation and key status on the Postgres store: every task value ends up under the
primary key and still reads as it was written; a service's write during a rotation is
never overwritten; what cannot be decrypted is counted, not lost; a stopped rotation goes
on where it stopped."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from datetime import timedelta

import asyncpg
import pytest
from conveyor_broker import (
    FakeClock,
    NewTask,
    Task,
    TaskListParams,
    TaskState,
    WebhookWorkerSpec,
)
from conveyor_broker.encrypted import EncryptedBroker
from conveyor_broker.keyring import Keyring
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.postgres.queries import rotation as queries
from conveyor_broker.postgres.rotation import (
    RotationProgress,
    _rewrite_batch,
    _stale_args,
    count_stale,
    key_status,
    rotate,
)
from conveyor_broker.testing.cron import cron_spec, template
from conveyor_broker.testing.schemas import scratch_schema
from conveyor_broker.types import LEASE_EXPIRED_ERROR, LeaseReapParams

pytestmark = pytest.mark.postgres

TTL = timedelta(seconds=30)
OLD, NEW, GONE = os.urandom(32), os.urandom(32), os.urandom(32)
BEFORE = Keyring({"old": OLD}, "old")
AFTER = Keyring({"old": OLD, "new": NEW}, "new")
ONLY_NEW = Keyring({"new": NEW}, "new")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def dsn(pg_dsn: str) -> AsyncIterator[str]:
    async with scratch_schema(pg_dsn) as scoped:
        yield scoped


@pytest.fixture
async def store(dsn: str, clock: FakeClock) -> AsyncIterator[PostgresBroker]:
    broker = await PostgresBroker.connect(dsn, clock, max_size=2)
    yield broker
    await broker.close()


@pytest.fixture
async def conn(dsn: str) -> AsyncIterator[asyncpg.Connection[asyncpg.Record]]:
    connection = await asyncpg.connect(dsn)
    yield connection
    await connection.close()


async def fill(store: PostgresBroker, clock: FakeClock, count: int) -> None:
    """``count`` tasks under the old key in every shape (headers, errors, progress,
    results), a few stored in clear before encryption, one with the broker's own error
    text."""
    old = EncryptedBroker(store, BEFORE)
    await store.enqueue_batch(
        [NewTask("legacy", "t", payload=b"clear %d" % i, headers={"h": "v"}) for i in range(3)]
    )
    await old.enqueue_batch(
        [
            NewTask("q", "t", payload=b"p%d" % i, headers={"a": f"x{i}", "b": "y"} if i % 2 else {})
            for i in range(count)
        ]
    )
    leased = await old.lease("q", count // 2, TTL)
    for i, task in enumerate(leased):
        lease = task.lease_id or ""
        if i % 3 == 0:
            await old.set_progress(task.id, lease, b"half %d" % i)
            await old.ack(task.id, lease, b"result %d" % i)
        elif i % 3 == 1:
            await old.fail(task.id, lease, f"error {i}", timedelta(0))
    # Left leased: one of them is reaped, so it holds the broker's own error text.
    clock.advance(TTL * 2)
    assert await store.reap_expired_leases(LeaseReapParams(limit=1))


async def read_all(store: PostgresBroker, keyring: Keyring) -> dict[str, Task]:
    """Every task, as the encrypted broker reads it with ``keyring``."""
    page = await EncryptedBroker(store, keyring).list_tasks(TaskListParams(limit=1000))
    assert page.next_cursor is None
    return {task.id: task for task in page.tasks}


async def test_rotation_moves_every_value_to_the_primary_key(
    store: PostgresBroker, conn: asyncpg.Connection[asyncpg.Record], clock: FakeClock
) -> None:
    await fill(store, clock, 40)
    written = await read_all(store, AFTER)
    await store.upsert_webhook_worker(
        WebhookWorkerSpec("hook", "https://example.com/", {"q": 1}, secrets=("enc:v1:wh:abc",))
    )
    before = await key_status(conn)
    assert set(before.task_values()) == {"old", None}  # sealed, and legacy in clear
    assert before.task_values()[None] == 6  # 3 legacy payloads and their header values
    assert before.server_errors() == 1
    assert before.secrets() == {"wh": 1}
    stale = await count_stale(conn, AFTER)
    assert stale == len(written)  # every task has a value to rewrite

    seen: list[int] = []
    done = await rotate(conn, AFTER, batch_size=7, on_batch=lambda p: seen.append(p.scanned))
    assert done.complete
    assert done.total == stale
    assert done.tasks == stale
    assert done.scanned == stale
    assert done.values == sum(before.task_values().values())
    assert seen == sorted(seen)
    assert seen[0] == 0  # counted first
    assert len(seen) == 1 + -(-stale // 7)  # then in batches

    after = await key_status(conn)
    assert after.task_values() == {"new": done.values}
    assert after.server_errors() == 1  # the broker's own text stays in clear
    assert after.secrets() == {"wh": 1}  # webhook secrets are the api's (own keys)
    assert await count_stale(conn, AFTER) == 0
    # Every value reads as it was written, with the new key alone.
    assert await read_all(store, ONLY_NEW) == written
    reaped = [t for t in written.values() if t.last_error == LEASE_EXPIRED_ERROR]
    assert len(reaped) == 1
    # Nothing else changed: a rotation is not a change of the task.
    assert {t.id: t.updated_at for t in written.values()} == {
        t.id: t.updated_at for t in (await read_all(store, ONLY_NEW)).values()
    }
    # Run again: nothing to do.
    again = await rotate(conn, AFTER, batch_size=7)
    assert (again.total, again.tasks, again.values) == (0, 0, 0)


async def test_a_write_during_a_rotation_is_never_overwritten(
    store: PostgresBroker, conn: asyncpg.Connection[asyncpg.Record]
) -> None:
    old = EncryptedBroker(store, BEFORE)
    await old.enqueue_batch([NewTask("q", "t", payload=b"p%d" % i) for i in range(4)])
    rows = list(await conn.fetch(queries.STALE_TASKS, *_stale_args(AFTER), "", 10))
    assert len(rows) == 4
    # A service acks one task between the rotation's read and its rewrite.
    leased = await old.lease("q", 1, TTL)
    await old.ack(leased[0].id, leased[0].lease_id or "", b"fresh result")
    progress = RotationProgress(total=4)
    await _rewrite_batch(conn, AFTER, rows, progress)
    assert (progress.tasks, progress.changed) == (4, 0)  # read again, then rewritten
    acked = await EncryptedBroker(store, ONLY_NEW).get_task(leased[0].id)
    assert acked.state == TaskState.COMPLETED
    assert acked.result == b"fresh result"
    assert await count_stale(conn, AFTER) == 0


async def test_values_under_a_missing_key_are_counted_and_kept(
    store: PostgresBroker, conn: asyncpg.Connection[asyncpg.Record]
) -> None:
    gone = EncryptedBroker(store, Keyring({"gone": GONE}, "gone"))
    lost = (await gone.enqueue(NewTask("q", "t", payload=b"x", headers={"h": "v"}))).task
    await EncryptedBroker(store, BEFORE).enqueue(NewTask("q", "t", payload=b"y"))
    done = await rotate(conn, AFTER)
    assert not done.complete
    assert done.unreadable == {"gone": 2}
    assert done.tasks == 1
    assert (await key_status(conn)).task_values() == {"gone": 2, "new": 1}
    # Still there for whoever has the key.
    both = Keyring({"gone": GONE, "new": NEW}, "new")
    assert (await EncryptedBroker(store, both).get_task(lost.id)).payload == b"x"


async def test_a_stopped_rotation_goes_on_where_it_stopped(
    store: PostgresBroker, conn: asyncpg.Connection[asyncpg.Record]
) -> None:
    old = EncryptedBroker(store, BEFORE)
    await old.enqueue_batch([NewTask("q", "t", payload=b"p%d" % i) for i in range(50)])

    class Stop(Exception):
        pass

    def stop_after_two(progress: RotationProgress) -> None:
        if progress.scanned >= 20:
            raise Stop

    with pytest.raises(Stop):
        await rotate(conn, AFTER, batch_size=10, on_batch=stop_after_two)
    assert await count_stale(conn, AFTER) == 30
    rest = await rotate(conn, AFTER, batch_size=10)
    assert (rest.total, rest.tasks, rest.scanned) == (30, 30, 30)  # the rest, only
    assert (await key_status(conn)).task_values() == {"new": 50}


async def test_cron_templates_are_rotated_and_counted(
    store: PostgresBroker, conn: asyncpg.Connection[asyncpg.Record]
) -> None:
    old = EncryptedBroker(store, BEFORE)
    spec = cron_spec(task=template(payload=b"template", headers={"h": "v"}))
    written = await old.upsert_cron_entry(spec)
    # One stored in clear, before encryption: sealed on the way.
    await store.upsert_cron_entry(cron_spec("legacy", task=template(payload=b"clear")))
    before = await key_status(conn)
    counts = {(c.field, c.key_id): c.count for c in before.counts}
    assert counts[("cron_payload", "old")] == 1
    assert counts[("cron_header", "old")] == 1
    assert counts[("cron_payload", None)] == 1

    done = await rotate(conn, AFTER)
    assert done.complete
    assert (done.tasks, done.entries, done.values) == (0, 2, 3)
    assert (await key_status(conn)).task_values() == {"new": 3}
    reader = EncryptedBroker(store, ONLY_NEW)
    entry = await reader.get_cron_entry(spec.name)
    assert (entry.task.payload, entry.task.headers) == (b"template", {"h": "v"})
    assert entry.updated_at == written.updated_at  # upkeep, not a change of the entry
    assert (await reader.get_cron_entry("legacy")).task.payload == b"clear"
    again = await rotate(conn, AFTER)
    assert (again.entries, again.values) == (0, 0)


async def test_a_cron_template_under_a_missing_key_is_kept_and_counted(
    store: PostgresBroker, conn: asyncpg.Connection[asyncpg.Record]
) -> None:
    gone = EncryptedBroker(store, Keyring({"gone": GONE}, "gone"))
    await gone.upsert_cron_entry(cron_spec(task=template(payload=b"x")))
    done = await rotate(conn, AFTER)
    assert done.unreadable == {"gone": 1}
    assert not done.complete
    assert (await key_status(conn)).task_values() == {"gone": 1}
