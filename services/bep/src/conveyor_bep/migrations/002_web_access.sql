-- Who may see a project (allowed groups) and administer it (admin groups), the people who
-- signed in to the web UI through OpenID Connect, and the audit log of admin actions.
ALTER TABLE bep.projects
    ADD COLUMN allowed_groups text[] NOT NULL DEFAULT '{}',
    ADD COLUMN admin_groups   text[] NOT NULL DEFAULT '{}';

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

-- No foreign key to projects: an entry outlives the project it is about.
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
