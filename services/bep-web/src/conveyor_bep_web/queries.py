"""The web process's SQL, as named constants.

Every read takes the viewer's project set as its first parameter, ``$1::bigint[]``
(:meth:`conveyor_bep_web.auth.Viewer.project_ids`; NULL: every project), and applies
it in SQL with ``($1::bigint[] IS NULL OR project_id = ANY($1::bigint[]))``: a project the
viewer may not read is absent from every answer, so a build of such a project is simply
not found (404) and its id does not leak.
"""

from __future__ import annotations

#: The viewer restriction on a table with a ``project_id`` (alias ``i`` for invocations).
_VISIBLE = "($1::bigint[] IS NULL OR {col} = ANY($1::bigint[]))"
_VISIBLE_PROJECT = _VISIBLE.format(col="p.id")
_VISIBLE_BUILD = _VISIBLE.format(col="i.project_id")

#: The projects the viewer may read, with their build counts.
PROJECTS = f"""
SELECT p.id, p.slug, p.name, p.created_at,
       count(i.invocation_id) AS builds,
       count(i.invocation_id) FILTER (WHERE NOT i.finished) AS running,
       count(i.invocation_id) FILTER (WHERE i.status = 'failed') AS failed,
       max(i.created_at) AS last_build_at
FROM bep.projects p
LEFT JOIN bep.invocations i ON i.project_id = p.id
WHERE {_VISIBLE_PROJECT}
GROUP BY p.id
ORDER BY p.slug
"""

#: One project by slug ($2), if the viewer may read it.
PROJECT_BY_SLUG = f"""
SELECT p.id, p.slug, p.name, p.created_at
FROM bep.projects p
WHERE p.slug = $2 AND {_VISIBLE_PROJECT}
"""

# The columns of a build in a list (and of the live digest of a list row).
_LIST_COLUMNS = """
i.invocation_id, i.project_id, i.build_id, i.status, i.finished, i.exit_code, i.exit_name,
i.command, i.patterns, i.user_name, i.host_name, i.branch, i.commit_sha, i.tags,
i.started_at, i.finished_at, i.created_at, i.updated_at, i.last_event_seq,
i.targets_configured, i.targets_completed, i.targets_failed,
i.tests_total, i.tests_passed, i.tests_failed, i.tests_flaky, i.actions_failed,
i.log_bytes, i.log_lines
"""

# The build search of one project ($2) with its filters, all optional (NULL: any):
# $3 status, $4 user, $5 branch, $6 tags (jsonb[]: each {key: value} must be contained),
# $7 free text (a LIKE pattern, escaped with backslash).
_BUILD_FILTER = f"""
i.project_id = $2 AND {_VISIBLE_BUILD}
AND ($3::text IS NULL OR i.status = $3::text)
AND ($4::text IS NULL OR i.user_name = $4::text)
AND ($5::text IS NULL OR i.branch = $5::text)
AND ($6::jsonb[] IS NULL OR i.tags @> ALL($6::jsonb[]))
AND ($7::text IS NULL OR i.invocation_id ILIKE $7::text OR i.build_id ILIKE $7::text
     OR i.command ILIKE $7::text OR i.commit_sha ILIKE $7::text
     OR i.host_name ILIKE $7::text OR i.user_name ILIKE $7::text
     OR i.branch ILIKE $7::text OR array_to_string(i.patterns, ' ') ILIKE $7::text
     OR i.tags::text ILIKE $7::text)
"""

#: A page of the search, newest first, keyset-paginated: builds strictly before the
#: cursor ($8 created_at, $9 invocation_id; NULL: from the newest), $10 rows.
BUILDS = f"""
SELECT {_LIST_COLUMNS}
FROM bep.invocations i
WHERE {_BUILD_FILTER}
AND ($8::timestamptz IS NULL OR (i.created_at, i.invocation_id) < ($8::timestamptz, $9::text))
ORDER BY i.created_at DESC, i.invocation_id DESC
LIMIT $10
"""

#: Facet counts over the search's filtered set (no cursor), capped: the newest $8 builds
#: are counted, and the $9 most frequent values of each facet returned. The row with
#: facet 'total' counts the builds looked at.
BUILD_FACETS = f"""
WITH f AS (
    SELECT i.status, i.user_name, i.branch
    FROM bep.invocations i
    WHERE {_BUILD_FILTER}
    ORDER BY i.created_at DESC
    LIMIT $8
), counted AS (
    SELECT v.facet, v.value, count(*) AS n,
           row_number() OVER (PARTITION BY v.facet ORDER BY count(*) DESC, v.value) AS r
    FROM f CROSS JOIN LATERAL (
        VALUES ('status', f.status), ('user', f.user_name), ('branch', f.branch)
    ) AS v (facet, value)
    WHERE v.value IS NOT NULL
    GROUP BY v.facet, v.value
)
SELECT facet, value, n FROM counted WHERE r <= $9
UNION ALL
SELECT 'total', NULL, count(*) FROM f
ORDER BY 1, 3 DESC, 2
"""

