"""Every SQL statement the Postgres broker runs, as named constants.

Conventions: "now" is always a parameter (the broker's injected clock), never ``now()``.
State lists are literals, not parameters, so that the planner can match them against the
partial indexes' predicates. Batch statements take parallel arrays and ``unnest`` them so a
whole batch is one round trip.
"""

from __future__ import annotations

import functools

from conveyor_broker.types import (
    ARCHIVED_BY_ADMIN_ERROR,
    CANCELED_WHILE_RUNNING_ERROR,
    INCOMPLETE_STATES,
    LEASE_EXPIRED_ERROR,
    WAITING_STATES,
    TaskState,
)


def _states(states: frozenset[TaskState] | set[TaskState]) -> str:
    """A SQL literal list of states in a stable order, e.g. ``('pending', 'retry')``."""
    order = list(TaskState)
    return "(" + ", ".join(f"'{s.value}'" for s in sorted(states, key=order.index)) + ")"


WAITING = _states(WAITING_STATES)
INCOMPLETE = _states(INCOMPLETE_STATES)
# Written out rather than derived: it must match conveyor_tasks_due_idx's predicate text.
LEASABLE = "('pending', 'retry')"

# Rows that describe a task start with these columns in this order (rows.task_from_row
# reads them by position); anything else a statement returns comes after them.
TASK_FIELDS = (
    "id",
    "queue",
    "type",
    "payload",
    "headers",
    "state",
    "max_retry",
    "retried",
    "timeout",
    "deadline",
    "process_at",
    "expires_at",
    "retention",
    "unique_key",
    "unique_until",
    "group_key",
    "depends_on",
    "on_failure",
    "concurrency_key",
    "available_at",
    "lease_id",
    "lease_expires_at",
    "progress",
    "result",
    "last_error",
    "created_at",
    "updated_at",
    "started_at",
    "completed_at",
)


def _columns(alias: str) -> str:
    # headers as text whatever codec the pool's owner may have registered for jsonb.
    return ", ".join(
        f"{alias}.headers::text AS headers" if name == "headers" else f"{alias}.{name}"
        for name in TASK_FIELDS
    )


#: Every column of a task row, qualified with the alias ``t``.
T_COLUMNS = _columns("t")

# ------------------------------------------------------------------------------ enqueue

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
    }
)


@functools.lru_cache(maxsize=256)
def enqueue_statement(columns: tuple[str, ...]) -> str:
    """Insert a batch; rows whose id (or live unique claim) exists are skipped.

    ``$1..$n`` are parallel arrays, one per name of ``columns`` (keys of
    ``ENQUEUE_COLUMNS``), one element per task; ``$n+1`` is now.
    """
    targets = [c for name in columns for c in ENQUEUE_COLUMNS[name][1]]
    values = [v for name in columns for v in ENQUEUE_COLUMNS[name][2]]
    arrays = [f"${i}::{ENQUEUE_COLUMNS[name][0]}[]" for i, name in enumerate(columns, 1)]
    now = f"${len(columns) + 1}"
    return f"""
INSERT INTO conveyor_tasks AS t ({", ".join(targets)}, created_at, updated_at)
SELECT {", ".join(values)}, {now}, {now}
FROM unnest({", ".join(arrays)}) AS u({", ".join(columns)})
ON CONFLICT DO NOTHING
RETURNING t.id
"""


#: Every column: $1..$19 in ``ENQUEUE_COLUMNS`` order, $20 is now.
ENQUEUE = enqueue_statement(tuple(ENQUEUE_COLUMNS))

#: Stored tasks among the ids $1.
TASKS_BY_IDS = f"SELECT {T_COLUMNS} FROM conveyor_tasks t WHERE t.id = ANY($1::text[])"

#: States of the stored tasks among the ids $1 (dependency checks).
STATES_BY_IDS = "SELECT id, state FROM conveyor_tasks WHERE id = ANY($1::text[])"

