"""The Postgres broker (asyncpg) and its migrations."""

from __future__ import annotations

from conveyor_broker.postgres.broker import PostgresBroker
from conveyor_broker.postgres.migrations import (
    MigrationStatus,
    latest_version,
    migrate,
    migration_status,
)

__all__ = ["MigrationStatus", "PostgresBroker", "latest_version", "migrate", "migration_status"]
