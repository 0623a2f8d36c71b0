"""Statements of dependencies: what an enqueue with dependencies locks and writes, the
resolution of ended tasks for the tasks that wait for them, the sweep that finds ended
tasks left unresolved, and the listings.

An edge (``conveyor_task_dependencies``: ``task_id`` waits for ``depends_on``) has an
``outcome``: NULL while open, then ``satisfied`` or ``failed``. A waiting task counts its
open and failed edges (``deps_open``, ``deps_failed``); a task others wait for has
``dependents_pending`` set until its end has been resolved for all of them. Resolution
walks the open-edge index of each ended task; the sweep walks ``conveyor_tasks_resolve_idx``.

Lock order: a resolution locks the ended tasks it resolves (by id), then the edges, then
the waiting tasks (by id); an enqueue locks the dependencies it names (by id) before it
inserts. Deleting a waiting task locks it, then its edges (the foreign key's cascade): a
deadlock with a resolution of one of its dependencies is possible and rare; Postgres
breaks it and the loser is retried.
"""

from __future__ import annotations

from conveyor_broker.types import DEPENDENCY_FAILED_ERROR

_ENDED = "('completed', 'archived', 'canceled')"

#: Lock the stored dependencies $1 of an enqueue (by id) and return their states; flag the
#: ones that have not ended as having dependents (the enqueue adds open edges to them).
#: Locked so that an ack committing meanwhile either comes first (the enqueue sees it
#: ended) or after (it reads the flag and reports the end).
LOCK_DEPENDENCIES = f"""
WITH locked AS (
    SELECT t.id, t.state, t.dependents_pending FROM conveyor_tasks t
    WHERE t.id = ANY($1::text[])
    ORDER BY t.id
    FOR NO KEY UPDATE
), flagged AS (
    UPDATE conveyor_tasks t SET dependents_pending = true
    FROM locked
    WHERE t.id = locked.id AND NOT locked.dependents_pending
      AND locked.state NOT IN {_ENDED}
    RETURNING t.id
)
SELECT locked.id, locked.state, (SELECT count(*) FROM flagged) AS flagged FROM locked
"""

#: Dependency edges (task_id $1[i] waits for depends_on $2[i], outcome $3[i]: NULL while
#: open).
INSERT_DEPENDENCIES = """
INSERT INTO conveyor_task_dependencies (task_id, depends_on, outcome)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[])
ON CONFLICT DO NOTHING
"""

_CANCELED_ERROR = DEPENDENCY_FAILED_ERROR.replace("{}", "' || v.failed_dep || '")


