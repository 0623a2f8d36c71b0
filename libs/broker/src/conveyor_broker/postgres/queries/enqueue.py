"""Statements of EnqueueBatch: the batch INSERT, and what a checked batch reads first
(stored ids, unique claims; dependencies are in ``queries.dependencies``)."""

from __future__ import annotations

import functools
import re

from conveyor_broker.postgres.queries import TASK_COLUMNS

# The columns an enqueue supplies: name -> (element type of its parameter array, the
# table columns it fills, the expressions that fill them from the unnested ``u.<name>``),
# in parameter order. ``unique_key`` also takes the claim; ``depends_on`` travels
# comma-joined.
ENQUEUE_COLUMNS: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    "id": ("text", ("id",), ("u.id",)),
    "queue": ("text", ("queue",), ("u.queue",)),
    "type": ("text", ("type",), ("u.type",)),
    "payload": ("bytea", ("payload",), ("u.payload",)),
    "headers": ("text", ("headers",), ("u.headers::jsonb",)),
    "state": ("text", ("state",), ("u.state",)),
    "max_retry": ("int", ("max_retry",), ("u.max_retry",)),
    "timeout": ("interval", ("timeout",), ("u.timeout",)),
    "deadline": ("timestamptz", ("deadline",), ("u.deadline",)),
    "process_at": ("timestamptz", ("process_at",), ("u.process_at",)),
    "expires_at": ("timestamptz", ("expires_at",), ("u.expires_at",)),
    "retention": ("interval", ("retention",), ("u.retention",)),
    "unique_key": ("text", ("unique_key", "unique_claim"), ("u.unique_key", "u.unique_key")),
    "unique_until": ("timestamptz", ("unique_until",), ("u.unique_until",)),
    "group_key": ("text", ("group_key",), ("u.group_key",)),
    "depends_on": ("text", ("depends_on",), ("string_to_array(u.depends_on, ',')",)),
    "on_failure": ("text", ("on_failure",), ("u.on_failure",)),
    "concurrency_key": ("text", ("concurrency_key",), ("u.concurrency_key",)),
    "available_at": ("timestamptz", ("available_at",), ("u.available_at",)),
    # Dependencies: a task's edge counters, whether tasks of the batch wait for it, and
    # what a task born CANCELED (a failed dependency, CASCADE_CANCEL) ends with.
    "deps_open": ("int", ("deps_open",), ("u.deps_open",)),
    "deps_failed": ("int", ("deps_failed",), ("u.deps_failed",)),
    "dependents_pending": ("boolean", ("dependents_pending",), ("u.dependents_pending",)),
    "completed_at": ("timestamptz", ("completed_at",), ("u.completed_at",)),
    "last_error": ("text", ("last_error",), ("u.last_error",)),
}
#: Columns a batch may leave out when no task in it sets them: the table's defaults (NULL,
#: or ``'{}'`` for headers and depends_on) are what those tasks would store anyway. A
#: plain batch then sends and unnests 9 arrays instead of 19, which is most of what an
#: enqueue costs the client per row.
ENQUEUE_OPTIONAL = frozenset(
    {
        "headers",
        "timeout",
        "deadline",
        "process_at",
        "expires_at",
        "retention",
        "unique_key",
        "unique_until",
        "group_key",
        "depends_on",
        "concurrency_key",
        "deps_open",
        "deps_failed",
        "dependents_pending",
        "completed_at",
        "last_error",
    }
)