#: Free lapsed claims ($3 = now) on the (queue, unique_key) pairs $1, $2, so that their
#: keys can be taken. Only an incomplete row is in the unique index.
FREE_LAPSED_CLAIMS = f"""
UPDATE conveyor_tasks t SET unique_claim = NULL
FROM unnest($1::text[], $2::text[]) AS u(queue, unique_key)
WHERE t.queue = u.queue AND t.unique_claim = u.unique_key
  AND t.unique_until <= $3 AND t.state IN {INCOMPLETE}
"""

_LIVE_CLAIM = f"t.state IN {INCOMPLETE} AND (t.unique_until IS NULL OR t.unique_until > $3)"

#: FREE_LAPSED_CLAIMS, and the live holders (id, queue, unique_key) of the same pairs.
#: The SELECT reads the snapshot from before the UPDATE, hence its own lapse test.
FREE_LAPSED_CLAIMS_AND_READ_HOLDERS = f"""
WITH freed AS ({FREE_LAPSED_CLAIMS} RETURNING t.id)
SELECT t.id, t.queue, t.unique_claim
FROM conveyor_tasks t
JOIN unnest($1::text[], $2::text[]) AS u(queue, unique_key)
  ON t.queue = u.queue AND t.unique_claim = u.unique_key
WHERE {_LIVE_CLAIM}
"""

#: The live holder of the claim on (queue $1, unique_key $2) at now $3.
UNIQUE_HOLDER = f"""
SELECT t.id FROM conveyor_tasks t
WHERE t.queue = $1 AND t.unique_claim = $2 AND {_LIVE_CLAIM}
"""

#: Dependency edges (task_id $1[i] waits for depends_on $2[i]).
INSERT_DEPENDENCIES = """
INSERT INTO conveyor_task_dependencies (task_id, depends_on)
SELECT * FROM unnest($1::text[], $2::text[])
ON CONFLICT DO NOTHING
"""

# -------------------------------------------------------------------------------- lease


def _lease(due: str, now: str, lease_ids: str, expiry: str) -> str:
    """A lease statement: ``due`` selects (id, state) of the rows to lease, locked with
    SKIP LOCKED so concurrent leasers never collide; each becomes ACTIVE with the next of
    the lease ids."""
    return f"""
WITH due AS ({due}
), numbered AS (
    SELECT id, state, row_number() OVER () AS n FROM due
)
UPDATE conveyor_tasks t
SET state = 'active', lease_id = ({lease_ids}::text[])[numbered.n],
    lease_expires_at = {expiry}, started_at = {now}, updated_at = {now}, progress = NULL
FROM numbered
WHERE t.id = numbered.id
RETURNING {T_COLUMNS}, numbered.state AS previous_state
"""


#: Lease up to $3 due tasks of queue $1 at now $2, handing out the lease ids $4 and
#: expiry $5.
LEASE = _lease(
    f"""
    SELECT id, state FROM conveyor_tasks
    WHERE queue = $1 AND state IN {LEASABLE} AND available_at <= $2
      AND (expires_at IS NULL OR expires_at > $2)
    ORDER BY available_at, id
    LIMIT $3
    FOR UPDATE SKIP LOCKED""",
    now="$2",
    lease_ids="$4",
    expiry="$5",
)

#: LEASE for several queues: $1 queues and $2 their limits (one lateral probe of the due
#: index per queue), $3 now, $4 lease ids, $5 expiry.
LEASE_MANY = _lease(
    f"""
    SELECT d.id, d.state
    FROM unnest($1::text[], $2::int[]) AS r(queue, n)
    CROSS JOIN LATERAL (
        SELECT c.id, c.state FROM conveyor_tasks c
        WHERE c.queue = r.queue AND c.state IN {LEASABLE} AND c.available_at <= $3
          AND (c.expires_at IS NULL OR c.expires_at > $3)
        ORDER BY c.available_at, c.id
        LIMIT r.n
        FOR UPDATE SKIP LOCKED
    ) d""",
    now="$3",
    lease_ids="$4",
    expiry="$5",
)

