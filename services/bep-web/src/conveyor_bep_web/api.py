"""The JSON API under ``/api``: projects, the build search, a build and its rows, its log,
and the live streams (Server-Sent Events).

Every route takes the request's :class:`~conveyor_bep_web.auth.Viewer` and reads only
its projects (in SQL): a project or build it may not read is 404, exactly as one that
does not exist. Bad input is 400 (a cursor, a tag filter, a status) or 422 (a parameter
of the wrong type or out of range) with a message saying which.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import StreamingResponse

from conveyor_bep_web import reads
from conveyor_bep_web.auth import Viewer, current_viewer
from conveyor_bep_web.live import build_events, project_events
from conveyor_bep_web.logs import log_bytes
from conveyor_bep_web.search import DEFAULT_LIMIT, MAX_LIMIT, build_search

router = APIRouter(prefix="/api", tags=["builds"])

ViewerDep = Annotated[Viewer, Depends(current_viewer)]
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description="rows per page")]
RowLimit = Annotated[int, Query(ge=1, le=5000, description="rows per page")]
After = Annotated[str | None, Query(description="the cursor 'next' of the previous page")]

_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9._-]")

#: Headers of a streamed answer that a proxy must not buffer.
STREAMING = {"cache-control": "no-store", "x-accel-buffering": "no"}


def _pool(request: Request) -> Any:
    return request.app.state.pool


def not_found(what: str) -> HTTPException:
    """The 404 of something that does not exist *or* that the viewer may not read."""
    return HTTPException(404, f"no such {what}")


async def _project(request: Request, viewer: Viewer, slug: str) -> reads.Project:
    async with _pool(request).acquire() as conn:
        project = await reads.project_by_slug(conn, viewer.project_ids(), slug)
    if project is None:
        raise not_found("project")
    return project


async def build_project_id(request: Request, viewer: Viewer, invocation_id: str) -> int:
    """The project of build ``invocation_id``; 404 when the viewer may not read it."""
    async with _pool(request).acquire() as conn:
        project_id = await reads.build_project(conn, viewer.project_ids(), invocation_id)
    if project_id is None:
        raise not_found("build")
    return project_id


@router.get("/projects")
async def projects(request: Request, viewer: ViewerDep) -> dict[str, Any]:
    """The projects the viewer may read, with their build counts."""
    async with _pool(request).acquire() as conn:
        return {"projects": await reads.list_projects(conn, viewer.project_ids())}


@router.get("/projects/{slug}/builds")
async def project_builds(
    request: Request,
    viewer: ViewerDep,
    slug: str,
    status: str | None = None,
    user: str | None = None,
    branch: str | None = None,
    tag: Annotated[list[str] | None, Query(description="key:value, repeatable")] = None,
    q: Annotated[str | None, Query(max_length=200, description="free text")] = None,
    before: Annotated[str | None, Query(description="the cursor 'next' of a page")] = None,
    limit: Limit = DEFAULT_LIMIT,
    facets: bool = True,
) -> dict[str, Any]:
    """A page of the project's builds matching the filters, newest first, with the
    cursor of the next page and the facets of the filtered set."""
    search = build_search(status=status, user=user, branch=branch, tag=tag, q=q)
    project = await _project(request, viewer, slug)
    allowed = viewer.project_ids()
    async with _pool(request).acquire() as conn:
        builds, following = await reads.search_builds(
            conn, allowed, project, search, before=before, limit=limit
        )
        counted = await reads.build_facets(conn, allowed, project, search) if facets else None
    return {
        "project": {"id": project.id, "slug": project.slug, "name": project.name},
        "builds": builds,
        "next": following,
        "facets": counted,
    }


@router.get("/projects/{slug}/live", response_class=StreamingResponse)
async def project_live(request: Request, viewer: ViewerDep, slug: str) -> StreamingResponse:
    """Server-Sent Events of the project's build list: ``ready``, then ``builds`` with
    the rows of builds that changed, at most one per digest interval."""
    project = await _project(request, viewer, slug)
    state = request.app.state
    body = project_events(
        state.pool,
        state.nc,
        prefix=state.settings.subject_prefix,
        projects=viewer.project_ids(),
        project_id=project.id,
        interval=state.settings.bep_web_digest_interval,
    )
    return StreamingResponse(body, media_type="text/event-stream", headers=STREAMING)


@router.get("/builds/{invocation_id}")
async def build(request: Request, viewer: ViewerDep, invocation_id: str) -> dict[str, Any]:
    """The build's summary (see :func:`conveyor_bep_web.reads.build_summary`)."""
    async with _pool(request).acquire() as conn:
        summary = await reads.build_summary(conn, viewer.project_ids(), invocation_id)
    if summary is None:
        raise not_found("build")
    return summary


