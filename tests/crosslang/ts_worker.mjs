// The checklist's behaviours (checklist.json) as a TypeScript-SDK worker process.
//
//     node tests/crosslang/ts_worker.mjs   # env: CONVEYOR_TARGET, XL_QUEUE
//
// Prints "ready" once its session is welcomed; SIGTERM stops it gracefully (exit 0).

import { RetryAfter, SkipRetry, Worker } from "../../sdks/typescript/dist/index.js";

/** An Error subclass whose class name is `name` (errors are reported as "Name: message"). */
function namedError(name, message) {
  const cls = { [name]: class extends Error {} }[name];
  return new cls(message);
}

const worker = new Worker({
  target: process.env.CONVEYOR_TARGET,
  queues: { [process.env.XL_QUEUE]: 1 },
  concurrency: 8,
  gracePeriodMs: 5_000,
  workerId: "crosslang-ts",
});

worker.task("xl.echo", (payload) => payload);
worker.task("xl.context", (_payload, ctx) => ({
  type: ctx.type,
  attempt: ctx.attempt,
  max_retry: ctx.maxRetry,
  headers: ctx.headers,
}));
worker.task("xl.none", () => undefined);
worker.task("xl.flaky", (payload, ctx) => {
  if (ctx.attempt <= payload.fail_times) throw namedError(payload.error, `attempt ${ctx.attempt} failed`);
  return { attempt: ctx.attempt };
});
worker.task("xl.fail", (payload) => {
  throw namedError(payload.error, payload.message);
});
worker.task("xl.skip", (payload) => {
  throw new SkipRetry(payload.reason);
});
worker.task("xl.retry_after", (payload, ctx) => {
  if (ctx.attempt === 1) throw new RetryAfter(payload.delay_ms, payload.message);
  return { attempt: ctx.attempt };
});
worker.task("xl.progress", async (payload, ctx) => {
  for (const step of payload.steps) await ctx.progress(step);
  return "done";
});
worker.task("xl.slow", async (payload, ctx) => {
  await new Promise((resolve) => {
    const timer = setTimeout(resolve, payload.ms);
    ctx.signal.addEventListener("abort", () => {
      clearTimeout(timer);
      resolve();
    });
  });
  return "slept";
});

const running = worker.run();
const ready = setInterval(() => {
  if (worker.sessionId) {
    console.log(`ready ${worker.sessionId}`);
    clearInterval(ready);
  }
}, 10);
await running;
clearInterval(ready);
console.log("stopped");
