"""The encrypted broker: what it stores is sealed, what cannot be opened is a clear error
naming the key, and batches stay batches. (It passes the conformance suite around both
brokers: test_memory.py, test_postgres.py.)"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from conveyor_broker import (
    AckItem,
    EnqueueResult,
    FakeClock,
    NewTask,
    Task,
    TaskEvent,
    TaskListParams,
    TaskPage,
    TaskState,
)
from conveyor_broker.encrypted import EncryptedBroker
from conveyor_broker.keyring import (
    BINARY_PREFIX,
    LAST_ERROR,
    PAYLOAD,
    RESULT,
    DecryptionError,
    Keyring,
    KeyringError,
    binary_key_id,
    generate_key,
    template_subject,
    text_key_id,
)
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.testing.cron import NAME, cron_spec, template
from conveyor_broker.testing.schemas import scratch_schema

TTL = timedelta(seconds=30)
SECRET = b"the payload nobody may read"


def ring(primary: str = "new", **keys: bytes) -> Keyring:
    return Keyring(keys or {"old": os.urandom(32), "new": os.urandom(32)}, primary)


class CountingMemoryBroker(MemoryBroker):
    """A memory broker that counts the hook calls it gets."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.calls: list[str] = []

    async def _enqueue_batch(self, tasks: Sequence[NewTask]) -> list[EnqueueResult]:
        self.calls.append("enqueue_batch")
        return await super()._enqueue_batch(tasks)

    async def _lease_many(
        self,
        wants: Sequence[tuple[str, int]],
        ttl: timedelta,
        holders: Sequence[tuple[str, ...]],
    ) -> list[list[Task]]:
        self.calls.append("lease_many")
        return await super()._lease_many(wants, ttl, holders)

    async def _ack_batch(self, items: Sequence[AckItem]) -> list[bool]:
        self.calls.append("ack_batch")
        return await super()._ack_batch(items)

    async def _list_tasks(self, params: TaskListParams) -> TaskPage:
        self.calls.append("list_tasks")
        return await super()._list_tasks(params)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def inner(clock: FakeClock) -> CountingMemoryBroker:
    return CountingMemoryBroker(clock)


@pytest.fixture
def keyring() -> Keyring:
    return ring()


@pytest.fixture
def broker(inner: MemoryBroker, keyring: Keyring) -> EncryptedBroker:
    return EncryptedBroker(inner, keyring)


# ------------------------------------------------------------------ what is stored


async def test_every_user_value_is_stored_sealed_and_read_back_plain(
    broker: EncryptedBroker, inner: MemoryBroker
) -> None:
    headers = {"trace": "trace-value-1", "tenant": "acme-corp"}
    task = (await broker.enqueue(NewTask("q", "t", payload=SECRET, headers=headers))).task
    assert task.payload == SECRET
    assert task.headers == headers

    raw = await inner.get_task(task.id)
    assert raw.payload.startswith(BINARY_PREFIX)
    assert SECRET not in raw.payload
    assert binary_key_id(raw.payload) == "new"
    assert set(raw.headers) == set(headers)  # names stay clear
    for name, value in raw.headers.items():
        assert text_key_id(value) == "new"
        assert headers[name] not in value

    leased = (await broker.lease("q", 1, TTL))[0]
    assert leased.payload == SECRET
    assert leased.headers == headers
    assert leased.lease_id is not None
    await broker.set_progress(task.id, leased.lease_id, b"progress: half way")
    raw = await inner.get_task(task.id)
    assert raw.progress is not None
    assert b"half way" not in raw.progress
    assert (await broker.get_task(task.id)).progress == b"progress: half way"

    failed = await broker.fail(task.id, leased.lease_id, "boom: card 4242 declined", timedelta(0))
    assert failed.last_error == "boom: card 4242 declined"
    raw = await inner.get_task(task.id)
    assert raw.last_error is not None
    assert "4242" not in raw.last_error
    assert text_key_id(raw.last_error) == "new"

    again = (await broker.lease("q", 1, TTL))[0]
    assert again.last_error == "boom: card 4242 declined"
    assert again.lease_id is not None
    done = await broker.ack(task.id, again.lease_id, b"result: shipped")
    assert done.result == b"result: shipped"
    raw = await inner.get_task(task.id)
    assert raw.result is not None
    assert b"shipped" not in raw.result
    assert (await broker.get_task(task.id)).result == b"result: shipped"
    # What the queries need is clear.
    assert (raw.queue, raw.type, raw.state) == ("q", "t", TaskState.COMPLETED)


