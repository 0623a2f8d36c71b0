-- The build-event ingest's schema: what applying every migration produces (a test checks).
CREATE SCHEMA IF NOT EXISTS bep;

CREATE TABLE bep.projects (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    slug        text NOT NULL UNIQUE CHECK (slug ~ '^[a-z0-9][a-z0-9-]{0,62}$'),
    name        text NOT NULL,
    key_prefix  text NOT NULL,
    max_streams integer NOT NULL DEFAULT 200 CHECK (max_streams > 0),
    max_unacked integer NOT NULL DEFAULT 5000 CHECK (max_unacked > 0),
    created_at  timestamptz NOT NULL DEFAULT now(),
    -- Who sees the project in the web UI, and who administers it (002_web_access).
    allowed_groups text[] NOT NULL DEFAULT '{}',
    admin_groups   text[] NOT NULL DEFAULT '{}'
);

CREATE TABLE bep.api_keys (
    id            text PRIMARY KEY,
    project_id    bigint NOT NULL REFERENCES bep.projects (id) ON DELETE CASCADE,
    secret_sha256 bytea NOT NULL,
    name          text NOT NULL DEFAULT '',
    created_at    timestamptz NOT NULL DEFAULT now(),
    revoked_at    timestamptz
);
CREATE INDEX api_keys_project_idx ON bep.api_keys (project_id);

