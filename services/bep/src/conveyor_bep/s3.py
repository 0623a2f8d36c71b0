"""The CAS sink's blobs in an S3-compatible bucket (AWS S3, MinIO, Ceph RGW, Cloudflare R2):
the object ``<key_prefix>/<sha256>`` of one bucket, over plain HTTP(S) with httpx and
requests signed with AWS Signature Version 4 (:mod:`conveyor_bep.sigv4`).

URLs are path-style, ``<endpoint>/<bucket>/<key>``, which every S3-compatible server
accepts (virtual-hosted buckets need DNS per bucket). A PUT signs the body's SHA-256,
which is the blob's digest, so the store itself refuses bytes that do not match it. One
PUT per blob, no multipart upload: S3 takes at most 5 GiB in a single PUT
(:data:`MAX_PUT_BYTES`), and the ingest's ``bep_max_blob_bytes`` is held under it.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Self

import httpx

from conveyor_bep.blobs import SHA256_RE, check_key_prefix
from conveyor_bep.sigv4 import EMPTY_PAYLOAD_SHA256, Credentials, encode_path, sign

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

#: The largest object one PUT may carry on AWS S3 (5 GiB).
MAX_PUT_BYTES = 5 * 1024**3
#: Bytes per read of a file being uploaded, and the read buffer of a download.
_CHUNK = 1024 * 1024
_CODE_RE = re.compile(r"<Code>([^<]{1,200})</Code>")
_MESSAGE_RE = re.compile(r"<Message>([^<]{1,500})</Message>")


def _utcnow() -> datetime:
    return datetime.now(UTC)


class S3Error(OSError):
    """The object store refused a request (``status``: its HTTP status; ``code``: its
    error code, e.g. ``SignatureDoesNotMatch``, ``NoSuchBucket``, ``AccessDenied``) or
    could not be reached (``status`` None)."""

    def __init__(
        self,
        operation: str,
        key: str,
        *,
        status: int | None = None,
        code: str = "",
        message: str = "",
    ) -> None:
        self.operation = operation
        self.key = key
        self.status = status
        self.code = code
        what = f"HTTP {status}" if status is not None else "unreachable"
        detail = ": ".join(part for part in (code, message) if part)
        super().__init__(f"S3 {operation} {key}: {what}" + (f" ({detail})" if detail else ""))


def _error(operation: str, key: str, status: int, body: bytes) -> S3Error:
    """The error of a refused request, with S3's code and message from its XML body."""
    text = body[:4096].decode("utf-8", "replace")
    code = _CODE_RE.search(text)
    message = _MESSAGE_RE.search(text)
    return S3Error(
        operation,
        key,
        status=status,
        code=code[1] if code else "",
        message=message[1] if message else "",
    )


