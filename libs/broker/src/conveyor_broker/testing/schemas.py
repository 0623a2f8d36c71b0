"""Throwaway Postgres schemas and databases for tests of code that runs on the Postgres
broker, and brokers on them."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg

from conveyor_broker.clock import FakeClock
from conveyor_broker.postgres import PostgresBroker, migrate

#: Every table that holds broker data (not the migration log): ``TRUNCATE`` empties a store.
DATA_TABLES = (
    "conveyor_tasks, conveyor_queues, conveyor_task_dependencies, conveyor_webhook_workers, "
    "conveyor_cron_entries, conveyor_group_configs, conveyor_rate_limits, "
    "conveyor_concurrency_limits, conveyor_concurrency_freed, conveyor_breaker_configs, "
    "conveyor_breakers"
)


async def migrated_schema(dsn: str, schema: str) -> str:
    """(Re)create ``schema`` in the database of ``dsn``, migrate it, and return a DSN whose
    ``search_path`` is that schema."""
    admin = await asyncpg.connect(dsn)
    try:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE; CREATE SCHEMA "{schema}"')
    finally:
        await admin.close()
    scoped = f"{dsn}?search_path={schema}"
    await migrate(scoped)
    return scoped


@asynccontextmanager
async def scratch_database(pg_dsn: str) -> AsyncIterator[str]:
    """A fresh, empty database on the server of ``pg_dsn``, dropped afterwards; yields its
    DSN."""
    name = f"conveyor_s_{uuid.uuid4().hex[:12]}"
    # Any database of the server can create and drop others: use the given one.
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            base, _, _ = pg_dsn.rpartition("/")
            yield f"{base}/{name}"
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@asynccontextmanager
async def scratch_schema(pg_dsn: str) -> AsyncIterator[str]:
    """A fresh, migrated schema in the database of ``pg_dsn``, dropped afterwards; yields a
    DSN whose search_path points at it."""
    name = f"conveyor_s_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute(f"CREATE SCHEMA {name}")
        dsn = f"{pg_dsn}?search_path={name}"
        await migrate(dsn)
        try:
            yield dsn
        finally:
            await admin.execute(f"DROP SCHEMA {name} CASCADE")
    finally:
        await admin.close()


@asynccontextmanager
async def brokers(dsn: str, clock: FakeClock, count: int) -> AsyncIterator[list[PostgresBroker]]:
    """``count`` brokers on ``dsn``, each with its own pool (so its own connections)."""
    opened = [
        await PostgresBroker.connect(dsn, clock, min_size=1, max_size=2) for _ in range(count)
    ]
    try:
        yield opened
    finally:
        for broker in opened:
            await broker.close()


#: The catalog of one schema, every part as sorted rows, so that two databases can be
#: compared with == (``$1`` is the schema's name).
_CATALOG_QUERIES = {
    "tables": """
        SELECT c.relname, c.relkind::text FROM pg_class c
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = $1 AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
        ORDER BY 1""",
    "columns": """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), co.collname, a.attnum
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation
        WHERE n.nspname = $1 AND c.relkind = 'r' AND a.attnum > 0
          AND NOT a.attisdropped
        ORDER BY 1, 7""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = $1 ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid)
        FROM pg_constraint k
        JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = $1 ORDER BY 1, 2""",
    "types": """
        SELECT t.typname, t.typtype::text FROM pg_type t
        JOIN pg_namespace n ON n.oid = t.typnamespace
        WHERE n.nspname = $1 AND t.typtype IN ('e', 'd', 'c')
          AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.reltype = t.oid)
        ORDER BY 1""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid) FROM pg_proc p
        JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = $1 ORDER BY 1, 2""",
}


#: The parts :func:`catalog` returns.
CATALOG_PARTS = tuple(_CATALOG_QUERIES)


async def catalog(dsn: str, schema: str = "public") -> dict[str, list[tuple[Any, ...]]]:
    """Tables, columns, indexes, constraints, types and functions of ``schema``."""
    conn = await asyncpg.connect(dsn)
    try:
        return {
            part: [tuple(row) for row in await conn.fetch(query, schema)]
            for part, query in _CATALOG_QUERIES.items()
        }
    finally:
        await conn.close()
