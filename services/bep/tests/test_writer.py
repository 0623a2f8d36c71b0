"""The group commit's fence, as one statement for many invocations: runs of consecutive
batches merge (last value set wins, counters add up), a batch whose fence does not hold
loses itself and every later batch of its stream, and a second stream of an invocation
in the same group is fenced one batch at a time after the first stream's run."""

from __future__ import annotations

import json
from datetime import UTC, date, datetime
from typing import Any

import asyncpg
import pytest
from conveyor_bep.keys import create_project
from conveyor_bep.store import BEP_MIGRATIONS
from conveyor_bep.writer import Batch, apply_batches, ensure_partitions

pytestmark = pytest.mark.postgres

TODAY = date(2026, 3, 10)


def batch(
    invocation_id: str,
    project_id: int,
    first: int,
    last: int,
    *,
    stream: int = 1,
    final: bool = False,
    status: str | None = None,
    command: str | None = None,
    tests_total: int = 0,
    tags: dict[str, str] | None = None,
    log: str = "",
) -> Batch:
    b = Batch(invocation_id, project_id=project_id, build_id="b", first_seq=first, stream=stream)
    b.last_seq = last
    b.events = [f"{invocation_id}:{seq}".encode() for seq in range(first, last + 1)]
    b.size = sum(len(e) for e in b.events)
    b.final = final
    inv = b.changes.invocation
    inv.put("status", status)
    inv.put("command", command)
    if tests_total:
        inv.incr("tests_total", tests_total)
    inv.tags.update(tags or {})
    if log:
        b.changes.log.append(log)
    return b


@pytest.fixture
async def conn(fresh_pg_dsn: str) -> Any:
    await BEP_MIGRATIONS.migrate(fresh_pg_dsn)
    connection = await asyncpg.connect(fresh_pg_dsn)
    await ensure_partitions(connection, TODAY)
    try:
        yield connection
    finally:
        await connection.close()


async def _row(conn: Any, invocation_id: str) -> Any:
    row = await conn.fetchrow(
        "SELECT * FROM bep.invocations WHERE invocation_id = $1", invocation_id
    )
    assert row is not None
    return row


async def test_runs_merge_and_fences_hold_per_invocation(conn: Any) -> None:
    project = await create_project(conn, "writer")
    async with conn.transaction():
        lost = await apply_batches(
            conn,
            [
                batch("a", project, 1, 3, command="build", tests_total=2, log="x\n"),
                batch("b", project, 1, 2, command="test"),
                batch("a", project, 4, 5, command="test", tests_total=3, tags={"k": "v"}),
                batch("a", project, 6, 6, final=True, status="passed", log="y\nz\n"),
            ],
            TODAY,
        )
    assert lost == set()
    a = await _row(conn, "a")
    assert (a["last_event_seq"], a["events"], a["finished"], a["status"]) == (6, 6, True, "passed")
    assert a["command"] == "test"  # the last value set wins
    assert a["tests_total"] == 5  # counters add up
    assert json.loads(a["tags"]) == {"k": "v"}
    assert (a["log_bytes"], a["log_lines"]) == (6, 3)
    segments = await conn.fetch(
        "SELECT first_seq, last_seq FROM bep.event_segments WHERE invocation_id = 'a' "
        "ORDER BY first_seq"
    )
    assert [(s[0], s[1]) for s in segments] == [(1, 3), (4, 5), (6, 6)]
    b = await _row(conn, "b")
    assert (b["last_event_seq"], b["command"]) == (2, "test")

    # A stale stream (a restarted client resending 3..4 as new) loses its fence and every
    # later batch of that stream; another invocation of the same group is unaffected.
    async with conn.transaction():
        lost = await apply_batches(
            conn,
            [
                batch("b", project, 3, 4, stream=2, status="failed"),
                batch("a", project, 3, 4, stream=2, status="failed"),
                batch("a", project, 5, 7, stream=2, status="failed"),
            ],
            TODAY,
        )
    assert lost == {1, 2}
    assert (await _row(conn, "a"))["last_event_seq"] == 6
    assert (await _row(conn, "a"))["status"] == "passed"
    assert (await _row(conn, "b"))["last_event_seq"] == 4
    assert (await _row(conn, "b"))["status"] == "failed"
    count = await conn.fetchval("SELECT count(*) FROM bep.event_segments WHERE invocation_id = 'a'")
    assert count == 3  # nothing of the fenced-out batches was written


async def test_two_streams_of_one_invocation_in_one_group(conn: Any) -> None:
    project = await create_project(conn, "racing")
    # Both streams start the invocation; the first stream's run wins, the second
    # stream's batches are fenced one by one after it and lose.
    async with conn.transaction():
        lost = await apply_batches(
            conn,
            [
                batch("r", project, 1, 2, stream=1, command="first"),
                batch("r", project, 1, 2, stream=2, command="second"),
                batch("r", project, 3, 3, stream=1, command="first-again"),
                batch("r", project, 3, 4, stream=2, command="second-again"),
            ],
            TODAY,
        )
    # Batch 2 (stream 1, 3..3) comes after a deferred batch of the invocation, so it is
    # fenced one by one too, in order: it continues stream 1 and wins.
    assert lost == {1, 3}
    row = await _row(conn, "r")
    assert (row["last_event_seq"], row["events"], row["command"]) == (3, 3, "first-again")
    assert row["updated_at"] <= datetime.now(UTC)
