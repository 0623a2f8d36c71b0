"""Test infrastructure shared by every test in the workspace.

- ``pg_dsn``: a throwaway database on the local PostgreSQL, created for this test run and
  dropped afterwards (server from CONVEYOR_TEST_PG_DSN, default the local trust-auth one).
- ``nats_server``: a private nats-server with JetStream on a free port (function scope,
  so a test may kill it); ``nats_url`` for tests that only need a URL (session scope).
- The cluster key: every service a test configures or starts, and the ``bus`` fixture,
  seal their NATS messages with one key per run (``conveyor_testkit.cluster_keys``, put
  into ``CONVEYOR_CLUSTER_KEY`` here, before any test builds a settings object).
- For service tests: ``nc`` (a connection to ``nats_url``), ``subjects`` (a prefix of the
  test's own), ``bus`` (the two together), ``clock`` (a FakeClock) and ``broker`` (memory,
  and Postgres on a fresh database, so sweeps see only the test's tasks).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest
from conveyor_broker import Broker, FakeClock
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.postgres import PostgresBroker, migrate
from conveyor_runtime.bus import Bus
from conveyor_runtime.embedded_nats import EmbeddedNats
from conveyor_runtime.nats_connect import close_nats, connect_nats
from conveyor_runtime.subjects import Subjects
from conveyor_testkit.cluster_keys import cluster_auth, use_test_key
from nats.aio.client import Client as NatsClient

use_test_key()

ADMIN_DSN = os.environ.get("CONVEYOR_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


def _with_database(dsn: str, database: str) -> str:
    base, _, _ = dsn.rpartition("/")
    return f"{base}/{database}"


async def _admin(sql: str) -> None:
    conn = await asyncpg.connect(ADMIN_DSN)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    """DSN of a fresh database that lives for the whole test run."""
    name = f"conveyor_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield _with_database(ADMIN_DSN, name)
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def fresh_pg_dsn(pg_dsn: str) -> Iterator[str]:
    """DSN of a fresh, empty database for one test (dropped after it)."""
    name = f"conveyor_t_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield _with_database(ADMIN_DSN, name)
    finally:
        asyncio.run(_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """URL of a private nats-server shared by the whole run."""
    with EmbeddedNats() as server:
        yield server.url


@pytest.fixture
def nats_server() -> Iterator[EmbeddedNats]:
    """A private nats-server for one test, which the test may kill or restart."""
    with EmbeddedNats() as server:
        yield server


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    """A NATS connection to the session's private server."""
    client = await connect_nats(nats_url, name="test")
    try:
        yield client
    finally:
        # No drain: nothing a test checks depends on messages still in flight at its end,
        # and a drain can wait for a subscription's backlog until DRAIN_TIMEOUT.
        await close_nats(client, drain=False)


@pytest.fixture
def subjects() -> Subjects:
    """Subjects under a prefix no other test uses."""
    return Subjects(prefix=f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture
def bus(nc: NatsClient, subjects: Subjects) -> Bus:
    """The typed messages of ``subjects`` on ``nc``."""
    return Bus(nc, subjects, cluster_auth())


@pytest.fixture
def clock() -> FakeClock:
    """The broker's clock; moves only when the test says so."""
    return FakeClock()


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.postgres)])
def broker_dsn(request: pytest.FixtureRequest) -> str | None:
    """None for the memory broker, else the DSN of a fresh Postgres database."""
    if request.param == "memory":
        return None
    dsn: str = request.getfixturevalue("fresh_pg_dsn")
    return dsn


@pytest.fixture
async def broker(broker_dsn: str | None, clock: FakeClock) -> AsyncIterator[Broker]:
    """Each test runs against the memory broker and against Postgres (a fresh database)."""
    if broker_dsn is None:
        b: Broker = MemoryBroker(clock)
    else:
        await migrate(broker_dsn)
        b = await PostgresBroker.connect(broker_dsn, clock, max_size=4)
    try:
        yield b
    finally:
        await b.close()
