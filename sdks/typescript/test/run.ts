// `npm test`: one `conveyor dev` for every test file (unless CONVEYOR_TARGET names a server),
// then node's built-in test runner over build/test/*.test.js.

import { spawn } from "node:child_process";
import { readdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import { startDevServer } from "./helpers.js";

const here = dirname(fileURLToPath(import.meta.url));

async function main(): Promise<number> {
  const given = process.env.CONVEYOR_TARGET;
  const server = given ? undefined : await startDevServer();
  const target = given ?? server!.target;
  const only = process.argv.slice(2);
  const files = readdirSync(here)
    .filter((name) => name.endsWith(".test.js"))
    .filter((name) => only.length === 0 || only.some((o) => name.includes(o)))
    .sort()
    .map((name) => join(here, name));
  console.log(`conveyor tests against ${target}${server ? " (conveyor dev started for this run)" : ""}`);
  try {
    return await new Promise<number>((resolveCode) => {
      const child = spawn(process.execPath, ["--test", "--test-reporter=spec", "--test-concurrency=4", ...files], {
        stdio: "inherit",
        env: { ...process.env, CONVEYOR_TARGET: target },
      });
      child.on("exit", (code, signal) => resolveCode(code ?? (signal ? 1 : 0)));
    });
  } finally {
    await server?.stop();
  }
}

main().then(
  (code) => process.exit(code),
  (err: unknown) => {
    console.error(err);
    process.exit(1);
  },
);
