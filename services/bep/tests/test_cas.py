"""The CAS sink in one process: the BES server with its CAS services on a loopback port
over a real Postgres and a blob directory, called by a real gRPC client.

Covers: ByteStream write and read (whole, ranges, resumed), a wrong digest or size refused
with nothing stored, the API key required, one project never seeing another's blobs,
FindMissingBlobs (and its touch), the batch calls, the capabilities and the empty action
cache, blobs pinned by the commit of a stream that references them, and the prune (with
"now" passed in: unpinned uploads past their TTL go, pinned ones stay until retention
deletes their build).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest
from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_bep.bazel.build.bazel.remote.execution.v2 import (
    remote_execution_pb2 as rex,
)
from conveyor_bep.bazel.build.bazel.remote.execution.v2 import (
    remote_execution_pb2_grpc as rex_grpc,
)
from conveyor_bep.bazel.google.bytestream import bytestream_pb2, bytestream_pb2_grpc
from conveyor_bep.blobs import (
    EMPTY_SHA256,
    blob_path,
    find_artifact,
    list_artifacts,
    open_blob,
    prune,
)
from conveyor_bep.cas import CasConfig
from conveyor_bep.ingest import IngestLimits
from conveyor_bep.keys import KeyCache, create_key, create_project
from conveyor_bep.normalize import Changes, bytestream_digest, normalize
from conveyor_bep.server import BepServer
from conveyor_bep.store import BEP_MIGRATIONS, delete_old_builds
from conveyor_testkit.bep import publish, request, sample_events

pytestmark = pytest.mark.postgres

TTL = timedelta(hours=24)


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


@dataclass
class Rig:
    pool: asyncpg.Pool[Any]
    channel: grpc.aio.Channel
    root: Path
    clock: Clock
    key: str
    other_key: str
    project_id: int


@pytest.fixture
async def rig(fresh_pg_dsn: str, tmp_path: Path) -> AsyncIterator[Rig]:
    await BEP_MIGRATIONS.migrate(fresh_pg_dsn)
    pool = await asyncpg.create_pool(fresh_pg_dsn, min_size=1, max_size=8)
    assert pool is not None
    async with pool.acquire() as conn:
        project_id = await create_project(conn, "acme")
        await create_project(conn, "other")
        key = (await create_key(conn, "acme")).key
        other_key = (await create_key(conn, "other")).key
    clock = Clock()
    root = tmp_path / "blobs"
    server = BepServer(
        pool,
        KeyCache(pool),
        shards=2,
        commit_interval=0.005,
        limits=IngestLimits(batch_window=0.01),
        cas=CasConfig(root, upload_ttl=TTL, max_blob_bytes=8 * 1024 * 1024, clock=clock),
    )
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Rig(pool, channel, root, clock, key, other_key, project_id)
    finally:
        await channel.close()
        await server.stop(0)
        await pool.close()


def _md(key: str | None) -> tuple[tuple[str, str], ...]:
    return (("x-api-key", key),) if key is not None else ()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _chunks(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


async def _write(
    channel: grpc.aio.Channel,
    key: str | None,
    data: bytes,
    *,
    digest: str | None = None,
    size: int | None = None,
    upload: str = "u-1",
    offset: int = 0,
    finish: bool = True,
    chunk: int = 64 * 1024,
) -> bytestream_pb2.WriteResponse:
    digest = digest or _sha(data)
    size = len(data) if size is None else size
    resource = f"main/uploads/{upload}/blobs/{digest}/{size}"
    pieces = _chunks(data, chunk)
    requests = []
    position = offset
    for i, piece in enumerate(pieces):
        requests.append(
            bytestream_pb2.WriteRequest(
                resource_name=resource if i == 0 else "",
                write_offset=position,
                data=piece,
                finish_write=finish and i == len(pieces) - 1,
            )
        )
        position += len(piece)

    async def source() -> AsyncIterator[bytestream_pb2.WriteRequest]:
        for r in requests:
            yield r

    stub = bytestream_pb2_grpc.ByteStreamStub(channel)  # type: ignore[no-untyped-call]
    response: bytestream_pb2.WriteResponse = await stub.Write(
        source(), metadata=_md(key), timeout=10
    )
    return response


async def _read(
    channel: grpc.aio.Channel, key: str | None, digest: str, size: int, **kwargs: int
) -> bytes:
    stub = bytestream_pb2_grpc.ByteStreamStub(channel)  # type: ignore[no-untyped-call]
    request = bytestream_pb2.ReadRequest(resource_name=f"main/blobs/{digest}/{size}", **kwargs)
    out = b""
    async for response in stub.Read(request, metadata=_md(key), timeout=10):
        out += response.data
    return out


def _cas(channel: grpc.aio.Channel) -> Any:
    return rex_grpc.ContentAddressableStorageStub(channel)  # type: ignore[no-untyped-call]


def _digest(data: bytes) -> rex.Digest:
    return rex.Digest(hash=_sha(data), size_bytes=len(data))


async def _stored(rig: Rig) -> tuple[list[dict[str, Any]], list[Path]]:
    rows = [dict(r) for r in await rig.pool.fetch("SELECT * FROM bep.blobs ORDER BY digest")]
    files = sorted(p for p in rig.root.rglob("*") if p.is_file()) if rig.root.exists() else []
    return rows, files


async def test_a_blob_written_reads_back_and_lives_under_the_project_prefix(rig: Rig) -> None:
    data = os.urandom(700_000)
    response = await _write(rig.channel, rig.key, data, chunk=100_000)
    assert response.committed_size == len(data)
    digest = _sha(data)
    assert await _read(rig.channel, rig.key, digest, len(data)) == data
    assert await _read(rig.channel, rig.key, digest, len(data), read_offset=10) == data[10:]
    part = await _read(rig.channel, rig.key, digest, len(data), read_offset=5, read_limit=7)
    assert part == data[5:12]
    path = rig.root / "acme" / digest[:2] / digest[2:4] / digest
    assert path.read_bytes() == data
    assert blob_path(rig.root, "acme", digest) == path
    rows, files = await _stored(rig)
    assert files == [path]  # no temporary file left behind
    assert len(rows) == 1
    row = rows[0]
    assert (row["project_id"], row["size"], row["key_prefix"]) == (
        rig.project_id,
        len(data),
        "acme",
    )
    assert row["origin"] == "upload"
    assert row["expires_at"] == rig.clock.now + TTL
    handle = open_blob(rig.root, "acme", digest)
    assert handle is not None
    with handle:
        assert handle.read() == data
    assert open_blob(rig.root, "other", digest) is None
    # The empty blob is always there, and is never stored.
    assert await _read(rig.channel, rig.key, EMPTY_SHA256, 0) == b""


async def test_a_wrong_digest_or_size_is_refused_and_nothing_is_stored(rig: Rig) -> None:
    data = b"the bytes of a test log\n" * 100
    cases: list[dict[str, Any]] = [
        {"digest": _sha(b"something else")},  # hash mismatch
        {"size": len(data) + 5},  # fewer bytes than announced
        {"size": len(data) - 5},  # more bytes than announced
    ]
    for case in cases:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _write(rig.channel, rig.key, data, **case)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _write(rig.channel, rig.key, b"x" * (9 * 1024 * 1024))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    rows, files = await _stored(rig)
    assert rows == []
    assert files == []
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _read(rig.channel, rig.key, _sha(data), len(data))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def test_the_cas_needs_a_valid_key(rig: Rig) -> None:
    data = b"secret build output"
    for key in (None, "conveyor_0123456789abcdef_notarealsecretatallxx", "garbage"):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _write(rig.channel, key, data)
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, key
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _read(rig.channel, key, _sha(data), len(data))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, key
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _cas(rig.channel).FindMissingBlobs(
                rex.FindMissingBlobsRequest(blob_digests=[_digest(data)]), metadata=_md(key)
            )
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED, key
    assert await _stored(rig) == ([], [])


async def test_a_project_never_reads_another_projects_blobs(rig: Rig) -> None:
    data = b"acme's profile"
    await _write(rig.channel, rig.key, data)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _read(rig.channel, rig.other_key, _sha(data), len(data))
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    cas = _cas(rig.channel)
    missing = await cas.FindMissingBlobs(
        rex.FindMissingBlobsRequest(blob_digests=[_digest(data)]), metadata=_md(rig.other_key)
    )
    assert list(missing.missing_blob_digests) == [_digest(data)]
    batch = await cas.BatchReadBlobs(
        rex.BatchReadBlobsRequest(digests=[_digest(data)]), metadata=_md(rig.other_key)
    )
    assert batch.responses[0].status.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert batch.responses[0].data == b""
    # The other project uploading the same bytes gets its own copy, under its prefix.
    await _write(rig.channel, rig.other_key, data)
    digest = _sha(data)
    rows, files = await _stored(rig)
    assert sorted(r["key_prefix"] for r in rows) == ["acme", "other"]
    assert files == sorted(
        rig.root / prefix / digest[:2] / digest[2:4] / digest for prefix in ("acme", "other")
    )


async def test_find_missing_blobs_and_its_touch(rig: Rig) -> None:
    present, absent = b"present", b"absent"
    await _write(rig.channel, rig.key, present)
    cas = _cas(rig.channel)
    wrong_size = rex.Digest(hash=_sha(present), size_bytes=3)
    empty = rex.Digest(hash=EMPTY_SHA256, size_bytes=0)
    response = await cas.FindMissingBlobs(
        rex.FindMissingBlobsRequest(
            blob_digests=[_digest(present), _digest(absent), wrong_size, empty]
        ),
        metadata=_md(rig.key),
    )
    assert list(response.missing_blob_digests) == [_digest(absent), wrong_size]
    # Found late in its TTL, a blob is kept a whole TTL more: Bazel will reference it.
    rig.clock.now += TTL * 0.9
    await cas.FindMissingBlobs(
        rex.FindMissingBlobsRequest(blob_digests=[_digest(present)]), metadata=_md(rig.key)
    )
    expires = await rig.pool.fetchval("SELECT expires_at FROM bep.blobs")
    assert expires == rig.clock.now + TTL


async def test_batch_update_and_read(rig: Rig) -> None:
    good, bad = b"good blob", b"bad blob"
    cas = _cas(rig.channel)
    response = await cas.BatchUpdateBlobs(
        rex.BatchUpdateBlobsRequest(
            requests=[
                rex.BatchUpdateBlobsRequest.Request(digest=_digest(good), data=good),
                rex.BatchUpdateBlobsRequest.Request(
                    digest=rex.Digest(hash=_sha(b"not it"), size_bytes=len(bad)), data=bad
                ),
                rex.BatchUpdateBlobsRequest.Request(
                    digest=rex.Digest(hash=_sha(bad), size_bytes=len(bad) + 1), data=bad
                ),
            ]
        ),
        metadata=_md(rig.key),
    )
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert [r.status.code for r in response.responses] == [0, invalid, invalid]
    rows, files = await _stored(rig)
    assert [r["digest"] for r in rows] == [_sha(good)]
    assert len(files) == 1
    read = await cas.BatchReadBlobs(
        rex.BatchReadBlobsRequest(digests=[_digest(good), _digest(bad)]), metadata=_md(rig.key)
    )
    assert [(r.status.code, r.data) for r in read.responses] == [
        (0, good),
        (grpc.StatusCode.NOT_FOUND.value[0], b""),
    ]
    assert await _read(rig.channel, rig.key, _sha(good), len(good)) == good


async def test_an_interrupted_write_resumes_where_it_stopped(rig: Rig) -> None:
    data = os.urandom(300_000)
    digest = _sha(data)
    resource = f"main/uploads/u-9/blobs/{digest}/{len(data)}"
    stub = bytestream_pb2_grpc.ByteStreamStub(rig.channel)  # type: ignore[no-untyped-call]

    async def status() -> tuple[int, bool]:
        response = await stub.QueryWriteStatus(
            bytestream_pb2.QueryWriteStatusRequest(resource_name=resource),
            metadata=_md(rig.key),
        )
        return response.committed_size, response.complete

    assert await status() == (0, False)
    first = await _write(
        rig.channel,
        rig.key,
        data[:100_000],
        digest=digest,
        size=len(data),
        upload="u-9",
        finish=False,
    )
    assert first.committed_size == 100_000
    assert await status() == (100_000, False)
    with pytest.raises(grpc.aio.AioRpcError) as error:  # not where the upload stands
        await _write(
            rig.channel,
            rig.key,
            data[50_000:],
            digest=digest,
            size=len(data),
            upload="u-9",
            offset=50_000,
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rest = await _write(
        rig.channel,
        rig.key,
        data[100_000:],
        digest=digest,
        size=len(data),
        upload="u-9",
        offset=100_000,
    )
    assert rest.committed_size == len(data)
    assert await status() == (len(data), True)
    assert await _read(rig.channel, rig.key, digest, len(data)) == data


async def test_capabilities_and_the_action_cache_that_keeps_nothing(rig: Rig) -> None:
    capabilities = await rex_grpc.CapabilitiesStub(rig.channel).GetCapabilities(  # type: ignore[no-untyped-call]
        rex.GetCapabilitiesRequest(), metadata=_md(rig.key)
    )
    cache = capabilities.cache_capabilities
    assert list(cache.digest_function) == [rex.DigestFunction.SHA256]
    assert cache.action_cache_update_capabilities.update_enabled
    assert cache.max_batch_total_size_bytes == 4 * 1024 * 1024
    assert capabilities.high_api_version.major == 2
    action_cache = rex_grpc.ActionCacheStub(rig.channel)  # type: ignore[no-untyped-call]
    action = rex.Digest(hash=_sha(b"action"), size_bytes=6)
    result = rex.ActionResult(exit_code=0, stdout_raw=b"hi")
    updated = await action_cache.UpdateActionResult(
        rex.UpdateActionResultRequest(action_digest=action, action_result=result),
        metadata=_md(rig.key),
    )
    assert updated == result
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await action_cache.GetActionResult(
            rex.GetActionResultRequest(action_digest=action), metadata=_md(rig.key)
        )
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def _uri(data: bytes) -> str:
    return f"bytestream://cache.example.com:443/blobs/{_sha(data)}/{len(data)}"


def _events_referencing(log: bytes, profile: bytes, output: bytes) -> list[bes.BuildEvent]:
    events = sample_events(tests=1)
    test_result = next(e for e in events if e.WhichOneof("payload") == "test_result")
    test_result.test_result.test_action_output.add(name="test.log", uri=_uri(log))
    test_result.test_result.test_action_output.add(name="test.xml", uri="file:///tmp/test.xml")
    named = bes.BuildEvent(
        named_set_of_files=bes.NamedSetOfFiles(files=[bes.File(name="out.txt", uri=_uri(output))])
    )
    named.id.named_set.id = "0"
    logs = bes.BuildEvent(
        build_tool_logs=bes.BuildToolLogs(
            log=[bes.File(name="command.profile.gz", uri=_uri(profile))]
        )
    )
    logs.id.build_tool_logs.SetInParent()
    return [*events[:-1], named, logs, events[-1]]


def test_normalize_takes_the_bytestream_files_of_events() -> None:
    log, profile, output = b"log", b"profile", b"output"
    changes = Changes()
    for seq, event in enumerate(_events_referencing(log, profile, output), 1):
        normalize(event, seq, changes)
    assert changes.artifacts == {
        ("test_output", "//pkg:test_0", "test.log", _sha(log)): len(log),
        ("output", "", "out.txt", _sha(output)): len(output),
        ("build_tool_log", "", "command.profile.gz", _sha(profile)): len(profile),
    }
    assert bytestream_digest(f"bytestream://h/inst/x/blobs/{'a' * 64}/12") == ("a" * 64, 12)
    assert bytestream_digest(f"bytestream://h/blobs/{'a' * 63}/12") is None
    assert bytestream_digest("file:///tmp/x") is None


async def _stream(rig: Rig, invocation_id: str, events: Iterable[bes.BuildEvent]) -> None:
    items = list(events)
    requests = [request(invocation_id, i + 1, bazel=e) for i, e in enumerate(items)]
    requests.append(request(invocation_id, len(items) + 1, finished=True))
    outcome = await publish(rig.channel, requests, key=rig.key)
    assert outcome.code == grpc.StatusCode.OK, outcome.details


async def test_a_build_pins_the_blobs_it_references_and_the_prune_keeps_them(rig: Rig) -> None:
    log, profile, output, stray = b"PASS\n", b"\x1f\x8b profile", b"out", b"nobody's"
    for data in (log, profile, output, stray):
        await _write(rig.channel, rig.key, data, upload=_sha(data))
    await _stream(rig, "inv-pin", _events_referencing(log, profile, output))

    artifacts = await rig.pool.fetch(
        "SELECT invocation_id, project_id, kind, label, name, digest, size FROM bep.artifacts"
        " ORDER BY kind"
    )
    assert [tuple(a) for a in artifacts] == [
        ("inv-pin", rig.project_id, "build_tool_log", "", "command.profile.gz", _sha(profile), 10),
        ("inv-pin", rig.project_id, "output", "", "out.txt", _sha(output), 3),
        ("inv-pin", rig.project_id, "test_output", "//pkg:test_0", "test.log", _sha(log), 5),
    ]
    async with rig.pool.acquire() as conn:
        found = await find_artifact(conn, "inv-pin", _sha(log))
        assert found is not None
        assert (found.name, found.key_prefix, found.size) == ("test.log", "acme", 5)
        assert await find_artifact(conn, "inv-pin", _sha(stray)) is None
        assert len(await list_artifacts(conn, "inv-pin")) == 3

        # Within the TTL nothing goes; past it the unpinned upload goes, the pinned stay.
        assert (await prune(conn, rig.root, rig.clock.now)).blobs == 0
        later = rig.clock.now + TTL + timedelta(hours=1)
        result = await prune(conn, rig.root, later)
        assert (result.blobs, result.bytes) == (1, len(stray))
        left = {r["digest"] for r in await conn.fetch("SELECT digest FROM bep.blobs")}
        assert left == {_sha(log), _sha(profile), _sha(output)}
        assert not blob_path(rig.root, "acme", _sha(stray)).exists()
        assert blob_path(rig.root, "acme", _sha(log)).read_bytes() == log

        # Retention deletes the build, and with it its pins: the next prune takes them.
        await conn.execute(
            "UPDATE bep.invocations SET created_at = created_at - interval '200 days'"
        )
        assert await delete_old_builds(conn, date.today(), 90) == 1
        assert (await prune(conn, rig.root, later)).blobs == 3
        assert await conn.fetchval("SELECT count(*) FROM bep.blobs") == 0
    assert [p for p in rig.root.rglob("*") if p.is_file()] == []


async def test_prune_removes_stale_partial_uploads(rig: Rig) -> None:
    data = os.urandom(1000)
    await _write(rig.channel, rig.key, data[:500], digest=_sha(data), size=1000, finish=False)
    partials = list((rig.root / ".uploads").rglob("*"))
    assert [p.stat().st_size for p in partials if p.is_file()] == [500]
    async with rig.pool.acquire() as conn:
        assert (await prune(conn, rig.root, datetime.now(UTC))).stale_uploads == 0
        result = await prune(conn, rig.root, datetime.now(UTC) + timedelta(days=2))
    assert result.stale_uploads == 1
    assert [p for p in rig.root.rglob("*") if p.is_file()] == []


async def test_without_a_blob_root_the_cas_is_unimplemented(fresh_pg_dsn: str) -> None:
    await BEP_MIGRATIONS.migrate(fresh_pg_dsn)
    pool = await asyncpg.create_pool(fresh_pg_dsn, min_size=1, max_size=2)
    assert pool is not None
    async with pool.acquire() as conn:
        await create_project(conn, "acme")
        key = (await create_key(conn, "acme")).key
    server = BepServer(pool, KeyCache(pool))
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _write(channel, key, b"data")
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await rex_grpc.CapabilitiesStub(channel).GetCapabilities(  # type: ignore[no-untyped-call]
                rex.GetCapabilitiesRequest(), metadata=_md(key)
            )
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await channel.close()
        await server.stop(0)
        await pool.close()