def _resolve(ended: str) -> str:
    """The resolution of the ended tasks that ``ended`` (a SELECT of ``id, state`` from
    ``locked``: the tasks $1, locked) picks; $2 = now, $3 = the most edges to settle.

    Open edges are taken per ended task from the open-edge index (at most $3 + 1 each, by
    dependent id) and numbered by (dependency, dependent); the first $3 are settled, and
    an ended task whose edges were all settled loses its ``dependents_pending``. Each
    waiting task still BLOCKED gets its counters moved by what was settled for it and
    its verdict (``conveyor_broker.dependencies.verdict``, written out in ``verdict``).

    Rows: ``kind`` 'changed' for each BLOCKED task it updated (id, queue, type, new state,
    its own dependents_pending), 'more' for each ended task with open edges left, and
    one 'edges' row whose ``settled`` counts the edges settled.
    """
    return f"""
WITH locked AS MATERIALIZED (
    -- By primary key alone: with the filter of ``ended`` beside the ids, the planner
    -- (without statistics) walks the sweep's whole index instead.
    SELECT t.id, t.state, t.dependents_pending FROM conveyor_tasks t
    WHERE t.id = ANY($1::text[])
    ORDER BY t.id
    FOR NO KEY UPDATE
), ended AS ({ended}
), open AS (
    SELECT e.task_id, e.depends_on, ended.state = 'completed' AS ok,
           row_number() OVER (ORDER BY e.depends_on, e.task_id) AS n
    FROM ended
    CROSS JOIN LATERAL (
        SELECT d.task_id, d.depends_on FROM conveyor_task_dependencies d
        WHERE d.depends_on = ended.id AND d.outcome IS NULL
        ORDER BY d.task_id
        LIMIT $3::integer + 1
    ) AS e
), marked AS (
    UPDATE conveyor_task_dependencies d
    SET outcome = CASE WHEN open.ok THEN 'satisfied' ELSE 'failed' END
    FROM open
    WHERE open.n <= $3 AND d.task_id = open.task_id AND d.depends_on = open.depends_on
      AND d.outcome IS NULL
    RETURNING d.task_id, d.depends_on, open.ok
), tally AS (
    SELECT task_id, count(*) AS closed, count(*) FILTER (WHERE NOT ok) AS failed,
           min(depends_on) FILTER (WHERE NOT ok) AS failed_dep
    FROM marked GROUP BY task_id
), waiting AS (
    SELECT t.id, t.deps_open - tally.closed AS still_open,
           t.deps_failed + tally.failed AS failed, tally.failed_dep, t.on_failure,
           t.group_key IS NOT NULL AS grouped, t.process_at
    FROM conveyor_tasks t JOIN tally ON t.id = tally.task_id
    WHERE t.state = 'blocked'
    ORDER BY t.id
    FOR NO KEY UPDATE OF t
), verdict AS (
    SELECT w.id, w.still_open, w.failed, w.failed_dep,
           CASE WHEN w.failed > 0 AND w.on_failure = 'cascade_cancel' THEN 'canceled'
                WHEN w.still_open > 0 OR (w.failed > 0 AND w.on_failure = 'block')
                    THEN 'blocked'
                WHEN w.grouped THEN 'aggregating'
                WHEN w.process_at > $2::timestamptz THEN 'scheduled'
                ELSE 'pending' END AS state
    FROM waiting w
), changed AS (
    UPDATE conveyor_tasks t
    SET deps_open = v.still_open, deps_failed = v.failed, state = v.state,
        completed_at = CASE WHEN v.state = 'canceled' THEN $2::timestamptz END,
        last_error = CASE WHEN v.state = 'canceled' THEN '{_CANCELED_ERROR}'
                          ELSE t.last_error END,
        updated_at = $2::timestamptz
    FROM verdict v
    WHERE t.id = v.id
    RETURNING t.id, t.queue, t.type, t.state, t.dependents_pending
), finished AS (
    UPDATE conveyor_tasks t SET dependents_pending = false
    FROM ended
    WHERE t.id = ended.id
      AND NOT EXISTS (SELECT 1 FROM open WHERE open.depends_on = ended.id AND open.n > $3)
    RETURNING t.id
)
SELECT 'changed' AS kind, c.id, c.queue, c.type, c.state, c.dependents_pending,
       NULL::bigint AS settled
FROM changed c
UNION ALL
SELECT 'more', ended.id, NULL, NULL, NULL, NULL, NULL FROM ended
WHERE ended.id NOT IN (SELECT id FROM finished)
UNION ALL
SELECT 'edges', NULL, NULL, NULL, NULL, NULL, (SELECT count(*) FROM marked)
"""


#: Resolve the ended tasks among $1 whose dependents are not all resolved (locked, by id).
RESOLVE_DEPENDENTS = _resolve(f"""
    SELECT l.id, l.state FROM locked l
    WHERE l.dependents_pending AND l.state IN {_ENDED}""")

#: Resolve the task $1[1] that is being deleted (its row locked by the caller already) as
#: if it had ended in state $4 ('completed' or 'canceled').
RESOLVE_DELETED = _resolve("""
    SELECT l.id, $4::text AS state FROM locked l WHERE l.dependents_pending""")

#: Ended tasks whose dependents are not all resolved and that ended at or before $1,
#: oldest end first, at most $2 (PromoteReadyDependents). The LIMIT is a subquery for the
#: reason PURGE_TERMINAL's are: told the limit, a planner without statistics reads every
#: such row and sorts them.
READY_TO_RESOLVE = f"""
SELECT t.id FROM conveyor_tasks t
WHERE t.dependents_pending AND t.state IN {_ENDED} AND t.completed_at <= $1
ORDER BY t.completed_at, t.id
LIMIT (SELECT $2::integer)
"""

#: Lock the task $1 for its deletion: its state and whether tasks wait for it.
LOCK_FOR_DELETE = """
SELECT t.state, t.dependents_pending FROM conveyor_tasks t WHERE t.id = $1 FOR UPDATE
"""

#: Whether task $1 exists.
TASK_EXISTS = "SELECT EXISTS (SELECT 1 FROM conveyor_tasks WHERE id = $1)"

#: The edges of task $1 to the tasks it waits for, after id $2 ('' for the first page), at
#: most $3, with the other task (NULL columns when it is gone).
LIST_DEPENDENCIES = """
SELECT e.depends_on AS other, e.outcome, o.queue, o.type, o.state
FROM conveyor_task_dependencies e
LEFT JOIN conveyor_tasks o ON o.id = e.depends_on
WHERE e.task_id = $1 AND e.depends_on > $2
ORDER BY e.depends_on
LIMIT $3
"""

#: The edges of the tasks that wait for task $1, by their id after $2, at most $3.
LIST_DEPENDENTS = """
SELECT e.task_id AS other, e.outcome, o.queue, o.type, o.state
FROM conveyor_task_dependencies e
LEFT JOIN conveyor_tasks o ON o.id = e.task_id
WHERE e.depends_on = $1 AND e.task_id > $2
ORDER BY e.task_id
LIMIT $3
"""
