// The worker against a real server: outcomes, progress, cancel, concurrency, shutdown.

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import {
  Client,
  RetryAfter,
  SkipRetry,
  TaskCancelled,
  type TaskContext,
  wireFeatures,
} from "@conveyor/sdk";

import {
  adminCancel,
  runWorker,
  serverTarget,
  signalled,
  testWorker,
  uniqueQueue,
  waitFor,
  waitForTask,
} from "./helpers.js";

let target: string;
let client: Client;

before(async () => {
  target = await serverTarget();
  client = new Client(target);
});
after(() => client.close());

/** Resolves when the signal aborts, with its reason. */
function aborted(signal: AbortSignal): Promise<unknown> {
  return new Promise((resolve) => {
    if (signal.aborted) resolve(signal.reason);
    else signal.addEventListener("abort", () => resolve(signal.reason), { once: true });
  });
}

describe("outcomes", () => {
  test("a worker completes tasks and their results are stored", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: { [queue]: 1 }, concurrency: 4 });
    const seen: Array<{ attempt: number; queue: string; type: string; headers: Record<string, string> }> = [];
    worker.task("math.add", async (payload: { a: number; b: number }, ctx: TaskContext) => {
      seen.push({ attempt: ctx.attempt, queue: ctx.queue, type: ctx.type, headers: { ...ctx.headers } });
      return { sum: payload.a + payload.b, taskId: ctx.taskId };
    });
    worker.task("nothing", () => undefined);
    const { running } = runWorker(worker);
    try {
      const tasks = await Promise.all(
        [1, 2, 3, 4, 5].map((i) => client.enqueue("math.add", { a: i, b: 10 }, { queue, headers: { i: String(i) } })),
      );
      const empty = await client.enqueue("nothing", "x", { queue });
      for (const [i, task] of tasks.entries()) {
        const done = await waitForTask(client, task.id);
        assert.equal(done.state, "completed");
        assert.deepEqual(done.result, { sum: i + 1 + 10, taskId: task.id });
        assert.equal(done.retried, 0);
      }
      const none = await waitForTask(client, empty.id);
      assert.equal(none.state, "completed");
      assert.equal(none.result, null);
      assert.ok(seen.every((s) => s.attempt === 1 && s.queue === queue && s.type === "math.add"));
      assert.deepEqual(seen.map((s) => s.headers.i).sort(), ["1", "2", "3", "4", "5"]);
      assert.ok(worker.sessionId, "the worker has a session");
    } finally {
      await worker.stop();
      await running;
    }
  });

  test("a failed attempt is retried, then succeeds", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue] });
    const attempts: number[] = [];
    worker.task("flaky", async (_payload: unknown, ctx) => {
      attempts.push(ctx.attempt);
      if (ctx.attempt < 2) throw new TypeError("not yet");
      return "ok";
    });
    const { running } = runWorker(worker);
    try {
      const task = await client.enqueue("flaky", {}, { queue, maxRetry: 3 });
      const retrying = await waitForTask(client, task.id, (t) => t.retried === 1 || t.state === "completed");
      assert.ok(retrying.lastError === "TypeError: not yet" || retrying.state === "completed");
      const done = await waitForTask(client, task.id);
      assert.equal(done.state, "completed");
      assert.equal(done.result, "ok");
      assert.equal(done.retried, 1);
      assert.equal(done.lastError, "TypeError: not yet");
      assert.deepEqual(attempts, [1, 2]);
    } finally {
      await worker.stop();
      await running;
    }
  });

  test("retries exhausted: archived with the last error", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue] });
    class PaymentDeclined extends Error {}
    worker.task("always.fails", () => {
      throw new PaymentDeclined("card 4242");
    });
    const { running } = runWorker(worker);
    try {
      const task = await client.enqueue("always.fails", {}, { queue, maxRetry: 0 });
      const done = await waitForTask(client, task.id);
      assert.equal(done.state, "archived");
      assert.equal(done.lastError, "PaymentDeclined: card 4242");
    } finally {
      await worker.stop();
      await running;
    }
  });

  test("SkipRetry archives at once, whatever retries remain", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue] });
    let calls = 0;
    worker.task("bad.input", () => {
      calls += 1;
      throw new SkipRetry("not an address: 'nobody'");
    });
    const { running } = runWorker(worker);
    try {
      const task = await client.enqueue("bad.input", {}, { queue, maxRetry: 10 });
      const done = await waitForTask(client, task.id);
      assert.equal(done.state, "archived");
      assert.equal(done.retried, 0);
      assert.equal(done.lastError, "not an address: 'nobody'");
      assert.equal(calls, 1);
    } finally {
      await worker.stop();
      await running;
    }
  });

  test("RetryAfter retries after the delay asked for, not the server's backoff", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue] });
    const starts: number[] = [];
    let failedAt = 0;
    worker.task("rate.limited", (_payload: unknown, ctx) => {
      starts.push(Date.now());
      if (ctx.attempt === 1) {
        failedAt = Date.now();
        throw new RetryAfter(2500, "429 from upstream");
      }
      return "done";
    });
    const { running } = runWorker(worker);
    try {
      const task = await client.enqueue("rate.limited", {}, { queue, maxRetry: 2 });
      const retrying = await waitForTask(client, task.id, (t) => t.state === "retry" || t.state === "completed");
      if (retrying.state === "retry") {
        assert.equal(retrying.lastError, "RetryAfter: 429 from upstream");
        const due = retrying.nextProcessAt!.getTime() - failedAt;
        assert.ok(due > 2000 && due < 4000, `due ${due} ms after the failure`);
      }
      const done = await waitForTask(client, task.id, undefined, { timeoutMs: 15_000 });
      assert.equal(done.state, "completed");
      assert.equal(starts.length, 2);
      // The server's own first backoff is at most 1 s.
      assert.ok(starts[1]! - starts[0]! >= 2300, `retried after ${starts[1]! - starts[0]!} ms`);
    } finally {
      await worker.stop();
      await running;
    }
  });

  test("a type with no handler fails the attempt, naming the type", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue] });
    worker.task("known", () => 1);
    const { running } = runWorker(worker);
    try {
      const task = await client.enqueue("unknown.type", {}, { queue, maxRetry: 0 });
      const done = await waitForTask(client, task.id);
      assert.equal(done.state, "archived");
      assert.equal(done.lastError, "no handler for type unknown.type");
    } finally {
      await worker.stop();
      await running;
    }
  });

  test("an attempt past its timeout fails 'timed out' and its signal aborts", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue] });
    const reasons: unknown[] = [];
    worker.task("slow", async (_payload: unknown, ctx) => {
      reasons.push(await aborted(ctx.signal));
      return "too late";
    });
    const { running } = runWorker(worker);
    try {
      const task = await client.enqueue("slow", {}, { queue, maxRetry: 0, timeoutMs: 300 });
      const done = await waitForTask(client, task.id);
      assert.equal(done.state, "archived");
      assert.equal(done.lastError, "timed out");
      assert.equal(done.result, null);
      await waitFor(() => reasons.length === 1, { message: "the handler saw the abort" });
      assert.ok(reasons[0] instanceof TaskCancelled);
      assert.equal((reasons[0] as Error).message, "timed out");
    } finally {
      await worker.stop();
      await running;
    }
  });

  test("a result over the worker's limit fails the attempt instead of breaking the stream", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue], maxResultSize: 100 });
    worker.task("big", () => "x".repeat(200));
    worker.task("small", () => "fine");
    const { running } = runWorker(worker);
    try {
      const big = await client.enqueue("big", {}, { queue, maxRetry: 0 });
      const small = await client.enqueue("small", {}, { queue });
      assert.equal((await waitForTask(client, big.id)).lastError, "result is 202 bytes; the limit is 100");
      assert.equal((await waitForTask(client, small.id)).result, "fine");
    } finally {
      await worker.stop();
      await running;
    }
  });
});

