"""The S3-compatible blob store: SigV4 against AWS's published example, :class:`S3Store`
against a real moto S3 server (a subprocess on a loopback port) that checks every
signature, the settings that choose it, and the CAS sink over gRPC with its blobs in S3.

moto checks signatures only once IAM knows the key: the module's server starts open,
an IAM user with an access key and an allow-all policy is created, and then
``/moto-api/reset-auth`` turns authentication on for every later request (moto recomputes
each signature with botocore, an implementation that is not ours).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import asyncpg
import grpc
import httpx
import pytest
from conveyor_bep.__main__ import _cas_config
from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_bep.bazel.build.bazel.remote.execution.v2 import (
    remote_execution_pb2 as rex,
)
from conveyor_bep.bazel.build.bazel.remote.execution.v2 import (
    remote_execution_pb2_grpc as rex_grpc,
)
from conveyor_bep.bazel.google.bytestream import bytestream_pb2, bytestream_pb2_grpc
from conveyor_bep.blobs import BlobUpload, DiskStore, open_blob, prune
from conveyor_bep.cas import CasConfig
from conveyor_bep.ingest import IngestLimits
from conveyor_bep.keys import KeyCache, create_key, create_project
from conveyor_bep.s3 import S3Error, S3Store
from conveyor_bep.server import BepServer
from conveyor_bep.sigv4 import (
    EMPTY_PAYLOAD_SHA256,
    Credentials,
    canonical_request,
    sign,
    string_to_sign,
)
from conveyor_bep.store import BEP_MIGRATIONS, delete_old_builds
from conveyor_runtime.settings import BepSettings
from conveyor_testkit.bep import publish, request, sample_events
from conveyor_testkit.polling import wait_until_blocking
from google.rpc import code_pb2  # type: ignore[import-untyped]

EXAMPLE = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
BUCKET = "conveyor-blobs"
TTL = timedelta(hours=24)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- SigV4 -------------------------------------------------------------------------------


def test_sigv4_matches_the_aws_s3_get_object_example() -> None:
    # The "GET Object" example of the S3 SigV4 documentation (header-based auth): the
    # first 10 bytes of examplebucket/test.txt, 2013-05-24T00:00:00Z.
    now = datetime(2013, 5, 24, tzinfo=UTC)
    headers = {
        "host": "examplebucket.s3.amazonaws.com",
        "range": "bytes=0-9",
        "x-amz-content-sha256": EMPTY_PAYLOAD_SHA256,
        "x-amz-date": "20130524T000000Z",
    }
    request_text, signed_headers = canonical_request(
        "GET", "/test.txt", (), headers, EMPTY_PAYLOAD_SHA256
    )
    assert signed_headers == "host;range;x-amz-content-sha256;x-amz-date"
    assert request_text == "\n".join(
        [
            "GET",
            "/test.txt",
            "",
            "host:examplebucket.s3.amazonaws.com",
            "range:bytes=0-9",
            f"x-amz-content-sha256:{EMPTY_PAYLOAD_SHA256}",
            "x-amz-date:20130524T000000Z",
            "",
            "host;range;x-amz-content-sha256;x-amz-date",
            EMPTY_PAYLOAD_SHA256,
        ]
    )
    assert string_to_sign(
        "20130524T000000Z", "20130524/us-east-1/s3/aws4_request", request_text
    ).endswith("\n7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972")
    signed = sign(
        EXAMPLE,
        method="GET",
        host="examplebucket.s3.amazonaws.com",
        path="/test.txt",
        payload_sha256=EMPTY_PAYLOAD_SHA256,
        now=now,
        headers={"Range": "bytes=0-9"},
    )
    assert signed["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )
    assert "wJalrXUtnFEMI" not in repr(EXAMPLE)


def test_sigv4_canonical_query_and_header_values() -> None:
    text, names = canonical_request(
        "get",
        "/b/k",
        [("prefix", "a b/c"), ("list-type", "2")],
        {"Host": "h", "X-Amz-Meta-Note": "  two   spaces "},
        "UNSIGNED-PAYLOAD",
    )
    lines = text.split("\n")
    assert lines[0] == "GET"
    assert lines[2] == "list-type=2&prefix=a%20b%2Fc"
    assert "x-amz-meta-note:two spaces" in lines
    assert names == "host;x-amz-meta-note"


# --- a moto S3 server --------------------------------------------------------------------


@dataclass(frozen=True)
class Moto:
    endpoint: str
    access_key_id: str
    secret_access_key: str

    def store(self, bucket: str = BUCKET, **kwargs: Any) -> S3Store:
        return S3Store(
            self.endpoint,
            bucket,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
            **kwargs,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _signed(
    client: httpx.Client,
    endpoint: str,
    credentials: Credentials,
    method: str,
    path: str,
    *,
    body: bytes = b"",
    query: list[tuple[str, str]] | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    """One request signed by our SigV4 (for what S3Store does not do: IAM, buckets)."""
    url = httpx.URL(endpoint + path, params=query or [])
    signed = sign(
        credentials,
        method=method,
        host=url.netloc.decode(),
        path=path,
        query=query or (),
        payload_sha256=_sha(body),
        now=datetime.now(UTC),
        headers=headers,
    )
    return client.request(method, url, headers=signed, content=body)


def _iam(client: httpx.Client, endpoint: str, **params: str) -> str:
    body = urlencode({**params, "Version": "2010-05-08"}).encode()
    response = _signed(
        client,
        endpoint,
        Credentials("AKIAIOSFODNN7EXAMPLE", "bootstrap", "us-east-1", "iam"),
        "POST",
        "/",
        body=body,
        headers={"content-type": "application/x-www-form-urlencoded; charset=utf-8"},
    )
    assert response.status_code == 200, response.text
    return response.text


@pytest.fixture(scope="module")
def moto() -> Iterator[Moto]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
    env.pop("INITIAL_NO_AUTH_ACTION_COUNT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until_blocking(
            lambda: proc.poll() is not None or _answers(port),
            within=60,
            message="moto's S3 server listening",
        )
        assert proc.poll() is None, "moto.server exited"
        with httpx.Client(timeout=10) as client:
            _iam(client, endpoint, Action="CreateUser", UserName="conveyor-bep")
            policy = {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
            }
            _iam(
                client,
                endpoint,
                Action="PutUserPolicy",
                UserName="conveyor-bep",
                PolicyName="blobs",
                PolicyDocument=json.dumps(policy),
            )
            created = _iam(client, endpoint, Action="CreateAccessKey", UserName="conveyor-bep")
            key_id = re.search(r"<AccessKeyId>([^<]+)</AccessKeyId>", created)
            secret = re.search(r"<SecretAccessKey>([^<]+)</SecretAccessKey>", created)
            assert key_id is not None, created
            assert secret is not None, created
            # From here on moto checks every request's signature and the key's policy.
            reset = client.post(f"{endpoint}/moto-api/reset-auth", content=b"0")
            assert reset.status_code == 200, reset.text
            credentials = Credentials(key_id[1], secret[1])
            made = _signed(client, endpoint, credentials, "PUT", f"/{BUCKET}")
            assert made.status_code == 200, made.text
        yield Moto(endpoint, key_id[1], secret[1])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def store(moto: Moto) -> Iterator[S3Store]:
    s3 = moto.store()
    try:
        yield s3
    finally:
        s3.close()


def _keys(moto: Moto, prefix: str = "") -> list[str]:
    """The bucket's object keys under ``prefix`` (ListObjectsV2: a signed query)."""
    with httpx.Client(timeout=10) as client:
        response = _signed(
            client,
            moto.endpoint,
            Credentials(moto.access_key_id, moto.secret_access_key),
            "GET",
            f"/{BUCKET}",
            query=[("list-type", "2"), ("prefix", prefix)],
        )
    assert response.status_code == 200, response.text
    return re.findall(r"<Key>([^<]+)</Key>", response.text)


