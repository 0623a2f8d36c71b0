"""Projects and their API keys: issuing, revoking, and the per-node cache that maps an
``x-api-key`` header to a project.

A key reads ``conveyor_<id>_<secret>``. Only the SHA-256 of the secret is stored; the
plain key is shown once, when it is created. Each ingest node caches what a key id maps
to for :attr:`KeyCache.ttl` seconds; revoking a key (or deleting its project) publishes
the key id on the ``<prefix>.bep.keys.invalidate`` NATS subject, and every node drops
it at once, so a revoked key stops working cluster-wide without waiting for the TTL.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import asyncpg

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient

logger = logging.getLogger(__name__)

KEY_RE = re.compile(r"conveyor_(?P<id>[a-z0-9]{8,32})_(?P<secret>[A-Za-z0-9_-]{16,128})")
SLUG_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def invalidate_subject(prefix: str) -> str:
    """The NATS subject that key invalidations travel on."""
    return f"{prefix}.bep.keys.invalidate"


@dataclass(frozen=True, slots=True)
class Project:
    """A project as the ingest sees it: who it is and its limits."""

    id: int
    slug: str
    max_streams: int
    max_unacked: int
    #: Where the project's blobs live in the CAS sink's store (the slug unless changed).
    key_prefix: str = ""


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A key just created: :attr:`key` is the only copy of the secret."""

    id: str
    key: str
    project: str


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def parse_key(header: str) -> tuple[str, str] | None:
    """``(id, secret)`` of a well-formed key, else None."""
    match = KEY_RE.fullmatch(header.strip())
    return (match["id"], match["secret"]) if match else None


async def create_project(
    conn: asyncpg.Connection[Any] | Any,
    slug: str,
    *,
    name: str | None = None,
    max_streams: int = 200,
    max_unacked: int = 5000,
) -> int:
    """Create a project and return its id. ``slug`` is lower-case letters, digits and
    dashes; it is also the default key prefix of the project's blobs."""
    if not SLUG_RE.fullmatch(slug):
        raise ValueError(f"invalid project slug {slug!r}: use a-z, 0-9 and '-' (at most 63)")
    if max_streams < 1 or max_unacked < 1:
        raise ValueError("max_streams and max_unacked must be at least 1")
    try:
        project_id = await conn.fetchval(
            "INSERT INTO bep.projects (slug, name, key_prefix, max_streams, max_unacked)"
            " VALUES ($1, $2, $1, $3, $4) RETURNING id",
            slug,
            name or slug,
            max_streams,
            max_unacked,
        )
    except asyncpg.UniqueViolationError:
        raise ValueError(f"project {slug!r} exists already") from None
    return int(project_id)


async def create_key(conn: Any, project_slug: str, *, name: str = "") -> IssuedKey:
    """Issue a new key for the project ``project_slug``."""
    project_id = await conn.fetchval("SELECT id FROM bep.projects WHERE slug = $1", project_slug)
    if project_id is None:
        raise ValueError(f"no project {project_slug!r}")
    key_id = secrets.token_hex(8)
    secret = secrets.token_urlsafe(32)
    await conn.execute(
        "INSERT INTO bep.api_keys (id, project_id, secret_sha256, name) VALUES ($1, $2, $3, $4)",
        key_id,
        project_id,
        _digest(secret),
        name,
    )
    return IssuedKey(key_id, f"conveyor_{key_id}_{secret}", project_slug)


async def announce_key_change(nc: NatsClient, prefix: str, key_id: str) -> None:
    """Tell every node to forget what it cached of ``key_id``. Call it after the change
    is committed: a node that reloads the key earlier would cache the old row again."""
    await nc.publish(invalidate_subject(prefix), key_id.encode())
    await nc.flush()


async def revoke_key(conn: Any, key_id: str, *, nc: NatsClient | None, prefix: str) -> bool:
    """Revoke a key (True if it existed and was live) and tell every node to forget it.
    Inside a transaction, pass ``nc=None`` and :func:`announce_key_change` after commit."""
    status = await conn.execute(
        "UPDATE bep.api_keys SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL",
        key_id,
    )
    if nc is not None:
        await announce_key_change(nc, prefix, key_id)
    return bool(status.endswith(" 1"))


_LOOKUP = """
SELECT k.secret_sha256, p.id, p.slug, p.max_streams, p.max_unacked, p.key_prefix
FROM bep.api_keys k JOIN bep.projects p ON p.id = k.project_id
WHERE k.id = $1 AND k.revoked_at IS NULL
"""


class KeyCache:
    """Key id -> (secret digest, project), cached per node and invalidated over NATS."""

    def __init__(self, pool: asyncpg.Pool[Any] | Any, *, ttl: float = 300.0) -> None:
        self._pool = pool
        self.ttl = ttl
        self._entries: dict[str, tuple[float, bytes, Project] | tuple[float, None, None]] = {}

    async def subscribe(self, nc: NatsClient, prefix: str) -> None:
        """Drop a key from the cache whenever another node says it changed."""

        async def on_message(msg: Any) -> None:
            self.forget(msg.data.decode(errors="replace"))

        await nc.subscribe(invalidate_subject(prefix), cb=on_message)

    def forget(self, key_id: str) -> None:
        """Drop ``key_id`` (an empty id drops everything)."""
        if key_id:
            self._entries.pop(key_id, None)
        else:
            self._entries.clear()

    async def authenticate(self, header: str | None) -> Project | None:
        """The project of a valid, live key, else None."""
        if not header:
            return None
        parsed = parse_key(header)
        if parsed is None:
            return None
        key_id, secret = parsed
        now = time.monotonic()
        entry = self._entries.get(key_id)
        if entry is None or now - entry[0] > self.ttl:
            row = await self._pool.fetchrow(_LOOKUP, key_id)
            if row is None:
                entry = (now, None, None)
            else:
                project = Project(row[1], row[2], row[3], row[4], row[5])
                entry = (now, bytes(row[0]), project)
            self._entries[key_id] = entry
        _, digest, project_or_none = entry
        if digest is None or project_or_none is None:
            return None
        if not hmac.compare_digest(digest, _digest(secret)):
            return None
        return project_or_none