#: The lease query's SELECT alone, for EXPLAIN in tests and diagnostics.
LEASE_SELECT = f"""
SELECT id FROM conveyor_tasks
WHERE queue = $1 AND state IN {LEASABLE} AND available_at <= $2
  AND (expires_at IS NULL OR expires_at > $2)
ORDER BY available_at, id
LIMIT $3
FOR UPDATE SKIP LOCKED
"""

_LEASED = "WHERE t.id = $1 AND t.state = 'active' AND t.lease_id = $2"
_CLEAR_LEASE = "lease_id = NULL, lease_expires_at = NULL"

#: $3 = new expiry, $4 = now.
EXTEND_LEASE = f"""
UPDATE conveyor_tasks t SET lease_expires_at = $3, updated_at = $4 {_LEASED}
RETURNING t.lease_expires_at
"""

# Batch statements keyed by (id, lease id) join an unnest() to the table. They must find
# their rows through the primary key whatever the statistics say: a burst into a freshly
# emptied (or never analyzed) table leaves the planner thinking ACTIVE rows are few, and
# ``t.state = 'active'`` then invites a bitmap scan of conveyor_tasks_lease_expiry_idx
# hashed against the batch. That index gains an entry per lease and, without a vacuum,
# keeps the dead ones, so such a scan grows with every task ever leased (measured: 46 ms
# per 100-row ack after 10k tasks, against 4 ms through the primary key). So these
# statements do not name the state: a matching, non-null lease id with a lease expiry is
# the same test, because conveyor_tasks_lease_check makes (state = 'active') equal to
# (lease_id IS NOT NULL AND lease_expires_at IS NOT NULL); and no partial index can be
# proven from it.
_HOLDS_BATCH_LEASE = "t.id = u.id AND t.lease_id = u.lease_id AND t.lease_expires_at IS NOT NULL"

#: Extend the leases ($1 ids, $2 lease ids) to $3; returns the ones still held.
EXTEND_LEASES = f"""
UPDATE conveyor_tasks t SET lease_expires_at = $3, updated_at = $4
FROM unnest($1::text[], $2::text[]) AS u(id, lease_id)
WHERE {_HOLDS_BATCH_LEASE}
RETURNING t.id, t.lease_id
"""

#: $3 = progress, $4 = now.
SET_PROGRESS = f"""
UPDATE conveyor_tasks t SET progress = $3, updated_at = $4 {_LEASED} RETURNING t.id
"""

# ----------------------------------------------------------------------------- outcomes


def _exact(interval: str) -> str:
    """``interval`` as exact seconds. Added to a timestamptz, a day-valued interval would
    follow the session's time zone across a DST change; this one is always 86400 s a day.
    NULL when ``interval`` is NULL."""
    return f"make_interval(secs => extract(epoch FROM {interval})::float8)"


# Every statement that makes a task COMPLETED sets purge_at with it ($4 = now): when a
# task with a retention of its own may go; NULL without one. PURGE_TERMINAL reads those
# rows in purge_at order. (A row completed by a release older than migration 003 has a
# retention and no purge_at: PURGE_TERMINAL's completed_at branch honours its retention.)
_SET_PURGE_AT = f"purge_at = $4::timestamptz + {_exact('t.retention')}"

#: $3 = result, $4 = now.
ACK = f"""
UPDATE conveyor_tasks t
SET state = 'completed', result = $3, completed_at = $4, updated_at = $4, {_SET_PURGE_AT},
    {_CLEAR_LEASE}
{_LEASED}
RETURNING {T_COLUMNS}
"""

#: Ack many: $1 ids, $2 lease ids, $3 results; $4 = now. Returns the ones completed.
ACK_BATCH = f"""
UPDATE conveyor_tasks t
SET state = 'completed', result = u.result, completed_at = $4, updated_at = $4,
    {_SET_PURGE_AT}, {_CLEAR_LEASE}
FROM unnest($1::text[], $2::text[], $3::bytea[]) AS u(id, lease_id, result)
WHERE {_HOLDS_BATCH_LEASE}
RETURNING t.id, t.queue, t.type
"""

