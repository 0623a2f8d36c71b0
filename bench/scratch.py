"""What every benchmark mode that runs real services needs: a throwaway database of the
same Postgres (migrated), a private nats-server and a work folder, all gone afterwards."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncpg
from conveyor_broker.postgres import migrate
from conveyor_runtime.embedded_nats import EmbeddedNats


@dataclass(frozen=True)
class Scratch:
    """A migrated database (``dsn``), a running nats-server and a work folder."""

    dsn: str
    nats: EmbeddedNats
    workdir: Path


@asynccontextmanager
async def scratch_services(admin_dsn: str, prefix: str) -> AsyncIterator[Scratch]:
    """A :class:`Scratch` made from ``admin_dsn`` (a database that may create others)."""
    name = f"conveyor_bench_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(admin_dsn)
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    dsn = admin_dsn.rpartition("/")[0] + f"/{name}"
    workdir = Path(tempfile.mkdtemp(prefix=f"conveyor-bench-{prefix}-"))
    nats = EmbeddedNats()
    nats.start()
    try:
        await migrate(dsn)
        yield Scratch(dsn=dsn, nats=nats, workdir=workdir)
    finally:
        nats.stop()
        shutil.rmtree(workdir, ignore_errors=True)
        conn = await asyncpg.connect(admin_dsn)
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()
