// The README's TypeScript quickstart, as a newcomer runs it: the example worker and
// producer (examples/typescript, compiled into build/examples) as their own processes,
// and SIGTERM stopping the worker gracefully.

import assert from "node:assert/strict";
import { type ChildProcess, spawn } from "node:child_process";
import { join } from "node:path";
import { test } from "node:test";

import { PACKAGE_ROOT, serverTarget, waitFor } from "./helpers.js";

function start(script: string, target: string): { child: ChildProcess; output: () => string; exited: Promise<number | null> } {
  let output = "";
  const child = spawn(process.execPath, [join(PACKAGE_ROOT, "build", "examples", script)], {
    env: { ...process.env, CONVEYOR_TARGET: target },
    stdio: ["ignore", "pipe", "pipe"],
  });
  child.stdout!.on("data", (chunk: Buffer) => (output += chunk.toString()));
  child.stderr!.on("data", (chunk: Buffer) => (output += chunk.toString()));
  const exited = new Promise<number | null>((resolve) => child.on("exit", (code) => resolve(code)));
  return { child, output: () => output, exited };
}

test("the example producer's tasks are run by the example worker; SIGTERM stops it cleanly", async () => {
  const target = await serverTarget();
  const worker = start("worker.js", target);
  try {
    const producer = start("producer.js", target);
    const code = await producer.exited;
    assert.equal(code, 0, producer.output());
    assert.match(producer.output(), /8 of 8 tasks completed/);
    assert.match(producer.output(), /email\.send\s+completed\s+result=\{"delivered_to":"user0@example\.com"\}/);
    assert.match(producer.output(), /report\.build\s+completed\s+result="weekly-0\.pdf"/);
    await waitFor(() => worker.output().includes("email to user0@example.com"), { message: "the worker's output" });

    worker.child.kill("SIGTERM");
    await waitFor(() => worker.child.exitCode !== null, { timeoutMs: 30_000, message: "the worker to exit after SIGTERM" });
    assert.equal(await worker.exited, 0, worker.output());
  } finally {
    if (worker.child.exitCode === null) worker.child.kill("SIGKILL");
  }
});
