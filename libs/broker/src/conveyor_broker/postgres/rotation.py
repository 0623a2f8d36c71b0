"""Encryption key rotation and key status on the Postgres store.

:func:`rotate` re-encrypts every stored value of every task (and of every cron entry's
task template) under the keyring's primary key, while the services keep running: it walks the task table in id order, a batch at a
time, and rewrites a batch in one statement that applies to a task only while its values
are still what were read (a compare and set on a digest of them), so a service's write
in between is never overwritten; such a task is read again and tried again. Values in
clear (stored before encryption was turned on) are encrypted on the way. The fixed error
texts the broker writes itself stay in clear.

Every batch commits on its own, so a rotation that is stopped or killed loses nothing:
run it again and it goes on, since only values not yet under the primary key are
selected (by the database, from the key id in clear in each envelope: nothing done is
read or written again).

:func:`key_status` counts stored values per key id (and those in clear), tasks and
webhook secrets apart: a key can be dropped from the configuration once no value names
it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from conveyor_broker.keyring import (
    BINARY_PREFIX,
    HEADER,
    LAST_ERROR,
    PAYLOAD,
    PROGRESS,
    RESULT,
    DecryptionError,
    Keyring,
    template_subject,
)
from conveyor_broker.postgres.queries import rotation as queries
from conveyor_broker.types import (
    ARCHIVED_BY_ADMIN_ERROR,
    CANCELED_WHILE_RUNNING_ERROR,
    EXPIRED_ERROR,
    LEASE_EXPIRED_ERROR,
)

if TYPE_CHECKING:
    import asyncpg
    from asyncpg.pool import PoolConnectionProxy

    Connection = asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]

#: The error texts the broker itself writes (not a user's words): left in clear.
SERVER_ERRORS: tuple[str, ...] = (
    EXPIRED_ERROR,
    CANCELED_WHILE_RUNNING_ERROR,
    ARCHIVED_BY_ADMIN_ERROR,
    LEASE_EXPIRED_ERROR,
)
#: Tasks read and rewritten per statement by default.
DEFAULT_BATCH = 500
#: How many times a task that changed under a rewrite is read and tried again in a run.
_ATTEMPTS = 3


@dataclass
class RotationProgress:
    """What a rotation has done so far (and, at the end, in all)."""

    #: Tasks that had a value to rewrite when the run started.
    total: int
    #: Tasks looked at (rewritten, or left as they were: see the counts below).
    scanned: int = 0
    #: Tasks rewritten, and the values re-encrypted in them.
    tasks: int = 0
    values: int = 0
    #: Values that could not be decrypted, by key id (the key is not configured, or not
    #: the one they were encrypted with): left as they are.
    unreadable: dict[str, int] = field(default_factory=dict)
    #: Tasks (and cron entries) that changed under every rewrite of this run: left for
    #: the next one.
    changed: int = 0
    #: Cron entries whose task template was rewritten (its values are in ``values``).
    entries: int = 0

    @property
    def complete(self) -> bool:
        """True when nothing was left behind (unreadable or still changing)."""
        return not self.unreadable and not self.changed


@dataclass(frozen=True)
class KeyCount:
    """How many stored values of ``field`` name ``key_id`` (None: in clear)."""

    field: str
    key_id: str | None
    count: int


@dataclass(frozen=True)
class KeyStatus:
    """Stored values per field and key id. Fields: ``payload``, ``progress``, ``result``,
    ``header``, ``last_error`` (a task's, sealed by the encrypted broker); ``cron_payload``
    and ``cron_header`` (a cron entry's task template, sealed by it too); ``server_error`` (the broker's own error texts, in clear by design); ``secret``
    (webhook signing secrets, sealed by the api under CONVEYOR_WEBHOOK_SECRET_KEY)."""

    counts: tuple[KeyCount, ...]

    def task_values(self) -> dict[str | None, int]:
        """Values the encrypted broker sealed (tasks' and cron templates'), per key id
        (None: in clear), the broker's own texts left out."""
        totals: dict[str | None, int] = {}
        for count in self.counts:
            if count.field not in ("secret", "server_error"):
                totals[count.key_id] = totals.get(count.key_id, 0) + count.count
        return totals

    def secrets(self) -> dict[str | None, int]:
        """Webhook secrets per key id (None: in clear)."""
        return {c.key_id: c.count for c in self.counts if c.field == "secret"}

    def server_errors(self) -> int:
        """Error texts the broker wrote itself (in clear by design)."""
        return sum(c.count for c in self.counts if c.field == "server_error")


async def key_status(conn: Connection) -> KeyStatus:
    """Count the stored values per field and key id (one scan of the task table)."""
    rows = await conn.fetch(queries.KEY_STATUS, BINARY_PREFIX, list(SERVER_ERRORS))
    return KeyStatus(tuple(KeyCount(row["field"], row["key_id"], row["n"]) for row in rows))


def _stale_args(keyring: Keyring) -> tuple[Any, ...]:
    return (keyring.binary_head(), keyring.text_head(), list(SERVER_ERRORS))


async def count_stale(conn: Connection, keyring: Keyring) -> int:
    """How many tasks have a value not encrypted under the primary key."""
    return int(await conn.fetchval(queries.COUNT_STALE, *_stale_args(keyring)))


@dataclass
class _Rewrite:
    """One task's values, re-encrypted."""

    id: str
    digest: str
    payload: bytes
    headers: str
    progress: bytes | None
    result: bytes | None
    last_error: str | None
    values: int


class _Resealer:
    """Re-encrypts the values of one subject (a task id, or a cron template's subject)
    under the primary key, counting the values it rewrites; a value that does not decrypt
    is kept as it is and counted in ``unreadable``."""

    def __init__(self, keyring: Keyring, subject: str, unreadable: dict[str, int]) -> None:
        self._keyring = keyring
        self._subject = subject
        self._unreadable = unreadable
        self.values = 0

    def _kept(self, exc: DecryptionError) -> None:
        self._unreadable[exc.key_id] = self._unreadable.get(exc.key_id, 0) + 1

    def binary(self, field_name: str, stored: bytes | None) -> bytes | None:
        keyring = self._keyring
        if stored is None or not keyring.needs_rotation_bytes(stored):
            return stored
        try:
            plain = keyring.open_bytes(self._subject, field_name, stored)
        except DecryptionError as exc:
            self._kept(exc)
            return stored
        self.values += 1
        return keyring.seal_bytes(self._subject, field_name, plain)

    def text(self, field_name: str, stored: str) -> str:
        keyring = self._keyring
        if not keyring.needs_rotation_text(stored):
            return stored
        try:
            plain = keyring.open_text(self._subject, field_name, stored)
        except DecryptionError as exc:
            self._kept(exc)
            return stored
        self.values += 1
        return keyring.seal_text(self._subject, field_name, plain)

    def headers(self, stored: str) -> str:
        """A JSON object of header values (as stored), its values rewritten."""
        headers: dict[str, str] = json.loads(stored)
        return json.dumps(
            {name: self.text(HEADER + name, value) for name, value in headers.items()},
            separators=(",", ":"),
        )


def _reseal(keyring: Keyring, row: Any, unreadable: dict[str, int]) -> _Rewrite | None:
    """``row``'s values under the primary key (None when none changes). A value that does
    not decrypt is kept as it is and counted in ``unreadable``."""
    tid: str = row["id"]
    reseal = _Resealer(keyring, tid, unreadable)
    payload = reseal.binary(PAYLOAD, row["payload"])
    assert payload is not None
    headers = reseal.headers(row["headers"])
    error: str | None = row["last_error"]
    if error is not None and error not in SERVER_ERRORS:
        error = reseal.text(LAST_ERROR, error)
    rewrite = _Rewrite(
        id=tid,
        digest=row["digest"],
        payload=payload,
        headers=headers,
        progress=reseal.binary(PROGRESS, row["progress"]),
        result=reseal.binary(RESULT, row["result"]),
        last_error=error,
        values=reseal.values,
    )
    return rewrite if reseal.values else None


async def _rotate_cron_templates(
    conn: Connection, keyring: Keyring, progress: RotationProgress
) -> None:
    """Re-encrypt the values of cron entries' task templates (sealed to their entry, see
    :func:`conveyor_broker.keyring.template_subject`), compare and set as for tasks. There
    are few entries: all of them at once."""
    rows = list(await conn.fetch(queries.STALE_CRON_TEMPLATES, *_stale_args(keyring)[:2]))
    unreadable: dict[str, dict[str, int]] = {}
    for attempt in range(_ATTEMPTS):
        rewrites: list[tuple[str, str, bytes, str, int]] = []
        for row in rows:
            found: dict[str, int] = {}
            reseal = _Resealer(keyring, template_subject(row["name"]), found)
            payload = reseal.binary(PAYLOAD, row["payload"])
            assert payload is not None
            headers = reseal.headers(row["headers"])
            unreadable[row["name"]] = found
            if reseal.values:
                rewrites.append((row["name"], row["digest"], payload, headers, reseal.values))
        written: set[str] = set()
        if rewrites:
            columns = list(zip(*rewrites, strict=True))
            done = await conn.fetch(queries.REWRITE_CRON_TEMPLATES, *map(list, columns[:4]))
            written = {row["name"] for row in done}
        for name, _, _, _, values in rewrites:
            if name in written:
                progress.entries += 1
                progress.values += values
        left = {name for name, *_ in rewrites if name not in written}
        if not left:
            break
        if attempt == _ATTEMPTS - 1:
            progress.changed += len(left)
            break
        # Changed by an operator since it was read (or deleted): read it again.
        rows = [
            row
            for row in await conn.fetch(queries.STALE_CRON_TEMPLATES, *_stale_args(keyring)[:2])
            if row["name"] in left
        ]
    for found in unreadable.values():
        for kid, n in found.items():
            progress.unreadable[kid] = progress.unreadable.get(kid, 0) + n


async def _apply(conn: Connection, rewrites: list[_Rewrite]) -> set[str]:
    """Write ``rewrites`` (in id order) where unchanged; the ids written."""
    if not rewrites:
        return set()
    rows = await conn.fetch(
        queries.REWRITE,
        [r.id for r in rewrites],
        [r.digest for r in rewrites],
        [r.payload for r in rewrites],
        [r.headers for r in rewrites],
        [r.progress for r in rewrites],
        [r.result for r in rewrites],
        [r.last_error for r in rewrites],
    )
    return {row["id"] for row in rows}


async def _rewrite_batch(
    conn: Connection, keyring: Keyring, rows: list[Any], progress: RotationProgress
) -> None:
    # The unreadable values of each task, as its last read found them.
    unreadable: dict[str, dict[str, int]] = {}
    for attempt in range(_ATTEMPTS):
        rewrites: list[_Rewrite] = []
        for row in rows:
            found: dict[str, int] = {}
            rewrite = _reseal(keyring, row, found)
            unreadable[row["id"]] = found
            if rewrite is not None:
                rewrites.append(rewrite)
        written = await _apply(conn, rewrites)
        for rewrite in rewrites:
            if rewrite.id in written:
                progress.tasks += 1
                progress.values += rewrite.values
        left = sorted(r.id for r in rewrites if r.id not in written)
        if not left:
            break
        if attempt == _ATTEMPTS - 1:
            progress.changed += len(left)
            break
        # Changed by a service since it was read (or deleted): read it again.
        rows = list(await conn.fetch(queries.TASKS_BY_IDS, left))
    for found in unreadable.values():
        for kid, n in found.items():
            progress.unreadable[kid] = progress.unreadable.get(kid, 0) + n


async def rotate(
    conn: Connection,
    keyring: Keyring,
    *,
    batch_size: int = DEFAULT_BATCH,
    pause: float = 0.0,
    on_batch: Callable[[RotationProgress], None] | None = None,
) -> RotationProgress:
    """Re-encrypt every stored task value, then every cron template's, under
    ``keyring``'s primary key (see the module docstring), ``batch_size`` tasks per
    statement, waiting ``pause`` seconds
    between batches (to leave the database to the services). ``on_batch`` is called with
    the progress so far once the work is counted, then after each batch. Returns the
    totals."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    progress = RotationProgress(total=await count_stale(conn, keyring))
    if on_batch is not None:
        on_batch(progress)
    args = _stale_args(keyring)
    cursor = ""
    while True:
        rows = list(await conn.fetch(queries.STALE_TASKS, *args, cursor, batch_size))
        if not rows:
            await _rotate_cron_templates(conn, keyring, progress)
            return progress
        cursor = rows[-1]["id"]
        await _rewrite_batch(conn, keyring, rows, progress)
        progress.scanned += len(rows)
        if on_batch is not None:
            on_batch(progress)
        if pause > 0:
            await asyncio.sleep(pause)
