"""The test infrastructure itself: the throwaway database and the private nats-server."""

from __future__ import annotations

import asyncpg
import nats
from conveyor_runtime.embedded_nats import EmbeddedNats


async def test_throwaway_database_is_empty_and_writable(fresh_pg_dsn: str) -> None:
    conn = await asyncpg.connect(fresh_pg_dsn)
    try:
        tables = await conn.fetchval(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = 'public'"
        )
        assert tables == 0
        await conn.execute("CREATE TABLE t (x int)")
        assert await conn.fetchval("SELECT current_database()") != "postgres"
    finally:
        await conn.close()


async def test_private_nats_server_has_jetstream_and_can_be_killed(
    nats_server: EmbeddedNats,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        info = await nc.jetstream().account_info()
        assert info.streams == 0
    finally:
        await nc.close()
    pid = nats_server.pid
    nats_server.kill()
    assert nats_server.pid is None
    assert pid is not None
    nats_server.start()
    nc = await nats.connect(nats_server.url)
    await nc.close()
