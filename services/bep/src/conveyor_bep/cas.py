"""The built-in CAS sink: the remote-cache services Bazel's ``--remote_cache`` needs to
upload the files its build events reference, on the BES server's port.

* ``ByteStream`` ``Write`` (resumable: ``QueryWriteStatus`` says how far an upload got),
  ``Read``, and ``QueryWriteStatus``;
* ``ContentAddressableStorage`` ``FindMissingBlobs``, ``BatchUpdateBlobs``,
  ``BatchReadBlobs`` (``GetTree`` is not served);
* ``Capabilities.GetCapabilities``: SHA-256, action-cache updates on, the batch limit;
* ``ActionCache``: stores nothing. ``GetActionResult`` is always NOT_FOUND and
  ``UpdateActionResult`` is accepted and dropped, so Bazel runs every action itself and
  uploads its outputs, which is what the sink is for: it is not a build cache.

Every CAS and ByteStream call needs the project's API key in ``x-api-key``
(``--remote_header=x-api-key=KEY``, which Bazel sends on every remote-cache call; the
server's :class:`~conveyor_bep.server.ApiKeyInterceptor` resolves it): no key or an unknown
one is UNAUTHENTICATED. Uploads go to the caller's project only (:mod:`conveyor_bep.blobs`),
unpinned until a build references them; reads see the caller's project's blobs only (any
other digest is NOT_FOUND). A digest that does not match the bytes, or a size that does not
match, is INVALID_ARGUMENT and nothing is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import grpc
from google.rpc import code_pb2, status_pb2  # type: ignore[import-untyped]

from conveyor_bep.bazel.build.bazel.remote.execution.v2 import (
    remote_execution_pb2 as rex,
)
from conveyor_bep.bazel.build.bazel.remote.execution.v2 import (
    remote_execution_pb2_grpc as rex_grpc,
)
from conveyor_bep.bazel.build.bazel.semver import semver_pb2
from conveyor_bep.bazel.google.bytestream import bytestream_pb2, bytestream_pb2_grpc
from conveyor_bep.blobs import (
    EMPTY_SHA256,
    BlobStore,
    BlobUpload,
    DigestMismatch,
    DiskStore,
    commit_blob,
    find_present,
    get_blob,
    open_blob,
    write_temp,
)
from conveyor_bep.keys import Project

logger = logging.getLogger(__name__)


class StoreUnavailable(Exception):
    """The blob store (disk, S3) or the database failed to take a verified blob."""


_READ_RE = re.compile(r"(?:.*/)?blobs/([0-9a-f]{64})/([0-9]{1,19})(?:/.*)?")
_WRITE_RE = re.compile(r"(?:.*/)?uploads/([^/]+)/blobs/([0-9a-f]{64})/([0-9]{1,19})(?:/.*)?")
#: Bytes per ByteStream read response.
_READ_CHUNK = 256 * 1024


def _utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class CasConfig:
    """Where the sink stores blobs and what it accepts."""

    #: A local directory: the blobs themselves with the disk store; with another store,
    #: only the uploads in progress (``<root>/.uploads``).
    root: Path
    #: How long an upload no build references is kept.
    upload_ttl: timedelta = timedelta(hours=24)
    #: The largest blob accepted (a larger one is RESOURCE_EXHAUSTED).
    max_blob_bytes: int = 1024 * 1024 * 1024
    #: The total of one BatchUpdateBlobs / BatchReadBlobs (announced in the capabilities).
    max_batch_bytes: int = 4 * 1024 * 1024
    clock: Callable[[], datetime] = field(default=_utcnow)
    #: Where the bytes go (None: the :class:`~conveyor_bep.blobs.DiskStore` at ``root``).
    store: BlobStore | None = None


def _key_prefix(project: Project) -> str:
    return project.key_prefix or project.slug


class _Sink:
    """What the servicers share: the pool, the config, the caller's project."""

    def __init__(
        self,
        pool: Any,
        config: CasConfig,
        header_project: Callable[[], Project | None],
    ) -> None:
        self.pool = pool
        self.config = config
        self.store: BlobStore = config.store if config.store is not None else DiskStore(config.root)
        self._header_project = header_project

    async def project(self, context: grpc.aio.ServicerContext[Any, Any]) -> Project:
        project = self._header_project()
        if project is None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "the CAS needs the project's API key: --remote_header=x-api-key=KEY",
            )
        return project

    def too_large(self, size: int) -> bool:
        return size > self.config.max_blob_bytes

    async def commit(self, project: Project, digest: str, size: int, temp: Path) -> None:
        """Store a verified upload; :class:`StoreUnavailable` when the blob store or the
        database fails (the staged bytes stay for a retry)."""
        config = self.config
        try:
            async with self.pool.acquire() as conn:
                await commit_blob(
                    conn,
                    self.store,
                    project_id=project.id,
                    key_prefix=_key_prefix(project),
                    digest=digest,
                    size=size,
                    temp=temp,
                    now=config.clock(),
                    ttl=config.upload_ttl,
                )
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            logger.warning(
                "bep.cas.store_failed project=%s digest=%s error=%s", project.slug, digest, exc
            )
            raise StoreUnavailable(f"the blob store failed; retry: {exc}") from exc
        logger.debug("bep.cas.stored project=%s digest=%s size=%d", project.slug, digest, size)

    async def read(self, project: Project, digest: str, size: int) -> bytes | None:
        """The whole blob, or None when the project does not hold it."""
        if digest == EMPTY_SHA256:
            return b"" if size == 0 else None
        async with self.pool.acquire() as conn:
            blob = await get_blob(conn, project.id, digest)
        if blob is None or blob.size != size:
            return None

        def load() -> bytes | None:
            f = open_blob(self.store, blob.key_prefix, digest)
            if f is None:
                return None
            with f:
                return f.read()

        return await asyncio.to_thread(load)


