"""Batches and the writer shards that commit them: group commit with a fence.

A stream's worker closes a :class:`Batch` every 50 ms, 500 events or 256 KB and hands it to
the :class:`WriterShard` its invocation id hashes to. A shard commits everything pending,
from all its invocations, in one transaction at most every ``interval`` seconds:

1. the invocation rows of new invocations (``INSERT ... ON CONFLICT DO NOTHING``);
2. the **fence**: every batch advances its invocation row only from where the batch
   starts (``... WHERE invocation_id = $1 AND last_event_seq = first_seq - 1``). One
   statement fences every invocation of the group, each invocation's run of consecutive
   batches merged into one row of it. An invocation the statement did not update has
   been moved on by another worker (another node, or this one before a restart): its
   batches are *fenced out* and its stream ends so Bazel retries;
3. one multi-row statement per table (raw segments, log segments, targets, test results,
   actions, named sets, metrics, tag facets, artifacts) with the rows of the batches that
   won their fence, merged by key.

Each batch's future resolves only after the commit: the stream acknowledges a batch's
events to Bazel then and not before, so an ack is the durability boundary. If the group
fails, its batches are retried one by one, so one bad invocation cannot block the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

import asyncpg
import zstandard

from conveyor_bep.normalize import Changes, Row

logger = logging.getLogger(__name__)

_COMPRESSOR = zstandard.ZstdCompressor(level=3)


class FencedOut(Exception):
    """Another worker took the invocation over: this stream must end (Bazel retries)."""


def varint(n: int) -> bytes:
    """The base-128 varint of ``n`` >= 0 (protobuf's length prefix)."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_delimited(messages: Sequence[bytes]) -> bytes:
    """Messages as one varint-length-delimited byte string (Bazel's binary file format)."""
    return b"".join(varint(len(data)) + data for data in messages)


def decode_delimited(data: bytes) -> list[bytes]:
    """The inverse of :func:`encode_delimited` (also reads Bazel's
    ``--build_event_binary_file``). ValueError when ``data`` ends inside a length or a
    message."""
    out: list[bytes] = []
    pos = 0
    while pos < len(data):
        shift = n = 0
        while True:
            if pos >= len(data):
                raise ValueError(f"truncated length at byte {pos}")
            byte = data[pos]
            pos += 1
            n |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift > 63:
                raise ValueError(f"length too long at byte {pos}")
        if pos + n > len(data):
            raise ValueError(f"truncated message at byte {pos} ({n} bytes)")
        out.append(data[pos : pos + n])
        pos += n
    return out


def compress(data: bytes) -> bytes:
    """zstd, as every segment is stored."""
    return _COMPRESSOR.compress(data)


def decompress(data: bytes) -> bytes:
    """The inverse of :func:`compress`."""
    return zstandard.ZstdDecompressor().decompress(data)


@dataclass(slots=True, eq=False)
class Batch:
    """Consecutive events ``first_seq..last_seq`` of one invocation, and what they say."""

    invocation_id: str
    project_id: int
    build_id: str
    first_seq: int
    last_seq: int = 0
    events: list[bytes] = field(default_factory=list)
    size: int = 0
    changes: Changes = field(default_factory=Changes)
    log_offset: int = 0
    line_offset: int = 0
    final: bool = False
    #: Which stream made the batch: a stream fenced out loses its later batches too.
    stream: int = 0
    done: asyncio.Future[None] | None = None

    @property
    def log_text(self) -> bytes:
        return "".join(self.changes.log).encode()

    def shard_key(self) -> int:
        return zlib.crc32(self.invocation_id.encode())


# Columns a batch may set on the invocation row, with their SQL types.
_SET_COLUMNS: tuple[tuple[str, str], ...] = (
    ("command", "text"),
    ("tool_version", "text"),
    ("started_at", "timestamptz"),
    ("command_line", "text[]"),
    ("options", "jsonb"),
    ("user_name", "text"),
    ("host_name", "text"),
    ("commit_sha", "text"),
    ("branch", "text"),
    ("patterns", "text[]"),
    ("exit_code", "integer"),
    ("exit_name", "text"),
    ("finished_at", "timestamptz"),
    ("actions_created", "bigint"),
    ("actions_executed", "bigint"),
)
#: The invocation row's counters, which batches add to.
COUNTER_COLUMNS: tuple[str, ...] = (
    "targets_configured",
    "targets_completed",
    "targets_failed",
    "tests_total",
    "tests_passed",
    "tests_failed",
    "tests_flaky",
    "actions_failed",
)


def _fenced_update_sql() -> str:
    params = 6  # $1 id, $2 project, $3 first_seq - 1, $4 last_seq, $5 events, $6 final
    sets = []
    for name, sql_type in _SET_COLUMNS:
        params += 1
        sets.append(f"{name} = COALESCE(${params}::{sql_type}, {name})")
    for name in COUNTER_COLUMNS:
        params += 1
        sets.append(f"{name} = {name} + ${params}::integer")
    status, tags, log_bytes, log_lines = (params + 1, params + 2, params + 3, params + 4)
    return f"""
UPDATE bep.invocations SET
    last_event_seq = $4, events = events + $5, finished = finished OR $6,
    status = CASE
        WHEN ${status}::text IS NOT NULL THEN ${status}::text
        WHEN $6 AND status = 'running' THEN 'incomplete'
        ELSE status END,
    tags = tags || ${tags}::jsonb,
    log_bytes = log_bytes + ${log_bytes}::bigint, log_lines = log_lines + ${log_lines}::bigint,
    updated_at = now(),
    {", ".join(sets)}
WHERE invocation_id = $1 AND project_id = $2 AND last_event_seq = $3
RETURNING 1"""


FENCED_UPDATE = _fenced_update_sql()

INSERT_INVOCATIONS = """
INSERT INTO bep.invocations (invocation_id, project_id, build_id)
SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[])
ON CONFLICT (invocation_id) DO NOTHING"""

INSERT_EVENT_SEGMENTS = """
INSERT INTO bep.event_segments (day, invocation_id, first_seq, last_seq, raw_bytes, data)
SELECT $1::date, * FROM unnest($2::text[], $3::bigint[], $4::bigint[], $5::integer[], $6::bytea[])
ON CONFLICT DO NOTHING"""

INSERT_LOG_SEGMENTS = """
INSERT INTO bep.log_segments (day, invocation_id, byte_offset, line_offset, bytes, lines, data)
SELECT $1::date, * FROM unnest($2::text[], $3::bigint[], $4::bigint[], $5::integer[],
    $6::integer[], $7::bytea[])
ON CONFLICT DO NOTHING"""

_TARGET_COLUMNS = (
    ("configuration", "text"),
    ("kind", "text"),
    ("test_size", "text"),
    ("tags", "text"),  # text[] rows travel as JSON text, see below
    ("success", "boolean"),
    ("failure", "text"),
    ("test_status", "text"),
    ("test_runs", "integer"),
    ("test_cached", "integer"),
    ("test_duration_ms", "bigint"),
)


def _upsert_targets_sql() -> str:
    cols = ", ".join(name for name, _ in _TARGET_COLUMNS)
    arrays = ", ".join(f"${i + 4}::{t}[]" for i, (_, t) in enumerate(_TARGET_COLUMNS))
    select = ", ".join(
        "CASE WHEN u.tags IS NULL THEN NULL ELSE ARRAY(SELECT jsonb_array_elements_text("
        "u.tags::jsonb)) END"
        if name == "tags"
        else f"u.{name}"
        for name, _ in _TARGET_COLUMNS
    )
    updates = ", ".join(f"{n} = COALESCE(EXCLUDED.{n}, t.{n})" for n, _ in _TARGET_COLUMNS)
    return f"""
INSERT INTO bep.targets AS t (invocation_id, label, aspect, {cols})
SELECT u.invocation_id, u.label, u.aspect, {select}
FROM unnest($1::text[], $2::text[], $3::text[], {arrays})
    AS u(invocation_id, label, aspect, {cols})
ON CONFLICT (invocation_id, label, aspect) DO UPDATE SET {updates}"""


UPSERT_TARGETS = _upsert_targets_sql()

UPSERT_TEST_RESULTS = """
INSERT INTO bep.test_results AS r (invocation_id, label, run, shard, attempt, configuration,
    status, status_details, cached_locally, cached_remotely, started_at, duration_ms,
    strategy, exit_code, outputs)
SELECT * FROM unnest($1::text[], $2::text[], $3::integer[], $4::integer[], $5::integer[],
    $6::text[], $7::text[], $8::text[], $9::boolean[], $10::boolean[], $11::timestamptz[],
    $12::bigint[], $13::text[], $14::integer[], $15::jsonb[])
ON CONFLICT (invocation_id, label, run, shard, attempt) DO UPDATE SET
    configuration = EXCLUDED.configuration, status = EXCLUDED.status,
    status_details = EXCLUDED.status_details, cached_locally = EXCLUDED.cached_locally,
    cached_remotely = EXCLUDED.cached_remotely, started_at = EXCLUDED.started_at,
    duration_ms = EXCLUDED.duration_ms, strategy = EXCLUDED.strategy,
    exit_code = EXCLUDED.exit_code, outputs = EXCLUDED.outputs"""

UPSERT_ACTIONS = """
INSERT INTO bep.actions (invocation_id, seq, label, mnemonic, configuration, primary_output,
    success, exit_code, stdout_uri, stderr_uri, command_line, failure)
SELECT u.invocation_id, u.seq, u.label, u.mnemonic, u.configuration, u.primary_output,
    u.success, u.exit_code, u.stdout_uri, u.stderr_uri,
    ARRAY(SELECT jsonb_array_elements_text(u.command_line)), u.failure
FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[], $6::text[],
    $7::boolean[], $8::integer[], $9::text[], $10::text[], $11::jsonb[], $12::text[])
    AS u(invocation_id, seq, label, mnemonic, configuration, primary_output, success,
         exit_code, stdout_uri, stderr_uri, command_line, failure)
ON CONFLICT (invocation_id, seq) DO NOTHING"""

UPSERT_NAMED_SETS = """
INSERT INTO bep.named_sets (invocation_id, set_id, files, file_sets)
SELECT u.invocation_id, u.set_id, u.files, ARRAY(SELECT jsonb_array_elements_text(u.sets))
FROM unnest($1::text[], $2::text[], $3::jsonb[], $4::jsonb[]) AS u(invocation_id, set_id, files, sets)
ON CONFLICT (invocation_id, set_id) DO UPDATE SET files = EXCLUDED.files,
    file_sets = EXCLUDED.file_sets"""

UPSERT_METRICS = """
INSERT INTO bep.invocation_metrics (invocation_id, metrics)
SELECT * FROM unnest($1::text[], $2::jsonb[])
ON CONFLICT (invocation_id) DO UPDATE SET metrics = EXCLUDED.metrics"""

ADD_TAG_FACETS = """
INSERT INTO bep.tag_keys AS f (project_id, key, value, builds)
SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::bigint[])
ON CONFLICT (project_id, key, value) DO UPDATE SET builds = f.builds + EXCLUDED.builds"""


# The files in the CAS a build references: each row pins its blob (conveyor_bep.blobs).
INSERT_ARTIFACTS = """
INSERT INTO bep.artifacts (invocation_id, project_id, kind, label, name, digest, size)
SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::text[], $6::text[],
    $7::bigint[])
ON CONFLICT DO NOTHING"""


def partition_name(table: str, day: date) -> str:
    return f"{table}_{day:%Y%m%d}"


async def ensure_partitions(conn: Any, today: date, *, ahead: int = 2) -> None:
    """Create the daily partitions of the segment tables for ``today`` and ``ahead`` days
    after it (idempotent)."""
    for table in ("event_segments", "log_segments"):
        for offset in range(ahead + 1):
            day = today + timedelta(days=offset)
            # IF NOT EXISTS is not safe against a concurrent creator (another shard or
            # node): the loser of that race sees the table exist, which is what it wanted.
            with contextlib.suppress(asyncpg.DuplicateTableError, asyncpg.UniqueViolationError):
                await conn.execute(
                    f"CREATE TABLE IF NOT EXISTS bep.{partition_name(table, day)} PARTITION OF "
                    f"bep.{table} FOR VALUES FROM ('{day.isoformat()}') "
                    f"TO ('{(day + timedelta(days=1)).isoformat()}')"
                )


def _invocation_args(batch: Batch) -> list[Any]:
    inv = batch.changes.invocation
    args: list[Any] = [
        batch.invocation_id,
        batch.project_id,
        batch.first_seq - 1,
        batch.last_seq,
        len(batch.events),
        batch.final,
    ]
    args.extend(inv.set.get(name) for name, _ in _SET_COLUMNS)
    args.extend(inv.add.get(name, 0) for name in COUNTER_COLUMNS)
    log = batch.log_text
    args.extend(
        [
            inv.set.get("status"),
            json.dumps(inv.tags),
            len(log),
            log.count(b"\n"),
        ]
    )
    return args


# Array columns travel through unnest as JSON (a text[][] must be rectangular).
_ARRAY_COLUMNS = frozenset(name for name, sql_type in _SET_COLUMNS if sql_type == "text[]")


def _fenced_advance_sql() -> str:
    """One statement for many invocations: each row of the unnest advances one
    invocation by a run of its batches, fenced like :data:`FENCED_UPDATE`."""
    columns = [
        ("invocation_id", "text"),
        ("project_id", "bigint"),
        ("prev_seq", "bigint"),
        ("last_seq", "bigint"),
        ("events", "bigint"),
        ("final", "boolean"),
        ("status", "text"),
        ("tags", "jsonb"),
        ("log_bytes", "bigint"),
        ("log_lines", "bigint"),
    ]
    columns += [
        (f"s_{name}", "jsonb" if name in _ARRAY_COLUMNS else sql_type)
        for name, sql_type in _SET_COLUMNS
    ]
    columns += [(f"a_{name}", "integer") for name in COUNTER_COLUMNS]
    arrays = ", ".join(f"${i + 1}::{sql_type}[]" for i, (_, sql_type) in enumerate(columns))
    names = ", ".join(name for name, _ in columns)
    sets = []
    for name, _ in _SET_COLUMNS:
        value = f"u.s_{name}"
        if name in _ARRAY_COLUMNS:
            value = f"CASE WHEN {value} IS NULL THEN NULL ELSE ARRAY(SELECT jsonb_array_elements_text({value})) END"
        sets.append(f"{name} = COALESCE({value}, i.{name})")
    sets += [f"{name} = i.{name} + u.a_{name}" for name in COUNTER_COLUMNS]
    return f"""
UPDATE bep.invocations AS i SET
    last_event_seq = u.last_seq, events = i.events + u.events, finished = i.finished OR u.final,
    status = CASE
        WHEN u.status IS NOT NULL THEN u.status
        WHEN u.final AND i.status = 'running' THEN 'incomplete'
        ELSE i.status END,
    tags = i.tags || u.tags,
    log_bytes = i.log_bytes + u.log_bytes, log_lines = i.log_lines + u.log_lines,
    updated_at = now(),
    {", ".join(sets)}
FROM unnest({arrays}) AS u({names})
WHERE i.invocation_id = u.invocation_id AND i.project_id = u.project_id
    AND i.last_event_seq = u.prev_seq
RETURNING i.invocation_id"""


FENCED_ADVANCE = _fenced_advance_sql()


@dataclass(slots=True)
class _Advance:
    """A run of consecutive batches of one invocation from one stream, merged into one
    fenced row of :data:`FENCED_ADVANCE`: the fence is the first batch's, the values set
    are the last non-null of each column, counters add up, tags merge."""

    first: Batch
    indexes: list[int]
    last_seq: int
    events: int
    final: bool
    set: dict[str, Any]
    add: dict[str, int]
    tags: dict[str, str]
    log_bytes: int
    log_lines: int

    @classmethod
    def of(cls, index: int, batch: Batch) -> _Advance:
        advance = cls(batch, [], 0, 0, False, {}, {}, {}, 0, 0)
        advance.extend(index, batch)
        return advance

    def follows(self, batch: Batch) -> bool:
        return batch.stream == self.first.stream and batch.first_seq == self.last_seq + 1

    def extend(self, index: int, batch: Batch) -> None:
        inv = batch.changes.invocation
        self.indexes.append(index)
        self.last_seq = batch.last_seq
        self.events += len(batch.events)
        self.final = self.final or batch.final
        self.set.update(inv.set)
        for name, by in inv.add.items():
            self.add[name] = self.add.get(name, 0) + by
        self.tags.update(inv.tags)
        log = batch.log_text
        self.log_bytes += len(log)
        self.log_lines += log.count(b"\n")

    def row(self) -> tuple[Any, ...]:
        first = self.first
        values: list[Any] = [
            first.invocation_id,
            first.project_id,
            first.first_seq - 1,
            self.last_seq,
            self.events,
            self.final,
            self.set.get("status"),
            json.dumps(self.tags),
            self.log_bytes,
            self.log_lines,
        ]
        for name, _ in _SET_COLUMNS:
            value = self.set.get(name)
            values.append(
                json.dumps(value) if name in _ARRAY_COLUMNS and value is not None else value
            )
        values.extend(self.add.get(name, 0) for name in COUNTER_COLUMNS)
        return tuple(values)


def _columns(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    return [[row[i] for row in rows] for i in range(width)]


async def apply_batches(conn: Any, batches: Sequence[Batch], today: date) -> set[int]:
    """Write ``batches`` in the caller's transaction; return the indexes of those fenced
    out (nothing of theirs is written).

    The fence of every invocation is one statement (:data:`FENCED_ADVANCE`): each
    invocation's run of consecutive batches from one stream is one row of it. Batches
    that do not continue their invocation's run (a second stream racing the first in the
    same group) follow one by one with :data:`FENCED_UPDATE`, in order."""
    new = [b for b in batches if b.first_seq == 1]
    if new:
        await conn.execute(
            INSERT_INVOCATIONS,
            [b.invocation_id for b in new],
            [b.project_id for b in new],
            [b.build_id for b in new],
        )
    advances: dict[str, _Advance] = {}
    later: list[int] = []
    deferred: set[str] = set()
    for index, batch in enumerate(batches):
        advance = advances.get(batch.invocation_id)
        if advance is None:
            advances[batch.invocation_id] = _Advance.of(index, batch)
        elif batch.invocation_id not in deferred and advance.follows(batch):
            advance.extend(index, batch)
        else:
            deferred.add(batch.invocation_id)
            later.append(index)
    rows = [advance.row() for advance in advances.values()]
    won = (
        {
            r["invocation_id"]
            for r in await conn.fetch(FENCED_ADVANCE, *_columns(rows, len(rows[0])))
        }
        if rows
        else set()
    )
    lost: set[int] = set()
    fenced_streams: set[tuple[str, int]] = set()
    for invocation_id, advance in advances.items():
        if invocation_id not in won:
            lost.update(advance.indexes)
            fenced_streams.add((invocation_id, advance.first.stream))
    for index in later:
        batch = batches[index]
        stream = (batch.invocation_id, batch.stream)
        if stream in fenced_streams:
            lost.add(index)
            continue
        if await conn.fetchval(FENCED_UPDATE, *_invocation_args(batch)) is None:
            lost.add(index)
            fenced_streams.add(stream)
    winners = [b for i, b in enumerate(batches) if i not in lost]
    if winners:
        await _write_rows(conn, winners, today)
    return lost


async def _write_rows(conn: Any, batches: Sequence[Batch], today: date) -> None:
    segments = [
        (b.invocation_id, b.first_seq, b.last_seq, b.size, compress(encode_delimited(b.events)))
        for b in batches
        if b.events
    ]
    if segments:
        await conn.execute(INSERT_EVENT_SEGMENTS, today, *_columns(segments, 5))
    logs = []
    for b in batches:
        text = b.log_text
        if text:
            logs.append(
                (
                    b.invocation_id,
                    b.log_offset,
                    b.line_offset,
                    len(text),
                    text.count(b"\n"),
                    compress(text),
                )
            )
    if logs:
        await conn.execute(INSERT_LOG_SEGMENTS, today, *_columns(logs, 6))

    targets: dict[tuple[str, str, str], Row] = {}
    results: dict[tuple[str, str, int, int, int], Row] = {}
    actions: list[tuple[Any, ...]] = []
    named: dict[tuple[str, str], Row] = {}
    metrics: dict[str, str] = {}
    facets: dict[tuple[int, str, str], int] = {}
    for b in batches:
        c = b.changes
        for (label, aspect), row in c.targets.items():
            targets.setdefault((b.invocation_id, label, aspect), {}).update(row)
        for (label, run, shard, attempt), row in c.test_results.items():
            results[(b.invocation_id, label, run, shard, attempt)] = row
        for seq, row in c.actions.items():
            actions.append(
                (
                    b.invocation_id,
                    seq,
                    row["label"],
                    row["mnemonic"],
                    row["configuration"],
                    row["primary_output"],
                    row["success"],
                    row["exit_code"],
                    row["stdout_uri"],
                    row["stderr_uri"],
                    json.dumps(row["command_line"]),
                    row["failure"],
                )
            )
        for set_id, row in c.named_sets.items():
            named[(b.invocation_id, set_id)] = row
        if c.metrics is not None:
            metrics[b.invocation_id] = json.dumps(c.metrics)
        for key, value in c.new_tags.items():
            facet = (b.project_id, key, value)
            facets[facet] = facets.get(facet, 0) + 1
    if targets:
        rows = [
            (
                *key,
                *(
                    json.dumps(row["tags"])
                    if name == "tags" and row.get("tags") is not None
                    else row.get(name)
                    for name, _ in _TARGET_COLUMNS
                ),
            )
            for key, row in targets.items()
        ]
        await conn.execute(UPSERT_TARGETS, *_columns(rows, 3 + len(_TARGET_COLUMNS)))
    if results:
        rows = [
            (
                *key,
                row["configuration"],
                row["status"],
                row["status_details"],
                row["cached_locally"],
                row["cached_remotely"],
                row["started_at"],
                row["duration_ms"],
                row["strategy"],
                row["exit_code"],
                row["outputs"],
            )
            for key, row in results.items()
        ]
        await conn.execute(UPSERT_TEST_RESULTS, *_columns(rows, 15))
    if actions:
        await conn.execute(UPSERT_ACTIONS, *_columns(actions, 12))
    if named:
        rows = [(*key, row["files"], json.dumps(row["file_sets"])) for key, row in named.items()]
        await conn.execute(UPSERT_NAMED_SETS, *_columns(rows, 4))
    if metrics:
        await conn.execute(UPSERT_METRICS, list(metrics), list(metrics.values()))
    if facets:
        rows = [(*key, count) for key, count in facets.items()]
        await conn.execute(ADD_TAG_FACETS, *_columns(rows, 4))
    artifacts = {
        (b.invocation_id, b.project_id, *key): size
        for b in batches
        for key, size in b.changes.artifacts.items()
    }
    if artifacts:
        rows = [(*key, size) for key, size in artifacts.items()]
        await conn.execute(INSERT_ARTIFACTS, *_columns(rows, 7))


Committed = Callable[[Sequence[Batch]], None]


class WriterShard:
    """One group-commit loop. Batches of one invocation always go to the same shard, so
    they commit in order."""

    def __init__(
        self,
        pool: asyncpg.Pool[Any] | Any,
        *,
        interval: float = 0.02,
        on_committed: Committed | None = None,
        today: Callable[[], date] | None = None,
    ) -> None:
        self._pool = pool
        self._interval = interval
        self._pending: list[Batch] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._on_committed = on_committed
        self._today = today or (lambda: datetime.now(UTC).date())
        self._partitions_for: date | None = None
        self.groups = 0
        self.batches = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="bep-writer")

    async def stop(self) -> None:
        """Commit what is pending, then stop."""
        if self._task is None:
            return
        task, self._task = self._task, None
        self._wake.set()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if self._pending:
            await self._commit(self._take())

    def submit(self, batch: Batch) -> asyncio.Future[None]:
        """Queue ``batch`` for the next group; the future resolves after its commit (or
        raises :class:`FencedOut` or the database error)."""
        batch.done = asyncio.get_running_loop().create_future()
        self._pending.append(batch)
        self._wake.set()
        return batch.done

    def _take(self) -> list[Batch]:
        batches, self._pending = self._pending, []
        self._wake.clear()
        return batches

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            started = loop.time()
            batches = self._take()
            if batches:
                await self._commit(batches)
            rest = self._interval - (loop.time() - started)
            if rest > 0:
                await asyncio.sleep(rest)

    async def _ensure_partitions(self, conn: Any, today: date) -> None:
        if self._partitions_for != today:
            await ensure_partitions(conn, today)
            self._partitions_for = today

    async def _commit(self, batches: list[Batch]) -> None:
        today = self._today()
        try:
            async with self._pool.acquire() as conn:
                await self._ensure_partitions(conn, today)
                async with conn.transaction():
                    lost = await apply_batches(conn, batches, today)
        except Exception as exc:
            if len(batches) == 1:
                logger.warning(
                    "bep.writer.batch_failed invocation=%s error=%s",
                    batches[0].invocation_id,
                    exc,
                )
                _resolve(batches[0], exc)
                return
            logger.warning("bep.writer.group_failed batches=%d error=%s", len(batches), exc)
            for batch in batches:
                await self._commit([batch])
            return
        self.groups += 1
        self.batches += len(batches)
        for index, batch in enumerate(batches):
            _resolve(batch, FencedOut(batch.invocation_id) if index in lost else None)
        if self._on_committed is not None:
            self._on_committed([b for i, b in enumerate(batches) if i not in lost])


def _resolve(batch: Batch, error: BaseException | None) -> None:
    done = batch.done
    if done is None or done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)
