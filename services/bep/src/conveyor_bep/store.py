"""The ingest's schema (numbered migrations in ``conveyor_bep/migrations``) and its upkeep:
segment partitions created ahead, dropped after their retention, build rows deleted in
batches after theirs, and the tag facets rebuilt after deletes."""

from __future__ import annotations

import logging
import re
from datetime import date, timedelta
from typing import Any

from conveyor_broker.postgres.migrations import MigrationSet

from conveyor_bep.writer import ensure_partitions

logger = logging.getLogger(__name__)

#: The ingest's migrations, recorded in ``bep.migrations`` ("bep-migr" in ASCII as lock).
BEP_MIGRATIONS = MigrationSet(
    package="conveyor_bep.migrations",
    schema_package="conveyor_bep",
    table="bep_migrations",
    lock_key=0x6265702D6D696772,
    log_event="bep.migration.applied",
)

_PARTITION_RE = re.compile(r"(event_segments|log_segments)_(\d{8})")
_NORMALIZED_TABLES = (
    "targets",
    "test_results",
    "actions",
    "named_sets",
    "invocation_metrics",
    "artifacts",  # unpins the build's blobs: the next blobs.prune deletes them
)


async def drop_old_partitions(conn: Any, today: date, retention_days: int) -> list[str]:
    """Drop segment partitions whose whole day is older than ``retention_days``."""
    cutoff = today - timedelta(days=retention_days)
    rows = await conn.fetch(
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace n ON n.oid = p.relnamespace"
        " WHERE n.nspname = 'bep' AND p.relname IN ('event_segments', 'log_segments')"
    )
    dropped = []
    for row in rows:
        match = _PARTITION_RE.fullmatch(row["relname"])
        if match is None:
            continue
        day = date(int(match[2][:4]), int(match[2][4:6]), int(match[2][6:]))
        if day < cutoff:
            await conn.execute(f"DROP TABLE IF EXISTS bep.{row['relname']}")
            dropped.append(row["relname"])
    return dropped


async def delete_old_builds(
    conn: Any, today: date, retention_days: int, *, batch: int = 500
) -> int:
    """Delete invocations created before the retention cutoff, ``batch`` at a time, with
    their normalized rows and segments; then rebuild the tag facets. The count deleted."""
    cutoff = today - timedelta(days=retention_days)
    total = 0
    while True:
        async with conn.transaction():
            ids = await conn.fetch(
                "SELECT invocation_id FROM bep.invocations WHERE created_at < $1::date"
                " ORDER BY created_at LIMIT $2 FOR UPDATE SKIP LOCKED",
                cutoff,
                batch,
            )
            if not ids:
                break
            keys = [r["invocation_id"] for r in ids]
            for table in (*_NORMALIZED_TABLES, "event_segments", "log_segments"):
                await conn.execute(
                    f"DELETE FROM bep.{table} WHERE invocation_id = ANY($1::text[])", keys
                )
            await conn.execute(
                "DELETE FROM bep.invocations WHERE invocation_id = ANY($1::text[])", keys
            )
            total += len(keys)
    if total:
        await rebuild_tag_facets(conn)
    return total


async def rebuild_tag_facets(conn: Any) -> None:
    """Recount the tag facets from the invocations that remain."""
    async with conn.transaction():
        await conn.execute("DELETE FROM bep.tag_keys")
        await conn.execute(
            "INSERT INTO bep.tag_keys (project_id, key, value, builds)"
            " SELECT project_id, t.key, t.value, count(*) FROM bep.invocations,"
            " jsonb_each_text(tags) AS t(key, value) GROUP BY 1, 2, 3"
        )


async def upkeep(conn: Any, today: date, *, segment_days: int, build_days: int) -> None:
    """One upkeep pass: partitions ahead, old partitions dropped, old builds deleted."""
    await ensure_partitions(conn, today)
    dropped = await drop_old_partitions(conn, today, segment_days)
    deleted = await delete_old_builds(conn, today, build_days)
    if dropped or deleted:
        logger.info("bep.upkeep dropped=%s deleted_builds=%d", dropped, deleted)