#: The project's tag facets (``bep.tag_keys``): the $3 most frequent values of each key.
TAG_FACETS = f"""
SELECT key, value, builds FROM (
    SELECT t.key, t.value, t.builds,
           row_number() OVER (PARTITION BY t.key ORDER BY t.builds DESC, t.value) AS r
    FROM bep.tag_keys t
    WHERE t.project_id = $2 AND {_VISIBLE.format(col="t.project_id")}
) ranked
WHERE r <= $3
ORDER BY key, builds DESC, value
"""

#: The list rows of the given builds ($2 text[]) of one project ($3).
BUILDS_BY_ID = f"""
SELECT {_LIST_COLUMNS}
FROM bep.invocations i
WHERE i.invocation_id = ANY($2::text[]) AND i.project_id = $3 AND {_VISIBLE_BUILD}
"""

#: Builds of a project ($2) updated after $3 (the polling fallback of the project stream).
BUILDS_UPDATED_SINCE = f"""
SELECT i.invocation_id
FROM bep.invocations i
WHERE i.project_id = $2 AND {_VISIBLE_BUILD} AND i.updated_at > $3
ORDER BY i.updated_at DESC
LIMIT 200
"""

#: The newest ``updated_at`` of a project's builds ($2).
PROJECT_UPDATED_AT = f"""
SELECT max(i.updated_at) FROM bep.invocations i WHERE i.project_id = $2 AND {_VISIBLE_BUILD}
"""

#: Which project a build ($2) is of, if the viewer may read it.
BUILD_PROJECT = f"""
SELECT i.project_id FROM bep.invocations i WHERE i.invocation_id = $2 AND {_VISIBLE_BUILD}
"""

#: A build's whole summary ($2), with its project and metrics.
BUILD = f"""
SELECT i.*, p.slug AS project_slug, p.name AS project_name, m.metrics,
       (SELECT count(*) FROM bep.test_results r
        WHERE r.invocation_id = i.invocation_id
          AND (r.cached_locally OR r.cached_remotely)) AS test_results_cached,
       (SELECT count(*) FROM bep.test_results r
        WHERE r.invocation_id = i.invocation_id) AS test_results
FROM bep.invocations i
JOIN bep.projects p ON p.id = i.project_id
LEFT JOIN bep.invocation_metrics m ON m.invocation_id = i.invocation_id
WHERE i.invocation_id = $2 AND {_VISIBLE_BUILD}
"""

#: What the live stream of a build watches when it polls ($2).
BUILD_PROGRESS = f"""
SELECT i.updated_at, i.last_event_seq, i.finished
FROM bep.invocations i WHERE i.invocation_id = $2 AND {_VISIBLE_BUILD}
"""

#: A page of a build's ($2) targets after (label, aspect) ($3, $4; NULL: from the
#: first); $5 true: only those that failed (their build or their test); $6 rows.
TARGETS = f"""
SELECT t.label, t.aspect, t.configuration, t.kind, t.test_size, t.tags, t.success,
       t.failure, t.test_status, t.test_runs, t.test_cached, t.test_duration_ms
FROM bep.targets t
JOIN bep.invocations i ON i.invocation_id = t.invocation_id
WHERE t.invocation_id = $2 AND {_VISIBLE_BUILD}
AND ($3::text IS NULL OR (t.label, t.aspect) > ($3::text, $4::text))
AND (NOT $5::boolean OR t.success = false
     OR t.test_status NOT IN ('PASSED', 'NO_STATUS'))
ORDER BY t.label, t.aspect
LIMIT $6
"""

#: A page of a build's ($2) test results after (label, run, shard, attempt) ($3..$6;
#: NULL: from the first); $7 true: only those that did not pass; $8 rows.
TEST_RESULTS = f"""
SELECT r.label, r.run, r.shard, r.attempt, r.configuration, r.status, r.status_details,
       r.cached_locally, r.cached_remotely, r.started_at, r.duration_ms, r.strategy,
       r.exit_code, r.outputs
FROM bep.test_results r
JOIN bep.invocations i ON i.invocation_id = r.invocation_id
WHERE r.invocation_id = $2 AND {_VISIBLE_BUILD}
AND ($3::text IS NULL
     OR (r.label, r.run, r.shard, r.attempt) > ($3::text, $4::int, $5::int, $6::int))
AND (NOT $7::boolean OR r.status <> 'PASSED')
ORDER BY r.label, r.run, r.shard, r.attempt
LIMIT $8
"""

#: A build's ($2) actions (Bazel reports the failed ones), in stream order, after $3.
ACTIONS = f"""
SELECT a.seq, a.label, a.mnemonic, a.configuration, a.primary_output, a.success,
       a.exit_code, a.stdout_uri, a.stderr_uri, a.command_line, a.failure
FROM bep.actions a
JOIN bep.invocations i ON i.invocation_id = a.invocation_id
WHERE a.invocation_id = $2 AND {_VISIBLE_BUILD} AND a.seq > $3
ORDER BY a.seq
LIMIT $4
"""

#: The log segments of a build ($2) from the one holding byte $3 on, $4 at most.
LOG_SEGMENTS = f"""
SELECT s.byte_offset, s.bytes, s.data
FROM bep.log_segments s
JOIN bep.invocations i ON i.invocation_id = s.invocation_id
WHERE s.invocation_id = $2 AND {_VISIBLE_BUILD} AND s.byte_offset + s.bytes > $3
ORDER BY s.byte_offset
LIMIT $4
"""
