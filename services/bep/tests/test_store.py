"""The ingest's schema and upkeep: migrations equal schema.sql, segment partitions are
made ahead and dropped after their retention, old builds are deleted in batches and the
tag facets rebuilt."""

from __future__ import annotations

from datetime import date, timedelta

import asyncpg
import pytest
from conveyor_bep.keys import create_project
from conveyor_bep.store import BEP_MIGRATIONS, delete_old_builds, drop_old_partitions
from conveyor_bep.writer import ensure_partitions
from conveyor_broker.testing.schemas import CATALOG_PARTS, catalog, scratch_database

pytestmark = pytest.mark.postgres


async def test_migrations_produce_the_declared_schema(pg_dsn: str) -> None:
    async with scratch_database(pg_dsn) as migrated, scratch_database(pg_dsn) as declared:
        assert await BEP_MIGRATIONS.migrate(migrated) == [m.version for m in BEP_MIGRATIONS.load()]
        assert await BEP_MIGRATIONS.migrate(migrated) == []  # idempotent
        conn = await asyncpg.connect(declared)
        try:
            await conn.execute(BEP_MIGRATIONS.declared_schema())
        finally:
            await conn.close()
        a, b = await catalog(migrated, "bep"), await catalog(declared, "bep")
    assert a["tables"]
    for part in CATALOG_PARTS:
        assert a[part] == b[part], part


async def test_partitions_are_made_ahead_and_dropped_after_retention(fresh_pg_dsn: str) -> None:
    await BEP_MIGRATIONS.migrate(fresh_pg_dsn)
    conn = await asyncpg.connect(fresh_pg_dsn)
    try:
        today = date(2026, 3, 10)
        await ensure_partitions(conn, today - timedelta(days=40), ahead=0)
        await ensure_partitions(conn, today)
        names = {
            r[0]
            for r in await conn.fetch(
                "SELECT relname FROM pg_class WHERE relname LIKE 'event_segments_%' AND relkind = 'r'"
            )
        }
        assert names == {
            "event_segments_20260129",
            "event_segments_20260310",
            "event_segments_20260311",
            "event_segments_20260312",
        }
        dropped = await drop_old_partitions(conn, today, 30)
        assert sorted(dropped) == ["event_segments_20260129", "log_segments_20260129"]
        assert await drop_old_partitions(conn, today, 30) == []
    finally:
        await conn.close()


async def test_old_builds_are_deleted_in_batches_and_facets_rebuilt(fresh_pg_dsn: str) -> None:
    await BEP_MIGRATIONS.migrate(fresh_pg_dsn)
    conn = await asyncpg.connect(fresh_pg_dsn)
    try:
        project = await create_project(conn, "p")
        today = date.today()
        for i in range(7):
            age = 100 if i < 5 else 1
            await conn.execute(
                "INSERT INTO bep.invocations (invocation_id, project_id, tags, created_at)"
                " VALUES ($1, $2, $3, now() - make_interval(days => $4))",
                f"inv-{i}",
                project,
                '{"ROLE": "CI"}',
                age,
            )
            await conn.execute(
                "INSERT INTO bep.targets (invocation_id, label) VALUES ($1, '//a')", f"inv-{i}"
            )
        await conn.execute("INSERT INTO bep.tag_keys VALUES ($1, 'ROLE', 'CI', 7)", project)
        assert await delete_old_builds(conn, today, 90, batch=2) == 5
        left = [r[0] for r in await conn.fetch("SELECT invocation_id FROM bep.invocations")]
        assert sorted(left) == ["inv-5", "inv-6"]
        assert await conn.fetchval("SELECT count(*) FROM bep.targets") == 2
        assert await conn.fetchval("SELECT builds FROM bep.tag_keys") == 2
    finally:
        await conn.close()