class _ObjectReader(io.RawIOBase):
    """A streamed GET response as a readable file; closing it closes the response."""

    def __init__(self, response: httpx.Response, key: str) -> None:
        self._response = response
        self._key = key
        self._chunks = response.iter_bytes()
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        while not self._pending:
            try:
                self._pending = memoryview(next(self._chunks))
            except StopIteration:
                return 0
            except httpx.HTTPError as exc:
                raise S3Error("GET", self._key, message=f"{type(exc).__name__}: {exc}") from exc
        out = memoryview(buffer).cast("B")
        n = min(len(out), len(self._pending))
        out[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self._response.close()
        super().close()


class S3Store:
    """Blobs as objects ``<key_prefix>/<digest>`` of ``bucket`` at ``endpoint`` (e.g.
    ``https://s3.eu-west-1.amazonaws.com``, ``http://127.0.0.1:9000`` for MinIO). Blocking,
    like every :class:`~conveyor_bep.blobs.BlobStore`; one connection pool, safe to use
    from several threads."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        *,
        access_key_id: str,
        secret_access_key: str,
        region: str = "us-east-1",
        max_put_bytes: int = MAX_PUT_BYTES,
        timeout: float = 60.0,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        url = httpx.URL(endpoint)
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"not an http(s) endpoint: {endpoint!r}")
        if not bucket or "/" in bucket:
            raise ValueError(f"invalid bucket name {bucket!r}")
        self.bucket = bucket
        self.max_put_bytes = max_put_bytes
        self._origin = f"{url.scheme}://{url.netloc.decode('ascii')}"
        self._host = url.netloc.decode("ascii")
        self._base_path = url.path.rstrip("/")
        self._credentials = Credentials(access_key_id, secret_access_key, region, "s3")
        self._clock = clock
        self._client = httpx.Client(
            timeout=timeout, transport=transport or httpx.HTTPTransport(retries=2)
        )

    def object_key(self, key_prefix: str, digest: str) -> str:
        """The object of ``digest`` in the bucket: ``<key_prefix>/<digest>``."""
        if not SHA256_RE.fullmatch(digest):
            raise ValueError(f"not a sha256 digest: {digest!r}")
        return f"{check_key_prefix(key_prefix)}/{digest}"

    def _send(
        self,
        method: str,
        key: str,
        *,
        headers: dict[str, str] | None = None,
        content: bytes | Iterator[bytes] | None = None,
        payload_sha256: str = EMPTY_PAYLOAD_SHA256,
        stream: bool = False,
    ) -> httpx.Response:
        path = encode_path(f"{self._base_path}/{self.bucket}/{key}")
        signed = sign(
            self._credentials,
            method=method,
            host=self._host,
            path=path,
            payload_sha256=payload_sha256,
            now=self._clock(),
            headers=headers,
        )
        request = self._client.build_request(
            method, self._origin + path, headers=signed, content=content
        )
        try:
            return self._client.send(request, stream=stream)
        except httpx.HTTPError as exc:
            raise S3Error(method, key, message=f"{type(exc).__name__}: {exc}") from exc

    def put(self, key_prefix: str, digest: str, source: Path | bytes) -> None:
        """PUT the object (``source`` already checked against ``digest``; a file is
        removed once stored, and kept when the PUT fails)."""
        key = self.object_key(key_prefix, digest)
        size = len(source) if isinstance(source, bytes) else source.stat().st_size
        if size > self.max_put_bytes:
            raise S3Error(
                "PUT", key, message=f"{size} bytes: one PUT takes at most {self.max_put_bytes}"
            )
        headers = {"content-length": str(size), "content-type": "application/octet-stream"}
        if isinstance(source, bytes):
            response = self._send(
                "PUT", key, headers=headers, content=source, payload_sha256=digest
            )
        else:
            with source.open("rb") as f:
                response = self._send(
                    "PUT",
                    key,
                    headers=headers,
                    content=iter(lambda: f.read(_CHUNK), b""),
                    payload_sha256=digest,
                )
        if response.status_code != 200:
            raise _error("PUT", key, response.status_code, response.content)
        if isinstance(source, Path):
            source.unlink(missing_ok=True)

    def open(self, key_prefix: str, digest: str, offset: int = 0) -> BinaryIO | None:
        """GET the object from ``offset`` on, streamed (None: no such object)."""
        key = self.object_key(key_prefix, digest)
        headers = {"range": f"bytes={offset}-"} if offset else None
        response = self._send("GET", key, headers=headers, stream=True)
        status = response.status_code
        if status == 200 and offset:
            # A server that ignores Range sends the whole object: skip to the offset.
            reader = io.BufferedReader(_ObjectReader(response, key), _CHUNK)
            left = offset
            while left > 0 and (skipped := len(reader.read(min(left, _CHUNK)))):
                left -= skipped
            return reader
        if status in (200, 206):
            return io.BufferedReader(_ObjectReader(response, key), _CHUNK)
        try:
            body = response.read()
        except httpx.HTTPError:
            body = b""
        finally:
            response.close()
        error = _error("GET", key, status, body)
        if status == 404 and error.code != "NoSuchBucket":
            return None
        if status == 416:  # the offset is the object's end (or past it)
            return io.BytesIO(b"")
        raise error

    def exists(self, key_prefix: str, digest: str) -> bool:
        """HEAD the object."""
        key = self.object_key(key_prefix, digest)
        response = self._send("HEAD", key)
        if response.status_code == 200:
            return True
        if response.status_code == 404:
            return False
        raise _error("HEAD", key, response.status_code, b"")

    def delete(self, key_prefix: str, digest: str) -> None:
        """DELETE the object (S3 answers 204 whether or not it was there)."""
        key = self.object_key(key_prefix, digest)
        response = self._send("DELETE", key)
        if response.status_code in (200, 204):
            return
        error = _error("DELETE", key, response.status_code, response.content)
        if response.status_code == 404 and error.code != "NoSuchBucket":
            return
        raise error

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
