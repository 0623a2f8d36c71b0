"""The blobs of the built-in CAS sink: bytes in a :class:`BlobStore` under each project's
key prefix, their metadata in ``bep.blobs``, the artifacts of builds that pin them, and
the prune.

A blob belongs to one project: it is keyed by ``(project_id, digest)`` and its bytes live
under the project's key prefix, so projects never share blobs. Two stores: on disk
(:class:`DiskStore`) at ``<root>/<key_prefix>/aa/bb/<sha256>`` (``aa``, ``bb``: the
digest's first two byte pairs), so one project's data is one directory; or in an
S3-compatible bucket (:class:`conveyor_bep.s3.S3Store`) as ``<key_prefix>/<sha256>``. Bazel
uploads a file to the cache *before* it sends the event that references it, so an upload
is accepted *unpinned*, with an expiry (the upload TTL); the ingest's commit of a batch
whose events reference ``bytestream://`` URIs adds ``bep.artifacts`` rows, and a blob
with an artifact row is *pinned* by that build. :func:`prune` deletes the blobs that no
artifact row references once their expiry has passed: uploads no build pinned within
their TTL, and blobs whose builds retention has since deleted (it deletes the builds'
artifact rows with them).

Writes are atomic: the bytes go to a temporary file under ``<root>/.uploads`` (a local
directory with either store), are checked against the digest, fsynced and put into the
store (on disk: renamed into place; in S3: one PUT, which S3 makes visible whole or not at
all) inside the transaction that upserts the metadata row, and :func:`prune` deletes the
bytes inside the transaction that deletes the rows, so a concurrent upload of the same
digest serializes on the row with the prune.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import os
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, BinaryIO, Protocol

logger = logging.getLogger(__name__)

SHA256_RE = re.compile(r"[0-9a-f]{64}")
#: The digest of the empty blob, which every CAS holds without storing it.
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: Path segments of a key prefix: no empty, dot-leading or ``..`` segment, so a prefix can
#: neither leave the root nor meet ``.uploads``.
_PREFIX_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*(?:/[A-Za-z0-9_][A-Za-z0-9._-]*)*")
_UPLOADS = ".uploads"
#: Bytes an upload buffers before it writes them to its file.
_FLUSH_BYTES = 1024 * 1024


class DigestMismatch(ValueError):
    """The bytes do not have the digest (hash or size) they were sent under."""


@dataclass(frozen=True, slots=True)
class Blob:
    """A blob's metadata row."""

    project_id: int
    digest: str
    size: int
    key_prefix: str
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Artifact:
    """A file a build references that is in the CAS sink: what a download serves."""

    invocation_id: str
    project_id: int
    kind: str
    label: str
    name: str
    digest: str
    size: int
    #: The prefix its bytes live under (None: no blob stored, unless it is the empty one).
    key_prefix: str | None


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What one :func:`prune` removed."""

    blobs: int
    bytes: int
    stale_uploads: int


def check_key_prefix(key_prefix: str) -> str:
    """``key_prefix`` if it is a safe relative path of the store, else ValueError."""
    if not _PREFIX_RE.fullmatch(key_prefix) or ".." in key_prefix.split("/"):
        raise ValueError(f"invalid blob key prefix {key_prefix!r}")
    return key_prefix


def blob_path(root: Path, key_prefix: str, digest: str) -> Path:
    """Where the bytes of ``digest`` live: ``<root>/<key_prefix>/aa/bb/<digest>``."""
    if not SHA256_RE.fullmatch(digest):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return root / check_key_prefix(key_prefix) / digest[:2] / digest[2:4] / digest


class BlobStore(Protocol):
    """Where the bytes of blobs live, by ``(key_prefix, digest)``. Every method blocks
    (file or network I/O): call it through a thread from async code. A failure of the
    store itself is an OSError (:class:`conveyor_bep.s3.S3Error` is one); an invalid key
    prefix or digest is ValueError."""

    def put(self, key_prefix: str, digest: str, source: Path | bytes) -> None:
        """Store ``source``, bytes already checked against ``digest``: a file (which
        ``put`` consumes: moved or removed once stored) or the bytes themselves."""
        ...

    def open(self, key_prefix: str, digest: str, offset: int = 0) -> BinaryIO | None:
        """The bytes from ``offset`` on, opened for reading (the caller closes it), or
        None when they are not there."""
        ...

    def exists(self, key_prefix: str, digest: str) -> bool:
        """Whether the bytes are there."""
        ...

    def delete(self, key_prefix: str, digest: str) -> None:
        """Remove the bytes (already absent: nothing to do)."""
        ...

    def close(self) -> None:
        """Release connections (the store is not used after)."""
        ...


class DiskStore:
    """Blobs as files ``<root>/<key_prefix>/aa/bb/<digest>``. Its uploads are staged in
    ``<root>/.uploads``, on the same file system, so that :meth:`put` is a rename."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def put(self, key_prefix: str, digest: str, source: Path | bytes) -> None:
        final = blob_path(self.root, key_prefix, digest)
        if isinstance(source, bytes):
            source = write_temp(self.root, 0, digest, source)
        _move_into_place(source, final)

    def open(self, key_prefix: str, digest: str, offset: int = 0) -> BinaryIO | None:
        try:
            f = blob_path(self.root, key_prefix, digest).open("rb")
        except FileNotFoundError:
            return None
        if offset:
            f.seek(offset)
        return f

    def exists(self, key_prefix: str, digest: str) -> bool:
        return blob_path(self.root, key_prefix, digest).is_file()

    def delete(self, key_prefix: str, digest: str) -> None:
        blob_path(self.root, key_prefix, digest).unlink(missing_ok=True)

    def close(self) -> None:
        pass


