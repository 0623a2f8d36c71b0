"""Statements of inspection (QueueStats, GetTask, ListTasks) and of the admin actions on
one task (cancel, run now, reschedule, archive, revive, delete) and on queues (pause).

An admin transition locks task $1 and changes it only when its state allows; $2 is always
now. Its result has one row when the task exists: the changed task's columns (all NULL
when the state did not allow the change), then ``previous_state``. No row: no such task.
"""

from __future__ import annotations

from conveyor_broker.postgres.queries import TASK_COLUMNS
from conveyor_broker.types import ARCHIVED_BY_ADMIN_ERROR, CANCELED_WHILE_RUNNING_ERROR

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

# ListTasks: one statement per filter combination, so each gets a plan that uses its
# index. $1 = cursor (the last id of the previous page, '' for the first), $2 = limit.

#: Every task.
LIST_TASKS = f"""
SELECT {TASK_COLUMNS} FROM conveyor_tasks t
WHERE t.id > $1
ORDER BY t.id LIMIT $2
"""
#: The tasks of queue $3.
LIST_TASKS_BY_QUEUE = f"""
SELECT {TASK_COLUMNS} FROM conveyor_tasks t
WHERE t.id > $1 AND t.queue = $3
ORDER BY t.id LIMIT $2
"""
#: The tasks in state $3.
LIST_TASKS_BY_STATE = f"""
SELECT {TASK_COLUMNS} FROM conveyor_tasks t
WHERE t.id > $1 AND t.state = $3
ORDER BY t.id LIMIT $2
"""
#: The tasks of queue $3 in state $4.
LIST_TASKS_BY_QUEUE_AND_STATE = f"""
SELECT {TASK_COLUMNS} FROM conveyor_tasks t
WHERE t.id > $1 AND t.queue = $3 AND t.state = $4
ORDER BY t.id LIMIT $2
"""

#: Waiting -> CANCELED; ACTIVE -> ARCHIVED with CANCELED_WHILE_RUNNING_ERROR.
CANCEL_TASK = f"""
WITH old AS (
    SELECT id, state FROM conveyor_tasks WHERE id = $1 FOR UPDATE
), changed AS (
    UPDATE conveyor_tasks t
    SET state = CASE WHEN old.state = 'active' THEN 'archived' ELSE 'canceled' END,
        last_error = CASE WHEN old.state = 'active' THEN '{CANCELED_WHILE_RUNNING_ERROR}'
                          ELSE t.last_error END,
        completed_at = $2, lease_id = NULL, lease_expires_at = NULL,
        updated_at = $2::timestamptz
    FROM old
    WHERE t.id = old.id
      AND old.state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'active', 'retry')
    RETURNING {TASK_COLUMNS}
)
SELECT changed.*, old.state AS previous_state FROM old LEFT JOIN changed ON true
"""

#: SCHEDULED, RETRY or PENDING -> PENDING, due now.
RUN_TASK_NOW = f"""
WITH old AS (
    SELECT id, state FROM conveyor_tasks WHERE id = $1 FOR UPDATE
), changed AS (
    UPDATE conveyor_tasks t
    SET state = 'pending', available_at = $2, updated_at = $2::timestamptz
    FROM old
    WHERE t.id = old.id AND old.state IN ('pending', 'scheduled', 'retry')
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
      AND old.state IN ('pending', 'scheduled', 'aggregating', 'blocked', 'retry')
    RETURNING {TASK_COLUMNS}
)
SELECT changed.*, old.state AS previous_state FROM old LEFT JOIN changed ON true
"""

#: ARCHIVED -> PENDING, due now, retried 0. A lapsed claim must not come back with the
#: task and take the key from a newer holder.
REVIVE_TASK = f"""
WITH old AS (
    SELECT id, state FROM conveyor_tasks WHERE id = $1 FOR UPDATE
), changed AS (
    UPDATE conveyor_tasks t
    SET state = 'pending', available_at = $2, retried = 0, completed_at = NULL,
        unique_claim = CASE WHEN t.unique_until <= $2::timestamptz THEN NULL
                            ELSE t.unique_claim END,
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
