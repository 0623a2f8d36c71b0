-- 004: who holds each lease, and when each holder was last heard of.
--
-- A holder is a process whose gateways hold leases (an api process). The dispatcher
-- names a task's holder when it leases it (conveyor_tasks.holder), the holder beats
-- (conveyor_holders.seen_at) while it lives, and the reaper releases the ACTIVE tasks of
-- a holder that stopped beating, seconds after it died rather than at lease expiry.
--
-- holder means something only while the task is ACTIVE: every statement that leases
-- sets it (NULL when nobody is named), every statement that ends a lease clears it. No
-- CHECK ties it to the state: during a rolling upgrade the previous release's services
-- still lease without setting it and end leases without clearing it. Until every
-- dispatcher and api runs this release, a task leased by an old dispatcher may carry the
-- holder of an earlier lease, and if that holder has died the reaper releases the task
-- early (it then runs twice, as after any lost lease).

ALTER TABLE conveyor_tasks ADD COLUMN holder text;

CREATE TABLE conveyor_holders (
    holder  text NOT NULL,
    seen_at timestamptz NOT NULL,
    CONSTRAINT conveyor_holders_pkey PRIMARY KEY (holder)
);
