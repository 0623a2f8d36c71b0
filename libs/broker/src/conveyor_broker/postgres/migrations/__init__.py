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


@dataclass(frozen=True, slots=True)
class MigrationSet:
    """One product's numbered migrations: the package holding its ``NNN_name.sql`` files,
    the ``schema.sql`` they must equal, the table recording what is applied and the
    advisory lock concurrent migrators serialize on.

    The task queue's set is :data:`BROKER_MIGRATIONS`; another product in this repository
    (the build-event ingest) declares its own and shares the runner."""

    package: str
    schema_package: str
    table: str
    lock_key: int
    log_event: str

    def load(self) -> list[Migration]:
        """Every migration shipped in :attr:`package`, in version order."""
        found: list[Migration] = []
        for entry in resources.files(self.package).iterdir():
            match = _FILE_RE.fullmatch(entry.name)
            if match is None:
                continue
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
        found.sort(key=lambda m: m.version)
        versions = [m.version for m in found]
        if len(set(versions)) != len(versions):
            raise RuntimeError(f"duplicate migration versions in {versions}")
        return found

    def declared_schema(self) -> str:
        """The text of ``schema.sql``: the schema that applying every migration produces."""
        path = resources.files(self.schema_package).joinpath("schema.sql")
        return path.read_text(encoding="utf-8")

    async def migrate(
        self, dsn_or_connection: str | Connection, *, target: int | None = None
    ) -> list[int]:
        """Apply pending migrations up to ``target`` (default: all) and return their versions.

        Each migration runs in its own transaction and is recorded in :attr:`table` in that
        same transaction, so a failure leaves the database at the last good version. Safe
        to run concurrently from several processes, and a no-op when up to date.
        Migrations never run backwards: a ``target`` below the current version applies
        nothing.
        """
        migrations = self.load()
        if target is not None and target not in {m.version for m in migrations}:
            raise ValueError(f"unknown migration version {target}")
        async with _connection(dsn_or_connection) as conn:
            await conn.execute("SELECT pg_advisory_lock($1)", self.lock_key)
            try:
                await conn.execute(_CREATE_TABLE.format(table=self.table))
                done = {
                    row["version"]
                    for row in await conn.fetch(_APPLIED_SQL.format(table=self.table))
                }
                applied: list[int] = []
                for migration in migrations:
                    if target is not None and migration.version > target:
                        break
                    if migration.version in done:
                        continue
                    async with conn.transaction():
                        await conn.execute(migration.sql)
                        await conn.execute(
                            _RECORD_SQL.format(table=self.table),
                            migration.version,
                            migration.name,
                            datetime.now(UTC),
                        )
                    logger.info(
                        "%s version=%d name=%s",
                        self.log_event,
                        migration.version,
                        migration.name,
                        extra={"version": migration.version, "migration": migration.name},
                    )
                    applied.append(migration.version)
                return applied
            finally:
                await conn.execute("SELECT pg_advisory_unlock($1)", self.lock_key)

    async def status(self, dsn_or_connection: str | Connection) -> list[MigrationStatus]:
        """Every shipped migration and whether (and when) it was applied, in version order."""
        async with _connection(dsn_or_connection) as conn:
            applied: dict[int, datetime] = {}
            if await conn.fetchval(_EXISTS_SQL, self.table):
                rows = await conn.fetch(_APPLIED_SQL.format(table=self.table))
                applied = {row["version"]: row["applied_at"] for row in rows}
        return [MigrationStatus(m.version, m.name, applied.get(m.version)) for m in self.load()]

    async def schema_version(self, conn: Connection) -> int | None:
        """The highest applied migration version, or None for an unmigrated database."""
        if not await conn.fetchval(_EXISTS_SQL, self.table):
            return None
        version = await conn.fetchval(f"SELECT max(version) FROM {self.table}")
        return int(version) if version is not None else None


_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS {table} (
    version    integer NOT NULL,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL,
    PRIMARY KEY (version)
)
"""
_EXISTS_SQL = "SELECT to_regclass($1) IS NOT NULL"
_APPLIED_SQL = "SELECT version, applied_at FROM {table} ORDER BY version"
_RECORD_SQL = "INSERT INTO {table} (version, name, applied_at) VALUES ($1, $2, $3)"

#: The task queue's migrations (this package) and its ``conveyor_migrations`` table.
BROKER_MIGRATIONS = MigrationSet(
    package=__name__,
    schema_package="conveyor_broker.postgres",
    table="conveyor_migrations",
    lock_key=MIGRATION_LOCK_KEY,
    log_event="broker.migration.applied",
)


def load_migrations() -> list[Migration]:
    """Every migration shipped with this package, in version order."""
    return BROKER_MIGRATIONS.load()


def latest_version() -> int:
    """The version the shipped migrations lead to."""
    return load_migrations()[-1].version


def declared_schema() -> str:
    """The text of ``schema.sql``: the schema that applying every migration produces."""
    return BROKER_MIGRATIONS.declared_schema()


async def migrate(dsn_or_connection: str | Connection, *, target: int | None = None) -> list[int]:
    """Apply the task queue's pending migrations (:meth:`MigrationSet.migrate`)."""
    return await BROKER_MIGRATIONS.migrate(dsn_or_connection, target=target)


async def migration_status(dsn_or_connection: str | Connection) -> list[MigrationStatus]:
    """Every shipped migration and whether (and when) it was applied, in version order."""
    return await BROKER_MIGRATIONS.status(dsn_or_connection)


async def schema_version(conn: Connection) -> int | None:
    """The highest applied migration version, or None for an unmigrated database."""
    return await BROKER_MIGRATIONS.schema_version(conn)


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
