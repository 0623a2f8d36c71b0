"""Throwaway Postgres schemas for tests of code that runs on the Postgres broker."""

from __future__ import annotations

import asyncpg

from conveyor_broker.postgres import migrate

#: Every table that holds broker data (not the migration log): ``TRUNCATE`` empties a store.
DATA_TABLES = (
    "conveyor_tasks, conveyor_queues, conveyor_task_dependencies, conveyor_webhook_workers"
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
