"""Statements of Ack, AckBatch, Fail, Release and Archive: an ACTIVE task leaves its
lease.

Every statement that makes a task COMPLETED sets ``purge_at`` with it: when a task with a
retention of its own may go; NULL without one. PURGE_TERMINAL (in sweeps) reads those rows
in purge_at order. (A row completed by a release older than migration 003 has a retention
and no purge_at: PURGE_TERMINAL's completed_at branch honours its retention.)

Column references in SET read the row as it was before the update.

Each returns ``dependents_pending`` after the task's columns: a task that ends with tasks
waiting for it is reported to the broker's dependency sink.
"""

from __future__ import annotations

from conveyor_broker.postgres.queries import TASK_COLUMNS

#: Complete task $1 under lease $2 with result $3 at now $4.
ACK = f"""
UPDATE conveyor_tasks t
SET state = 'completed', result = $3, completed_at = $4, updated_at = $4,
    purge_at = $4::timestamptz + make_interval(secs => extract(epoch FROM t.retention)::float8),
    lease_id = NULL, lease_expires_at = NULL, holder = NULL
WHERE t.id = $1 AND t.state = 'active' AND t.lease_id = $2
RETURNING {TASK_COLUMNS}, t.dependents_pending
"""

#: Ack many: $1 ids, $2 lease ids, $3 results; $4 = now. Returns the ones completed.
#: Like EXTEND_LEASES, it does not name the state (see lease.py for why).
ACK_BATCH = """
UPDATE conveyor_tasks t
SET state = 'completed', result = u.result, completed_at = $4, updated_at = $4,
    purge_at = $4::timestamptz + make_interval(secs => extract(epoch FROM t.retention)::float8),
    lease_id = NULL, lease_expires_at = NULL, holder = NULL
FROM unnest($1::text[], $2::text[], $3::bytea[]) AS u(id, lease_id, result)
WHERE t.id = u.id AND t.lease_id = u.lease_id AND t.lease_expires_at IS NOT NULL
RETURNING t.id, t.queue, t.type, t.dependents_pending
"""

#: A failed attempt of task $1 under lease $2: error $3, now $4, skip_retry $5, and $6
#: when a retry becomes due. ``($5 OR retried >= max_retry)`` is "the attempt ends the
#: task": ARCHIVED then, else RETRY (a group's member: back to AGGREGATING, due with its
#: group once the retry is).
FAIL = f"""
UPDATE conveyor_tasks t
SET state = CASE WHEN ($5::boolean OR t.retried >= t.max_retry) THEN 'archived'
                 WHEN t.group_key IS NOT NULL THEN 'aggregating'
                 ELSE 'retry' END,
    available_at = CASE WHEN ($5::boolean OR t.retried >= t.max_retry) THEN t.available_at
                        ELSE $6::timestamptz END,
    completed_at = CASE WHEN ($5::boolean OR t.retried >= t.max_retry) THEN $4::timestamptz
                        END,
    retried = t.retried + 1, last_error = $3, updated_at = $4,
    lease_id = NULL, lease_expires_at = NULL, holder = NULL
WHERE t.id = $1 AND t.state = 'active' AND t.lease_id = $2
RETURNING {TASK_COLUMNS}, t.dependents_pending
"""

#: Give task $1 under lease $2 back at now $3: PENDING (a group's member: AGGREGATING),
#: due now.
RELEASE = f"""
UPDATE conveyor_tasks t
SET state = CASE WHEN t.group_key IS NOT NULL THEN 'aggregating' ELSE 'pending' END,
    available_at = $3, updated_at = $3,
    lease_id = NULL, lease_expires_at = NULL, holder = NULL
WHERE t.id = $1 AND t.state = 'active' AND t.lease_id = $2
RETURNING {TASK_COLUMNS}, t.dependents_pending
"""

#: Archive task $1 under lease $2 with error $3 at now $4.
ARCHIVE = f"""
UPDATE conveyor_tasks t
SET state = 'archived', last_error = $3, completed_at = $4, updated_at = $4,
    lease_id = NULL, lease_expires_at = NULL, holder = NULL
WHERE t.id = $1 AND t.state = 'active' AND t.lease_id = $2
RETURNING {TASK_COLUMNS}, t.dependents_pending
"""
