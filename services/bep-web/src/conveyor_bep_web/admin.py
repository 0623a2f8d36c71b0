"""The admin API (JSON, under ``/api/admin``): projects, their groups and limits, API
keys, and the audit log.

A global admin (the admin token, or a member of an admin group) does everything. A
project admin (a member of one of the project's ``admin_groups``) lists and manages that
project's keys, name and groups, and reads its audit log; creating projects and changing
limits (capacity of the shared ingest) stay with the global admins. A project the caller
may not even read is 404, one they read but do not administer 403.

Every change writes its audit entry in the same transaction (:mod:`.audit`). A revoked
key is announced on NATS after the commit, so that every ingest node drops it at once
(announcing before the commit could let a node reload and cache the still-live row).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from conveyor_bep.keys import SLUG_RE, announce_key_change, create_key, create_project, revoke_key
from conveyor_runtime.settings import BepWebSettings
from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from conveyor_bep_web import audit
from conveyor_bep_web.auth import Viewer, admin_viewer, manager_viewer, same_origin

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/api/admin", tags=["admin"], dependencies=[Depends(same_origin)])

AdminDep = Annotated[Viewer, Depends(admin_viewer)]
ManagerDep = Annotated[Viewer, Depends(manager_viewer)]

#: Longest group name, and most groups of one list.
MAX_GROUP = 256
MAX_GROUPS = 100


def _clean_groups(groups: list[str]) -> list[str]:
    cleaned: list[str] = []
    for group in groups:
        name = group.strip()
        if not name or len(name) > MAX_GROUP or not name.isprintable():
            raise ValueError(f"invalid group name {group[:MAX_GROUP]!r}")
        if name not in cleaned:
            cleaned.append(name)
    if len(cleaned) > MAX_GROUPS:
        raise ValueError(f"at most {MAX_GROUPS} groups")
    return cleaned


class ProjectCreate(BaseModel):
    """A new project."""

    model_config = ConfigDict(extra="forbid")

    slug: str
    name: str | None = Field(None, min_length=1, max_length=200)
    max_streams: int = Field(200, ge=1)
    max_unacked: int = Field(5000, ge=1)
    allowed_groups: list[str] = []
    admin_groups: list[str] = []

    @field_validator("allowed_groups", "admin_groups")
    @classmethod
    def _groups(cls, groups: list[str]) -> list[str]:
        return _clean_groups(groups)


class ProjectUpdate(BaseModel):
    """The fields of a project to change (absent: unchanged)."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, min_length=1, max_length=200)
    max_streams: int | None = Field(None, ge=1)
    max_unacked: int | None = Field(None, ge=1)
    allowed_groups: list[str] | None = None
    admin_groups: list[str] | None = None

    @field_validator("allowed_groups", "admin_groups")
    @classmethod
    def _groups(cls, groups: list[str] | None) -> list[str] | None:
        return None if groups is None else _clean_groups(groups)


class KeyCreate(BaseModel):
    """A new API key: a name saying where it is used."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=200)


#: Limits are the ingest's capacity, shared by every project: global admins only.
LIMIT_FIELDS = ("max_streams", "max_unacked")

_PROJECT = """
SELECT p.id, p.slug, p.name, p.max_streams, p.max_unacked, p.allowed_groups,
       p.admin_groups, p.created_at,
       (SELECT count(*) FROM bep.api_keys k
        WHERE k.project_id = p.id AND k.revoked_at IS NULL) AS live_keys
