"""Statements of encryption key rotation and key status (``conveyor keys rotate|status``).

They read the key id of each sealed value where the envelope puts it in clear (see
:mod:`conveyor_broker.keyring`): a binary value (payload, progress, result) starts with
the 5-byte magic and version, a length byte and the id; a text value (header value, last
error, webhook secret) with ``enc:v1:<id>:``. Nothing here decrypts.

Parameters of the statements that look for values to rewrite: ``$1`` the binary head of
the primary key (magic, version, length, id), ``$2`` its text head (``enc:v1:<id>:``),
``$3`` the fixed error texts the broker writes itself (left in clear: the server's words,
not a user's).
"""

from __future__ import annotations

from conveyor_broker.keyring import TEXT_PREFIX

# A stored value that is not sealed under the primary key: a binary one ($1 its head)...
_BINARY_STALE = "(substring({col} FROM 1 FOR octet_length($1::bytea)) <> $1::bytea)"
# ... a text one ($2 its head; the broker's own texts $3 stay clear)...
_TEXT_STALE = "(left({col}, length($2::text)) <> $2::text AND {col} <> ALL($3::text[]))"
# ... and a header value ($2 its head).
_HEADERS_STALE = (
    "EXISTS (SELECT 1 FROM jsonb_each_text({col}) h "
    "WHERE left(h.value, length($2::text)) <> $2::text)"
)
#: A task with a value that a rotation must rewrite.
STALE = " OR ".join(
    (
        _BINARY_STALE.format(col="t.payload"),
        f"(t.progress IS NOT NULL AND {_BINARY_STALE.format(col='t.progress')})",
        f"(t.result IS NOT NULL AND {_BINARY_STALE.format(col='t.result')})",
        f"(t.last_error IS NOT NULL AND {_TEXT_STALE.format(col='t.last_error')})",
        f"(t.headers <> '{{}}'::jsonb AND {_HEADERS_STALE.format(col='t.headers')})",
    )
)

#: A digest of every value a rotation rewrites: a rewrite applies only while it is
#: unchanged (compare and set against the live services' writes).
_DIGEST = "md5(ROW(t.payload, t.headers, t.progress, t.result, t.last_error)::text)"

#: How many tasks have a value to rewrite ($1-$3 as above).
COUNT_STALE = f"""
SELECT count(*) FROM conveyor_tasks t WHERE {STALE}
"""

#: The next $5 tasks with a value to rewrite after id $4, by id ($1-$3 as above).
STALE_TASKS = f"""
SELECT t.id, t.payload, t.headers::text AS headers, t.progress, t.result, t.last_error,
       {_DIGEST} AS digest
FROM conveyor_tasks t
WHERE t.id > $4 AND ({STALE})
ORDER BY t.id
LIMIT $5
"""

#: The tasks $1 as STALE_TASKS reads them (to try a rewrite again).
TASKS_BY_IDS = f"""
SELECT t.id, t.payload, t.headers::text AS headers, t.progress, t.result, t.last_error,
       {_DIGEST} AS digest
FROM conveyor_tasks t
WHERE t.id = ANY($1::text[])
ORDER BY t.id
"""

#: Rewrite the values of tasks $1 (in id order) whose digest is still $2: payloads $3,
#: headers $4, progress $5, results $6, last errors $7. Returns the ids rewritten. Nothing
#: else changes, ``updated_at`` included: a rotation is upkeep, not a change of the task.
REWRITE = f"""
UPDATE conveyor_tasks t
SET payload = u.payload, headers = u.headers, progress = u.progress, result = u.result,
    last_error = u.last_error
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::jsonb[], $5::bytea[], $6::bytea[],
            $7::text[]) AS u(id, digest, payload, headers, progress, result, last_error)
WHERE t.id = u.id AND {_DIGEST} = u.digest
RETURNING t.id
"""

#: A digest of a cron template's values (compare and set, as for tasks).
_CRON_DIGEST = "md5(ROW(c.payload, c.headers)::text)"

#: The cron entries whose template has a value to rewrite ($1, $2 as above), by name.
STALE_CRON_TEMPLATES = f"""
SELECT c.name, c.payload, c.headers::text AS headers, {_CRON_DIGEST} AS digest
FROM conveyor_cron_entries c
WHERE (({_BINARY_STALE.format(col="c.payload")})
       OR (c.headers <> '{{}}'::jsonb AND {_HEADERS_STALE.format(col="c.headers")}))
ORDER BY c.name
"""

#: Rewrite the templates of entries $1 whose digest is still $2: payloads $3, headers $4.
#: Returns the names rewritten; ``updated_at`` stays (upkeep, not a change of the entry).
REWRITE_CRON_TEMPLATES = f"""
UPDATE conveyor_cron_entries c
SET payload = u.payload, headers = u.headers
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::jsonb[])
    AS u(name, digest, payload, headers)
WHERE c.name = u.name AND {_CRON_DIGEST} = u.digest
RETURNING c.name
"""

_BINARY_KEY = (
    "CASE WHEN substring({col} FROM 1 FOR 5) = $1::bytea AND octet_length({col}) > 6 "
    "THEN convert_from(substring({col} FROM 7 FOR get_byte({col}, 5)), 'UTF8') END"
)
_TEXT_KEY = f"CASE WHEN left({{col}}, {len(TEXT_PREFIX)}) = '{TEXT_PREFIX}' THEN split_part({{col}}, ':', 3) END"

#: Stored values per (field, key id): key id NULL for a value in clear; field
#: ``server_error`` for the broker's own error texts ($2, left in clear). ``secret`` is a
#: webhook secret (sealed by the api under its own keys); ``cron_payload`` and
#: ``cron_header`` the values of cron entries' task templates. $1: the binary envelope prefix.
KEY_STATUS = f"""
SELECT field, key_id, count(*) AS n FROM (
    SELECT 'payload' AS field, {_BINARY_KEY.format(col="t.payload")} AS key_id
    FROM conveyor_tasks t
  UNION ALL
    SELECT 'progress', {_BINARY_KEY.format(col="t.progress")}
    FROM conveyor_tasks t WHERE t.progress IS NOT NULL
  UNION ALL
    SELECT 'result', {_BINARY_KEY.format(col="t.result")}
    FROM conveyor_tasks t WHERE t.result IS NOT NULL
  UNION ALL
    SELECT CASE WHEN t.last_error = ANY($2::text[]) THEN 'server_error' ELSE 'last_error' END,
           {_TEXT_KEY.format(col="t.last_error")}
    FROM conveyor_tasks t WHERE t.last_error IS NOT NULL
  UNION ALL
    SELECT 'header', {_TEXT_KEY.format(col="h.value")}
    FROM conveyor_tasks t, jsonb_each_text(t.headers) h
  UNION ALL
    SELECT 'cron_payload', {_BINARY_KEY.format(col="c.payload")}
    FROM conveyor_cron_entries c
  UNION ALL
    SELECT 'cron_header', {_TEXT_KEY.format(col="h.value")}
    FROM conveyor_cron_entries c, jsonb_each_text(c.headers) h
  UNION ALL
    SELECT 'secret', {_TEXT_KEY.format(col="s.value")}
    FROM conveyor_webhook_workers w, unnest(w.secrets) AS s(value)
) v
GROUP BY field, key_id
ORDER BY field, key_id
"""
