"""A build's artifacts: the files its events reference that the ingest's CAS sink holds
(test logs and outputs, the profile), listed and downloaded.

``GET /api/builds/{id}/artifacts`` lists them; ``GET /api/builds/{id}/artifacts/{digest}``
streams one from the blob store the settings name (disk or S3, the ingest's), only when
the viewer may read the build and the build references that digest (so a digest alone
opens nothing: not another build's, not another project's). Text files (logs, test XML)
are shown as plain text, never as HTML; anything else is an attachment.
"""

from __future__ import annotations

import asyncio
import mimetypes
import re
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any, BinaryIO

from conveyor_bep.blobs import Artifact, find_artifact, list_artifacts, open_blob
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import StreamingResponse

from conveyor_bep_web.api import ViewerDep, build_project_id, not_found

router = APIRouter(prefix="/api", tags=["builds"])

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_TEXT_SUFFIXES = (".log", ".txt", ".xml", ".json", ".out", ".err")
CHUNK = 256 * 1024


def artifact_href(invocation_id: str, digest: str) -> str:
    """The download URL of one artifact of a build."""
    return f"/api/builds/{urllib.parse.quote(invocation_id, safe='')}/artifacts/{digest}"


def describe(artifact: Artifact) -> dict[str, Any]:
    """An artifact as the API lists it (``stored``: the sink holds its bytes)."""
    return {
        "kind": artifact.kind,
        "label": artifact.label,
        "name": artifact.name,
        "digest": artifact.digest,
        "size": artifact.size,
        "stored": artifact.key_prefix is not None or artifact.size == 0,
        "href": artifact_href(artifact.invocation_id, artifact.digest),
    }


async def visible_artifacts(
    request: Request, project_id: int, invocation_id: str
) -> list[Artifact]:
    """The artifacts of a build the caller has already been allowed to read."""
    async with request.app.state.pool.acquire() as conn:
        found = await list_artifacts(conn, invocation_id)
    return [a for a in found if a.project_id == project_id]


@router.get("/builds/{invocation_id}/artifacts")
async def build_artifacts(
    request: Request, viewer: ViewerDep, invocation_id: str
) -> dict[str, Any]:
    """The files the build references that the CAS sink holds."""
    project_id = await build_project_id(request, viewer, invocation_id)
    artifacts = await visible_artifacts(request, project_id, invocation_id)
    return {"artifacts": [describe(a) for a in artifacts]}


async def _chunks(blob: BinaryIO) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(blob.read, CHUNK):
            yield chunk
    finally:
        await asyncio.to_thread(blob.close)


@router.get("/builds/{invocation_id}/artifacts/{digest}", response_class=StreamingResponse)
async def download_artifact(
    request: Request, viewer: ViewerDep, invocation_id: str, digest: str
) -> StreamingResponse:
    """One artifact's bytes (404: no such build for the viewer, no such file in it, or
    its bytes are not in the sink)."""
    if not _DIGEST.match(digest):
        raise HTTPException(400, "digest must be 64 lowercase hex digits (a SHA-256)")
    project_id = await build_project_id(request, viewer, invocation_id)
    async with request.app.state.pool.acquire() as conn:
        artifact = await find_artifact(conn, invocation_id, digest)
    if artifact is None or artifact.project_id != project_id:
        raise not_found("artifact")
    configured = request.app.state.blobs
    if configured is None or (artifact.key_prefix is None and artifact.size):
        raise not_found("artifact (its bytes are not in this service's blob store)")
    blob = await asyncio.to_thread(
        open_blob, configured.store, artifact.key_prefix or "", artifact.digest
    )
    if blob is None:
        raise not_found("artifact (its bytes are gone: pruned, or never uploaded)")
    name = artifact.name.rsplit("/", 1)[-1] or artifact.digest
    quoted = urllib.parse.quote(name, safe="")
    headers = {"x-content-type-options": "nosniff", "content-length": str(artifact.size)}
    if name.endswith(_TEXT_SUFFIXES):
        media = "text/plain; charset=utf-8"
        headers["content-disposition"] = f"inline; filename*=UTF-8''{quoted}"
    else:
        media = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if media.startswith("text/") or "html" in media or "xml" in media or "svg" in media:
            media = "application/octet-stream"
        headers["content-disposition"] = f"attachment; filename*=UTF-8''{quoted}"
    return StreamingResponse(_chunks(blob), media_type=media, headers=headers)
