"""Statements of inspection (QueueStats, GetTask, ListTasks) and of the admin actions on
one task (cancel, run now, reschedule, archive, revive, delete) and on queues (pause).

An admin transition locks task $1 and changes it only when its state allows; $2 is always
now. Its result has one row when the task exists: the changed task's columns (all NULL
when the state did not allow the change), then ``previous_state``. No row: no such task.
The transitions that can end a task (cancel, archive) also return ``dependents_pending``
before ``previous_state``.
"""

from __future__ import annotations

from conveyor_broker.postgres.queries import TASK_COLUMNS, TASK_FIELDS
from conveyor_broker.types import (
    ARCHIVED_BY_ADMIN_ERROR,
    CANCELED_WHILE_RUNNING_ERROR,
    LISTED_OVERHEAD,
)

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

#: The task $1.
GET_TASK = f"SELECT {TASK_COLUMNS} FROM conveyor_tasks t WHERE t.id = $1"

#: QueueStats a page at a time: the first $2 queue names after $1 (tasks' queues, found
#: by skipping through the queue index one name at a time, and stored flags), each with
#: its per-state counts (a row with a NULL state when it has no tasks) and its flag.
LIST_QUEUES = """
WITH RECURSIVE named(queue) AS (
    (SELECT t.queue FROM conveyor_tasks t WHERE t.queue > $1 ORDER BY t.queue LIMIT 1)
    UNION ALL
    SELECT (SELECT t.queue FROM conveyor_tasks t
            WHERE t.queue > n.queue ORDER BY t.queue LIMIT 1)
    FROM named n
    WHERE n.queue IS NOT NULL
), names AS (
    SELECT queue FROM (
        (SELECT queue FROM named WHERE queue IS NOT NULL LIMIT $2)
        UNION
        (SELECT queue FROM conveyor_queues WHERE queue > $1 ORDER BY queue LIMIT $2)
    ) AS candidates
    ORDER BY queue LIMIT $2
)
SELECT names.queue, counts.state, counts.n, q.paused
FROM names
LEFT JOIN conveyor_queues q ON q.queue = names.queue
LEFT JOIN LATERAL (
    SELECT t.state, count(*) AS n FROM conveyor_tasks t
    WHERE t.queue = names.queue GROUP BY t.state
) AS counts ON true
ORDER BY names.queue
"""

# ListTasks: one statement per filter combination, so each gets a plan that uses its
# index. $1 = cursor (the last id of the previous page, '' for the first), $2 = limit,
# $3 = the page's byte budget, $4 = leave payloads out. The ids of the page are picked
# first with their sizes (types.listed_size: octet_length reads a stored value's length
# without fetching it), the page ends before the row that takes the running size past $3
# (the first row always stays), and only the rows kept are read whole. Each row ends
# with ``fetched``, how many rows the page picked before the budget cut.

#: The size types.listed_size gives a task, $4 saying whether payloads are left out.
_LISTED_SIZE = f"""(
    {LISTED_OVERHEAD}
    + coalesce(octet_length(t.last_error), 0)
    + (SELECT coalesce(sum(octet_length(h.key) + octet_length(h.value)), 0)
       FROM jsonb_each_text(t.headers) AS h)
    + CASE WHEN $4 THEN 0 ELSE octet_length(t.payload)
           + coalesce(octet_length(t.progress), 0) + coalesce(octet_length(t.result), 0) END
)"""
#: TASK_COLUMNS, with the payload, progress and result left out when $4 is true.
_OMITTED = {"payload": "''::bytea", "progress": "NULL::bytea", "result": "NULL::bytea"}
_LISTED_COLUMNS = ", ".join(
    "t.headers::text AS headers"
    if name == "headers"
    else f"CASE WHEN $4 THEN {_OMITTED[name]} ELSE t.{name} END AS {name}"
    if name in _OMITTED
    else f"t.{name}"
    for name in TASK_FIELDS
)


def _list_tasks(where: str) -> str:
    return f"""
WITH page AS (
    SELECT t.id, {_LISTED_SIZE} AS size FROM conveyor_tasks t
    WHERE t.id > $1{where}
    ORDER BY t.id LIMIT $2
), sized AS (
    SELECT id, count(*) OVER () AS fetched, row_number() OVER (ORDER BY id) AS n,
           sum(size) OVER (ORDER BY id) AS running
    FROM page
)
SELECT {_LISTED_COLUMNS}, sized.fetched
FROM sized JOIN conveyor_tasks t ON t.id = sized.id
WHERE sized.n = 1 OR sized.running <= $3
ORDER BY t.id
"""


#: Every task.
LIST_TASKS = _list_tasks("")
#: The tasks of queue $5.
LIST_TASKS_BY_QUEUE = _list_tasks(" AND t.queue = $5")
#: The tasks in state $5.
LIST_TASKS_BY_STATE = _list_tasks(" AND t.state = $5")
#: The tasks of queue $5 in state $6.
LIST_TASKS_BY_QUEUE_AND_STATE = _list_tasks(" AND t.queue = $5 AND t.state = $6")