def open_blob(
    store: BlobStore | Path, key_prefix: str, digest: str, *, offset: int = 0
) -> BinaryIO | None:
    """The bytes of ``digest`` under ``key_prefix`` from ``offset`` on, opened for reading
    (the caller closes it), or None when they are not there; ``store`` a Path is the
    :class:`DiskStore` at that root. This is what a download serves (the web UI's
    ``/api/builds/{id}/artifacts/{digest}``, after :func:`find_artifact` has said the
    build references the digest and under which prefix it lives). Blocking: run it in a
    thread from async code."""
    if digest == EMPTY_SHA256:
        return io.BytesIO(b"")
    if isinstance(store, Path):
        store = DiskStore(store)
    return store.open(key_prefix, digest, offset)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlobUpload:
    """One upload in progress: a temporary file under ``<root>/.uploads/<project>/``, named
    after the upload id so that a broken stream can resume where its bytes stop
    (:attr:`committed`). Blocking file work: call its methods through a thread, or
    accept that :meth:`write` blocks once per megabyte."""

    def __init__(self, root: Path, project_id: int, upload_id: str, digest: str, size: int):
        self.digest = digest
        self.size = size
        name = hashlib.sha256(f"{upload_id}\0{digest}".encode()).hexdigest()[:40]
        self.path = root / _UPLOADS / str(project_id) / name
        self._hash = hashlib.sha256()
        self._buffer = bytearray()
        self._file: BinaryIO | None = None
        self.committed = 0

    @staticmethod
    def partial_size(root: Path, project_id: int, upload_id: str, digest: str) -> int:
        """Bytes a broken earlier upload of this id left (0: none)."""
        probe = BlobUpload(root, project_id, upload_id, digest, 0)
        try:
            return probe.path.stat().st_size
        except FileNotFoundError:
            return 0

    def open(self, offset: int) -> None:
        """Start at ``offset``: 0 starts over; more resumes a partial file of exactly that
        many bytes (ValueError otherwise)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if offset == 0:
            self._file = self.path.open("wb")
            return
        try:
            existing = self.path.stat().st_size
        except FileNotFoundError:
            existing = 0
        if existing != offset:
            raise ValueError(f"write_offset {offset}: the upload has {existing} bytes")
        with self.path.open("rb") as f:
            while chunk := f.read(_FLUSH_BYTES):
                self._hash.update(chunk)
        self._file = self.path.open("ab")
        self.committed = offset

    def write(self, data: bytes) -> None:
        """Append ``data`` (DigestMismatch past the declared size)."""
        if self.committed + len(data) > self.size:
            raise DigestMismatch(f"more than the {self.size} bytes of {self.digest}")
        self._hash.update(data)
        self._buffer += data
        self.committed += len(data)
        if len(self._buffer) >= _FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        assert self._file is not None
        self._file.write(self._buffer)
        self._buffer.clear()
        self._file.flush()

    def finish(self) -> Path:
        """Check size and hash, fsync, close; the temporary file to commit. On a
        mismatch the file is removed and DigestMismatch raised."""
        self.flush()
        assert self._file is not None
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        actual = self._hash.hexdigest()
        if self.committed != self.size or actual != self.digest:
            self.discard()
            raise DigestMismatch(
                f"received {self.committed} bytes of sha256 {actual},"
                f" not {self.size} bytes of {self.digest}"
            )
        return self.path

    def suspend(self) -> None:
        """Keep what arrived for a resumed upload (a stream that broke off)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self.flush()
            self._file.close()
            self._file = None

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)


