// The checklist (checklist.json) enqueued by the TypeScript SDK's Client; waits until every
// task has ended, checks each one against its `expect`, and prints a JSON report:
// {"tasks": {name: task id}, "failures": [...]}. Exit 0 when nothing failed.
//
//     node tests/crosslang/ts_producer.mjs   # env: CONVEYOR_TARGET, XL_QUEUE

import { readFileSync } from "node:fs";
import { isDeepStrictEqual } from "node:util";

import { Client, isTerminal } from "../../sdks/typescript/dist/index.js";

const checklist = JSON.parse(readFileSync(new URL("./checklist.json", import.meta.url), "utf8"));
const queue = process.env.XL_QUEUE;
const client = new Client(process.env.CONVEYOR_TARGET);

/** What differs between a task read back and a scenario's expectations. */
export function mismatches(task, expect) {
  const found = [];
  const actual = {
    state: task.state,
    retried: task.retried,
    result: task.result,
    progress: task.progress,
    last_error: task.lastError,
  };
  for (const [key, wanted] of Object.entries(expect)) {
    if (!isDeepStrictEqual(actual[key], wanted)) {
      found.push(`${key}: expected ${JSON.stringify(wanted)}, got ${JSON.stringify(actual[key])}`);
    }
  }
  return found;
}

try {
  const ids = {};
  for (const scenario of checklist.scenarios) {
    const options = scenario.options ?? {};
    const task = await client.enqueue(scenario.type, scenario.payload, {
      queue,
      ...(options.max_retry === undefined ? {} : { maxRetry: options.max_retry }),
      ...(options.timeout_ms === undefined ? {} : { timeoutMs: options.timeout_ms }),
      ...(options.headers === undefined ? {} : { headers: options.headers }),
    });
    ids[scenario.name] = task.id;
  }
  const deadline = Date.now() + 60_000;
  const tasks = {};
  for (;;) {
    for (const [name, id] of Object.entries(ids)) tasks[name] = await client.getTask(id);
    if (Object.values(tasks).every((t) => isTerminal(t.state)) || Date.now() > deadline) break;
    await new Promise((resolve) => setTimeout(resolve, 50)); // polling interval
  }
  const failures = [];
  for (const scenario of checklist.scenarios) {
    for (const problem of mismatches(tasks[scenario.name], scenario.expect)) failures.push(`${scenario.name}: ${problem}`);
  }
  console.log(JSON.stringify({ tasks: ids, failures }));
  process.exitCode = failures.length === 0 ? 0 : 1;
} finally {
  client.close();
}