# True when a failed attempt ends the task: $5 = skip_retry. Column references in SET
# read the row as it was before this update.
_EXHAUSTED = "($5::boolean OR t.retried >= t.max_retry)"

#: $3 = error, $4 = now, $5 = skip_retry, $6 = when a retry becomes due.
FAIL = f"""
UPDATE conveyor_tasks t
SET state = CASE WHEN {_EXHAUSTED} THEN 'archived' ELSE 'retry' END,
    available_at = CASE WHEN {_EXHAUSTED} THEN t.available_at ELSE $6::timestamptz END,
    completed_at = CASE WHEN {_EXHAUSTED} THEN $4::timestamptz END,
    retried = t.retried + 1, last_error = $3, updated_at = $4, {_CLEAR_LEASE}
{_LEASED}
RETURNING {T_COLUMNS}
"""

#: $3 = now.
RELEASE = f"""
UPDATE conveyor_tasks t
SET state = 'pending', available_at = $3, updated_at = $3, {_CLEAR_LEASE}
{_LEASED}
RETURNING {T_COLUMNS}
"""

#: $3 = error, $4 = now.
ARCHIVE = f"""
UPDATE conveyor_tasks t
SET state = 'archived', last_error = $3, completed_at = $4, updated_at = $4, {_CLEAR_LEASE}
{_LEASED}
RETURNING {T_COLUMNS}
"""

# ---------------------------------------------------------------------------- maintenance

#: $1 = now, $2 = limit, $3 = when a retry becomes due.
REAP_EXPIRED_LEASES = f"""
WITH expired AS (
    SELECT id, lease_expires_at FROM conveyor_tasks
    WHERE state = 'active' AND lease_expires_at <= $1
    ORDER BY lease_expires_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE conveyor_tasks t
SET state = CASE WHEN t.retried >= t.max_retry THEN 'archived' ELSE 'retry' END,
    available_at = CASE WHEN t.retried >= t.max_retry THEN t.available_at
                        ELSE $3::timestamptz END,
    completed_at = CASE WHEN t.retried >= t.max_retry THEN $1::timestamptz END,
    retried = t.retried + 1, last_error = '{LEASE_EXPIRED_ERROR}', updated_at = $1,
    {_CLEAR_LEASE}
FROM expired
WHERE t.id = expired.id
RETURNING t.id, t.queue, t.type, t.state, expired.lease_expires_at
"""

#: $1 = now, $2 = limit.
PROMOTE_SCHEDULED = """
WITH due AS (
    SELECT id FROM conveyor_tasks
    WHERE state = 'scheduled' AND available_at <= $1
    ORDER BY available_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE conveyor_tasks t SET state = 'pending', updated_at = $1
FROM due
WHERE t.id = due.id
RETURNING t.id, t.queue, t.type, t.available_at
"""

# Terminal rows go in purge order: oldest purge time (completed_at + the retention that
# applies) first, then id. Each kind of row is read from its own index, in that order,
# only as far as the limit and never past the rows that are due: COMPLETED rows with a
# retention of their own by purge_at (conveyor_tasks_purge_at_idx); COMPLETED rows that
# take the default retention $2 (conveyor_tasks_completed_idx) and ARCHIVED and CANCELED
# rows (conveyor_tasks_ended_idx, retention $3) by completed_at, which for them is purge
# order. Merging the three short lists gives the first $4 overall, so a sweep reads at
# most three times its limit however many rows are retained. Each list's LIMIT is a
# subquery so that the planner, not knowing it, plans for a large one: told "10" or
# "1000" while it guesses (with stale or no statistics) that fewer rows are due, it
# prefers a bitmap scan of every due row and a sort, and a backlog would be sorted whole.
_DEFAULT_KEEP = _exact("$2::interval")
_ARCHIVE_KEEP = _exact("$3::interval")