FROM bep.projects p
"""


def _project_json(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "slug": row["slug"],
        "name": row["name"],
        "max_streams": row["max_streams"],
        "max_unacked": row["max_unacked"],
        "allowed_groups": list(row["allowed_groups"]),
        "admin_groups": list(row["admin_groups"]),
        "created_at": row["created_at"].isoformat(),
        "live_keys": row["live_keys"],
    }


def _key_json(row: Any) -> dict[str, Any]:
    return {
        "id": row["id"],
        "name": row["name"],
        "created_at": row["created_at"].isoformat(),
        "revoked_at": row["revoked_at"].isoformat() if row["revoked_at"] else None,
    }


async def _managed_project(conn: Any, viewer: Viewer, slug: str, *, lock: bool = False) -> Any:
    """The project ``slug`` if the viewer administers it: 404 when they cannot even see
    it (nor whether it exists), 403 when they see but do not administer it."""
    row = await conn.fetchrow(
        _PROJECT + " WHERE p.slug = $1" + (" FOR UPDATE OF p" if lock else ""), slug
    )
    if row is None or not viewer.may_read(row["id"]):
        raise HTTPException(404, f"no project {slug!r}")
    if not viewer.may_admin(row["id"]):
        raise HTTPException(403, f"not an admin of project {slug!r}")
    return row


def _prefix(request: Request) -> str:
    settings: BepWebSettings = request.app.state.settings
    return settings.subject_prefix


async def _announce(request: Request, key_id: str) -> bool:
    """Tell the ingest nodes to drop the key (False: no NATS, they wait for the TTL)."""
    nc = getattr(request.app.state, "nc", None)
    if nc is None:
        logger.warning("bep_web.key_revoked_unannounced key=%s reason=no-nats", key_id)
        return False
    try:
        await announce_key_change(nc, _prefix(request), key_id)
    except Exception as error:  # the revocation stands; the cache TTL bounds the rest
        logger.warning(
            "bep_web.key_revoked_unannounced key=%s reason=%s", key_id, type(error).__name__
        )
        return False
    return True


@router.get("/projects")
async def list_projects(request: Request, viewer: ManagerDep) -> dict[str, Any]:
    """The projects the caller administers (a global admin: all)."""
    ids = None if viewer.admin else sorted(viewer.admin_projects)
    rows = await request.app.state.pool.fetch(
        _PROJECT + " WHERE $1::bigint[] IS NULL OR p.id = ANY($1::bigint[]) ORDER BY p.slug",
        ids,
    )
    return {"projects": [_project_json(r) for r in rows]}


@router.post("/projects", status_code=201)
async def create_project_route(
    request: Request, viewer: AdminDep, body: ProjectCreate
) -> dict[str, Any]:
    """Create a project (global admins): 422 for a bad slug, 409 when it exists."""
    if not SLUG_RE.fullmatch(body.slug):
        raise HTTPException(
            422,
            f"invalid project slug {body.slug[:80]!r}: use a-z, 0-9 and '-', starting with a "
            "letter or digit (at most 63)",
        )
    async with request.app.state.pool.acquire() as conn, conn.transaction():
        try:
            project_id = await create_project(
                conn,
                body.slug,
                name=body.name,
                max_streams=body.max_streams,
                max_unacked=body.max_unacked,
            )
        except ValueError as error:  # the slug is valid: it exists
            raise HTTPException(409, str(error)) from None
        await conn.execute(
            "UPDATE bep.projects SET allowed_groups = $2, admin_groups = $3 WHERE id = $1",
            project_id,
            body.allowed_groups,
            body.admin_groups,
        )
        row = await conn.fetchrow(_PROJECT + " WHERE p.id = $1", project_id)
        await audit.record(
            conn,
            viewer,
            "project.create",
            project_id=project_id,
            target=body.slug,
            details={
                k: v
                for k, v in _project_json(row).items()
                if k not in ("id", "created_at", "live_keys")
            },
        )
    logger.info("bep_web.project_created slug=%s actor=%s", body.slug, viewer.subject)
    return _project_json(row)


@router.get("/projects/{slug}")
async def get_project(request: Request, viewer: ManagerDep, slug: str) -> dict[str, Any]:
    """One project the caller administers."""
    async with request.app.state.pool.acquire() as conn:
        return _project_json(await _managed_project(conn, viewer, slug))


@router.patch("/projects/{slug}")
async def update_project(
    request: Request, viewer: ManagerDep, slug: str, body: ProjectUpdate
) -> dict[str, Any]:
    """Change a project's name, groups or (global admins) limits; the audit entry holds
    each changed field's old and new value."""
    wanted = body.model_dump(exclude_unset=True, exclude_none=True)
    async with request.app.state.pool.acquire() as conn, conn.transaction():
        row = await _managed_project(conn, viewer, slug, lock=True)
        if not viewer.admin and any(f in wanted for f in LIMIT_FIELDS):
            raise HTTPException(403, "only global admins change a project's limits")
        before = _project_json(row)
        changes = {f: {"from": before[f], "to": v} for f, v in wanted.items() if before[f] != v}
        if not changes:
            return before
        assignments = ", ".join(f"{f} = ${i}" for i, f in enumerate(changes, start=2))
        await conn.execute(
            f"UPDATE bep.projects SET {assignments} WHERE id = $1",
            row["id"],
            *(c["to"] for c in changes.values()),
        )
        await audit.record(
            conn,
            viewer,
            "project.update",
            project_id=row["id"],
            target=slug,
            details={"changes": changes},
        )
        row = await conn.fetchrow(_PROJECT + " WHERE p.id = $1", row["id"])
    logger.info("bep_web.project_updated slug=%s fields=%s", slug, ",".join(changes))
    return _project_json(row)