@router.get("/builds/{invocation_id}/targets")
async def build_targets(
    request: Request,
    viewer: ViewerDep,
    invocation_id: str,
    after: After = None,
    failed: bool = False,
    limit: RowLimit = 1000,
) -> dict[str, Any]:
    """A page of the build's targets by label (``failed``: only those that failed)."""
    await build_project_id(request, viewer, invocation_id)
    async with _pool(request).acquire() as conn:
        rows, following = await reads.build_targets(
            conn, viewer.project_ids(), invocation_id, after=after, failed=failed, limit=limit
        )
    return {"targets": rows, "next": following}


@router.get("/builds/{invocation_id}/tests")
async def build_tests(
    request: Request,
    viewer: ViewerDep,
    invocation_id: str,
    after: After = None,
    failed: bool = False,
    limit: RowLimit = 1000,
) -> dict[str, Any]:
    """A page of the build's test results with their outputs (``failed``: only those
    that did not pass)."""
    await build_project_id(request, viewer, invocation_id)
    async with _pool(request).acquire() as conn:
        rows, following = await reads.build_tests(
            conn, viewer.project_ids(), invocation_id, after=after, failed=failed, limit=limit
        )
    return {"tests": rows, "next": following}


@router.get("/builds/{invocation_id}/actions")
async def build_actions(
    request: Request,
    viewer: ViewerDep,
    invocation_id: str,
    after: After = None,
    limit: RowLimit = 1000,
) -> dict[str, Any]:
    """A page of the build's actions (Bazel reports the failed ones) in stream order."""
    await build_project_id(request, viewer, invocation_id)
    async with _pool(request).acquire() as conn:
        rows, following = await reads.build_actions(
            conn, viewer.project_ids(), invocation_id, after=after, limit=limit
        )
    return {"actions": rows, "next": following}


@router.get("/builds/{invocation_id}/log", response_class=StreamingResponse)
async def build_log(
    request: Request,
    viewer: ViewerDep,
    invocation_id: str,
    offset: Annotated[int, Query(ge=0, description="the first byte to send")] = 0,
    download: bool = False,
) -> StreamingResponse:
    """The build's log from byte ``offset`` to its end as committed, streamed as text
    (``download``: as an attachment)."""
    await build_project_id(request, viewer, invocation_id)
    headers = dict(STREAMING)
    headers["x-log-offset"] = str(offset)
    if download:
        name = _UNSAFE_FILENAME.sub("_", invocation_id)[:100] or "build"
        headers["content-disposition"] = f'attachment; filename="{name}.log"'
    body = log_bytes(_pool(request), viewer.project_ids(), invocation_id, offset)
    return StreamingResponse(body, media_type="text/plain; charset=utf-8", headers=headers)


@router.get("/builds/{invocation_id}/live", response_class=StreamingResponse)
async def build_live(request: Request, viewer: ViewerDep, invocation_id: str) -> StreamingResponse:
    """Server-Sent Events of the build: ``build`` (its summary, with the log's size) at
    connect and after each change, at most one per digest interval; ``end`` once it is
    finished."""
    project_id = await build_project_id(request, viewer, invocation_id)
    state = request.app.state
    body = build_events(
        state.pool,
        state.nc,
        prefix=state.settings.subject_prefix,
        projects=viewer.project_ids(),
        project_id=project_id,
        invocation_id=invocation_id,
        interval=state.settings.bep_web_digest_interval,
    )
    return StreamingResponse(body, media_type="text/event-stream", headers=STREAMING)