class CapabilitiesService(rex_grpc.CapabilitiesServicer):
    """SHA-256 only, action-cache updates accepted, the batch limit; no execution."""

    def __init__(self, config: CasConfig) -> None:
        self._config = config

    async def GetCapabilities(
        self, request: rex.GetCapabilitiesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rex.ServerCapabilities:
        return rex.ServerCapabilities(
            cache_capabilities=rex.CacheCapabilities(
                digest_function=[rex.DigestFunction.SHA256],
                action_cache_update_capabilities=rex.ActionCacheUpdateCapabilities(
                    update_enabled=True
                ),
                max_batch_total_size_bytes=self._config.max_batch_bytes,
                symlink_absolute_path_strategy=rex.SymlinkAbsolutePathStrategy.ALLOWED,
            ),
            low_api_version=semver_pb2.SemVer(major=2),
            high_api_version=semver_pb2.SemVer(major=2),
        )


class ActionCacheService(rex_grpc.ActionCacheServicer):
    """An action cache that keeps nothing: every lookup misses, every update is dropped."""

    async def GetActionResult(
        self, request: rex.GetActionResultRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rex.ActionResult:
        await context.abort(grpc.StatusCode.NOT_FOUND, "the CAS sink keeps no action results")

    async def UpdateActionResult(
        self,
        request: rex.UpdateActionResultRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> rex.ActionResult:
        return request.action_result


def _status(code: int, message: str = "") -> status_pb2.Status:
    return status_pb2.Status(code=code, message=message)


class ContentAddressableStorageService(rex_grpc.ContentAddressableStorageServicer):
    """FindMissingBlobs and the batch calls, over the caller's project's blobs."""

    def __init__(self, sink: _Sink) -> None:
        self._sink = sink

    async def FindMissingBlobs(
        self, request: rex.FindMissingBlobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rex.FindMissingBlobsResponse:
        project = await self._sink.project(context)
        config = self._sink.config
        wanted = [(d.hash, d.size_bytes) for d in request.blob_digests]
        async with self._sink.pool.acquire() as conn:
            present = await find_present(
                conn, project.id, wanted, now=config.clock(), ttl=config.upload_ttl
            )
        missing = [d for d in request.blob_digests if (d.hash, d.size_bytes) not in present]
        return rex.FindMissingBlobsResponse(missing_blob_digests=missing)

    async def BatchUpdateBlobs(
        self, request: rex.BatchUpdateBlobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rex.BatchUpdateBlobsResponse:
        project = await self._sink.project(context)
        sink = self._sink
        total = sum(len(r.data) for r in request.requests)
        if total > sink.config.max_batch_bytes:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{total} bytes in one batch: the limit is {sink.config.max_batch_bytes}",
            )
        responses = []
        for item in request.requests:
            digest = item.digest
            status = _status(code_pb2.OK)
            if sink.too_large(digest.size_bytes):
                status = _status(code_pb2.RESOURCE_EXHAUSTED, "blob too large")
            elif digest.hash == EMPTY_SHA256 and not item.data:
                pass
            else:
                try:
                    temp = await asyncio.to_thread(
                        write_temp, sink.config.root, project.id, digest.hash, item.data
                    )
                except DigestMismatch as exc:
                    status = _status(code_pb2.INVALID_ARGUMENT, str(exc))
                else:
                    if digest.size_bytes != len(item.data):
                        temp.unlink(missing_ok=True)
                        status = _status(
                            code_pb2.INVALID_ARGUMENT,
                            f"{len(item.data)} bytes sent as {digest.size_bytes}",
                        )
                    else:
                        try:
                            await sink.commit(project, digest.hash, digest.size_bytes, temp)
                        except StoreUnavailable as exc:
                            status = _status(code_pb2.UNAVAILABLE, str(exc))
            responses.append(rex.BatchUpdateBlobsResponse.Response(digest=digest, status=status))
        return rex.BatchUpdateBlobsResponse(responses=responses)

    async def BatchReadBlobs(
        self, request: rex.BatchReadBlobsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> rex.BatchReadBlobsResponse:
        project = await self._sink.project(context)
        total = sum(d.size_bytes for d in request.digests)
        if total > self._sink.config.max_batch_bytes:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{total} bytes in one batch: the limit is {self._sink.config.max_batch_bytes}",
            )
        responses = []
        for digest in request.digests:
            data = await self._sink.read(project, digest.hash, digest.size_bytes)
            responses.append(
                rex.BatchReadBlobsResponse.Response(
                    digest=digest,
                    data=data or b"",
                    status=_status(code_pb2.OK)
                    if data is not None
                    else _status(code_pb2.NOT_FOUND, "no such blob"),
                )
            )
        return rex.BatchReadBlobsResponse(responses=responses)


class ByteStreamService(bytestream_pb2_grpc.ByteStreamServicer):
    """Write (resumable), Read and QueryWriteStatus of ``[instance/]blobs/...`` and
    ``[instance/]uploads/<id>/blobs/...`` resources."""

    def __init__(self, sink: _Sink) -> None:
        self._sink = sink

    async def Read(
        self, request: bytestream_pb2.ReadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[bytestream_pb2.ReadResponse]:
        project = await self._sink.project(context)
        match = _READ_RE.fullmatch(request.resource_name)
        if match is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"not a blob resource: {request.resource_name!r}",
            )
        digest, size = match[1], int(match[2])
        if request.read_offset < 0 or request.read_limit < 0:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, "negative read_offset or limit")
        if request.read_offset > size:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"read_offset past {size} bytes")
        f = None
        if digest == EMPTY_SHA256 and size == 0:
            return
        async with self._sink.pool.acquire() as conn:
            blob = await get_blob(conn, project.id, digest)
        if blob is not None and blob.size == size:
            f = await asyncio.to_thread(
                open_blob, self._sink.store, blob.key_prefix, digest, offset=request.read_offset
            )
        if f is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no blob {digest}/{size}")
        with f:
            left = request.read_limit or size - request.read_offset
            while left > 0:
                chunk = await asyncio.to_thread(f.read, min(_READ_CHUNK, left))
                if not chunk:
                    break
                left -= len(chunk)
                yield bytestream_pb2.ReadResponse(data=chunk)

    async def Write(
        self,
        request_iterator: AsyncIterator[bytestream_pb2.WriteRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> bytestream_pb2.WriteResponse:
        project = await self._sink.project(context)
        sink = self._sink
        upload: BlobUpload | None = None
        finished = False
        try:
            async for request in request_iterator:
                if upload is None:
                    upload = await self._begin(project, request, context)
                if request.write_offset != upload.committed:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"write_offset {request.write_offset}, expected {upload.committed}",
                    )
                try:
                    upload.write(request.data)
                except DigestMismatch as exc:
                    upload.discard()
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                if request.finish_write:
                    finished = True
                    break
            if upload is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no write request")
            if not finished:
                # The client went away mid-upload: keep the bytes for QueryWriteStatus.
                await asyncio.to_thread(upload.suspend)
                return bytestream_pb2.WriteResponse(committed_size=upload.committed)
            try:
                temp = await asyncio.to_thread(upload.finish)
            except DigestMismatch as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            try:
                await sink.commit(project, upload.digest, upload.size, temp)
            except StoreUnavailable as exc:
                # Bazel retries UNAVAILABLE; the staged bytes let it resume at their end.
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            return bytestream_pb2.WriteResponse(committed_size=upload.size)
        except BaseException:
            if upload is not None:
                with contextlib.suppress(Exception):
                    upload.suspend()
            raise

    async def _begin(
        self,
        project: Project,
        request: bytestream_pb2.WriteRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> BlobUpload:
        match = _WRITE_RE.fullmatch(request.resource_name)
        if match is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"not an upload resource: {request.resource_name!r}",
            )
        upload_id, digest, size = match[1], match[2], int(match[3])
        if self._sink.too_large(size):
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"blob of {size} bytes: the limit is {self._sink.config.max_blob_bytes}",
            )
        upload = BlobUpload(self._sink.config.root, project.id, upload_id, digest, size)
        try:
            await asyncio.to_thread(upload.open, request.write_offset)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return upload

    async def QueryWriteStatus(
        self,
        request: bytestream_pb2.QueryWriteStatusRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> bytestream_pb2.QueryWriteStatusResponse:
        project = await self._sink.project(context)
        match = _WRITE_RE.fullmatch(request.resource_name)
        if match is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"not an upload resource: {request.resource_name!r}",
            )
        upload_id, digest, size = match[1], match[2], int(match[3])
        async with self._sink.pool.acquire() as conn:
            blob = await get_blob(conn, project.id, digest)
        if (blob is not None and blob.size == size) or (digest == EMPTY_SHA256 and size == 0):
            return bytestream_pb2.QueryWriteStatusResponse(committed_size=size, complete=True)
        partial = await asyncio.to_thread(
            BlobUpload.partial_size, self._sink.config.root, project.id, upload_id, digest
        )
        return bytestream_pb2.QueryWriteStatusResponse(committed_size=partial, complete=False)


def add_cas_services(
    server: grpc.aio.Server,
    pool: Any,
    config: CasConfig,
    header_project: Callable[[], Project | None],
) -> None:
    """Serve the CAS sink on ``server`` (beside the BES)."""
    sink = _Sink(pool, config, header_project)
    config.root.mkdir(parents=True, exist_ok=True)
    rex_grpc.add_CapabilitiesServicer_to_server(CapabilitiesService(config), server)  # type: ignore[no-untyped-call]
    rex_grpc.add_ActionCacheServicer_to_server(ActionCacheService(), server)  # type: ignore[no-untyped-call]
    rex_grpc.add_ContentAddressableStorageServicer_to_server(  # type: ignore[no-untyped-call]
        ContentAddressableStorageService(sink), server
    )
    bytestream_pb2_grpc.add_ByteStreamServicer_to_server(ByteStreamService(sink), server)  # type: ignore[no-untyped-call]
