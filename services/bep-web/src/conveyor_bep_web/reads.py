"""What the pages and the JSON API read: each function runs one query of
:mod:`conveyor_bep_web.queries` for a viewer and returns JSON-ready dicts.

Every function takes the viewer's project set (``projects``: :meth:`Viewer.project_ids`,
None: every project) and hands it to SQL; a build of a project outside it is None (the
callers' 404), never an error that says it exists.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
from conveyor_bep.writer import COUNTER_COLUMNS

from conveyor_bep_web import queries
from conveyor_bep_web.search import (
    FACET_SCAN,
    FACET_VALUES,
    BuildSearch,
    decode_cursor,
    encode_cursor,
)

Projects = list[int] | None
Json = dict[str, Any]

#: How many values of each tag key the facets list.
TAG_VALUES = 20


def _value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def _json(value: Any, default: Any) -> Any:
    """A ``jsonb`` column (asyncpg hands it over as text)."""
    if value is None:
        return default
    return json.loads(value) if isinstance(value, str) else value


def _duration_ms(start: datetime | None, end: datetime | None) -> int | None:
    if start is None or end is None:
        return None
    return int((end - start).total_seconds() * 1000)


def build_row(row: asyncpg.Record) -> Json:
    """A build of a list: its identity, outcome, who and where, and counters."""
    out = {k: _value(v) for k, v in row.items()}
    out["tags"] = _json(row["tags"], {})
    out["duration_ms"] = _duration_ms(row["started_at"], row["finished_at"])
    return out


@dataclass(frozen=True, slots=True)
class Project:
    """A project the viewer may read."""

    id: int
    slug: str
    name: str


async def list_projects(conn: Any, projects: Projects) -> list[Json]:
    """The projects the viewer may read, with their build counts."""
    rows = await conn.fetch(queries.PROJECTS, projects)
    return [{k: _value(v) for k, v in row.items()} for row in rows]


async def project_by_slug(conn: Any, projects: Projects, slug: str) -> Project | None:
    """The project ``slug`` if the viewer may read it."""
    row = await conn.fetchrow(queries.PROJECT_BY_SLUG, projects, slug)
    return None if row is None else Project(row["id"], row["slug"], row["name"])


def builds_cursor(cursor: str | None) -> tuple[datetime | None, str | None]:
    """The sort key after which a page of builds starts (None, None: the newest)."""
    if cursor is None or cursor == "":
        return None, None
    created, invocation = decode_cursor(cursor, (datetime, str))
    return created, invocation


async def search_builds(
    conn: Any,
    projects: Projects,
    project: Project,
    search: BuildSearch,
    *,
    before: str | None,
    limit: int,
) -> tuple[list[Json], str | None]:
    """A page of ``project``'s builds matching ``search``, newest first, after the
    cursor ``before``; and the cursor of the next page (None: this is the last)."""
    created, invocation = builds_cursor(before)
    rows = await conn.fetch(
        queries.BUILDS, projects, project.id, *search.params(), created, invocation, limit + 1
    )
    more = len(rows) > limit
    rows = rows[:limit]
    following = encode_cursor(rows[-1]["created_at"], rows[-1]["invocation_id"]) if more else None
    return [build_row(r) for r in rows], following


async def build_facets(
    conn: Any, projects: Projects, project: Project, search: BuildSearch
) -> Json:
    """Counts by status, user and branch over the builds ``search`` matches (the newest
    :data:`FACET_SCAN` of them, the :data:`FACET_VALUES` most frequent values each), and
    the project's tag values (``bep.tag_keys``)."""
    rows = await conn.fetch(
        queries.BUILD_FACETS,
        projects,
        project.id,
        *search.params(),
        FACET_SCAN,
        FACET_VALUES,
    )
    facets: Json = {"status": [], "user": [], "branch": []}
    counted = 0
    for row in rows:
        if row["facet"] == "total":
            counted = row["n"]
        else:
            facets[row["facet"]].append({"value": row["value"], "count": row["n"]})
    tags: dict[str, list[Json]] = {}
    for row in await conn.fetch(queries.TAG_FACETS, projects, project.id, TAG_VALUES):
        tags.setdefault(row["key"], []).append({"value": row["value"], "count": row["builds"]})
    facets["tags"] = tags
    facets["counted"] = counted
    facets["capped"] = counted >= FACET_SCAN
    return facets


async def build_project(conn: Any, projects: Projects, invocation_id: str) -> int | None:
    """The project id of build ``invocation_id`` if the viewer may read it."""
    value = await conn.fetchval(queries.BUILD_PROJECT, projects, invocation_id)
    return None if value is None else int(value)