# --- S3Store -----------------------------------------------------------------------------


def test_put_open_head_delete_round_trip(store: S3Store, moto: Moto, tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # more than one read chunk
    digest = _sha(data)
    assert not store.exists("acme", digest)
    assert store.open("acme", digest) is None
    store.put("acme", digest, data)
    assert store.exists("acme", digest)
    assert _keys(moto, "acme/") == [f"acme/{digest}"]  # <key_prefix>/<digest>, as the spec says
    handle = store.open("acme", digest)
    assert handle is not None
    with handle:
        assert handle.read() == data
    handle = store.open("acme", digest, offset=1_000_000)
    assert handle is not None
    with handle:
        assert handle.read(5) == data[1_000_000:1_000_005]  # a stream closed early
    handle = store.open("acme", digest, offset=len(data))
    assert handle is not None
    with handle:
        assert handle.read() == b""
    assert not store.exists("other", digest)  # another prefix is another object

    small = b"a file staged in the spool"
    spooled = tmp_path / "upload"
    spooled.write_bytes(small)
    store.put("team/ci", _sha(small), spooled)
    assert not spooled.exists()  # consumed once stored
    reader = open_blob(store, "team/ci", _sha(small))
    assert reader is not None
    with reader:
        assert reader.read() == small

    store.delete("acme", digest)
    assert not store.exists("acme", digest)
    assert store.open("acme", digest) is None
    store.delete("acme", digest)  # absent: nothing to do
    store.delete("team/ci", _sha(small))
    assert _keys(moto) == []


def test_a_bad_prefix_or_digest_never_reaches_the_store(store: S3Store) -> None:
    for prefix, digest in (("../x", _sha(b"")), ("acme", "not-a-digest"), ("", _sha(b""))):
        with pytest.raises(ValueError, match=r"invalid|not a sha256"):
            store.open(prefix, digest)


def test_store_errors_are_clear(moto: Moto, tmp_path: Path) -> None:
    data = b"bytes"
    wrong = S3Store(
        moto.endpoint, BUCKET, access_key_id=moto.access_key_id, secret_access_key="wrong"
    )
    with wrong, pytest.raises(S3Error) as error:
        wrong.put("acme", _sha(data), data)
    assert (error.value.status, error.value.code) == (403, "SignatureDoesNotMatch")
    assert isinstance(error.value, OSError)
    assert "wrong" not in str(error.value)

    missing = moto.store("no-such-bucket")
    with missing:
        with pytest.raises(S3Error) as error:
            missing.open("acme", _sha(data))
        assert (error.value.status, error.value.code) == (404, "NoSuchBucket")
        with pytest.raises(S3Error, match="NoSuchBucket"):
            missing.put("acme", _sha(data), data)

    small = moto.store(max_put_bytes=3)
    spooled = tmp_path / "upload"
    spooled.write_bytes(data)
    with small, pytest.raises(S3Error, match="one PUT takes at most 3"):
        small.put("acme", _sha(data), spooled)
    assert spooled.exists()  # kept for a retry

    dead = S3Store(
        f"http://127.0.0.1:{_free_port()}",
        BUCKET,
        access_key_id="k",
        secret_access_key="s",
        timeout=2,
    )
    with dead, pytest.raises(S3Error, match="unreachable") as error:
        dead.exists("acme", _sha(data))
    assert error.value.status is None


# --- settings ----------------------------------------------------------------------------


def _settings(**kwargs: Any) -> BepSettings:
    return BepSettings(**kwargs)


def test_the_s3_settings_choose_the_store(tmp_path: Path) -> None:
    s3 = {
        "bep_blob_store": "s3",
        "bep_s3_endpoint": "https://s3.example.com",
        "bep_s3_bucket": "blobs",
        "bep_s3_access_key_id": "AKIA",
        "bep_s3_secret_access_key": "hunter2-secret-value",
    }
    config = _cas_config(_settings(**s3, bep_blob_root=str(tmp_path)))
    assert config is not None
    assert isinstance(config.store, S3Store)
    assert config.root == tmp_path  # only the spool of uploads in progress
    config.store.close()
    config = _cas_config(_settings(**s3))
    assert config is not None
    assert config.store is not None
    config.store.close()
    disk = _cas_config(_settings(bep_blob_root=str(tmp_path)))
    assert disk is not None
    assert isinstance(disk.store, DiskStore)
    assert disk.store.root == tmp_path
    assert _cas_config(_settings()) is None

    for name in ("bep_s3_endpoint", "bep_s3_bucket", "bep_s3_secret_access_key"):
        with pytest.raises(ValueError, match=f"needs {name}"):
            _settings(**{**s3, name: None})
    with pytest.raises(ValueError, match="http"):
        _settings(**{**s3, "bep_s3_endpoint": "s3.example.com"})
    with pytest.raises(ValueError, match="plain HTTP"):
        _settings(**{**s3, "bep_s3_endpoint": "http://s3.example.com"})
    _settings(**{**s3, "bep_s3_endpoint": "http://127.0.0.1:9000"})
    _settings(**{**s3, "bep_s3_endpoint": "http://s3.example.com"}, allow_plaintext=True)
    with pytest.raises(ValueError, match="5 GiB"):
        _settings(**s3, bep_max_blob_bytes=6 * 1024**3)
    with pytest.raises(ValueError, match="needs bep_s3_bucket") as error:
        _settings(**{**s3, "bep_s3_bucket": None})
    assert "hunter2" not in str(error.value)


# --- the CAS sink over gRPC with its blobs in S3 -----------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


@dataclass
class Rig:
    pool: asyncpg.Pool[Any]
    channel: grpc.aio.Channel
    spool: Path
    store: S3Store
    clock: Clock
    key: str


@pytest.fixture
async def rig(fresh_pg_dsn: str, tmp_path: Path, store: S3Store) -> AsyncIterator[Rig]:
    await BEP_MIGRATIONS.migrate(fresh_pg_dsn)
    pool = await asyncpg.create_pool(fresh_pg_dsn, min_size=1, max_size=8)
    assert pool is not None
    async with pool.acquire() as conn:
        await create_project(conn, "acme")
        key = (await create_key(conn, "acme")).key
    clock = Clock()
    spool = tmp_path / "spool"
    server = BepServer(
        pool,
        KeyCache(pool),
        shards=2,
        commit_interval=0.005,
        limits=IngestLimits(batch_window=0.01),
        cas=CasConfig(spool, upload_ttl=TTL, clock=clock, store=store),
    )
    port = await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Rig(pool, channel, spool, store, clock, key)
    finally:
        await channel.close()
        await server.stop(0)
        await pool.close()


async def _write(rig: Rig, data: bytes, *, upload: str, chunk: int = 64 * 1024) -> int:
    resource = f"uploads/{upload}/blobs/{_sha(data)}/{len(data)}"
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)] or [b""]

    async def source() -> AsyncIterator[bytestream_pb2.WriteRequest]:
        for i, piece in enumerate(pieces):
            yield bytestream_pb2.WriteRequest(
                resource_name=resource if i == 0 else "",
                write_offset=i * chunk,
                data=piece,
                finish_write=i == len(pieces) - 1,
            )

    stub = bytestream_pb2_grpc.ByteStreamStub(rig.channel)  # type: ignore[no-untyped-call]
    response = await stub.Write(source(), metadata=(("x-api-key", rig.key),), timeout=10)
    size: int = response.committed_size
    return size