describe("while a task runs", () => {
  test("progress is stored and visible while the task runs", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue] });
    const release = signalled();
    worker.task("report.build", async (_payload: unknown, ctx) => {
      await ctx.progress({ pct: 10 });
      await ctx.progress({ pct: 50, step: "rendering" });
      await release.promise;
      return "report.pdf";
    });
    const { running } = runWorker(worker);
    try {
      const task = await client.enqueue("report.build", {}, { queue });
      const mid = await waitForTask(client, task.id, (t) => (t.progress as { pct?: number } | null)?.pct === 50);
      assert.equal(mid.state, "active");
      assert.deepEqual(mid.progress, { pct: 50, step: "rendering" });
      release.resolve();
      const done = await waitForTask(client, task.id);
      assert.equal(done.state, "completed");
      assert.equal(done.result, "report.pdf");
    } finally {
      await worker.stop();
      await running;
    }
  });

  test("heartbeats keep a task leased past the lease TTL", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue] });
    let runs = 0;
    worker.task("long", async () => {
      runs += 1;
      // The test servers run with a 3 s lease TTL: this outlives it.
      await new Promise((r) => setTimeout(r, 4_000));
      return "still mine";
    });
    const { running } = runWorker(worker);
    try {
      const task = await client.enqueue("long", {}, { queue, maxRetry: 0 });
      const done = await waitForTask(client, task.id);
      assert.equal(done.state, "completed");
      assert.equal(done.result, "still mine");
      assert.equal(runs, 1);
    } finally {
      await worker.stop();
      await running;
    }
  });

  test("an operator cancel aborts ctx.signal and the handler's return is not used", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue] });
    const started = signalled<string>();
    const reasons: unknown[] = [];
    worker.task("cancellable", async (_payload: unknown, ctx) => {
      started.resolve(ctx.taskId);
      reasons.push(await aborted(ctx.signal));
      return "finished anyway";
    });
    const { running } = runWorker(worker);
    try {
      const task = await client.enqueue("cancellable", {}, { queue });
      assert.equal(await started.promise, task.id);
      await adminCancel(target, task.id);
      await waitFor(() => reasons.length === 1, { message: "the signal to abort" });
      assert.ok(reasons[0] instanceof TaskCancelled);
      assert.match((reasons[0] as Error).message, /^cancelled by the server/);
      const done = await waitForTask(client, task.id);
      assert.equal(done.state, "archived");
      assert.equal(done.result, null);
    } finally {
      await worker.stop();
      await running;
    }
  });

  test("concurrency is respected, and reached", async () => {
    const queue = uniqueQueue("w");
    const frames: string[] = [];
    const quiet = () => {};
    const logger = { debug: (event: string, f?: Record<string, unknown>) => void (event === "worker.frame" && frames.push(String(f?.kind))), info: quiet, warn: quiet, error: quiet };
    const worker = testWorker(target, { queues: [queue], concurrency: 3, logger });
    let now = 0;
    let most = 0;
    worker.task("work", async () => {
      now += 1;
      most = Math.max(most, now);
      await new Promise((r) => setTimeout(r, 150));
      now -= 1;
      return null;
    });
    const { running } = runWorker(worker);
    try {
      const results = await client.enqueueBatch(Array.from({ length: 12 }, (_, i) => ({ type: "work", payload: i, queue })));
      for (const item of results) assert.equal((await waitForTask(client, item.task!.id)).state, "completed");
      assert.equal(most, 3);
      // Hello set accepts_dispatches: a batch enqueued at once comes several to a frame.
      assert.ok(frames.includes("dispatches"), `frames seen: ${[...new Set(frames)].join(", ")}`);
    } finally {
      await worker.stop();
      await running;
    }
  });
});