CREATE TABLE bep.invocations (
    invocation_id        text PRIMARY KEY,
    project_id           bigint NOT NULL REFERENCES bep.projects (id) ON DELETE CASCADE,
    build_id             text NOT NULL DEFAULT '',
    last_event_seq       bigint NOT NULL DEFAULT 0,
    status               text NOT NULL DEFAULT 'running',
    finished             boolean NOT NULL DEFAULT false,
    exit_code            integer,
    exit_name            text,
    command              text,
    patterns             text[],
    tool_version         text,
    user_name            text,
    host_name            text,
    branch               text,
    commit_sha           text,
    tags                 jsonb NOT NULL DEFAULT '{}',
    command_line         text[],
    options              jsonb,
    started_at           timestamptz,
    finished_at          timestamptz,
    attempt_started_at   timestamptz,
    attempt_finished_at  timestamptz,
    lifecycle_status     text,
    targets_configured   integer NOT NULL DEFAULT 0,
    targets_completed    integer NOT NULL DEFAULT 0,
    targets_failed       integer NOT NULL DEFAULT 0,
    tests_total          integer NOT NULL DEFAULT 0,
    tests_passed         integer NOT NULL DEFAULT 0,
    tests_failed         integer NOT NULL DEFAULT 0,
    tests_flaky          integer NOT NULL DEFAULT 0,
    actions_failed       integer NOT NULL DEFAULT 0,
    actions_created      bigint,
    actions_executed     bigint,
    cache_hits           bigint,
    events               bigint NOT NULL DEFAULT 0,
    log_bytes            bigint NOT NULL DEFAULT 0,
    log_lines            bigint NOT NULL DEFAULT 0,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX invocations_project_idx ON bep.invocations (project_id, created_at DESC);
CREATE INDEX invocations_created_idx ON bep.invocations (created_at);

CREATE TABLE bep.targets (
    invocation_id  text NOT NULL,
    label          text NOT NULL,
    aspect         text NOT NULL DEFAULT '',
    configuration  text,
    kind           text,
    test_size      text,
    tags           text[],
    success        boolean,
    failure        text,
    test_status    text,
    test_runs      integer,
    test_cached    integer,
    test_duration_ms bigint,
    PRIMARY KEY (invocation_id, label, aspect)
);

CREATE TABLE bep.test_results (
    invocation_id   text NOT NULL,
    label           text NOT NULL,
    run             integer NOT NULL,
    shard           integer NOT NULL,
    attempt         integer NOT NULL,
    configuration   text,
    status          text NOT NULL,
    status_details  text,
    cached_locally  boolean NOT NULL DEFAULT false,
    cached_remotely boolean NOT NULL DEFAULT false,
    started_at      timestamptz,
    duration_ms     bigint,
    strategy        text,
    exit_code       integer,
    outputs         jsonb NOT NULL DEFAULT '[]',
    PRIMARY KEY (invocation_id, label, run, shard, attempt)
);

CREATE TABLE bep.actions (
    invocation_id  text NOT NULL,
    seq            bigint NOT NULL,
    label          text,
    mnemonic       text,
    configuration  text,
    primary_output text,
    success        boolean NOT NULL,
    exit_code      integer,
    stdout_uri     text,
    stderr_uri     text,
    command_line   text[],
    failure        text,
    PRIMARY KEY (invocation_id, seq)
);

CREATE TABLE bep.named_sets (
    invocation_id text NOT NULL,
    set_id        text NOT NULL,
    files         jsonb NOT NULL,
    file_sets     text[] NOT NULL,
    PRIMARY KEY (invocation_id, set_id)
);

CREATE TABLE bep.invocation_metrics (
    invocation_id text PRIMARY KEY,
    metrics       jsonb NOT NULL
);

-- The raw stream (scrubbed), as zstd-compressed batches of length-delimited events, in
-- daily partitions: retention drops a partition. The service creates partitions ahead.
CREATE TABLE bep.event_segments (
    day           date NOT NULL,
    invocation_id text NOT NULL,
    first_seq     bigint NOT NULL,
    last_seq      bigint NOT NULL,
    raw_bytes     integer NOT NULL,
    data          bytea NOT NULL,
    PRIMARY KEY (invocation_id, first_seq, day)
) PARTITION BY RANGE (day);

-- The build log (progress stdout/stderr and console output, scrubbed), compressed per
-- batch, with the byte and line offset of each segment's first byte in the whole log.
CREATE TABLE bep.log_segments (
    day           date NOT NULL,
    invocation_id text NOT NULL,
    byte_offset   bigint NOT NULL,
    line_offset   bigint NOT NULL,
    bytes         integer NOT NULL,
    lines         integer NOT NULL,
    data          bytea NOT NULL,
    PRIMARY KEY (invocation_id, byte_offset, day)
) PARTITION BY RANGE (day);

CREATE TABLE bep.tag_keys (
    project_id bigint NOT NULL REFERENCES bep.projects (id) ON DELETE CASCADE,
    key        text NOT NULL,
    value      text NOT NULL,
    builds     bigint NOT NULL,
    PRIMARY KEY (project_id, key, value)
);

-- The people who signed in to the web UI (OpenID Connect) and their groups at last login.
CREATE TABLE bep.users (
    subject        text PRIMARY KEY,
    email          text,
    name           text,
    groups         text[] NOT NULL DEFAULT '{}',
    first_login_at timestamptz NOT NULL DEFAULT now(),
    last_login_at  timestamptz NOT NULL DEFAULT now(),
    -- A session cookie names the generation it was issued in; signing out moves it on,
    -- which ends every session of the user.
    session_generation integer NOT NULL DEFAULT 0
);

-- Every admin action of the web UI. No foreign key: an entry outlives its project.
CREATE TABLE bep.audit_log (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT now(),
    actor      text NOT NULL,
    action     text NOT NULL,
    project_id bigint,
    target     text,
    details    jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_log_at_idx ON bep.audit_log (at);
CREATE INDEX audit_log_project_idx ON bep.audit_log (project_id, id);

-- The CAS sink's blobs and the artifacts that pin them (003_artifacts).
CREATE TABLE bep.blobs (
    project_id  bigint NOT NULL REFERENCES bep.projects (id) ON DELETE CASCADE,
    digest      text NOT NULL CHECK (digest ~ '^[0-9a-f]{64}$'),
    size        bigint NOT NULL CHECK (size >= 0),
    key_prefix  text NOT NULL,
    origin      text NOT NULL,
    created_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (project_id, digest)
);
CREATE INDEX blobs_expires_idx ON bep.blobs (expires_at);

CREATE TABLE bep.artifacts (
    invocation_id text NOT NULL,
    project_id    bigint NOT NULL,
    kind          text NOT NULL,
    label         text NOT NULL DEFAULT '',
    name          text NOT NULL,
    digest        text NOT NULL,
    size          bigint NOT NULL,
    PRIMARY KEY (invocation_id, kind, label, name, digest)
);
CREATE INDEX artifacts_blob_idx ON bep.artifacts (project_id, digest);
