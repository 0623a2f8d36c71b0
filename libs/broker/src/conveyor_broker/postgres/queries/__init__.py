"""Every SQL statement the Postgres broker runs, as named constants, one module per area
(the areas of the conformance suite, :mod:`conveyor_broker.testing`): ``enqueue``,
``lease``, ``outcomes``, ``sweeps``, ``admin`` and ``webhooks``.

Conventions: "now" is always a parameter (the broker's injected clock), never ``now()``.
State lists are literals, not parameters, so that the planner can match them against the
partial indexes' predicates. Batch statements take parallel arrays and ``unnest`` them so
a whole batch is one round trip. Each statement is written out whole; the only pieces put
into them are the column lists below and the fixed error texts of
:mod:`conveyor_broker.types`.

Durations added to a timestamptz go through ``make_interval(secs => extract(epoch FROM
...)::float8)``: exact seconds. Added as it is, a day-valued interval would follow the
session's time zone across a DST change; this one is always 86400 s a day (and NULL for a
NULL interval).
"""

from __future__ import annotations

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
    "holder",
)

#: Every column of a task row, in TASK_FIELDS order, qualified with the alias ``t``;
#: headers as text whatever codec the pool's owner may have registered for jsonb.
TASK_COLUMNS = ", ".join(
    "t.headers::text AS headers" if name == "headers" else f"t.{name}" for name in TASK_FIELDS
)
