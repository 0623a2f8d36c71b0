"""The audit log: every admin action of the web UI, written in the transaction of the
change it records (so there is no change without its entry), read newest first.

Actions are ``<noun>.<verb>``: ``project.create``, ``project.update``, ``key.create``,
``key.revoke``. ``details`` never holds a secret: a key entry names the key id only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from conveyor_bep_web.auth import Viewer

# Cast through text: the JSON goes in and out as text whatever codec the pool has for jsonb.
_INSERT = """
INSERT INTO bep.audit_log (actor, action, project_id, target, details)
VALUES ($1, $2, $3, $4, $5::text::jsonb) RETURNING id
"""

_PAGE = """
SELECT a.id, a.at, a.actor, u.email AS actor_email, a.action, a.project_id,
       p.slug AS project, a.target, a.details::text AS details
FROM bep.audit_log a
LEFT JOIN bep.projects p ON p.id = a.project_id
LEFT JOIN bep.users u ON u.subject = a.actor
WHERE ($1::bigint[] IS NULL OR a.project_id = ANY($1::bigint[]))
  AND ($2::bigint IS NULL OR a.id < $2)
ORDER BY a.id DESC
LIMIT $3
"""


async def record(
    conn: Any,
    viewer: Viewer,
    action: str,
    *,
    project_id: int | None,
    target: str | None,
    details: Mapping[str, Any] | None = None,
) -> int:
    """Write one entry (inside the caller's transaction) and return its id."""
    entry_id = await conn.fetchval(
        _INSERT,
        viewer.subject,
        action,
        project_id,
        target,
        json.dumps(dict(details or {}), sort_keys=True, default=str),
    )
    return int(entry_id)


async def page(
    conn: Any, *, projects: list[int] | None, before: int | None, limit: int
) -> list[dict[str, Any]]:
    """Up to ``limit`` entries older than the entry ``before`` (None: the newest), of the
    ``projects`` (None: all, and entries about no project too), newest first."""
    rows = await conn.fetch(_PAGE, projects, before, limit)
    return [
        {
            "id": row["id"],
            "at": row["at"].isoformat(),
            "actor": row["actor"],
            "actor_email": row["actor_email"],
            "action": row["action"],
            "project_id": row["project_id"],
            "project": row["project"],
            "target": row["target"],
            "details": json.loads(row["details"]),
        }
        for row in rows
    ]