@functools.lru_cache(maxsize=256)
def enqueue_statement(
    columns: tuple[str, ...], scalars: frozenset[str] = frozenset(), *, skip_existing: bool = True
) -> str:
    """Insert a batch: rows whose id (or live unique claim) exists are skipped, and the ids
    inserted are returned; with ``skip_existing`` False, a plain INSERT (a row whose id
    exists fails the statement) that returns nothing, for ids that were just made.

    ``$1..$n`` take the names of ``columns`` (keys of ``ENQUEUE_COLUMNS``) in order: a
    parallel array, one element per task, or for a name in ``scalars`` one value that
    every task of the batch shares; ``$n+1`` is now. The one statement put together from
    parts, because a batch sends only the optional columns it uses, and one value for a
    column its tasks agree on (their queue, type, state, retry policy, due time...: an
    array of a thousand equal values costs more to encode, send and unnest than the rows'
    own data). ``id`` is always an array. A batch of new tasks with none of the optional
    columns (the hot path) runs::

        INSERT INTO conveyor_tasks AS t (id, queue, type, payload, state, max_retry,
                                         on_failure, available_at, created_at, updated_at)
        SELECT u.id, $2::text, $3::text, $4::bytea, $5::text, $6::int, $7::text,
               $8::timestamptz, $9, $9
        FROM unnest($1::text[]) AS u(id)

    (``payload`` is an array as soon as two tasks differ in it.)
    """
    if "id" in scalars:
        raise ValueError("id is always an array")
    targets = [c for name in columns for c in ENQUEUE_COLUMNS[name][1]]
    values: list[str] = []
    arrays: list[str] = []
    unnested: list[str] = []
    for i, name in enumerate(columns, 1):
        element_type, _, expressions = ENQUEUE_COLUMNS[name]
        if name in scalars:
            value = f"${i}::{element_type}"
            values += [re.sub(rf"\bu\.{name}\b", value, e) for e in expressions]
        else:
            values += expressions
            arrays.append(f"${i}::{element_type}[]")
            unnested.append(name)
    now = f"${len(columns) + 1}"
    tail = "ON CONFLICT DO NOTHING\nRETURNING t.id\n" if skip_existing else ""
    return f"""
INSERT INTO conveyor_tasks AS t ({", ".join(targets)}, created_at, updated_at)
SELECT {", ".join(values)}, {now}, {now}
FROM unnest({", ".join(arrays)}) AS u({", ".join(unnested)})
{tail}"""


#: What only a task with dependencies sets (see ``conveyor_broker.dependencies``).
DEPENDENCY_COLUMNS = frozenset(
    {"deps_open", "deps_failed", "dependents_pending", "completed_at", "last_error"}
)

#: Every column a task without dependencies may set: $1..$19 in ``ENQUEUE_COLUMNS``
#: order, $20 is now (the statement every schema version since 001 takes).
ENQUEUE = enqueue_statement(tuple(c for c in ENQUEUE_COLUMNS if c not in DEPENDENCY_COLUMNS))

#: Stored tasks among the ids $1.
TASKS_BY_IDS = f"SELECT {TASK_COLUMNS} FROM conveyor_tasks t WHERE t.id = ANY($1::text[])"

#: Free lapsed claims ($3 = now) on the (queue, unique_key) pairs $1, $2, so that their
#: keys can be taken. Only an incomplete row is in the unique index.
FREE_LAPSED_CLAIMS = """
UPDATE conveyor_tasks t SET unique_claim = NULL
FROM unnest($1::text[], $2::text[]) AS u(queue, unique_key)
WHERE t.queue = u.queue AND t.unique_claim = u.unique_key
  AND t.unique_until <= $3
  AND t.state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'held', 'active', 'retry')
"""

#: FREE_LAPSED_CLAIMS, and the live holders (id, queue, unique_key) of the same pairs.
#: The SELECT reads the snapshot from before the UPDATE, hence its own lapse test.
FREE_LAPSED_CLAIMS_AND_READ_HOLDERS = """
WITH freed AS (
    UPDATE conveyor_tasks t SET unique_claim = NULL
    FROM unnest($1::text[], $2::text[]) AS u(queue, unique_key)
    WHERE t.queue = u.queue AND t.unique_claim = u.unique_key
      AND t.unique_until <= $3
      AND t.state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'held', 'active', 'retry')
    RETURNING t.id
)
SELECT t.id, t.queue, t.unique_claim
FROM conveyor_tasks t
JOIN unnest($1::text[], $2::text[]) AS u(queue, unique_key)
  ON t.queue = u.queue AND t.unique_claim = u.unique_key
WHERE t.state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'held', 'active', 'retry')
  AND (t.unique_until IS NULL OR t.unique_until > $3)
"""

#: The live holder of the claim on (queue $1, unique_key $2) at now $3.
UNIQUE_HOLDER = """
SELECT t.id FROM conveyor_tasks t
WHERE t.queue = $1 AND t.unique_claim = $2
  AND t.state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'held', 'active', 'retry')
  AND (t.unique_until IS NULL OR t.unique_until > $3)
"""