describe("shutdown", () => {
  test("stop() lets running handlers finish, gives nothing back that finished, and takes no new task", async () => {
    const queue = uniqueQueue("w");
    let stopCalled = false;
    const dispatchedAfterStop: string[] = [];
    const quiet = () => {};
    const logger = {
      debug: (event: string, f?: Record<string, unknown>) => {
        if (stopCalled && event === "worker.frame" && String(f?.kind).startsWith("dispatch")) dispatchedAfterStop.push(String(f?.kind));
      },
      info: quiet,
      warn: quiet,
      error: quiet,
    };
    const worker = testWorker(target, { queues: [queue], concurrency: 3, gracePeriodMs: 10_000, logger });
    const release = signalled();
    const ids: string[] = [];
    const runningIds: string[] = [];
    worker.task("job", async (payload: number, ctx) => {
      runningIds.push(ctx.taskId);
      const order = runningIds.length;
      await release.promise;
      if (order === 3) {
        // The last one outlives the other two: their slots are free while the worker
        // drains. Without Drain the server fills them (and the worker gives the tasks
        // back); with Drain it sends nothing. Wait until the server has stored the two
        // Results, then until a dispatch shows up or half a second passes.
        const others = runningIds.slice(0, 2);
        await waitFor(async () => (await Promise.all(others.map((id) => client.getTask(id)))).every((t) => t.state === "completed"), { message: "the first two results" });
        await waitFor(() => dispatchedAfterStop.length > 0, { timeoutMs: 500 }).catch(() => undefined);
      }
      return payload * 2;
    });
    const { running } = runWorker(worker);
    const items = await client.enqueueBatch(Array.from({ length: 6 }, (_, i) => ({ type: "job", payload: i, queue })));
    ids.push(...items.map((item) => item.task!.id));
    await waitFor(() => runningIds.length === 3, { message: "three handlers running" });
    stopCalled = true;
    const stopped = worker.stop();
    // The worker is draining: let the running handlers finish now.
    setImmediate(() => release.resolve());
    await stopped;
    await running;
    const tasks = await Promise.all(ids.map((id) => client.getTask(id)));
    const completed = tasks.filter((t) => t.state === "completed");
    assert.deepEqual(completed.map((t) => t.id).sort(), [...runningIds].sort(), JSON.stringify(tasks.map((t) => t.state)));
    for (const t of completed) {
      assert.equal(t.retried, 0);
      assert.equal(t.result, (t.payload as number) * 2);
    }
    for (const t of tasks.filter((t) => t.state !== "completed")) {
      assert.equal(t.state, "pending", "given back untouched");
      assert.equal(t.retried, 0);
    }
    assert.equal(runningIds.length, 3, "no task started after stop()");
    if (wireFeatures().drain) {
      // Drain went out before the Results: the server sent nothing new after it.
      assert.deepEqual(dispatchedAfterStop, []);
    }
  });

  test("handlers still running after the grace period are aborted and their tasks given back", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue], gracePeriodMs: 300 });
    const started = signalled();
    const reasons: unknown[] = [];
    worker.task("stubborn", async (_payload: unknown, ctx) => {
      started.resolve();
      reasons.push(await aborted(ctx.signal));
      return "too late";
    });
    const { running } = runWorker(worker);
    const task = await client.enqueue("stubborn", {}, { queue });
    await started.promise;
    const t0 = Date.now();
    await worker.stop();
    await running;
    assert.ok(Date.now() - t0 >= 250, "the grace period was given");
    assert.equal(reasons.length, 1);
    assert.ok(reasons[0] instanceof TaskCancelled);
    const back = await client.getTask(task.id);
    assert.equal(back.state, "pending");
    assert.equal(back.retried, 0);
    assert.equal(back.result, null);

    // Another worker picks it up.
    const second = testWorker(target, { queues: [queue] });
    second.task("stubborn", () => "second worker");
    const other = runWorker(second);
    try {
      assert.equal((await waitForTask(client, task.id)).result, "second worker");
    } finally {
      await second.stop();
      await other.running;
    }
  });

  test("stop() before run() is a no-op, and a worker runs again after a stop", async () => {
    const queue = uniqueQueue("w");
    const worker = testWorker(target, { queues: [queue] });
    worker.task("t", (p: number) => p + 1);
    await worker.stop();
    for (const round of [1, 2]) {
      const { running } = runWorker(worker);
      const task = await client.enqueue("t", round, { queue });
      assert.equal((await waitForTask(client, task.id)).result, round + 1);
      await worker.stop();
      await running;
    }
  });
});