async def _read(rig: Rig, data: bytes, **kwargs: int) -> bytes:
    stub = bytestream_pb2_grpc.ByteStreamStub(rig.channel)  # type: ignore[no-untyped-call]
    read = bytestream_pb2.ReadRequest(resource_name=f"blobs/{_sha(data)}/{len(data)}", **kwargs)
    out = b""
    async for response in stub.Read(read, metadata=(("x-api-key", rig.key),), timeout=10):
        out += response.data
    return out


def _uri(data: bytes) -> str:
    return f"bytestream://cache.example.com/blobs/{_sha(data)}/{len(data)}"


@pytest.mark.postgres
async def test_the_cas_sink_keeps_its_blobs_in_s3(rig: Rig, moto: Moto) -> None:
    log, stray = os.urandom(600_000), b"an upload no build references"
    assert await _write(rig, log, upload="u-log", chunk=100_000) == len(log)
    assert await _write(rig, stray, upload="u-stray") == len(stray)
    assert sorted(_keys(moto)) == sorted(f"acme/{_sha(d)}" for d in (log, stray))
    assert [p for p in rig.spool.rglob("*") if p.is_file()] == []  # nothing left staged
    assert await _read(rig, log) == log
    assert await _read(rig, log, read_offset=1000, read_limit=10) == log[1000:1010]
    assert await _read(rig, log, read_offset=len(log)) == b""
    async with rig.pool.acquire() as conn:
        assert await conn.fetchval("SELECT key_prefix FROM bep.blobs LIMIT 1") == "acme"

    # A build references the log: its stream pins it.
    events = sample_events(tests=1)
    logs = bes.BuildEvent(
        build_tool_logs=bes.BuildToolLogs(log=[bes.File(name="test.log", uri=_uri(log))])
    )
    logs.id.build_tool_logs.SetInParent()
    items = [*events[:-1], logs, events[-1]]
    requests = [request("inv-s3", i + 1, bazel=e) for i, e in enumerate(items)]
    requests.append(request("inv-s3", len(items) + 1, finished=True))
    outcome = await publish(rig.channel, requests, key=rig.key)
    assert outcome.code == grpc.StatusCode.OK, outcome.details

    async with rig.pool.acquire() as conn:
        later = rig.clock.now + TTL + timedelta(hours=1)
        result = await prune(conn, rig.spool, later, store=rig.store)
        assert (result.blobs, result.bytes) == (1, len(stray))
        assert _keys(moto) == [f"acme/{_sha(log)}"]  # the unpinned upload's object is gone
        assert await _read(rig, log) == log
        # Retention deletes the build and its pins: the next prune deletes the object.
        await conn.execute(
            "UPDATE bep.invocations SET created_at = created_at - interval '200 days'"
        )
        assert await delete_old_builds(conn, date.today(), 90) == 1
        assert (await prune(conn, rig.spool, later, store=rig.store)).blobs == 1
        assert await conn.fetchval("SELECT count(*) FROM bep.blobs") == 0
    assert _keys(moto) == []


