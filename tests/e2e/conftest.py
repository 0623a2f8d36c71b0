"""Fixtures for end-to-end tests: a migrated throwaway database and a Cluster of processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from conveyor_broker import SystemClock
from conveyor_broker.postgres import PostgresBroker, migrate
from conveyor_runtime.embedded_nats import EmbeddedNats

from tests.e2e.harness import Cluster


@pytest.fixture
async def migrated_dsn(fresh_pg_dsn: str) -> str:
    """A fresh database with every migration applied."""
    await migrate(fresh_pg_dsn)
    return fresh_pg_dsn


@pytest.fixture
async def store(migrated_dsn: str) -> AsyncIterator[PostgresBroker]:
    """A broker on the test's database, for checking what the services stored."""
    broker = await PostgresBroker.connect(migrated_dsn, SystemClock())
    yield broker
    await broker.close()


@pytest.fixture
def cluster(
    migrated_dsn: str, nats_server: EmbeddedNats, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Cluster]:
    """Services as real processes; their logs are printed when the test fails."""
    c = Cluster(dsn=migrated_dsn, nats_url=nats_server.url, workdir=tmp_path)
    yield c
    c.stop_all()
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(c.logs())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)


def read_record(path: Path) -> list[list[str]]:
    """The lines of a worker record file, split into fields."""
    if not path.exists():
        return []
    return [line.split() for line in path.read_text().splitlines() if line.strip()]