#: $1 = now, $2 = default retention of COMPLETED rows, $3 = retention of ARCHIVED and
#: CANCELED rows, $4 = limit. Returns how many rows went.
PURGE_TERMINAL = f"""
WITH own AS (
    SELECT t.id, t.purge_at AS at FROM conveyor_tasks t
    WHERE t.state = 'completed' AND t.purge_at IS NOT NULL AND t.purge_at <= $1
    ORDER BY t.purge_at, t.id
    LIMIT (SELECT $4::integer)
    FOR UPDATE SKIP LOCKED
), by_default AS (
    SELECT t.id, t.completed_at + coalesce({_exact("t.retention")}, {_DEFAULT_KEEP}) AS at
    FROM conveyor_tasks t
    WHERE t.state = 'completed' AND t.purge_at IS NULL
      AND t.completed_at <= $1::timestamptz - {_DEFAULT_KEEP}
      AND (t.retention IS NULL OR t.completed_at + {_exact("t.retention")} <= $1)
    ORDER BY t.completed_at, t.id
    LIMIT (SELECT $4::integer)
    FOR UPDATE SKIP LOCKED
), ended AS (
    SELECT t.id, t.completed_at + {_ARCHIVE_KEEP} AS at FROM conveyor_tasks t
    WHERE t.state IN ('archived', 'canceled')
      AND t.completed_at <= $1::timestamptz - {_ARCHIVE_KEEP}
    ORDER BY t.completed_at, t.id
    LIMIT (SELECT $4::integer)
    FOR UPDATE SKIP LOCKED
), doomed AS (
    SELECT id, at FROM own
    UNION ALL SELECT id, at FROM by_default
    UNION ALL SELECT id, at FROM ended
    ORDER BY at, id
    LIMIT $4
), purged AS (
    DELETE FROM conveyor_tasks t USING doomed
    WHERE t.id = doomed.id
    RETURNING t.id
)
SELECT count(*) FROM purged
"""

#: Free up to $2 lapsed unique claims ($1 = now), so their keys can be reused.
FREE_ALL_LAPSED_CLAIMS = """
UPDATE conveyor_tasks SET unique_claim = NULL
WHERE id IN (
    SELECT id FROM conveyor_tasks
    WHERE unique_claim IS NOT NULL AND unique_until IS NOT NULL AND unique_until <= $1
    ORDER BY unique_until
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
"""

#: $1 = now, $2 = limit.
ARCHIVE_EXPIRED = f"""
WITH expired AS (
    SELECT id, state FROM conveyor_tasks
    WHERE expires_at IS NOT NULL AND expires_at <= $1 AND state IN {WAITING}
    ORDER BY expires_at, id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE conveyor_tasks t
SET state = 'archived', last_error = $3, completed_at = $1, updated_at = $1
FROM expired
WHERE t.id = expired.id
RETURNING {T_COLUMNS}, expired.state AS previous_state
"""

# ---------------------------------------------------------------------------- inspection

_DUE = f"state IN {LEASABLE} AND available_at <= $1 AND (expires_at IS NULL OR expires_at > $1)"

#: Due tasks per queue at now $1.
PENDING_COUNT = f"SELECT queue, count(*) AS n FROM conveyor_tasks WHERE {_DUE} GROUP BY queue"
#: Due tasks of queue $2 at now $1.
PENDING_COUNT_QUEUE = f"SELECT count(*) FROM conveyor_tasks WHERE queue = $2 AND {_DUE}"