@pytest.mark.postgres
async def test_a_failing_store_stores_nothing_and_keeps_the_upload(rig: Rig, moto: Moto) -> None:
    data = b"bytes the store refuses"
    broken = moto.store("no-such-bucket")
    rig_config = CasConfig(rig.spool, upload_ttl=TTL, clock=rig.clock, store=broken)
    pool = rig.pool
    async with pool.acquire() as conn:
        project_id = await conn.fetchval("SELECT id FROM bep.projects WHERE slug = 'acme'")
    server = BepServer(pool, KeyCache(pool), cas=rig_config)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            failing = Rig(pool, channel, rig.spool, broken, rig.clock, rig.key)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await _write(failing, data, upload="u-broken")
            # UNAVAILABLE, which Bazel retries (resuming at the staged bytes' end).
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            cas = rex_grpc.ContentAddressableStorageStub(channel)  # type: ignore[no-untyped-call]
            batch = await cas.BatchUpdateBlobs(
                rex.BatchUpdateBlobsRequest(
                    requests=[
                        rex.BatchUpdateBlobsRequest.Request(
                            digest=rex.Digest(hash=_sha(data), size_bytes=len(data)), data=data
                        )
                    ]
                ),
                metadata=(("x-api-key", rig.key),),
            )
            assert [r.status.code for r in batch.responses] == [code_pb2.UNAVAILABLE]
    finally:
        await server.stop(0)
        broken.close()
    assert await pool.fetchval("SELECT count(*) FROM bep.blobs") == 0
    # The verified bytes stay staged: a retry resumes at their end and commits them.
    partial = BlobUpload.partial_size(rig.spool, project_id, "u-broken", _sha(data))
    assert partial == len(data)
    assert _keys(moto) == []