async def test_each_value_has_its_own_nonce(broker: EncryptedBroker, inner: MemoryBroker) -> None:
    results = await broker.enqueue_batch([NewTask("q", "t", payload=SECRET)] * 2)
    first, second = [await inner.get_task(r.task.id) for r in results]
    head = len(broker.keyring.binary_head())
    # Same key, same plaintext: a repeated nonce would repeat the ciphertext.
    assert first.payload[head : head + 12] != second.payload[head : head + 12]
    assert first.payload[head + 12 : -16] != second.payload[head + 12 : -16]


async def test_a_value_moved_to_another_task_does_not_open(
    broker: EncryptedBroker, inner: MemoryBroker, clock: FakeClock
) -> None:
    sealed = (
        await inner.get_task((await broker.enqueue(NewTask("q", "t", payload=SECRET))).task.id)
    ).payload
    other = (await inner.enqueue(NewTask("q2", "t", payload=sealed))).task
    with pytest.raises(
        DecryptionError, match=r"payload of task .* does not decrypt with key 'new'"
    ):
        await broker.get_task(other.id)
    # Nor in another field of its own task.
    with pytest.raises(DecryptionError):
        broker.keyring.open_bytes(other.id, RESULT, sealed)


async def test_plaintext_stored_before_encryption_reads_as_itself(
    broker: EncryptedBroker, inner: MemoryBroker
) -> None:
    before = (await inner.enqueue(NewTask("q", "t", payload=b"old plain", headers={"h": "v"}))).task
    assert await broker.get_task(before.id) == before
    leased = await broker.lease("q", 1, TTL)
    assert [t.payload for t in leased] == [b"old plain"]


async def test_broker_info_says_encrypted(broker: EncryptedBroker) -> None:
    assert (await broker.info()).driver == "memory+encrypted"


# ---------------------------------------------------------------- batches stay batched


async def test_batches_make_one_inner_call(
    broker: EncryptedBroker, inner: CountingMemoryBroker
) -> None:
    results = await broker.enqueue_batch(
        [NewTask(f"q{i % 3}", "t", payload=b"p%d" % i) for i in range(300)]
    )
    assert inner.calls == ["enqueue_batch"]
    leased = await broker.lease_many([("q0", 100), ("q1", 100), ("q2", 100)], TTL)
    assert inner.calls == ["enqueue_batch", "lease_many"]
    assert sorted(t.payload for batch in leased for t in batch) == sorted(
        r.task.payload for r in results
    )
    items = [AckItem(t.id, t.lease_id or "", b"r") for batch in leased for t in batch]
    assert all(await broker.ack_batch(items))
    assert inner.calls == ["enqueue_batch", "lease_many", "ack_batch"]


# ------------------------------------------------------------ keys that are missing