#: Waiting -> CANCELED; ACTIVE -> ARCHIVED with CANCELED_WHILE_RUNNING_ERROR.
CANCEL_TASK = f"""
WITH old AS (
    SELECT id, state FROM conveyor_tasks WHERE id = $1 FOR UPDATE
), changed AS (
    UPDATE conveyor_tasks t
    SET state = CASE WHEN old.state = 'active' THEN 'archived' ELSE 'canceled' END,
        last_error = CASE WHEN old.state = 'active' THEN '{CANCELED_WHILE_RUNNING_ERROR}'
                          ELSE t.last_error END,
        completed_at = $2, lease_id = NULL, lease_expires_at = NULL, holder = NULL,
        updated_at = $2::timestamptz
    FROM old
    WHERE t.id = old.id
      AND old.state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'held', 'active', 'retry')
    RETURNING {TASK_COLUMNS}, t.dependents_pending
)
SELECT changed.*, old.state AS previous_state FROM old LEFT JOIN changed ON true
"""

#: SCHEDULED, RETRY, PENDING, BLOCKED or HELD -> PENDING, due now.
RUN_TASK_NOW = f"""
WITH old AS (
    SELECT id, state FROM conveyor_tasks WHERE id = $1 FOR UPDATE
), changed AS (
    UPDATE conveyor_tasks t
    SET state = 'pending', available_at = $2, updated_at = $2::timestamptz
    FROM old
    WHERE t.id = old.id AND old.state IN ('pending', 'scheduled', 'blocked', 'held', 'retry')
    RETURNING {TASK_COLUMNS}
)
SELECT changed.*, old.state AS previous_state FROM old LEFT JOIN changed ON true
"""

#: PENDING, SCHEDULED or RETRY -> SCHEDULED at $3 (PENDING, due now, when $3 is not
#: after now).
RESCHEDULE_TASK = f"""
WITH old AS (
    SELECT id, state FROM conveyor_tasks WHERE id = $1 FOR UPDATE
), changed AS (
    UPDATE conveyor_tasks t
    SET state = CASE WHEN $3::timestamptz > $2::timestamptz THEN 'scheduled'
                     ELSE 'pending' END,
        available_at = greatest($3::timestamptz, $2::timestamptz),
        updated_at = $2::timestamptz
    FROM old
    WHERE t.id = old.id AND old.state IN ('pending', 'scheduled', 'retry')
    RETURNING {TASK_COLUMNS}
)
SELECT changed.*, old.state AS previous_state FROM old LEFT JOIN changed ON true
"""

#: A waiting task -> ARCHIVED with ARCHIVED_BY_ADMIN_ERROR.
ARCHIVE_TASK = f"""
WITH old AS (
    SELECT id, state FROM conveyor_tasks WHERE id = $1 FOR UPDATE
), changed AS (
    UPDATE conveyor_tasks t
    SET state = 'archived', last_error = '{ARCHIVED_BY_ADMIN_ERROR}', completed_at = $2,
        updated_at = $2::timestamptz
    FROM old
    WHERE t.id = old.id
      AND old.state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'held', 'retry')
    RETURNING {TASK_COLUMNS}, t.dependents_pending
)
SELECT changed.*, old.state AS previous_state FROM old LEFT JOIN changed ON true
"""

#: ARCHIVED -> PENDING, due now, retried 0. A lapsed claim must not come back with the
#: task and take the key from a newer holder. The tasks still BLOCKED on its failure wait
#: for its new outcome: their failed edges to it open again (counters too), and it is
#: flagged as waited for.
REVIVE_TASK = f"""
WITH old AS (
    SELECT id, state FROM conveyor_tasks WHERE id = $1 FOR UPDATE
), reopened AS (
    UPDATE conveyor_task_dependencies e SET outcome = NULL
    FROM old, conveyor_tasks w
    WHERE old.state IN ('archived') AND e.depends_on = old.id AND e.outcome = 'failed'
      AND w.id = e.task_id AND w.state = 'blocked'
    RETURNING e.task_id
), reblocked AS (
    UPDATE conveyor_tasks w
    SET deps_open = w.deps_open + 1, deps_failed = w.deps_failed - 1,
        updated_at = $2::timestamptz
    FROM reopened
    WHERE w.id = reopened.task_id
), changed AS (
    UPDATE conveyor_tasks t
    SET state = 'pending', available_at = $2, retried = 0, completed_at = NULL,
        unique_claim = CASE WHEN t.unique_until <= $2::timestamptz THEN NULL
                            ELSE t.unique_claim END,
        dependents_pending = t.dependents_pending OR EXISTS (SELECT 1 FROM reopened),
        updated_at = $2::timestamptz
    FROM old
    WHERE t.id = old.id AND old.state IN ('archived')
    RETURNING {TASK_COLUMNS}
)
SELECT changed.*, old.state AS previous_state FROM old LEFT JOIN changed ON true
"""

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

#: Store the pause flag $2 of queue $1 at now $3.
SET_QUEUE_PAUSED = """
INSERT INTO conveyor_queues (queue, paused, updated_at) VALUES ($1, $2, $3)
ON CONFLICT (queue) DO UPDATE SET paused = excluded.paused, updated_at = excluded.updated_at
"""

#: The stored pause flag of queue $1 (no row: never stored).
QUEUE_PAUSED = "SELECT paused FROM conveyor_queues WHERE queue = $1"