@router.get("/projects/{slug}/keys")
async def list_keys(request: Request, viewer: ManagerDep, slug: str) -> dict[str, Any]:
    """The project's keys, live and revoked, newest first (never their secrets)."""
    async with request.app.state.pool.acquire() as conn:
        project = await _managed_project(conn, viewer, slug)
        rows = await conn.fetch(
            "SELECT id, name, created_at, revoked_at FROM bep.api_keys WHERE project_id = $1"
            " ORDER BY created_at DESC, id",
            project["id"],
        )
    return {"keys": [_key_json(r) for r in rows]}


@router.post("/projects/{slug}/keys", status_code=201)
async def create_key_route(
    request: Request, viewer: ManagerDep, slug: str, body: KeyCreate
) -> dict[str, Any]:
    """Issue a key: the answer is the only time its secret is shown."""
    async with request.app.state.pool.acquire() as conn, conn.transaction():
        project = await _managed_project(conn, viewer, slug)
        issued = await create_key(conn, slug, name=body.name)
        await audit.record(
            conn,
            viewer,
            "key.create",
            project_id=project["id"],
            target=issued.id,
            details={"name": body.name},
        )
    logger.info("bep_web.key_created project=%s key=%s", slug, issued.id)
    return {"id": issued.id, "key": issued.key, "project": slug, "name": body.name}


@router.post("/projects/{slug}/keys/{key_id}/revoke")
async def revoke_key_route(
    request: Request, viewer: ManagerDep, slug: str, key_id: str
) -> dict[str, Any]:
    """Revoke a key of the project and tell every ingest node to drop it. ``revoked``:
    whether it was live until now; ``announced``: whether the nodes were told (else they
    notice within their cache TTL)."""
    async with request.app.state.pool.acquire() as conn, conn.transaction():
        project = await _managed_project(conn, viewer, slug)
        key = await conn.fetchrow(
            "SELECT id, name FROM bep.api_keys WHERE id = $1 AND project_id = $2 FOR UPDATE",
            key_id,
            project["id"],
        )
        if key is None:
            raise HTTPException(404, f"no key {key_id!r} in project {slug!r}")
        revoked = await revoke_key(conn, key_id, nc=None, prefix=_prefix(request))
        await audit.record(
            conn,
            viewer,
            "key.revoke",
            project_id=project["id"],
            target=key_id,
            details={"name": key["name"], "was_live": revoked},
        )
    # Announced even when it was revoked already: an earlier announcement may have failed.
    announced = await _announce(request, key_id)
    logger.info("bep_web.key_revoked project=%s key=%s was_live=%s", slug, key_id, revoked)
    return {"id": key_id, "revoked": revoked, "announced": announced}


@router.get("/audit")
async def audit_log(
    request: Request,
    viewer: ManagerDep,
    project: str | None = None,
    before: Annotated[int | None, Query(ge=1)] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> dict[str, Any]:
    """The audit log, newest first, ``limit`` entries older than ``before`` (an entry
    id; ``next_before`` continues), of one ``project`` or of every project the caller
    administers (a global admin: everything)."""
    async with request.app.state.pool.acquire() as conn:
        if project is not None:
            ids: list[int] | None = [(await _managed_project(conn, viewer, project))["id"]]
        else:
            ids = None if viewer.admin else sorted(viewer.admin_projects)
        entries = await audit.page(conn, projects=ids, before=before, limit=limit)
    more = len(entries) == limit
    return {"entries": entries, "next_before": entries[-1]["id"] if more else None}


@router.get("/users")
async def list_users(
    request: Request,
    viewer: AdminDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 200,
) -> dict[str, Any]:
    """The people who signed in, most recent first, with their groups (global admins)."""
    rows = await request.app.state.pool.fetch(
        "SELECT subject, email, name, groups, first_login_at, last_login_at FROM bep.users"
        " ORDER BY last_login_at DESC LIMIT $1",
        limit,
    )
    return {
        "users": [
            {
                "subject": r["subject"],
                "email": r["email"],
                "name": r["name"],
                "groups": list(r["groups"]),
                "first_login_at": r["first_login_at"].isoformat(),
                "last_login_at": r["last_login_at"].isoformat(),
            }
            for r in rows
        ]
    }