async def build_summary(conn: Any, projects: Projects, invocation_id: str) -> Json | None:
    """Everything about one build but its rows: outcome, command, who and where, tags,
    timings, counters, cache statistics, options and command line (scrubbed at
    ingest) and metrics. None: no such build the viewer may read."""
    row = await conn.fetchrow(queries.BUILD, projects, invocation_id)
    if row is None:
        return None
    metrics = _json(row["metrics"], None)
    action_cache = (metrics or {}).get("action_summary", {}).get("action_cache_statistics")
    return {
        "invocation_id": row["invocation_id"],
        "build_id": row["build_id"],
        "project": {
            "id": row["project_id"],
            "slug": row["project_slug"],
            "name": row["project_name"],
        },
        "status": row["status"],
        "finished": row["finished"],
        "exit_code": row["exit_code"],
        "exit_name": row["exit_name"],
        "command": row["command"],
        "patterns": row["patterns"] or [],
        "tool_version": row["tool_version"],
        "user": row["user_name"],
        "host": row["host_name"],
        "branch": row["branch"],
        "commit": row["commit_sha"],
        "tags": _json(row["tags"], {}),
        "timing": {
            "created_at": _value(row["created_at"]),
            "updated_at": _value(row["updated_at"]),
            "started_at": _value(row["started_at"]),
            "finished_at": _value(row["finished_at"]),
            "attempt_started_at": _value(row["attempt_started_at"]),
            "attempt_finished_at": _value(row["attempt_finished_at"]),
            "duration_ms": _duration_ms(row["started_at"], row["finished_at"]),
        },
        "lifecycle_status": row["lifecycle_status"],
        "counters": {name: row[name] for name in (*COUNTER_COLUMNS, "events", "last_event_seq")},
        "cache": {
            "actions_created": row["actions_created"],
            "actions_executed": row["actions_executed"],
            "cache_hits": row["cache_hits"],
            "action_cache": action_cache,
            "test_results": row["test_results"],
            "test_results_cached": row["test_results_cached"],
        },
        "log": {"bytes": row["log_bytes"], "lines": row["log_lines"]},
        "options": _json(row["options"], None),
        "command_line": row["command_line"] or [],
        "metrics": metrics,
    }


async def build_targets(
    conn: Any,
    projects: Projects,
    invocation_id: str,
    *,
    after: str | None,
    failed: bool,
    limit: int,
) -> tuple[list[Json], str | None]:
    """A page of the build's targets by label (after the cursor ``after``); the next
    page's cursor (None: the last)."""
    label, aspect = decode_cursor(after, (str, str)) if after else (None, None)
    rows = await conn.fetch(
        queries.TARGETS, projects, invocation_id, label, aspect, failed, limit + 1
    )
    following = None
    if len(rows) > limit:
        rows = rows[:limit]
        following = encode_cursor(rows[-1]["label"], rows[-1]["aspect"])
    return [{k: _value(v) for k, v in r.items()} for r in rows], following


async def build_tests(
    conn: Any,
    projects: Projects,
    invocation_id: str,
    *,
    after: str | None,
    failed: bool,
    limit: int,
) -> tuple[list[Json], str | None]:
    """A page of the build's test results (each with its outputs) by label, run, shard
    and attempt; the next page's cursor (None: the last)."""
    key = decode_cursor(after, (str, int, int, int)) if after else (None, None, None, None)
    rows = await conn.fetch(queries.TEST_RESULTS, projects, invocation_id, *key, failed, limit + 1)
    following = None
    if len(rows) > limit:
        rows = rows[:limit]
        last = rows[-1]
        following = encode_cursor(last["label"], last["run"], last["shard"], last["attempt"])
    out = []
    for row in rows:
        item = {k: _value(v) for k, v in row.items()}
        item["outputs"] = _json(row["outputs"], [])
        out.append(item)
    return out, following


async def build_actions(
    conn: Any, projects: Projects, invocation_id: str, *, after: str | None, limit: int
) -> tuple[list[Json], str | None]:
    """A page of the build's actions in stream order; the next page's cursor."""
    (seq,) = decode_cursor(after, (int,)) if after else (0,)
    rows = await conn.fetch(queries.ACTIONS, projects, invocation_id, seq, limit + 1)
    following = None
    if len(rows) > limit:
        rows = rows[:limit]
        following = encode_cursor(rows[-1]["seq"])
    return [{k: _value(v) for k, v in r.items()} for r in rows], following


async def builds_by_id(
    conn: Any, projects: Projects, project_id: int, invocation_ids: list[str]
) -> list[Json]:
    """The list rows of the given builds of one project (those the viewer may read)."""
    rows = await conn.fetch(queries.BUILDS_BY_ID, projects, invocation_ids, project_id)
    return [build_row(r) for r in rows]