async def test_a_missing_key_fails_only_that_task_with_an_error_naming_the_key(
    inner: MemoryBroker, caplog: pytest.LogCaptureFixture
) -> None:
    k1, k2 = os.urandom(32), os.urandom(32)
    before = EncryptedBroker(inner, ring("k1", k1=k1))
    lost = (await before.enqueue(NewTask("q", "t", payload=b"under k1"))).task
    after = EncryptedBroker(inner, ring("k2", k2=k2))
    events: list[TaskEvent] = []
    after.set_event_sink(events.append)
    fine = (await after.enqueue(NewTask("q", "t", payload=b"under k2"))).task

    with caplog.at_level(logging.ERROR, logger="conveyor_broker.encrypted"):
        leased = await after.lease("q", 10, TTL)
    assert [t.id for t in leased] == [fine.id]
    assert leased[0].payload == b"under k2"
    assert "key_id=k1" in caplog.text

    # The unreadable task failed (it retries, like any failure) with a clear error...
    raw = await inner.get_task(lost.id)
    assert raw.state == TaskState.RETRY
    assert raw.retried == 1
    failed = next(e for e in events if e.task_id == lost.id and e.state == TaskState.RETRY)
    assert failed.error is not None
    assert "key 'k1', which is not configured" in failed.error
    assert "k2" in failed.error
    # ...that the operator can read with the key configured, and the payload is intact.
    both = EncryptedBroker(inner, ring("k2", k1=k1, k2=k2))
    readable = await both.get_task(lost.id)
    assert readable.payload == b"under k1"
    assert readable.last_error is not None
    assert "cannot decrypt the task: the payload of task" in readable.last_error

    # A read names the task, the field and the key.
    with pytest.raises(
        DecryptionError, match=r"payload of task \w+ is encrypted with key 'k1'"
    ) as info:
        await after.get_task(lost.id)
    assert (info.value.key_id, info.value.field, info.value.task_id) == ("k1", PAYLOAD, lost.id)
    with pytest.raises(DecryptionError, match="'k1'"):
        await after.list_tasks(TaskListParams(queue="q"))


async def test_a_wrong_key_under_the_same_id_is_refused(inner: MemoryBroker) -> None:
    before = EncryptedBroker(inner, ring("k1", k1=os.urandom(32)))
    task = (await before.enqueue(NewTask("q", "t", payload=SECRET))).task
    impostor = EncryptedBroker(inner, ring("k1", k1=os.urandom(32)))
    with pytest.raises(DecryptionError, match="does not decrypt with key 'k1'"):
        await impostor.get_task(task.id)


async def test_a_committed_change_is_never_turned_into_an_error(
    inner: MemoryBroker, caplog: pytest.LogCaptureFixture
) -> None:
    before = EncryptedBroker(inner, ring("k1", k1=os.urandom(32)))
    task = (await before.enqueue(NewTask("q", "t", payload=SECRET, headers={"h": "v"}))).task
    after = EncryptedBroker(inner, ring("k2", k2=os.urandom(32)))
    with caplog.at_level(logging.WARNING, logger="conveyor_broker.encrypted"):
        canceled = await after.cancel_task(task.id)
    assert canceled.state == TaskState.CANCELED
    assert canceled.payload == b""  # never garbage
    assert canceled.headers == {"h": ""}
    assert "broker.decrypt_failed" in caplog.text
    assert "key_id=k1" in caplog.text


# -------------------------------------------------------------------- list budgets


async def test_byte_budgets_count_plaintext_over_several_inner_pages(
    broker: EncryptedBroker, inner: CountingMemoryBroker, clock: FakeClock
) -> None:
    # Many small headers inflate the ciphertext far beyond the plaintext, so the inner
    # broker's pages (which count ciphertext) are short and several make one page.
    plain = MemoryBroker(clock)
    tasks = [
        NewTask(
            "q",
            "t",
            id=None,
            payload=b"x" * (i * 37 % 300),
            headers={f"h{j}": "v" for j in range(i % 9)},
        )
        for i in range(60)
    ]
    stored = await broker.enqueue_batch(tasks)
    await plain.enqueue_batch(
        [
            NewTask("q", "t", id=r.task.id, payload=t.payload, headers=t.headers)
            for t, r in zip(tasks, stored, strict=True)
        ]
    )
    pages = 0
    for budget in (1, 600, 2000, 5000, 20000):
        for omit in (False, True):
            cursor: str | None = None
            while True:
                params = TaskListParams(
                    limit=25, max_bytes=budget, cursor=cursor, omit_payloads=omit
                )
                got, want = await broker.list_tasks(params), await plain.list_tasks(params)
                assert [t.id for t in got.tasks] == [t.id for t in want.tasks]
                assert got.tasks == want.tasks
                assert got.next_cursor == want.next_cursor
                pages += 1
                if got.next_cursor is None:
                    break
                cursor = got.next_cursor
    # Some pages took more than one inner page (else this tested nothing).
    assert inner.calls.count("list_tasks") > pages