#: Queues that have a due task at now $1, named after $2, by name, at most $3. A skip
#: scan of conveyor_tasks_due_idx: one probe finds the next queue that has PENDING or
#: RETRY rows, one more its first due row; no row is counted.
DUE_QUEUES = f"""
WITH RECURSIVE leasable(queue) AS (
    (SELECT t.queue FROM conveyor_tasks t
     WHERE t.state IN {LEASABLE} AND t.queue > $2
     ORDER BY t.queue
     LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM conveyor_tasks t
            WHERE t.state IN {LEASABLE} AND t.queue > l.queue
            ORDER BY t.queue
            LIMIT 1)
    FROM leasable l
    WHERE l.queue IS NOT NULL
)
SELECT l.queue FROM leasable l
WHERE l.queue IS NOT NULL AND (
    SELECT true FROM conveyor_tasks t
    WHERE t.queue = l.queue AND t.state IN {LEASABLE} AND t.available_at <= $1
      AND (t.expires_at IS NULL OR t.expires_at > $1)
    ORDER BY t.available_at, t.id
    LIMIT 1
)
ORDER BY l.queue
LIMIT $3
"""

#: Per-state counts and stored flags of every queue: rows with a state carry a count,
#: rows without one carry the pause flag.
QUEUE_STATS = """
SELECT queue, state, count(*) AS n, NULL::boolean AS paused
FROM conveyor_tasks GROUP BY queue, state
UNION ALL
SELECT queue, NULL, 0, paused FROM conveyor_queues
"""
#: The same for the one queue $1.
QUEUE_STATS_QUEUE = """
SELECT queue, state, count(*) AS n, NULL::boolean AS paused
FROM conveyor_tasks WHERE queue = $1 GROUP BY queue, state
UNION ALL
SELECT queue, NULL, 0, paused FROM conveyor_queues WHERE queue = $1
"""

GET_TASK = f"SELECT {T_COLUMNS} FROM conveyor_tasks t WHERE t.id = $1"


def _list_tasks(by_queue: bool, by_state: bool) -> str:
    # One statement per filter combination, so each gets a plan that uses its index.
    where = ["t.id > $1"]
    if by_queue:
        where.append("t.queue = $3")
    if by_state:
        where.append(f"t.state = ${4 if by_queue else 3}")
    return (
        f"SELECT {T_COLUMNS} FROM conveyor_tasks t WHERE {' AND '.join(where)} "
        "ORDER BY t.id LIMIT $2"
    )


#: ListTasks by (filter by queue, filter by state): $1 = cursor, $2 = limit, then the
#: queue and/or state.
LIST_TASKS = {(q, s): _list_tasks(q, s) for q in (False, True) for s in (False, True)}

# ------------------------------------------------------------------------ admin actions


def _admin_transition(allowed: str, assignments: str) -> str:
    """Lock task $1, update it when its state is in ``allowed``, and report both.

    The result has one row when the task exists: the updated columns (all NULL when the
    state did not allow the change), then ``previous_state``. $2 is always now.
    """
    return f"""
WITH old AS (
    SELECT id, state FROM conveyor_tasks WHERE id = $1 FOR UPDATE
), changed AS (
    UPDATE conveyor_tasks t SET {assignments}, updated_at = $2::timestamptz
    FROM old
    WHERE t.id = old.id AND old.state IN {allowed}
    RETURNING {T_COLUMNS}
)
SELECT changed.*, old.state AS previous_state FROM old LEFT JOIN changed ON true
"""


CANCEL_TASK = _admin_transition(
    _states(WAITING_STATES | {TaskState.ACTIVE}),
    "state = CASE WHEN old.state = 'active' THEN 'archived' ELSE 'canceled' END, "
    f"last_error = CASE WHEN old.state = 'active' THEN '{CANCELED_WHILE_RUNNING_ERROR}' "
    f"ELSE t.last_error END, completed_at = $2, {_CLEAR_LEASE}",
)

RUN_TASK_NOW = _admin_transition(
    _states({TaskState.SCHEDULED, TaskState.RETRY, TaskState.PENDING}),
    "state = 'pending', available_at = $2",
)