_UPSERT_BLOB = """
INSERT INTO bep.blobs AS b (project_id, digest, size, key_prefix, origin, created_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7)
ON CONFLICT (project_id, digest) DO UPDATE SET key_prefix = EXCLUDED.key_prefix,
    expires_at = GREATEST(b.expires_at, EXCLUDED.expires_at)"""


async def commit_blob(
    conn: Any,
    store: BlobStore,
    *,
    project_id: int,
    key_prefix: str,
    digest: str,
    size: int,
    temp: Path | bytes,
    now: datetime,
    ttl: timedelta,
    origin: str = "upload",
) -> None:
    """Put a verified temporary file (or verified bytes) into the store and record the
    blob, unpinned until ``now + ttl`` (an existing blob keeps the later of the two
    expiries). A store that fails rolls the row back, and a file stays for a retry."""
    check_key_prefix(key_prefix)
    async with conn.transaction():
        await conn.execute(
            _UPSERT_BLOB, project_id, digest, size, key_prefix, origin, now, now + ttl
        )
        await asyncio.to_thread(store.put, key_prefix, digest, temp)


def _move_into_place(temp: Path, final: Path) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(temp, final)
    _fsync_dir(final.parent)


def write_temp(root: Path, project_id: int, digest: str, data: bytes) -> Path:
    """``data`` as a verified, fsynced temporary file (DigestMismatch otherwise)."""
    upload = BlobUpload(root, project_id, os.urandom(16).hex(), digest, len(data))
    upload.open(0)
    upload.write(data)
    return upload.finish()


async def get_blob(conn: Any, project_id: int, digest: str) -> Blob | None:
    """The metadata of ``digest`` in the project, or None."""
    row = await conn.fetchrow(
        "SELECT project_id, digest, size, key_prefix, expires_at FROM bep.blobs"
        " WHERE project_id = $1 AND digest = $2",
        project_id,
        digest,
    )
    return Blob(*row) if row is not None else None


async def find_present(
    conn: Any,
    project_id: int,
    digests: list[tuple[str, int]],
    *,
    now: datetime,
    ttl: timedelta,
) -> set[tuple[str, int]]:
    """Which of ``digests`` (hash, size) the project holds. Each one found is kept for at
    least ``ttl`` more: Bazel skips uploading what is present and references it a moment
    later, so the prune must not take it in between."""
    hashes = list({h for h, _ in digests if h != EMPTY_SHA256})
    present = {(h, s) for h, s in digests if h == EMPTY_SHA256 and s == 0}
    if not hashes:
        return present
    # The touch first: it waits for a prune holding the row, and what the prune deleted
    # the select then no longer finds.
    await conn.execute(
        "UPDATE bep.blobs SET expires_at = $3 WHERE project_id = $1"
        " AND digest = ANY($2::text[]) AND expires_at < $4",
        project_id,
        hashes,
        now + ttl,
        now + ttl / 2,
    )
    rows = await conn.fetch(
        "SELECT digest, size FROM bep.blobs WHERE project_id = $1 AND digest = ANY($2::text[])",
        project_id,
        hashes,
    )
    stored = {(r["digest"], r["size"]) for r in rows}
    return present | {d for d in digests if d in stored}


