"""Test infrastructure shared by every test in the workspace.

- ``pg_dsn``: a throwaway database on the local PostgreSQL, created for this test run and
  dropped afterwards (server from CONVEYOR_TEST_PG_DSN, default the local trust-auth one).
- ``nats_server``: a private nats-server with JetStream on a free port (function scope,
  so a test may kill it); ``nats_url`` for tests that only need a URL (session scope).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator

import asyncpg
import pytest
from conveyor_runtime.embedded_nats import EmbeddedNats

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
