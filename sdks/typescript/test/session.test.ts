// The worker's session: reconnects, a refused Hello, options checked before connecting.

import assert from "node:assert/strict";
import { describe, test } from "node:test";

import { Client, FailedPrecondition, InvalidArgument, Worker } from "@conveyor/sdk";

import { runWorker, serverTarget, startDevServer, testWorker, uniqueQueue, waitForTask } from "./helpers.js";

describe("the session", () => {
  test("a worker reconnects when its server goes away and comes back", async () => {
    let server = await startDevServer();
    const queue = uniqueQueue("w");
    const worker = testWorker(server.target, { queues: [queue] });
    worker.task("echo", (p: unknown) => p);
    const { running } = runWorker(worker);
    try {
      let local = new Client(server.target);
      const first = await local.enqueue("echo", "one", { queue });
      assert.equal((await waitForTask(local, first.id)).result, "one");
      local.close();
      const firstSession = worker.sessionId;
      await server.stop();
      server = await startDevServer({ port: server.port });
      local = new Client(server.target);
      const second = await local.enqueue("echo", "two", { queue });
      assert.equal((await waitForTask(local, second.id, undefined, { timeoutMs: 30_000 })).result, "two");
      assert.notEqual(worker.sessionId, firstSession);
      local.close();
    } finally {
      await worker.stop();
      await running;
      await server.stop();
    }
  });

  test("a refused Hello is not retried: run() rejects", async () => {
    const worker = testWorker(await serverTarget(), { queues: [uniqueQueue("w")], minServerVersion: "999.0.0" });
    await assert.rejects(worker.run(), (err: unknown) => {
      assert.ok(err instanceof FailedPrecondition);
      assert.equal(err.code, "FAILED_PRECONDITION");
      return true;
    });
  });

  test("bad worker options are refused before connecting", () => {
    assert.throws(() => new Worker({ queues: { "bad name": 1 } }), InvalidArgument);
    assert.throws(() => new Worker({ queues: { q: 0 } }), InvalidArgument);
    assert.throws(() => new Worker({ queues: [] }), InvalidArgument);
    assert.throws(() => new Worker({ concurrency: 0 }), InvalidArgument);
    assert.throws(() => new Worker({ concurrency: 10_001 }), InvalidArgument);
    assert.throws(() => new Worker({ workerId: "a\nb" }), InvalidArgument);
    assert.throws(() => new Worker({ labels: Object.fromEntries(Array.from({ length: 17 }, (_, i) => [`k${i}`, "v"])) }), InvalidArgument);
    const worker = new Worker({ handleSignals: false });
    worker.task("t", () => 1);
    assert.throws(() => worker.task("t", () => 2), InvalidArgument);
  });
});
