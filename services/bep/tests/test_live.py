"""Live digests: the ingest publishes one digest per committed batch on the build's NATS
subject (a real nats-server), and they say where the build is: the last committed event,
the log's size, the final status with the end of the stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import grpc
import pytest
from conveyor_bep.ingest import IngestLimits
from conveyor_bep.keys import KeyCache, create_key, create_project
from conveyor_bep.live import LivePublisher, build_subject, invocation_token, project_subject
from conveyor_bep.server import BepServer
from conveyor_bep.store import BEP_MIGRATIONS
from conveyor_runtime.nats_connect import close_nats, connect_nats
from conveyor_testkit.bep import publish, sample_stream

pytestmark = [pytest.mark.postgres, pytest.mark.nats]

PREFIX = "livetest"


def test_invocation_tokens_are_single_subject_tokens() -> None:
    assert invocation_token("6f1c0d2e-aaaa-bbbb-cccc-0123456789ab") == (
        "6f1c0d2e-aaaa-bbbb-cccc-0123456789ab"
    )
    odd = invocation_token("inv.with dots*and>wildcards")
    assert odd.startswith("h")
    assert len(odd) == 33
    assert not set(odd) & set(". *>")
    assert odd == invocation_token("inv.with dots*and>wildcards")  # stable
    assert build_subject("p", 7, "abc") == "p.bep.live.7.abc"
    assert project_subject("p", 7) == "p.bep.live.7.*"


@pytest.fixture
async def live_rig(fresh_pg_dsn: str, nats_url: str) -> AsyncIterator[tuple[Any, ...]]:
    await BEP_MIGRATIONS.migrate(fresh_pg_dsn)
    pool = await asyncpg.create_pool(fresh_pg_dsn, min_size=1, max_size=4)
    assert pool is not None
    async with pool.acquire() as conn:
        project_id = await create_project(conn, "live")
        issued = await create_key(conn, "live")
    nc = await connect_nats(nats_url, name="bep-live-test")
    live = LivePublisher(nc, PREFIX)
    live.start()
    server = BepServer(
        pool,
        KeyCache(pool),
        shards=1,
        commit_interval=0.005,
        limits=IngestLimits(batch_window=0.01, batch_events=20),
        on_committed=live.committed,
    )
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield nc, live, channel, issued.key, project_id
    finally:
        await channel.close()
        await server.stop(0)
        await live.stop()
        await close_nats(nc, drain=False)
        await pool.close()


async def test_each_commit_publishes_a_digest_on_the_builds_subject(
    live_rig: tuple[Any, ...],
) -> None:
    nc, live, channel, key, project_id = live_rig
    digests: list[dict[str, Any]] = []
    finished = asyncio.Event()

    async def seen(msg: Any) -> None:
        digest = json.loads(msg.data)
        digests.append(digest)
        if digest["final"]:
            finished.set()

    # The project's wildcard subject sees every build of the project.
    sub = await nc.subscribe(project_subject(PREFIX, project_id), cb=seen)
    await nc.flush()
    stream = sample_stream("live-inv-1", tests=30, log_lines=5)
    outcome = await publish(channel, stream, key=key)
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    await asyncio.wait_for(finished.wait(), 10)
    await sub.unsubscribe()

    assert len(digests) >= 2  # 20 events per batch: several commits, several digests
    assert {d["invocation_id"] for d in digests} == {"live-inv-1"}
    seqs = [d["last_seq"] for d in digests]
    assert seqs == sorted(seqs)
    assert seqs[-1] == len(stream)
    assert sum(d["events"] for d in digests) == len(stream)
    last = digests[-1]
    assert last["final"]
    assert last["status"] is not None
    assert last["log_bytes"] >= max(d["log_bytes"] for d in digests) > 0
    assert sum(d["tests"] for d in digests) >= 30
    assert live.published == len(digests)
    assert live.dropped == 0