# ------------------------------------------------------------------------- keyring


KEY_A = base64.b64encode(b"a" * 32).decode()
KEY_B = base64.b64encode(b"b" * 32).decode()


def test_a_lone_key_is_the_primary() -> None:
    assert Keyring.parse(f"k1:{KEY_A}").primary == "k1"


def test_the_primary_is_the_marked_key() -> None:
    keyring = Keyring.parse(f"# keys, newest last\nk1:{KEY_A},\n *k2:{KEY_B}\n# a comment, too\n")
    assert keyring.primary == "k2"
    assert keyring.ids == ("k2", "k1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"k1:{KEY_A},k2:{KEY_B}", "none is marked primary"),
        (f"*k1:{KEY_A},*k2:{KEY_B}", "several keys are marked primary"),
        (f"k1:{KEY_A},*k1:{KEY_B}", "key id 'k1' is listed twice"),
        ("k1:" + base64.b64encode(b"short").decode(), "key 'k1' is not the base64 of 32 bytes"),
        (f"bad id:{KEY_A}", "entry #1 is not"),
        (f"{KEY_A}", "entry #1 is not"),
        ("", "lists no key"),
    ],
)
def test_malformed_keys_are_refused_without_quoting_them(text: str, message: str) -> None:
    with pytest.raises(KeyringError, match=message) as info:
        Keyring.parse(text)
    assert KEY_A not in str(info.value)
    assert KEY_B not in str(info.value)