async def find_artifact(conn: Any, invocation_id: str, digest: str) -> Artifact | None:
    """The artifact ``digest`` of build ``invocation_id``, with where its bytes live, or
    None when the build references no such file. For the download route
    ``/api/builds/{id}/artifacts/{digest}``: check the viewer may see
    :attr:`Artifact.project_id`, then :func:`open_blob` with :attr:`Artifact.key_prefix`."""
    row = await conn.fetchrow(
        "SELECT a.invocation_id, a.project_id, a.kind, a.label, a.name, a.digest, a.size,"
        " b.key_prefix FROM bep.artifacts a LEFT JOIN bep.blobs b"
        " ON b.project_id = a.project_id AND b.digest = a.digest"
        " WHERE a.invocation_id = $1 AND a.digest = $2 ORDER BY a.kind, a.name LIMIT 1",
        invocation_id,
        digest,
    )
    return Artifact(*row) if row is not None else None


async def list_artifacts(conn: Any, invocation_id: str) -> list[Artifact]:
    """Every file build ``invocation_id`` references in a remote cache, with where the
    CAS sink holds it (``key_prefix`` None: not stored here)."""
    rows = await conn.fetch(
        "SELECT a.invocation_id, a.project_id, a.kind, a.label, a.name, a.digest, a.size,"
        " b.key_prefix FROM bep.artifacts a LEFT JOIN bep.blobs b"
        " ON b.project_id = a.project_id AND b.digest = a.digest"
        " WHERE a.invocation_id = $1 ORDER BY a.kind, a.label, a.name",
        invocation_id,
    )
    return [Artifact(*r) for r in rows]


_PRUNE = """
DELETE FROM bep.blobs WHERE (project_id, digest) IN (
    SELECT b.project_id, b.digest FROM bep.blobs b
    WHERE b.expires_at <= $1 AND NOT EXISTS (
        SELECT 1 FROM bep.artifacts a WHERE a.project_id = b.project_id AND a.digest = b.digest)
    LIMIT $2 FOR UPDATE SKIP LOCKED)
RETURNING key_prefix, digest, size"""


def _delete_all(store: BlobStore, rows: list[Any]) -> None:
    for row in rows:
        # A prefix or digest no store could hold has no bytes to delete.
        with contextlib.suppress(ValueError):
            store.delete(row["key_prefix"], row["digest"])


async def prune(
    conn: Any,
    root: Path,
    now: datetime,
    *,
    store: BlobStore | None = None,
    batch: int = 1000,
    stale_uploads: timedelta = timedelta(days=1),
) -> PruneResult:
    """Delete the blobs no build pins whose expiry is past ``now`` (rows and bytes,
    ``batch`` at a time), and the partial uploads under ``root`` untouched for
    ``stale_uploads``. The bytes are in ``store`` (None: the :class:`DiskStore` at
    ``root``); a store that fails rolls its batch back for the next prune. Meant to run
    nightly (``conveyor-bep prune``, e.g. from a Conveyor cron task); each upkeep pass of
    ``conveyor-bep serve`` runs it too, which is cheap when there is nothing to do.
    ``now`` is a parameter so that a test can move time."""
    store = store if store is not None else DiskStore(root)
    blobs = size = 0
    while True:
        async with conn.transaction():
            rows = await conn.fetch(_PRUNE, now, batch)
            if rows:
                await asyncio.to_thread(_delete_all, store, rows)
            blobs += len(rows)
            size += sum(r["size"] for r in rows)
        if len(rows) < batch:
            break
    stale = 0
    cutoff = (now - stale_uploads).timestamp()
    uploads = root / _UPLOADS
    if uploads.is_dir():
        for path in uploads.glob("*/*"):
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    stale += 1
    if blobs or stale:
        logger.info("bep.blobs.pruned blobs=%d bytes=%d stale_uploads=%d", blobs, size, stale)
    return PruneResult(blobs, size, stale)
