// Test support: a real `conveyor dev` server, waits on conditions, and raw admin calls.
// Nothing here sleeps for a fixed time: every wait polls a condition until a timeout.

import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { randomBytes } from "node:crypto";
import { createWriteStream, mkdtempSync, readFileSync } from "node:fs";
import { createConnection, createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

import * as grpc from "@grpc/grpc-js";

import { type Client, type TaskInfo, type TaskState, Worker, type WorkerOptions } from "@conveyor/sdk";
import { wire } from "@conveyor/sdk/wire";

const here = dirname(fileURLToPath(import.meta.url));
/** sdks/typescript */
export const PACKAGE_ROOT = resolve(here, "..", "..");
/** The monorepo's root (where `uv run conveyor dev` runs). */
export const REPO_ROOT = resolve(PACKAGE_ROOT, "..", "..");
/** Lease TTL of the servers the tests start: heartbeats every second. */
export const LEASE_TTL_S = 3;

export async function freePort(): Promise<number> {
  return new Promise((resolvePort, reject) => {
    const server = createServer();
    server.unref();
    server.on("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      const port = typeof address === "object" && address ? address.port : 0;
      server.close(() => resolvePort(port));
    });
  });
}

export function portOpen(port: number): Promise<boolean> {
  return new Promise((resolveOpen) => {
    const socket = createConnection({ host: "127.0.0.1", port });
    const done = (open: boolean) => {
      socket.destroy();
      resolveOpen(open);
    };
    socket.setTimeout(200, () => done(false));
    socket.once("connect", () => done(true));
    socket.once("error", () => done(false));
  });
}

export interface WaitOptions {
  timeoutMs?: number;
  intervalMs?: number;
  message?: string;
}

/** Poll `condition` until it returns a truthy value (returned) or the timeout passes. */
export async function waitFor<T>(condition: () => T | Promise<T>, options: WaitOptions = {}): Promise<NonNullable<T>> {
  const { timeoutMs = 20_000, intervalMs = 25, message = "condition" } = options;
  const deadline = Date.now() + timeoutMs;
  let last: unknown;
  for (;;) {
    try {
      const value = await condition();
      if (value) return value as NonNullable<T>;
      last = value;
    } catch (err) {
      last = err;
    }
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${message} (last: ${last instanceof Error ? last.message : JSON.stringify(last)})`);
    }
    await new Promise((r) => setTimeout(r, intervalMs));
  }
}

/** The command that runs uv: CONVEYOR_UV (e.g. "python3 -m uv"), else `uv` when it is on
 * PATH, else `python3 -m uv`. */
function uvCommand(): string[] {
  const given = process.env.CONVEYOR_UV?.trim();
  if (given) return given.split(/\s+/);
  const found = spawnSync("uv", ["--version"], { stdio: "ignore" });
  return found.status === 0 ? ["uv"] : ["python3", "-m", "uv"];
}

export interface DevServer {
  target: string;
  port: number;
  log: string;
  stop(): Promise<void>;
}

/** `uv run conveyor dev` on `port` (a free one by default), from the repo root, in its own
 * process group; resolves once the port accepts connections. */
export async function startDevServer(options: { port?: number; leaseTtlS?: number } = {}): Promise<DevServer> {
  const port = options.port ?? (await freePort());
  const dir = mkdtempSync(join(tmpdir(), "conveyor-ts-"));
  const log = join(dir, "dev.log");
  const out = createWriteStream(log);
  const [cmd, ...base] = uvCommand();
  const args = [...base, "run", "--frozen", "conveyor", "dev", "--port", String(port), "--lease-ttl", String(options.leaseTtlS ?? LEASE_TTL_S)];
  const child: ChildProcess = spawn(cmd!, args, {
    cwd: REPO_ROOT,
    env: { ...process.env, CONVEYOR_REST_PORT: "0", UV_PYTHON_DOWNLOADS: "never" },
    stdio: ["ignore", "pipe", "pipe"],
    detached: true,
  });
  child.stdout?.pipe(out);
  child.stderr?.pipe(out);
  let exited = false;
  child.on("exit", () => (exited = true));
  const stop = async () => {
    if (exited || child.pid === undefined) return;
    try {
      process.kill(-child.pid, "SIGTERM");
    } catch {
      return;
    }
    await waitFor(() => exited, { timeoutMs: 30_000, message: "the dev server to exit" }).catch(() => {
      if (child.pid !== undefined) process.kill(-child.pid, "SIGKILL");
    });
  };
  try {
    await waitFor(async () => exited || (await portOpen(port)), { timeoutMs: 120_000, intervalMs: 50, message: `conveyor dev on port ${port}` });
  } catch (err) {
    await stop();
    throw err;
  }
  if (exited) throw new Error(`conveyor dev exited: ${readFileSync(log, "utf8")}`);
  return { target: `127.0.0.1:${port}`, port, log, stop };
}

let shared: Promise<string> | undefined;

/** The server the tests use: CONVEYOR_TARGET (the runner starts one for all files), else
 * a dev server of this process, stopped when the process exits. */
export function serverTarget(): Promise<string> {
  if (process.env.CONVEYOR_TARGET) return Promise.resolve(process.env.CONVEYOR_TARGET);
  shared ??= startDevServer().then((server) => {
    const pid = process.pid;
    process.once("exit", () => {
      if (process.pid === pid) void server.stop();
    });
    process.env.CONVEYOR_TARGET = server.target;
    return server.target;
  });
  return shared;
}

/** A queue name no other test uses. */
export function uniqueQueue(prefix = "ts"): string {
  return `${prefix}-${randomBytes(5).toString("hex")}`;
}

const TERMINAL: ReadonlySet<TaskState> = new Set(["completed", "archived", "canceled"]);

/** The task once `predicate` holds for it (default: it reached a terminal state). */
export function waitForTask(
  client: Client,
  id: string,
  predicate: (task: TaskInfo) => boolean = (t) => TERMINAL.has(t.state),
  options: WaitOptions = {},
): Promise<TaskInfo> {
  return waitFor(async () => {
    const task = await client.getTask(id);
    return predicate(task) ? task : undefined;
  }, { message: `task ${id}`, ...options });
}

/** A worker on `target` with test defaults (no signal handlers, fast reconnects). */
export function testWorker(target: string, options: WorkerOptions = {}): Worker {
  return new Worker({ target, handleSignals: false, reconnect: { initialMs: 50, maxMs: 500 }, gracePeriodMs: 5_000, ...options });
}

/** AdminService.CancelTask, called raw (the SDK has no admin client). */
export async function adminCancel(target: string, id: string): Promise<void> {
  const Admin = wire().services.AdminService;
  const admin = new Admin(target, grpc.credentials.createInsecure());
  try {
    await new Promise<void>((resolveCall, reject) => {
      (admin as unknown as Record<string, (req: unknown, cb: (err: Error | null) => void) => void>).CancelTask!(
        { id },
        (err) => (err ? reject(err) : resolveCall()),
      );
    });
  } finally {
    admin.close();
  }
}

/** Run a worker in the background; returns it and its run() promise. */
export function runWorker(worker: Worker): { worker: Worker; running: Promise<void> } {
  const running = worker.run();
  running.catch(() => {});
  return { worker, running };
}

/** A promise with its resolve function. */
export function signalled<T = void>(): { promise: Promise<T>; resolve: (value: T) => void } {
  let resolveFn!: (value: T) => void;
  const promise = new Promise<T>((r) => (resolveFn = r));
  return { promise, resolve: resolveFn };
}
