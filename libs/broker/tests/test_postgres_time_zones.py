"""The Postgres broker whatever the session's time zone: durations are exact and times
read back in UTC.

Each test works in a schema of its own, so none depends on another's rows.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from conveyor_broker import FakeClock, NewTask, TerminalPurgeParams, WebhookWorkerSpec
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.testing.schemas import scratch_schema

pytestmark = pytest.mark.postgres

TTL = timedelta(seconds=30)


async def test_purge_adds_retention_as_exact_time_across_a_dst_change(pg_dsn: str) -> None:
    """A one-day retention is 24 hours even when the session's time zone skips an hour."""
    # 2030-03-10 is the day US clocks spring forward.
    clock = FakeClock(datetime(2030, 3, 9, 12, 0, tzinfo=UTC))
    async with scratch_schema(pg_dsn) as dsn:
        broker = await PostgresBroker.connect(f"{dsn}&timezone=America/New_York", clock)
        try:
            await broker.enqueue(NewTask("q", "t", retention=timedelta(days=1)))
            [leased] = await broker.lease("q", 1, TTL)
            await broker.ack(leased.id, leased.lease_id or "")
            clock.advance(timedelta(hours=23, minutes=30))
            month = timedelta(days=30)
            assert await broker.purge_terminal(TerminalPurgeParams(archive_retention=month)) == 0
            clock.advance(timedelta(minutes=30))
            assert await broker.purge_terminal(TerminalPurgeParams(archive_retention=month)) == 1
        finally:
            await broker.close()


async def test_webhook_worker_times_read_back_in_utc_whatever_the_session_zone(
    pg_dsn: str,
) -> None:
    clock = FakeClock(datetime(2030, 3, 10, 6, 59, 59, 999999, tzinfo=UTC))
    timeout = timedelta(minutes=59, seconds=59, microseconds=999999)
    async with scratch_schema(pg_dsn) as dsn:
        writer = await PostgresBroker.connect(f"{dsn}&timezone=Asia/Kolkata", clock)
        reader = await PostgresBroker.connect(f"{dsn}&timezone=America/New_York", clock)
        try:
            written = await writer.upsert_webhook_worker(
                WebhookWorkerSpec("tz", "https://hooks.example.com/", {"q": 1}, timeout=timeout)
            )
            read = await reader.get_webhook_worker("tz")
            assert read == written
            assert read.timeout == timeout
            assert read.created_at == clock.now()
            assert read.created_at.utcoffset() == timedelta(0)
        finally:
            await writer.close()
            await reader.close()
