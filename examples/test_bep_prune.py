"""The nightly CAS prune as a Conveyor cron task (``examples/bep_prune.py``), run for
real: the cron entry applies on an embedded server, and the task, run by the example's
worker, runs ``conveyor-bep prune`` against a real Postgres and blob root, which deletes
the upload no build pinned past its TTL and keeps the one within it."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest
from conveyor import AdminClient, Client, TaskState
from conveyor_bep.blobs import DiskStore, blob_path, commit_blob
from conveyor_bep.keys import create_project
from conveyor_bep.store import BEP_MIGRATIONS
from conveyor_cli.pytest_plugin import conveyor_server  # noqa: F401 - the fixture
from conveyor_cli.testing import BlockingEmbeddedServer

from examples.bep_prune import ENTRY, worker

pytestmark = pytest.mark.postgres

STALE, FRESH = b"uploaded two days ago, never referenced", b"uploaded just now"


async def _blobs(dsn: str, root: Path) -> None:
    await BEP_MIGRATIONS.migrate(dsn)
    conn = await asyncpg.connect(dsn)
    try:
        project = await create_project(conn, "acme")
        now = datetime.now(UTC)
        for data, at in ((STALE, now - timedelta(days=2)), (FRESH, now)):
            await commit_blob(
                conn,
                DiskStore(root),
                project_id=project,
                key_prefix="acme",
                digest=hashlib.sha256(data).hexdigest(),
                size=len(data),
                temp=data,
                now=at,
                ttl=timedelta(hours=24),
            )
    finally:
        await conn.close()


def test_the_cron_task_prunes_unpinned_uploads_past_their_ttl(
    conveyor_server: BlockingEmbeddedServer,  # noqa: F811
    fresh_pg_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asyncio.run(_blobs(fresh_pg_dsn, tmp_path))
    # The worker's `conveyor-bep prune` reads the ingest's settings from its environment.
    monkeypatch.setenv("CONVEYOR_DSN", fresh_pg_dsn)
    monkeypatch.setenv("CONVEYOR_BEP_BLOB_ROOT", str(tmp_path))
    with AdminClient(conveyor_server.target) as admin:
        [applied] = admin.apply_cron_entries([ENTRY])
    assert (applied.name, applied.schedule) == ("bep-prune", "0 3 * * *")
    with conveyor_server.running(worker), Client(conveyor_server.target) as client:
        task = client.enqueue("bep.prune", {}, queue="maintenance")
        done = conveyor_server.wait_for(task.id, timeout=120)
    assert done.state is TaskState.COMPLETED, done.last_error
    assert "pruned 1 blobs" in str(done.result)
    assert not blob_path(tmp_path, "acme", hashlib.sha256(STALE).hexdigest()).exists()
    assert blob_path(tmp_path, "acme", hashlib.sha256(FRESH).hexdigest()).read_bytes() == FRESH
