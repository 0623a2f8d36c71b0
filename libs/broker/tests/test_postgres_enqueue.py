"""The Postgres enqueue statement's shapes: a column the batch's tasks agree on goes as one
value, a batch of new ids is a plain INSERT, and what either stores reads back as the
enqueue returned it."""

from __future__ import annotations

from datetime import timedelta

import pytest
from conveyor_broker import FakeClock, NewTask
from conveyor_broker.postgres import enqueue as postgres_enqueue
from conveyor_broker.postgres.queries.enqueue import ENQUEUE, enqueue_statement
from conveyor_broker.postgres.rows import enqueue_statement as statement_for
from conveyor_broker.postgres.rows import new_task
from conveyor_broker.testing.schemas import brokers, scratch_schema
from conveyor_broker.types import TaskState


def test_shared_columns_go_as_one_value_and_ids_always_as_an_array() -> None:
    clock = FakeClock()
    now = clock.now()
    tasks = [
        new_task(
            NewTask("q", "t", payload=bytes([i % 2]), max_retry=3),
            task_id=f"01HZY{i:021d}",
            state=TaskState.PENDING,
            now=now,
            max_retry=3,
        )
        for i in range(4)
    ]
    sql, params = statement_for(tasks, now, skip_existing=False)
    assert "unnest($1::text[], $4::bytea[]) AS u(id, payload)" in sql
    assert "$2::text" in sql
    assert "$3::text" in sql
    assert "ON CONFLICT" not in sql
    assert "RETURNING" not in sql
    assert params[0] == [t.id for t in tasks]
    assert params[1:3] == ["q", "t"]
    assert params[3] == [t.payload for t in tasks]
    assert params[-1] == now
    # One task: every column but its id is one value.
    sql, _ = statement_for(tasks[:1], now)
    assert "unnest($1::text[]) AS u(id)" in sql
    assert "ON CONFLICT DO NOTHING" in sql
    assert "RETURNING t.id" in sql
    # The full statement every schema version takes is unchanged: all arrays.
    selected = ENQUEUE.split("SELECT", 1)[1].split("FROM", 1)[0]
    assert selected.count("$") == 2  # now, for created_at and updated_at
    with pytest.raises(ValueError, match="id"):
        enqueue_statement(("id", "queue"), frozenset({"id"}))


@pytest.mark.postgres
async def test_what_each_statement_shape_stores_reads_back_as_returned(pg_dsn: str) -> None:
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 1) as (broker,):
        shared = [NewTask("q", "t", payload=b"{}") for _ in range(3)]
        mixed = [
            NewTask("q", "t", payload=b"a", headers={"h": "1"}, timeout=timedelta(seconds=5)),
            NewTask("r", "u", payload=b"b", max_retry=0, retention=timedelta(minutes=1)),
            NewTask("q", "t", process_at=clock.now() + timedelta(minutes=1), group="g"),
        ]
        given = [NewTask("q", "t", id="01HZY0000000000000000000AA", payload=b"x")]
        for batch in (shared, mixed, given, shared[:1]):
            results = await broker.enqueue_batch(batch)
            assert all(r.created for r in results)
            for result in results:
                assert await broker.get_task(result.task.id) == result.task
        again = await broker.enqueue_batch(given)
        assert not again[0].created


@pytest.mark.postgres
async def test_a_clash_of_new_ids_falls_back_to_the_idempotent_insert(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plain INSERT of new ids refuses a stored id: the batch then goes through the
    statement that skips it (so the answer is the stored task, as for a given id)."""
    clock = FakeClock()
    async with scratch_schema(pg_dsn) as dsn, brokers(dsn, clock, 1) as (broker,):
        (first,) = await broker.enqueue_batch([NewTask("q", "t", payload=b"first")])
        stored = first.task.id
        fresh = "01HZY0000000000000000000ZZ"
        monkeypatch.setattr(postgres_enqueue, "new_ids", lambda now, n: [stored, fresh][:n])
        clash, new = await broker.enqueue_batch(
            [NewTask("q", "t", payload=b"second"), NewTask("q", "t", payload=b"third")]
        )
        assert (clash.created, clash.task) == (False, first.task)
        assert new.created
        assert new.task.id == fresh
        assert await broker.get_task(fresh) == new.task
