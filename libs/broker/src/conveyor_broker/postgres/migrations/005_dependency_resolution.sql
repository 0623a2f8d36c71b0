-- 005: dependencies are resolved. A task that waits for others keeps counters of its
-- edges (deps_open: dependencies not ended yet; deps_failed: ended without completing),
-- each edge its outcome, and a task others wait for a flag (dependents_pending) while
-- its end has not been resolved for them. A resolution then touches one edge and one
-- counter pair per dependent, and the sweep finds unresolved ends from an index.

ALTER TABLE conveyor_tasks
    ADD COLUMN deps_open integer NOT NULL DEFAULT 0,
    ADD COLUMN deps_failed integer NOT NULL DEFAULT 0,
    ADD COLUMN dependents_pending boolean NOT NULL DEFAULT false;

-- NULL while the dependency has not ended (or its end is not resolved yet).
ALTER TABLE conveyor_task_dependencies
    ADD COLUMN outcome text,
    ADD CONSTRAINT conveyor_task_dependencies_outcome_check CHECK (
        outcome IN ('satisfied', 'failed'));

-- Edges stored before this release were never resolved: they stay open, and the sweep
-- resolves every one whose dependency has ended (a dependent whose dependencies all
-- completed meanwhile is promoted then). An edge to a task no longer stored can never
-- resolve: it counts as failed, and its dependent follows its policy when its other
-- edges resolve (one that waited only for such tasks stays blocked for an operator).
UPDATE conveyor_task_dependencies e SET outcome = 'failed'
WHERE NOT EXISTS (SELECT 1 FROM conveyor_tasks t WHERE t.id = e.depends_on);

UPDATE conveyor_tasks t
SET deps_open = counts.open, deps_failed = counts.failed
FROM (
    SELECT task_id,
           count(*) FILTER (WHERE outcome IS NULL) AS open,
           count(*) FILTER (WHERE outcome = 'failed') AS failed
    FROM conveyor_task_dependencies GROUP BY task_id
) AS counts
WHERE t.id = counts.task_id;

UPDATE conveyor_tasks t SET dependents_pending = true
WHERE EXISTS (
    SELECT 1 FROM conveyor_task_dependencies e WHERE e.depends_on = t.id AND e.outcome IS NULL
);

-- Listing a task's dependents, by dependent id (replaces the index on depends_on alone).
DROP INDEX conveyor_task_dependencies_depends_on_idx;
CREATE INDEX conveyor_task_dependencies_depends_on_idx
    ON conveyor_task_dependencies (depends_on, task_id);

-- Resolution: the open edges of a dependency, by dependent id.
CREATE INDEX conveyor_task_dependencies_open_idx
    ON conveyor_task_dependencies (depends_on, task_id) WHERE outcome IS NULL;

-- PromoteReadyDependents: ended tasks whose dependents are not resolved yet, oldest end
-- first.
CREATE INDEX conveyor_tasks_resolve_idx ON conveyor_tasks (completed_at, id)
    WHERE dependents_pending AND state IN ('completed', 'archived', 'canceled');
