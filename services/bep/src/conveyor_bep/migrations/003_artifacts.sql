-- The built-in CAS sink: blobs uploaded per project (keyed by (project_id, digest), the
-- bytes under the project's key prefix), and the artifacts a build's events reference,
-- which pin their blobs (conveyor_bep.blobs).
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