#: $3 = process_at.
RESCHEDULE_TASK = _admin_transition(
    _states({TaskState.PENDING, TaskState.SCHEDULED, TaskState.RETRY}),
    "state = CASE WHEN $3::timestamptz > $2::timestamptz THEN 'scheduled' ELSE 'pending' END, "
    "available_at = greatest($3::timestamptz, $2::timestamptz)",
)

ARCHIVE_TASK = _admin_transition(
    WAITING,
    f"state = 'archived', last_error = '{ARCHIVED_BY_ADMIN_ERROR}', completed_at = $2",
)

REVIVE_TASK = _admin_transition(
    _states({TaskState.ARCHIVED}),
    "state = 'pending', available_at = $2, retried = 0, completed_at = NULL, "
    # A lapsed claim must not come back with the task and take the key from a newer holder.
    "unique_claim = CASE WHEN t.unique_until <= $2::timestamptz THEN NULL "
    "ELSE t.unique_claim END",
)

#: Delete task $1 unless it is active; reports its previous state (no row: not found).
DELETE_TASK = """
WITH old AS (
    SELECT id, queue, type, state FROM conveyor_tasks WHERE id = $1 FOR UPDATE
), gone AS (
    DELETE FROM conveyor_tasks t USING old
    WHERE t.id = old.id AND old.state <> 'active'
    RETURNING t.id
)
SELECT old.queue, old.type, old.state, gone.id IS NOT NULL AS deleted
FROM old LEFT JOIN gone ON true
"""

SET_QUEUE_PAUSED = """
INSERT INTO conveyor_queues (queue, paused, updated_at) VALUES ($1, $2, $3)
ON CONFLICT (queue) DO UPDATE SET paused = excluded.paused, updated_at = excluded.updated_at
"""

QUEUE_PAUSED = "SELECT paused FROM conveyor_queues WHERE queue = $1"

# ---------------------------------------------------------------- webhook registrations

# Rows that describe a webhook worker have these columns in this order
# (rows.webhook_worker_from_row reads them by position).
WEBHOOK_FIELDS = (
    "name",
    "url",
    "queues",
    "concurrency",
    "timeout",
    "paused",
    "secrets",
    "created_at",
    "updated_at",
)
# queues as text whatever codec the pool's owner may have registered for jsonb.
_W_COLUMNS = ", ".join(
    f"w.{name}::text AS {name}" if name == "queues" else f"w.{name}" for name in WEBHOOK_FIELDS
)

#: Create or replace registration $1 at now $8; an empty $7 keeps the stored secrets.
UPSERT_WEBHOOK_WORKER = f"""
INSERT INTO conveyor_webhook_workers AS w
    (name, url, queues, concurrency, timeout, paused, secrets, created_at, updated_at)
VALUES ($1, $2, $3::jsonb, $4, $5, $6, $7::text[], $8, $8)
ON CONFLICT (name) DO UPDATE SET
    url = excluded.url,
    queues = excluded.queues,
    concurrency = excluded.concurrency,
    timeout = excluded.timeout,
    paused = excluded.paused,
    secrets = CASE WHEN cardinality(excluded.secrets) = 0 THEN w.secrets
                   ELSE excluded.secrets END,
    updated_at = excluded.updated_at
RETURNING {_W_COLUMNS}
"""

GET_WEBHOOK_WORKER = f"SELECT {_W_COLUMNS} FROM conveyor_webhook_workers w WHERE w.name = $1"

LIST_WEBHOOK_WORKERS = f"SELECT {_W_COLUMNS} FROM conveyor_webhook_workers w ORDER BY w.name"

#: Set the pause flag of registration $1 to $2 at now $3 (no row: not found).
SET_WEBHOOK_WORKER_PAUSED = f"""
UPDATE conveyor_webhook_workers w SET paused = $2, updated_at = $3
WHERE w.name = $1
RETURNING {_W_COLUMNS}
"""

#: Delete registration $1 (no row: not found).
DELETE_WEBHOOK_WORKER = "DELETE FROM conveyor_webhook_workers WHERE name = $1 RETURNING name"
