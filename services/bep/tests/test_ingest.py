"""The ingest end to end in one process: a real BES gRPC server on a loopback port over a
real Postgres, streams sent by a real gRPC client.

Covers: acks in order and only after the commit, the normalized rows and the raw and log
segments, scrubbing (a stream full of secrets leaves none anywhere), auth, ordering (a
resend is acked at once, a gap refused), a client that dies and resumes (nothing
duplicated, nothing lost), two streams racing for one invocation (the fence), one bad
batch not blocking a group, and fields a newer Bazel sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import grpc
import pytest
import zstandard
from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_bep.bazel.google.devtools.build.v1 import publish_build_event_pb2
from conveyor_bep.ingest import IngestLimits
from conveyor_bep.keys import KeyCache, create_key, create_project
from conveyor_bep.normalize import Changes
from conveyor_bep.server import BepServer
from conveyor_bep.store import BEP_MIGRATIONS
from conveyor_bep.writer import Batch, WriterShard, decode_delimited, decompress, varint
from conveyor_testkit.bep import publish, request, sample_events, sample_stream

pytestmark = pytest.mark.postgres

SECRETS = [
    "hdrSECRETvalue0001",
    "ghpSECRETtoken0002",
    "pwSECRETpass0003",
    "bearerSECRET0004xyz",
    "deploySECRET0005",
    "querySECRET0006",
]


@dataclass
class Rig:
    pool: asyncpg.Pool[Any]
    server: BepServer
    channel: grpc.aio.Channel
    key: str
    keys: KeyCache


@pytest.fixture
async def rig(fresh_pg_dsn: str) -> AsyncIterator[Rig]:
    await BEP_MIGRATIONS.migrate(fresh_pg_dsn)
    pool = await asyncpg.create_pool(fresh_pg_dsn, min_size=1, max_size=8)
    assert pool is not None
    async with pool.acquire() as conn:
        await create_project(conn, "acme", max_unacked=50)
        issued = await create_key(conn, "acme")
    keys = KeyCache(pool)
    server = BepServer(
        pool, keys, shards=2, commit_interval=0.005, limits=IngestLimits(batch_window=0.01)
    )
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Rig(pool, server, channel, issued.key, keys)
    finally:
        await channel.close()
        await server.stop(0)
        await pool.close()


async def _all_text(pool: asyncpg.Pool[Any]) -> str:
    """Every row of every bep table as text, segments decompressed."""
    parts: list[str] = []
    async with pool.acquire() as conn:
        tables = await conn.fetch(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'bep' AND c.relkind = 'r'"
        )
        for table in tables:
            for row in await conn.fetch(f"SELECT * FROM bep.{table['relname']}"):
                for value in row.values():
                    if isinstance(value, bytes):
                        with contextlib.suppress(zstandard.ZstdError):
                            value = decompress(value)
                        parts.append(value.decode(errors="replace"))
                    else:
                        parts.append(str(value))
    return "\n".join(parts)


async def test_a_build_is_stored_normalized_and_acked_in_order(rig: Rig) -> None:
    stream = sample_stream("inv-1", tests=3, failing=True)
    outcome = await publish(rig.channel, stream, key=rig.key)
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    assert outcome.acks == list(range(1, len(stream) + 1))

    inv = await rig.pool.fetchrow("SELECT * FROM bep.invocations WHERE invocation_id = 'inv-1'")
    assert inv is not None
    assert inv["last_event_seq"] == len(stream)
    assert inv["finished"] is True
    assert inv["status"] == "failed"
    assert inv["exit_code"] == 3
    assert inv["exit_name"] == "TESTS_FAILED"
    assert inv["command"] == "test"
    assert inv["branch"] == "main"
    assert inv["user_name"] == "alice"
    assert inv["host_name"] == "ci-1"
    assert json.loads(inv["tags"]) == {"BRANCH": "main", "ROLE": "CI"}
    assert (inv["targets_configured"], inv["targets_completed"], inv["targets_failed"]) == (3, 3, 1)
    assert (inv["tests_total"], inv["tests_passed"], inv["tests_failed"]) == (3, 2, 1)
    assert (inv["actions_created"], inv["actions_executed"]) == (7, 5)
    assert inv["events"] == len(stream)
    assert inv["started_at"] == datetime.fromtimestamp(1_700_000_000, UTC)

    targets = await rig.pool.fetch(
        "SELECT label, kind, success, test_status, tags FROM bep.targets ORDER BY label"
    )
    assert [(t["label"], t["success"], t["test_status"]) for t in targets] == [
        ("//pkg:test_0", False, "FAILED"),
        ("//pkg:test_1", True, "PASSED"),
        ("//pkg:test_2", True, "PASSED"),
    ]
    assert targets[0]["kind"] == "my_test rule"
    assert targets[0]["tags"] == ["unit"]
    results = await rig.pool.fetch("SELECT label, status FROM bep.test_results ORDER BY label")
    assert [r["status"] for r in results] == ["FAILED", "PASSED", "PASSED"]
    metrics = await rig.pool.fetchval("SELECT metrics FROM bep.invocation_metrics")
    assert json.loads(metrics)["action_summary"]["actions_created"] == "7"
    facets = await rig.pool.fetch("SELECT key, value, builds FROM bep.tag_keys ORDER BY key")
    assert [(f["key"], f["value"], f["builds"]) for f in facets] == [
        ("BRANCH", "main", 1),
        ("ROLE", "CI", 1),
    ]

    # The raw stream: every event once, in order, parseable.
    segments = await rig.pool.fetch(
        "SELECT first_seq, last_seq, data FROM bep.event_segments ORDER BY first_seq"
    )
    seqs = []
    for segment in segments:
        for raw in decode_delimited(decompress(segment["data"])):
            ordered = publish_build_event_pb2.OrderedBuildEvent.FromString(raw)
            seqs.append(ordered.sequence_number)
    assert seqs == list(range(1, len(stream) + 1))
    # The log, with its offsets.
    logs = await rig.pool.fetch("SELECT byte_offset, bytes, data FROM bep.log_segments")
    text = b"".join(decompress(r["data"]) for r in sorted(logs, key=lambda r: r[0])).decode()
    assert "INFO: line 2\n" in text
    assert inv["log_bytes"] == len(text.encode())


async def test_a_stream_full_of_secrets_stores_none_of_them(rig: Rig) -> None:
    stream = sample_stream("inv-secret", secrets=SECRETS)
    stream.insert(
        len(stream) - 1,
        request(
            "inv-secret",
            len(stream),
            console=f"curl -H 'Authorization: Bearer {SECRETS[3]}x' https://a:{SECRETS[2]}@h/\n",
        ),
    )
    stream[-1].ordered_build_event.sequence_number = len(stream)
    outcome = await publish(rig.channel, stream, key=rig.key)
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    stored = await _all_text(rig.pool)
    assert "alice" in stored  # the rows are there...
    for secret in SECRETS:
        assert secret not in stored  # ...the secrets are not
    assert rig.key not in stored
    line = await rig.pool.fetchval("SELECT command_line FROM bep.invocations")
    assert "--remote_header=<redacted>" in line
    assert "--client_env=GITHUB_TOKEN=<redacted>" in line


async def test_bad_keys_are_unauthenticated_and_store_nothing(rig: Rig) -> None:
    # One request each: a client still writing when the server refuses may see its own
    # write fail first (gRPC reports that as INTERNAL on the client).
    first = sample_stream("inv-auth")[:1]
    bad = ("nonsense", "conveyor_0123456789abcdef_" + "x" * 40, rig.key + "x")
    for key in (None, *bad):
        outcome = await publish(rig.channel, first, key=key)
        assert outcome.code == grpc.StatusCode.UNAUTHENTICATED, key
        assert "key" in outcome.details
    for key in bad:  # the key in project_id (Bazel 4's --project_id) is checked as well
        outcome = await publish(rig.channel, _with_project_id(first, key), key=None)
        assert outcome.code == grpc.StatusCode.UNAUTHENTICATED, key
    assert await rig.pool.fetchval("SELECT count(*) FROM bep.invocations") == 0

    # Revoking works at once on a node told so (the NATS invalidation calls forget).
    assert (await publish(rig.channel, sample_stream("inv-auth"), key=rig.key)).code == (
        grpc.StatusCode.OK
    )
    key_id = rig.key.split("_")[1]
    await rig.pool.execute("UPDATE bep.api_keys SET revoked_at = now() WHERE id = $1", key_id)
    rig.keys.forget(key_id)
    outcome = await publish(rig.channel, sample_stream("inv-auth-2")[:1], key=rig.key)
    assert outcome.code == grpc.StatusCode.UNAUTHENTICATED


def _with_project_id(requests: list[Any], key: str) -> list[Any]:
    out = []
    for item in requests:
        copy = type(item)()
        copy.CopyFrom(item)
        copy.project_id = key
        out.append(copy)
    return out


async def test_the_key_may_travel_in_project_id(rig: Rig) -> None:
    stream = _with_project_id(sample_stream("inv-pid"), rig.key)
    outcome = await publish(rig.channel, stream, key=None)
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    assert outcome.acks == list(range(1, len(stream) + 1))
    assert await rig.pool.fetchval("SELECT status FROM bep.invocations") == "success"
    assert rig.key not in await _all_text(rig.pool)


async def test_a_gap_is_refused_and_a_resend_acked_at_once(rig: Rig) -> None:
    stream = sample_stream("inv-order")
    gap = [stream[0], stream[2]]
    outcome = await publish(rig.channel, gap, key=rig.key)
    assert outcome.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "expected" in outcome.details

    assert (await publish(rig.channel, stream, key=rig.key)).code == grpc.StatusCode.OK
    # Bazel retrying the whole stream after losing the acks: all acked, nothing doubled.
    again = await publish(rig.channel, stream, key=rig.key)
    assert again.code == grpc.StatusCode.OK
    assert again.acks == list(range(1, len(stream) + 1))
    assert await rig.pool.fetchval("SELECT events FROM bep.invocations") == len(stream)
    assert await rig.pool.fetchval("SELECT count(*) FROM bep.test_results") == 2


async def test_a_client_that_dies_resumes_without_loss_or_duplicates(rig: Rig) -> None:
    stream = sample_stream("inv-resume", tests=20)
    first = await publish(rig.channel, stream, key=rig.key, stop_after_acks=10)
    assert len(first.acks) >= 10
    # Bazel resends from its first unacked event. The dead stream's last batches may still
    # commit after the new stream read where the invocation stood: the new one then loses
    # its fence (UNAVAILABLE) and, like Bazel, retries from what it has seen acked.
    acks = list(first.acks)
    for _ in range(5):
        resumed = await publish(rig.channel, stream[len(acks) :], key=rig.key)
        acks += resumed.acks
        if resumed.code == grpc.StatusCode.OK:
            break
        assert resumed.code == grpc.StatusCode.UNAVAILABLE, resumed.details
    assert resumed.code == grpc.StatusCode.OK, resumed.details
    assert acks == list(range(1, len(stream) + 1))
    inv = await rig.pool.fetchrow("SELECT * FROM bep.invocations")
    assert inv is not None
    assert inv["events"] == len(stream) == inv["last_event_seq"]
    assert inv["tests_total"] == 20
    raw = 0
    for row in await rig.pool.fetch("SELECT data FROM bep.event_segments"):
        raw += len(decode_delimited(decompress(row["data"])))
    assert raw == len(stream)


async def test_two_streams_racing_for_one_invocation_are_fenced(rig: Rig) -> None:
    stream = sample_stream("inv-race", tests=30)
    outcomes = await asyncio.gather(
        publish(rig.channel, stream, key=rig.key), publish(rig.channel, stream, key=rig.key)
    )
    codes = sorted(o.code.name for o in outcomes)
    # Either one lost its fence (UNAVAILABLE, which Bazel retries; gRPC's Python client
    # may report its own write failing first, INTERNAL) or they serialized cleanly.
    assert codes in (["OK", "OK"], ["OK", "UNAVAILABLE"], ["INTERNAL", "OK"]), [
        o.details for o in outcomes
    ]
    winner = next(o for o in outcomes if o.code == grpc.StatusCode.OK)
    assert winner.acks == list(range(1, len(stream) + 1))
    inv = await rig.pool.fetchrow("SELECT * FROM bep.invocations")
    assert inv is not None
    assert inv["events"] == len(stream) == inv["last_event_seq"]
    assert inv["tests_total"] == 30
    assert await rig.pool.fetchval("SELECT count(*) FROM bep.targets") == 30


async def test_a_batch_that_fails_does_not_block_its_group(rig: Rig) -> None:
    shard = WriterShard(rig.pool, interval=0)
    good = Batch("inv-good", project_id=await _project_id(rig), build_id="b", first_seq=1)
    good.last_seq = 1
    good.events.append(b"x")
    bad = Batch("inv-bad", project_id=987654, build_id="b", first_seq=1)  # no such project
    bad.last_seq = 1
    bad.events.append(b"y")
    futures = [shard.submit(good), shard.submit(bad)]
    shard.start()
    try:
        results = await asyncio.gather(*futures, return_exceptions=True)
    finally:
        await shard.stop()
    assert results[0] is None
    assert isinstance(results[1], asyncpg.ForeignKeyViolationError)
    ids = [r[0] for r in await rig.pool.fetch("SELECT invocation_id FROM bep.invocations")]
    assert ids == ["inv-good"]


async def _project_id(rig: Rig) -> int:
    return int(await rig.pool.fetchval("SELECT id FROM bep.projects WHERE slug = 'acme'"))


async def test_fields_of_a_newer_bazel_are_kept_and_masked(rig: Rig) -> None:
    event = sample_events()[0]
    # A field number this version does not know, holding a header flag.
    unknown = b"--remote_header=x-api-key=" + SECRETS[0].encode()
    field = varint((999 << 3) | 2)  # field 999, length-delimited
    data = event.SerializeToString() + field + varint(len(unknown)) + unknown
    newer = bes.BuildEvent.FromString(data)
    stream = [request("inv-new", 1, bazel=newer), request("inv-new", 2, finished=True)]
    outcome = await publish(rig.channel, stream, key=rig.key)
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    stored = await _all_text(rig.pool)
    assert SECRETS[0] not in stored
    segment = await rig.pool.fetchval("SELECT data FROM bep.event_segments")
    first = publish_build_event_pb2.OrderedBuildEvent.FromString(
        decode_delimited(decompress(segment))[0]
    )
    kept = bes.BuildEvent()
    first.event.bazel_event.Unpack(kept)
    assert kept.started.command == "test"
    assert b"--remote_header=****" in kept.SerializeToString()  # the field survived, masked


async def test_too_many_unacked_events_pause_the_reader(rig: Rig) -> None:
    # max_unacked is 50 for this project: a stream of 400 events still completes, in order,
    # with a writer that commits slowly, because the reader waits for acks.
    stream = sample_stream("inv-bp", tests=100)
    assert len(stream) > 400
    outcome = await publish(rig.channel, stream, key=rig.key)
    assert outcome.code == grpc.StatusCode.OK, outcome.details
    assert outcome.acks == list(range(1, len(stream) + 1))


def test_changes_merge_targets_by_key() -> None:
    changes = Changes()
    changes.merge_target("//a", "", {"kind": "x", "success": None})
    changes.merge_target("//a", "", {"success": True})
    assert changes.targets == {("//a", ""): {"kind": "x", "success": True}}


async def test_undecodable_requests_are_invalid_argument(rig: Rig) -> None:
    """Bytes that are no protobuf message end the call with INVALID_ARGUMENT; what the
    stream committed before them stays committed."""
    method = "/google.devtools.build.v1.PublishBuildEvent/PublishBuildToolEventStream"
    raw = rig.channel.stream_stream(
        method, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    good = [r.SerializeToString() for r in sample_stream("inv-garbled")[:3]]
    garbage = b"\xff\xff\xff\xff"
    acked: list[bytes] = []
    all_acked = asyncio.Event()

    async def requests() -> AsyncIterator[bytes]:
        for data in good:
            yield data
        await asyncio.wait_for(all_acked.wait(), 10)  # the good part is committed first
        yield garbage

    async def read_acks() -> None:
        async for response in raw(requests(), metadata=(("x-api-key", rig.key),)):
            acked.append(response)
            if len(acked) == len(good):
                all_acked.set()

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await read_acks()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed request" in (refused.value.details() or "")
    assert len(acked) == 3
    async with rig.pool.acquire() as conn:
        last = await conn.fetchval(
            "SELECT last_event_seq FROM bep.invocations WHERE invocation_id = 'inv-garbled'"
        )
    assert last == 3

    unary = rig.channel.unary_unary(
        "/google.devtools.build.v1.PublishBuildEvent/PublishLifecycleEvent",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.aio.AioRpcError) as lifecycle:
        await unary(garbage, metadata=(("x-api-key", rig.key),))
    assert lifecycle.value.code() == grpc.StatusCode.INVALID_ARGUMENT
