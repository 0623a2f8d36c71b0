"""The Postgres broker passes the conformance suite.

The schema is migrated once, into a schema of its own in the session's test database; each
test starts from truncated tables and gets a broker on a shared pool (closing that broker
leaves the pool open), so per-test isolation costs one TRUNCATE.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
from conveyor_broker.postgres import PostgresBroker, migrate
from conveyor_broker.testing import BrokerConformance, FakeClock

pytestmark = pytest.mark.postgres

SCHEMA = "conveyor_conformance"
TABLES = "conveyor_tasks, conveyor_queues, conveyor_task_dependencies, conveyor_webhook_workers"


@pytest.fixture(scope="module")
async def conformance_pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool[asyncpg.Record]]:
    admin = await asyncpg.connect(pg_dsn)
    try:
        await admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA}")
    finally:
        await admin.close()
    dsn = f"{pg_dsn}?search_path={SCHEMA}"
    await migrate(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=2, max_size=8)
    try:
        yield pool
    finally:
        await pool.close()


class TestPostgresBroker(BrokerConformance):
    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    async def broker(
        self, clock: FakeClock, conformance_pool: asyncpg.Pool[asyncpg.Record]
    ) -> AsyncIterator[PostgresBroker]:
        await conformance_pool.execute(f"TRUNCATE {TABLES}")
        broker = PostgresBroker(conformance_pool, clock)
        yield broker
        await broker.close()
