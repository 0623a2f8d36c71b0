"""The Postgres broker passes the conformance suite, plain and encrypted.

The schema is migrated once, into a schema of its own in the session's test database; each
test starts from truncated tables and gets a broker on a shared pool (closing that broker
leaves the pool open), so per-test isolation costs one TRUNCATE.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from conveyor_broker import InvalidTask, NewTask
from conveyor_broker.encrypted import EncryptedBroker
from conveyor_broker.keyring import Keyring
from conveyor_broker.postgres import PostgresBroker
from conveyor_broker.testing import BrokerConformance, FakeClock
from conveyor_broker.testing.schemas import DATA_TABLES, migrated_schema

pytestmark = pytest.mark.postgres

SCHEMA = "conveyor_conformance"


@pytest.fixture(scope="module")
async def conformance_pool(pg_dsn: str) -> AsyncIterator[asyncpg.Pool[asyncpg.Record]]:
    dsn = await migrated_schema(pg_dsn, SCHEMA)
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
        await conformance_pool.execute(f"TRUNCATE {DATA_TABLES}")
        broker = PostgresBroker(conformance_pool, clock)
        yield broker
        await broker.close()

    @pytest.mark.parametrize(
        "options",
        [
            {"type": "t\x00"},
            {"unique_key": "k\x00"},
            {"headers": {"k": "v\x00"}},
            {"headers": {"k\x00": "v"}},
            {"type": "t\ud800"},
        ],
        ids=["type", "unique-key", "header-value", "header-key", "surrogate"],
    )
    async def test_a_value_the_database_refuses_is_invalid_task(
        self, broker: PostgresBroker, options: dict[str, Any]
    ) -> None:
        # Validation refuses these first; past it (the protected hook), what Postgres
        # refuses is still the item's fault: InvalidTask, nothing stored.
        good = NewTask("q", "t")
        with pytest.raises(InvalidTask, match="the database refused a value"):
            await broker._enqueue_batch([good, NewTask("q", **{"type": "t", **options})])
        assert (await broker.list_tasks()).tasks == []
        assert (await broker._enqueue_batch([good]))[0].created


class TestEncryptedPostgresBroker(BrokerConformance):
    """The encrypted broker passes the same suite around the Postgres broker."""

    @pytest.fixture
    def clock(self) -> FakeClock:
        return FakeClock()

    @pytest.fixture
    async def broker(
        self, clock: FakeClock, conformance_pool: asyncpg.Pool[asyncpg.Record]
    ) -> AsyncIterator[EncryptedBroker]:
        await conformance_pool.execute(f"TRUNCATE {DATA_TABLES}")
        keyring = Keyring({"old": os.urandom(32), "new": os.urandom(32)}, primary="new")
        broker = EncryptedBroker(PostgresBroker(conformance_pool, clock), keyring)
        yield broker
        await broker.close()
