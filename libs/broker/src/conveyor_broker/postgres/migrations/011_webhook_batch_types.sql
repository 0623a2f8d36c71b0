-- 011: the task types a webhook registration takes as whole aggregation groups.
--
-- A due group of one of these types goes to the endpoint as one JSON-RPC call carrying
-- every member (conveyor.batch). Registrations stored before take none.

ALTER TABLE conveyor_webhook_workers
    ADD COLUMN batch_types text[] NOT NULL DEFAULT '{}';
