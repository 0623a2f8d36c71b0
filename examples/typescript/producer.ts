// Quickstart producer (TypeScript): enqueues a few tasks and waits until they are done,
// like examples/producer.py.
//
//     cd sdks/typescript && npm run example:producer   # with the example worker running

import { Client, type TaskInfo, isTerminal } from "@conveyor/sdk";

async function main(): Promise<number> {
  const client = new Client(process.env.CONVEYOR_TARGET ?? "127.0.0.1:50051");
  try {
    const tasks: TaskInfo[] = [];
    for (let i = 0; i < 5; i++) {
      tasks.push(
        await client.enqueue("email.send", { to: `user${i}@example.com`, subject: "Welcome!" }, { queue: "emails", maxRetry: 3 }),
      );
    }
    // Many at once, in one call (each item succeeds or fails on its own).
    const batch = await client.enqueueBatch(
      [0, 1, 2].map((i) => ({ type: "report.build", payload: { name: `weekly-${i}`, pages: 3 }, queue: "reports" })),
    );
    for (const item of batch) {
      if (item.error) throw item.error;
      tasks.push(item.task!);
    }
    console.log(`enqueued ${tasks.length} tasks`);

    const deadline = Date.now() + 60_000;
    let states: TaskInfo[];
    for (;;) {
      states = await Promise.all(tasks.map((t) => client.getTask(t.id)));
      if (states.every((s) => isTerminal(s.state))) break;
      if (Date.now() > deadline) {
        console.log("timed out waiting for the worker: is examples/typescript/worker.ts running?");
        return 1;
      }
      await new Promise((resolve) => setTimeout(resolve, 200)); // poll the task states once in a while
    }

    for (const info of states) {
      console.log(`${info.id} ${info.type.padEnd(13)} ${info.state.padEnd(10)} result=${JSON.stringify(info.result)}`);
    }
    const completed = states.filter((s) => s.state === "completed").length;
    console.log(`${completed} of ${tasks.length} tasks completed`);
    return completed === tasks.length ? 0 : 1;
  } finally {
    client.close();
  }
}

process.exitCode = await main();