def test_keys_load_from_a_file_or_the_setting(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# rotated 2025\n*k2:{KEY_B}\nk1:{KEY_A}\n")
    assert Keyring.load(None, str(path)) is not None
    assert Keyring.load(f"k1:{KEY_A}", None) is not None
    assert Keyring.load(None, None) is None
    with pytest.raises(KeyringError, match="not both"):
        Keyring.load(f"k1:{KEY_A}", str(path))
    with pytest.raises(KeyringError, match="cannot read CONVEYOR_ENCRYPTION_KEYS_FILE"):
        Keyring.load(None, str(tmp_path / "missing"))


def test_key_material_is_never_in_a_repr() -> None:
    keyring = Keyring.parse(f"*k2:{KEY_B},k1:{KEY_A}")
    assert repr(keyring) == "Keyring(primary='k2', ids=('k2', 'k1'))"
    broker = EncryptedBroker(MemoryBroker(), keyring)
    assert KEY_A not in repr(broker.keyring)
    assert b"a" * 32 not in repr(vars(broker)).encode()


def test_a_generated_key_parses() -> None:
    key = generate_key("k9")
    assert key.startswith("k9:")
    keyring = Keyring.parse(key)
    sealed = keyring.seal_text("01J0000000000000000000000A", LAST_ERROR, "text")
    assert keyring.open_text("01J0000000000000000000000A", LAST_ERROR, sealed) == "text"
    with pytest.raises(KeyringError):
        generate_key("bad id")


# ---------------------------------------------------------------- Postgres, raw rows


@pytest.mark.postgres
async def test_postgres_rows_hold_no_plaintext(pg_dsn: str, clock: FakeClock) -> None:
    marks = ["PAYLOAD-MARK", "HEADER-MARK", "PROGRESS-MARK", "ERROR-MARK", "RESULT-MARK"]
    async with scratch_schema(pg_dsn) as dsn:
        inner = await PostgresBroker.connect(dsn, clock, max_size=2)
        broker = EncryptedBroker(inner, ring())
        try:
            task = (
                await broker.enqueue(
                    NewTask("q", "t", payload=b"PAYLOAD-MARK", headers={"h": "HEADER-MARK"})
                )
            ).task
            leased = (await broker.lease("q", 1, TTL))[0]
            await broker.fail(task.id, leased.lease_id or "", "ERROR-MARK", timedelta(0))
            again = (await broker.lease("q", 1, TTL))[0]
            await broker.set_progress(task.id, again.lease_id or "", b"PROGRESS-MARK")
            await broker.ack(task.id, again.lease_id or "", b"RESULT-MARK")
            entry = await broker.upsert_cron_entry(
                cron_spec(task=template(payload=b"PAYLOAD-MARK", headers={"h": "HEADER-MARK"}))
            )
            assert entry.next_run_at is not None
            slot = clock.now().replace(microsecond=0) + timedelta(days=1)
            fired = await broker.fire_cron_entry(NAME, entry.next_run_at, None, slot)
            assert fired.task is not None
            assert fired.task.task.payload == b"PAYLOAD-MARK"
            stored = await broker.get_task(task.id)
            assert (stored.payload, stored.headers, stored.progress) == (
                b"PAYLOAD-MARK",
                {"h": "HEADER-MARK"},
                b"PROGRESS-MARK",
            )
            assert (stored.result, stored.last_error) == (b"RESULT-MARK", "ERROR-MARK")
        finally:
            await broker.close()
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch("SELECT * FROM conveyor_tasks WHERE id = $1", task.id)
            dump = await conn.fetchval("SELECT string_agg(t::text, ' ') FROM conveyor_tasks t")
            dump += await conn.fetchval(
                "SELECT string_agg(c::text, ' ') FROM conveyor_cron_entries c"
            )
        finally:
            await conn.close()
    assert len(rows) == 1
    envelopes = [value for value in rows[0].values() if isinstance(value, bytes)]
    assert len(envelopes) == 3  # payload, progress, result
    assert all(value.startswith(BINARY_PREFIX) for value in envelopes)
    texts = [value for value in rows[0].values() if isinstance(value, str)]
    for mark in marks:
        assert not any(mark.encode() in value for value in envelopes)
        assert not any(mark in value or mark.encode().hex() in value for value in texts)
    for mark in marks:
        assert mark not in dump
        assert mark.encode().hex() not in dump


async def test_the_fast_copies_equal_dataclasses_replace(broker: EncryptedBroker) -> None:
    from conveyor_broker.encrypted import _as_given, _opened, _sealed_new

    new = NewTask(
        "q", "t", payload=b"p", headers={"a": "b"}, unique_key="u", depends_on=(), max_retry=3
    )
    assert _sealed_new(new, "ID", b"x", {"a": "c"}) == replace(
        new, id="ID", payload=b"x", headers={"a": "c"}
    )
    task = (await broker.enqueue(new)).task
    assert _opened(task, b"1", {"h": "2"}, b"3", b"4", "5") == replace(
        task, payload=b"1", headers={"h": "2"}, progress=b"3", result=b"4", last_error="5"
    )
    assert _as_given(task, b"z", {}) == replace(task, payload=b"z", headers={})
    copy = _as_given(task, b"z", {})
    with pytest.raises(AttributeError):
        copy.payload = b"frozen"  # type: ignore[misc]


# --------------------------------------------------------------------- cron


def _slot(clock: FakeClock) -> datetime:
    return clock.now().replace(microsecond=0) + timedelta(days=1)


async def test_a_cron_template_is_sealed_to_its_entry_and_each_task_to_itself(
    broker: EncryptedBroker, inner: MemoryBroker, keyring: Keyring, clock: FakeClock
) -> None:
    spec = cron_spec(task=template(payload=SECRET, headers={"h": "HEADER-MARK"}))
    entry = await broker.upsert_cron_entry(spec)
    assert (entry.task.payload, entry.task.headers) == (SECRET, {"h": "HEADER-MARK"})
    stored = (await inner.get_cron_entry(spec.name)).task
    assert stored.payload.startswith(BINARY_PREFIX)
    assert SECRET not in stored.payload
    assert stored.headers["h"].startswith("enc:v1:")
    subject = template_subject(spec.name)
    assert keyring.open_bytes(subject, PAYLOAD, stored.payload) == SECRET
    for read in (await broker.get_cron_entry(spec.name), (await broker.list_cron_entries())[0]):
        assert (read.task.payload, read.task.headers) == (SECRET, {"h": "HEADER-MARK"})

    slot = _slot(clock)
    assert entry.next_run_at is not None
    fired = await broker.fire_cron_entry(spec.name, entry.next_run_at, None, slot)
    assert fired.task is not None
    assert fired.task.created
    assert fired.task.task.payload == SECRET
    triggered = (await broker.trigger_cron_entry(spec.name)).task
    for task in (fired.task.task, triggered):
        raw = await inner.get_task(task.id)
        assert SECRET not in raw.payload
        # Sealed to the task's own id, like any task: not to the entry.
        assert keyring.open_bytes(task.id, PAYLOAD, raw.payload) == SECRET
        with pytest.raises(DecryptionError):
            keyring.open_bytes(subject, PAYLOAD, raw.payload)
        assert all(value.startswith("enc:v1:") for value in raw.headers.values())
        assert (await broker.get_task(task.id)).headers["h"] == "HEADER-MARK"
    leased = await broker.lease("reports", 10, TTL)
    assert sorted(t.payload for t in leased) == [SECRET, SECRET]


async def test_a_template_moved_to_another_entry_does_not_open(
    broker: EncryptedBroker, inner: MemoryBroker
) -> None:
    await broker.upsert_cron_entry(cron_spec("a", task=template(payload=SECRET)))
    await broker.upsert_cron_entry(cron_spec("b", task=template(payload=b"other")))
    moved = (await inner.get_cron_entry("a")).task
    inner._cron_entries["b"] = replace(inner._cron_entries["b"], task=moved)
    with pytest.raises(DecryptionError, match="does not decrypt"):
        await broker.get_cron_entry("b")
    assert (await broker.get_cron_entry("a")).task.payload == SECRET


async def test_a_template_under_a_missing_key_fails_its_tasks_not_the_schedule(
    inner: MemoryBroker, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    k1, k2 = os.urandom(32), os.urandom(32)
    before = EncryptedBroker(inner, ring("k1", k1=k1))
    await before.upsert_cron_entry(cron_spec(task=template(payload=SECRET)))
    after = EncryptedBroker(inner, ring("k2", k2=k2))
    with pytest.raises(DecryptionError, match="'k1'"):
        await after.get_cron_entry(NAME)
    with caplog.at_level(logging.WARNING, logger="conveyor_broker.encrypted"):
        (listed,) = await after.list_cron_entries()
    assert listed.task.payload == b""
    assert "key_id=k1" in caplog.text
    # The schedule goes on: the slot fires, and its task fails at its lease naming the key.
    assert listed.next_run_at is not None
    slot = _slot(clock)
    fired = await after.fire_cron_entry(NAME, listed.next_run_at, slot + timedelta(days=1), slot)
    assert fired.applied
    assert fired.task is not None
    assert await after.lease("reports", 10, TTL) == []
    failed = await inner.get_task(fired.task.task.id)
    assert failed.state == TaskState.RETRY
    assert failed.last_error is not None
    error = after.keyring.open_text(failed.id, LAST_ERROR, failed.last_error)
    assert "cannot decrypt the task" in error
    assert "'k1'" in error
