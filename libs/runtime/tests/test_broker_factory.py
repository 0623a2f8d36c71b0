"""open_broker: the driver the settings name, migrated first when asked."""

from __future__ import annotations

import pytest
from conveyor_broker.clock import FakeClock
from conveyor_broker.memory import MemoryBroker
from conveyor_broker.postgres import latest_version
from conveyor_broker.types import NewTask, TaskState
from conveyor_runtime.broker_factory import open_broker
from conveyor_runtime.settings import CommonSettings


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
