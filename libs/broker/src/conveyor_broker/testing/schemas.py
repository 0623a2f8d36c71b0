"""Throwaway Postgres schemas and databases for tests of code that runs on the Postgres
broker, and brokers on them."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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
