// Quickstart worker (TypeScript): runs `email.send` and `report.build` tasks, like
// examples/worker.py.
//
//     cd sdks/typescript && npm ci && npm run build && npm run example:worker
//
// Set CONVEYOR_TARGET to point it elsewhere (default 127.0.0.1:50051). Stop it with
// Ctrl-C (or SIGTERM): running tasks finish (or are handed back) before it exits.

import { SkipRetry, type TaskContext, Worker } from "@conveyor/sdk";

const worker = new Worker({
  target: process.env.CONVEYOR_TARGET ?? "127.0.0.1:50051",
  queues: { emails: 3, reports: 1 }, // emails get three times the slots of reports
  concurrency: 8,
});

interface Email {
  to?: string;
  subject?: string;
}

// The return value is stored as the task's result.
worker.task("email.send", async (payload: Email, ctx: TaskContext) => {
  if (!payload.to?.includes("@")) {
    throw new SkipRetry(`not an address: '${payload.to}'`); // archived, never retried
  }
  await ctx.progress({ step: "sending" });
  console.log(`[attempt ${ctx.attempt}] email to ${payload.to}: ${payload.subject}`);
  return { delivered_to: payload.to };
});

// Long work checks ctx.signal to stop early (a cancel, a timeout, the end of shutdown).
worker.task("report.build", async (payload: { name: string; pages?: number }, ctx: TaskContext) => {
  for (let page = 0; page < (payload.pages ?? 1); page++) {
    ctx.signal.throwIfAborted();
    await new Promise((resolve) => setTimeout(resolve, 10)); // stands in for real work
  }
  console.log(`report ${payload.name} built`);
  return `${payload.name}.pdf`;
});

await worker.run();
