"""open_broker: the driver the settings name, migrated first when asked."""

from __future__ import annotations

import time
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
from conveyor_broker import DatabaseUnavailable
from conveyor_broker.clock import FakeClock
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.postgres import PostgresBroker, latest_version
from conveyor_broker.types import NewTask, TaskState
from conveyor_runtime.broker_factory import open_broker
from conveyor_runtime.settings import CommonSettings
from conveyor_testkit.proxy import WedgeProxy


async def test_memory_broker_uses_the_given_clock() -> None:
    clock = FakeClock()
    broker = await open_broker(CommonSettings(broker="memory"), clock)
    try:
        assert isinstance(broker, MemoryBroker)
        task = (await broker.enqueue(NewTask(queue="q", type="t"))).task
        assert task.created_at == clock.now()
    finally:
        await broker.close()


@pytest.mark.postgres
async def test_postgres_broker_is_migrated_before_use(fresh_pg_dsn: str) -> None:
    settings = CommonSettings(broker="postgres", dsn=fresh_pg_dsn, db_pool_size=2)
    assert settings.auto_migrate
    clock = FakeClock()
    broker = await open_broker(settings, clock)
    try:
        info = await broker.info()
        assert info.driver == "postgres"
        assert info.schema_version == latest_version()
        task = (await broker.enqueue(NewTask(queue="q", type="t"))).task
        assert task.state is TaskState.PENDING
        assert task.created_at == clock.now()
    finally:
        await broker.close()


@pytest.mark.postgres
async def test_migration_can_be_turned_off(fresh_pg_dsn: str) -> None:
    settings = CommonSettings(broker="postgres", dsn=fresh_pg_dsn, auto_migrate=False)
    broker = await open_broker(settings)
    try:
        assert (await broker.info()).schema_version is None
    finally:
        await broker.close()


@pytest.mark.postgres
async def test_pool_connections_carry_the_statement_timeout(fresh_pg_dsn: str) -> None:
    settings = CommonSettings(
        broker="postgres", dsn=fresh_pg_dsn, db_pool_size=2, db_statement_timeout=1.5
    )
    broker = await open_broker(settings)
    try:
        assert isinstance(broker, PostgresBroker)
        # Every pool connection (two at once, so not just the first one opened).
        async with broker._conn() as one, broker._conn() as two:
            assert await one.fetchval("SHOW statement_timeout") == "1500ms"
            assert await two.fetchval("SHOW statement_timeout") == "1500ms"
            with pytest.raises(asyncpg.QueryCanceledError):
                await one.execute("SELECT pg_sleep(3)")
    finally:
        await broker.close()


@pytest.mark.postgres
async def test_statement_timeout_zero_leaves_the_server_default(fresh_pg_dsn: str) -> None:
    settings = CommonSettings(broker="postgres", dsn=fresh_pg_dsn, db_statement_timeout=0)
    broker = await open_broker(settings)
    try:
        assert isinstance(broker, PostgresBroker)
        async with broker._conn() as conn:
            assert await conn.fetchval("SHOW statement_timeout") == "0"
    finally:
        await broker.close()


def _via(dsn: str, port: int) -> str:
    parts = urlsplit(dsn)
    host = f"{parts.username}@" if parts.username else ""
    if parts.password:
        host = f"{parts.username}:{parts.password}@"
    return urlunsplit(parts._replace(netloc=f"{host}127.0.0.1:{port}"))


@pytest.mark.postgres
async def test_a_wedged_connection_is_dropped_and_the_next_call_uses_a_fresh_one(
    fresh_pg_dsn: str,
) -> None:
    parts = urlsplit(fresh_pg_dsn)
    async with WedgeProxy(parts.hostname or "127.0.0.1", parts.port or 5432) as proxy:
        settings = CommonSettings(
            broker="postgres",
            dsn=_via(fresh_pg_dsn, proxy.port),
            db_pool_size=1,
            db_statement_timeout=0.5,
            db_command_timeout=1.0,
            db_acquire_timeout=5.0,
        )
        broker = await open_broker(settings)
        try:
            task = (await broker.enqueue(NewTask(queue="q", type="t"))).task
            assert proxy.wedge() >= 1
            started = time.monotonic()
            with pytest.raises(DatabaseUnavailable) as caught:
                await broker.get_task(task.id)
            # The command timeout, then at most as long again for the cancel: bounded.
            assert time.monotonic() - started < 5
            assert str(caught.value) == "database unavailable (timed out): retry"
            # The wedged connection was closed; the pool's next one goes through.
            assert (await broker.get_task(task.id)).id == task.id
        finally:
            await broker.close()


@pytest.mark.postgres
async def test_an_exhausted_pool_fails_the_call_as_unavailable(fresh_pg_dsn: str) -> None:
    settings = CommonSettings(
        broker="postgres", dsn=fresh_pg_dsn, db_pool_size=1, db_acquire_timeout=0.2
    )
    broker = await open_broker(settings)
    try:
        assert isinstance(broker, PostgresBroker)
        async with broker._conn():
            with pytest.raises(DatabaseUnavailable):
                await broker.get_task("0" * 26)
    finally:
        await broker.close()


@pytest.mark.postgres
async def test_asyncpg_internal_state_errors_come_out_clean(fresh_pg_dsn: str) -> None:
    # What asyncpg raises on a connection an outage left mid-operation.
    internal = asyncpg.exceptions.InternalClientError(
        "cannot switch to state 12; another operation (2) is in progress"
    )
    broker = await open_broker(CommonSettings(broker="postgres", dsn=fresh_pg_dsn))
    try:
        assert isinstance(broker, PostgresBroker)
        with pytest.raises(DatabaseUnavailable) as caught:
            async with broker._conn():
                raise internal
        assert str(caught.value) == "database unavailable (connection failed): retry"
        assert caught.value.__cause__ is internal
    finally:
        await broker.close()
