"""Versioned SQL migrations for the Postgres broker, and what applies them.

Migrations are the numbered files ``NNN_name.sql`` of this package.
:func:`migrate` applies the pending ones in order, each in its own transaction, while
holding a session advisory lock so that concurrent migrators (several replicas starting at
once) apply each migration exactly once. Applied versions are recorded in
``conveyor_migrations``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import TYPE_CHECKING, TypeAlias

import asyncpg

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    Connection: TypeAlias = asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]

logger = logging.getLogger(__name__)

#: Key of the session advisory lock held while migrating ("conveyor" in ASCII).
MIGRATION_LOCK_KEY = 0x636F6E7665796F72

_FILE_RE = re.compile(r"([0-9]{3})_([a-z0-9_]+)\.sql")

CREATE_MIGRATIONS_TABLE = """
CREATE TABLE IF NOT EXISTS conveyor_migrations (
    version    integer NOT NULL,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL,
    CONSTRAINT conveyor_migrations_pkey PRIMARY KEY (version)
)
"""
_MIGRATIONS_TABLE_EXISTS = "SELECT to_regclass('conveyor_migrations') IS NOT NULL"
_APPLIED = "SELECT version, applied_at FROM conveyor_migrations ORDER BY version"
_RECORD = "INSERT INTO conveyor_migrations (version, name, applied_at) VALUES ($1, $2, $3)"


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered migration file."""

    version: int
    name: str
    sql: str


@dataclass(frozen=True, slots=True)
class MigrationStatus:
    """Whether one known migration is applied to a database, and when."""

    version: int
    name: str
    applied_at: datetime | None

    @property
    def applied(self) -> bool:
        """True when the migration has been applied."""
        return self.applied_at is not None


def load_migrations() -> list[Migration]:
    """Every migration shipped with this package, in version order."""
    found: list[Migration] = []
    for entry in resources.files(__name__).iterdir():
        match = _FILE_RE.fullmatch(entry.name)
        if match is None:
            continue
        found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration versions in {versions}")
    return found


def latest_version() -> int:
    """The version the shipped migrations lead to."""
    return load_migrations()[-1].version


def declared_schema() -> str:
    """The text of ``schema.sql``: the schema that applying every migration produces."""
    path = resources.files("conveyor_broker.postgres").joinpath("schema.sql")
    return path.read_text(encoding="utf-8")


async def migrate(dsn_or_connection: str | Connection, *, target: int | None = None) -> list[int]:
    """Apply pending migrations up to ``target`` (default: all) and return their versions.

    Each migration runs in its own transaction and is recorded in ``conveyor_migrations``
    in that same transaction, so a failure leaves the database at the last good version.
    Safe to run concurrently from several processes, and a no-op when up to date.
    Migrations never run backwards: a ``target`` below the current version applies nothing.
    """
    migrations = load_migrations()
    if target is not None and target not in {m.version for m in migrations}:
        raise ValueError(f"unknown migration version {target}")
    async with _connection(dsn_or_connection) as conn:
        await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_KEY)
        try:
            await conn.execute(CREATE_MIGRATIONS_TABLE)
            done = {row["version"] for row in await conn.fetch(_APPLIED)}
            applied: list[int] = []
            for migration in migrations:
                if target is not None and migration.version > target:
                    break
                if migration.version in done:
                    continue
                async with conn.transaction():
                    await conn.execute(migration.sql)
                    await conn.execute(
                        _RECORD, migration.version, migration.name, datetime.now(UTC)
                    )
                logger.info(
                    "broker.migration.applied version=%d name=%s",
                    migration.version,
                    migration.name,
                    extra={"version": migration.version, "migration": migration.name},
                )
                applied.append(migration.version)
            return applied
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_KEY)


async def migration_status(dsn_or_connection: str | Connection) -> list[MigrationStatus]:
    """Every shipped migration and whether (and when) it was applied, in version order."""
    async with _connection(dsn_or_connection) as conn:
        applied: dict[int, datetime] = {}
        if await conn.fetchval(_MIGRATIONS_TABLE_EXISTS):
            applied = {row["version"]: row["applied_at"] for row in await conn.fetch(_APPLIED)}
    return [MigrationStatus(m.version, m.name, applied.get(m.version)) for m in load_migrations()]


async def schema_version(conn: Connection) -> int | None:
    """The highest applied migration version, or None for an unmigrated database."""
    if not await conn.fetchval(_MIGRATIONS_TABLE_EXISTS):
        return None
    version = await conn.fetchval("SELECT max(version) FROM conveyor_migrations")
    return int(version) if version is not None else None


@asynccontextmanager
async def _connection(dsn_or_connection: str | Connection) -> AsyncIterator[Connection]:
    """The caller's connection as is, or one opened from a DSN (and closed afterwards)."""
    if not isinstance(dsn_or_connection, str):
        yield dsn_or_connection
        return
    conn = await asyncpg.connect(dsn_or_connection)
    try:
        yield conn
    finally:
        await conn.close()
