// The worker: a handler registry, one WorkerService.Session stream at a time
// (docs/protocol.md), local slots, graceful shutdown and reconnects.

import { hostname } from "node:os";

import * as grpc from "@grpc/grpc-js";

import { CHANNEL_OPTIONS, type ConnectionOptions, DEFAULT_TARGET, type Endpoint, endpoint } from "./channel.js";
import { type Codec, JsonCodec, decodeValue, encodeValue } from "./codec.js";
import { InvalidArgument, SkipRetry, codeName, errorFromStatus } from "./errors.js";
import {
  MAX_CONCURRENCY,
  MAX_HELLO_QUEUES,
  MAX_LABEL_KEY_LEN,
  MAX_LABEL_VALUE_LEN,
  MAX_LABELS,
  MAX_QUEUE_WEIGHT,
  MAX_VERSION_LEN,
  MAX_WORKER_ID_LEN,
  checkText,
  isQueueName,
} from "./types.js";
import { VERSION, SDK_NAME } from "./version.js";
import {
  type WireCancel,
  type WireBatchDispatch,
  type WireHello,
  type WireOutcome,
  type WireResult,
  type WireServerFrame,
  type WireTaskEnvelope,
  type WireWelcome,
  type WireWorkerFrame,
  durationFromWire,
  durationToWire,
  timestampFromWire,
  wire,
  wireFeatures,
} from "./wire.js";

/** Statuses that end a worker instead of a reconnect: they do not heal by retrying. */
export const FATAL_CODES: ReadonlySet<string> = new Set([
  "INVALID_ARGUMENT",
  "FAILED_PRECONDITION",
  "UNAUTHENTICATED",
  "PERMISSION_DENIED",
]);
/** How long to wait for Welcome after Hello. */
const WELCOME_TIMEOUT_MS = 30_000;
/** How long a closing session waits for the server to end the stream after the half-close. */
const CLOSE_TIMEOUT_MS = 5_000;
/** How long handlers that were aborted get to unwind before run() resolves without them. */
const UNWIND_TIMEOUT_MS = 5_000;
/** Used when Welcome names neither a heartbeat interval nor a lease TTL. */
const DEFAULT_HEARTBEAT_MS = 10_000;
/** The server's default result limit (CONVEYOR_MAX_RESULT), when Welcome announces none. */
const DEFAULT_MAX_RESULT = 1024 * 1024;
/** The server stores at most this many characters of an error. */
const MAX_ERROR_LEN = 4096;
/** The error of an attempt that outlived its timeout or the task's deadline. */
export const TIMED_OUT = "timed out";

// ------------------------------------------------------------------ public types

/** What a handler knows about the delivery it runs, and how it talks back. */
export interface TaskContext {
  readonly taskId: string;
  readonly queue: string;
  readonly type: string;
  /** 1 for the first attempt. */
  readonly attempt: number;
  readonly maxRetry: number;
  readonly headers: Readonly<Record<string, string>>;
  /** This attempt's bound in milliseconds, if any. */
  readonly timeoutMs: number | undefined;
  /** The task's absolute deadline, if any. */
  readonly deadline: Date | undefined;
  readonly enqueuedAt: Date | undefined;
  readonly group: string | undefined;
  readonly concurrencyKey: string | undefined;
  readonly leaseId: string;
  /** True when this delivery is the probe of a half-open circuit breaker. */
  readonly probe: boolean;
  /** Aborted when the run is cancelled: a server Cancel (lost lease, operator cancel), the
   * attempt's timeout or the task's deadline, the end of the worker's grace period, or the
   * end of the session. `signal.reason` is a `TaskCancelled` saying which. Once it is
   * aborted, what the handler returns or throws is not used. */
  readonly signal: AbortSignal;
  /** Report progress (any value the codec encodes), stored on the task and visible to
   * `getTask` while it runs. Updates are coalesced: the latest unsent value wins. */
  progress(value: unknown): Promise<void>;
}

/** A task handler: the decoded payload and the context in, the result (encoded by the
 * codec; `undefined`/`null` for none) out. */
export type Handler<P = any, R = unknown> = (payload: P, ctx: TaskContext) => R | Promise<R>;

/** The reason of an aborted `ctx.signal`. */
export class TaskCancelled extends Error {
  constructor(message: string) {
    super(message);
    this.name = "TaskCancelled";
  }
}

/** Where log lines go; each method takes an event name and fields. */
export interface Logger {
  debug(event: string, fields?: Record<string, unknown>): void;
  info(event: string, fields?: Record<string, unknown>): void;
  warn(event: string, fields?: Record<string, unknown>): void;
  error(event: string, fields?: Record<string, unknown>): void;
}

/** Pacing of reconnects: attempt n waits `initialMs * multiplier^n`, capped at `maxMs`,
 * less a random fraction of up to `jitter` of it; the count resets once a session is
 * welcomed. */
export interface ReconnectBackoff {
  initialMs: number;
  maxMs: number;
  multiplier: number;
  jitter: number;
}

export const DEFAULT_BACKOFF: ReconnectBackoff = { initialMs: 100, maxMs: 5_000, multiplier: 2, jitter: 0.2 };

export interface WorkerOptions extends ConnectionOptions {
  /** `host:port`, or `https://host:port` for TLS (default 127.0.0.1:50051). */
  target?: string;
  /** Queue name -> weight (1-1000), or queue names (weight 1 each). Default: {default: 1}. */
  queues?: Record<string, number> | string[];
  /** The most handlers run at once, across all queues (1-10,000; default 10). */
  concurrency?: number;
  /** How long a stopping worker lets running handlers finish before it aborts them and
   * gives their tasks back (default 30 s). */
  gracePeriodMs?: number;
  /** A stable name for the worker process (default `<hostname>:<pid>`). */
  workerId?: string;
  labels?: Record<string, string>;
  /** Refuse servers older than this (`X.Y.Z`; default: any). */
  minServerVersion?: string;
  /** The largest encoded result sent (default: the limit Welcome announces, else 1 MiB). */
  maxResultSize?: number;
  /** Decodes payloads, encodes results and progress (JSON by default). */
  codec?: Codec;
  reconnect?: Partial<ReconnectBackoff>;
  /** SIGTERM and SIGINT stop the worker gracefully while `run()` runs (a second signal
   * skips the grace period). Default true. */
  handleSignals?: boolean;
  logger?: Logger;
}

// ------------------------------------------------------------------ helpers

function defaultLogger(): Logger {
  const level = (process.env.CONVEYOR_LOG ?? "warn").toLowerCase();
  const order = ["debug", "info", "warn", "error"];
  const min = Math.max(0, order.indexOf(level));
  const line = (lvl: string, event: string, fields?: Record<string, unknown>) => {
    if (order.indexOf(lvl) < min) return;
    const parts = Object.entries(fields ?? {}).map(([k, v]) => `${k}=${typeof v === "string" ? v : JSON.stringify(v)}`);
    console.error(`${new Date().toISOString()} ${lvl.toUpperCase()} conveyor.worker ${event} ${parts.join(" ")}`.trimEnd());
  };
  return {
    debug: (e, f) => line("debug", e, f),
    info: (e, f) => line("info", e, f),
    warn: (e, f) => line("warn", e, f),
    error: (e, f) => line("error", e, f),
  };
}

function truncate(text: string): string {
  if (text.length <= MAX_ERROR_LEN) return text;
  const points = Array.from(text);
  return points.length <= MAX_ERROR_LEN ? text : points.slice(0, MAX_ERROR_LEN - 3).join("") + "...";
}

function errorName(err: Error): string {
  if (err.name && err.name !== "Error") return err.name;
  const ctor = (err as { constructor?: { name?: string } }).constructor?.name;
  return ctor || "Error";
}

/** `"Name: message"` (just the name when the message is empty), bounded. */
export function describeError(err: unknown): string {
  if (err instanceof Error) {
    const name = errorName(err);
    return truncate(err.message ? `${name}: ${err.message}` : name);
  }
  return truncate(String(err));
}

function retryAfterOf(err: unknown): number | undefined {
  const value = (err as { retryAfterMs?: unknown } | null)?.retryAfterMs;
  return typeof value === "number" && Number.isFinite(value) && value >= 0 ? value : undefined;
}

type Key = string;
const keyOf = (taskId: string, leaseId: string): Key => `${taskId}\u0000${leaseId}`;

function result(taskId: string, leaseId: string, outcome: WireOutcome, extra: Partial<WireResult> = {}): WireResult {
  return { task_id: taskId, lease_id: leaseId, outcome, ...extra };
}

/** The Result a handler error maps to: SkipRetry archives, an error carrying
 * `retryAfterMs` fails with that delay, anything else fails with the server's backoff. */
export function resultForError(taskId: string, leaseId: string, err: unknown): WireResult {
  if (err instanceof SkipRetry) {
    return result(taskId, leaseId, "OUTCOME_SKIP_RETRY", { error: err.message ? truncate(err.message) : describeError(err) });
  }
  const delay = retryAfterOf(err);
  return result(taskId, leaseId, "OUTCOME_FAILURE", {
    error: describeError(err),
    ...(delay === undefined ? {} : { retry_after: durationToWire(delay) }),
  });
}

interface Deferred<T> {
  promise: Promise<T>;
  resolve(value: T): void;
}

function deferred<T = void>(): Deferred<T> {
  let resolve!: (value: T) => void;
  const promise = new Promise<T>((r) => (resolve = r));
  return { promise, resolve };
}

/** Wakes everyone waiting for a change of the worker's state. */
class Changes {
  private waiters: Array<() => void> = [];
  wait(): Promise<void> {
    return new Promise<void>((resolve) => this.waiters.push(resolve));
  }
  /** Resolves at the next change, or after `ms`. */
  async waitFor(ms: number): Promise<void> {
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([this.wait(), new Promise<void>((r) => (timer = setTimeout(r, Math.max(0, ms))))]);
    clearTimeout(timer);
  }
  fire(): void {
    for (const waiter of this.waiters.splice(0)) waiter();
  }
}

// ------------------------------------------------------------------ execution

/** One delivery being run. */
class Execution {
  readonly key: Key;
  readonly controller = new AbortController();
  /** The outcome was dealt with (a Result queued, or deliberately none): nothing more is
   * sent for this delivery. */
  reported = false;
  /** The handler has returned or thrown (its local slot is free). */
  settled = false;
  private timer: NodeJS.Timeout | undefined;

  constructor(
    readonly envelope: WireTaskEnvelope,
    readonly handler: Handler,
    readonly session: Session,
  ) {
    this.key = keyOf(envelope.id, envelope.lease_id);
  }

  get taskId(): string {
    return this.envelope.id;
  }

  /** Run the handler; `onSettled` runs once the handler has returned or thrown. */
  start(codec: Codec, onSettled: (e: Execution) => void): void {
    const env = this.envelope;
    const session = this.session;
    const ctx: TaskContext = {
      taskId: env.id,
      queue: env.queue,
      type: env.type,
      attempt: env.attempt,
      maxRetry: env.max_retry,
      headers: Object.freeze({ ...env.headers }),
      timeoutMs: durationFromWire(env.timeout) || undefined,
      deadline: timestampFromWire(env.deadline),
      enqueuedAt: timestampFromWire(env.enqueued_at),
      group: env.group || undefined,
      concurrencyKey: env.concurrency_key || undefined,
      leaseId: env.lease_id,
      probe: Boolean(env.probe),
      signal: this.controller.signal,
      progress: async (value: unknown) => {
        const data = encodeValue(codec, value, "progress");
        if (!this.reported && !this.controller.signal.aborted) session.sendProgress(env.id, env.lease_id, data);
      },
    };
    const limit = this.timeLimit(ctx);
    const run = async (): Promise<WireResult | undefined> => {
      let payload: unknown;
      try {
        payload = decodeValue(codec, env.payload, "payload");
      } catch (err) {
        return result(env.id, env.lease_id, "OUTCOME_FAILURE", { error: truncate((err as Error).message) });
      }
      if (limit !== undefined && limit <= 0) {
        this.controller.abort(new TaskCancelled(TIMED_OUT));
        return result(env.id, env.lease_id, "OUTCOME_FAILURE", { error: TIMED_OUT });
      }
      if (limit !== undefined) this.timer = setTimeout(() => this.expire(), limit);
      let value: unknown;
      try {
        value = await this.handler(payload, ctx);
      } catch (err) {
        return resultForError(env.id, env.lease_id, err);
      } finally {
        if (this.timer !== undefined) clearTimeout(this.timer);
      }
      let data: Buffer;
      try {
        data = encodeValue(codec, value, "result");
      } catch (err) {
        return result(env.id, env.lease_id, "OUTCOME_FAILURE", { error: truncate((err as Error).message) });
      }
      const max = session.maxResult;
      if (data.length > max) {
        // A frame past the server's receive limit would end the whole session.
        return result(env.id, env.lease_id, "OUTCOME_FAILURE", { error: `result is ${data.length} bytes; the limit is ${max}` });
      }
      return result(env.id, env.lease_id, "OUTCOME_SUCCESS", { result: data });
    };
    run()
      .catch((err: unknown) => resultForError(env.id, env.lease_id, err))
      .then((res) => {
        this.settled = true;
        if (res !== undefined) this.report(res);
        onSettled(this);
      });
  }

  private timeLimit(ctx: TaskContext): number | undefined {
    const limits: number[] = [];
    if (ctx.timeoutMs !== undefined && ctx.timeoutMs > 0) limits.push(ctx.timeoutMs);
    if (ctx.deadline !== undefined) limits.push(ctx.deadline.getTime() - Date.now());
    return limits.length > 0 ? Math.min(...limits) : undefined;
  }

  private expire(): void {
    if (this.reported) return;
    this.report(result(this.envelope.id, this.envelope.lease_id, "OUTCOME_FAILURE", { error: TIMED_OUT }));
    this.controller.abort(new TaskCancelled(TIMED_OUT));
  }

  /** Queue this delivery's Result, once; nothing after an abort (Cancel, shutdown). */
  report(res: WireResult): void {
    if (this.reported) return;
    this.reported = true;
    this.session.send(res);
  }

  /** Stop the handler; send nothing for it (a server Cancel, a dead session). */
  abandon(reason: string): void {
    this.reported = true;
    this.session.forget(this.key);
    this.abort(reason);
  }

  /** Give the delivery back (RELEASE) and abort the handler. */
  release(reason: string): void {
    if (!this.reported) {
      this.reported = true;
      this.session.send(result(this.envelope.id, this.envelope.lease_id, "OUTCOME_RELEASE"));
    }
    this.abort(reason);
  }

  abort(reason: string): void {
    if (this.timer !== undefined) clearTimeout(this.timer);
    if (!this.controller.signal.aborted) this.controller.abort(new TaskCancelled(reason));
  }
}

// ------------------------------------------------------------------ session

type SessionEnd =
  | { graceful: true }
  | { graceful: false; code: string; details: string; welcomed: boolean };

/** One WorkerService.Session stream: handshake, frames in and out, graceful close. */
class Session {
  sessionId: string | undefined;
  /** Welcomed, and the stream not ended: Results can be sent. */
  live = false;
  maxResult: number;
  /** Deliveries of this session not answered yet (running here, or waiting). */
  private readonly holding = new Set<Key>();
  /** Deliveries taken on while every local slot was busy, oldest first. */
  private readonly waiting = new Map<Key, { envelope: WireTaskEnvelope; handler: Handler }>();
  private readonly executions = new Map<Key, Execution>();
  private readonly results: WireResult[] = [];
  private readonly progress = new Map<Key, { task_id: string; lease_id: string; progress: Buffer }>();
  private readonly control: WireWorkerFrame[] = [];
  private flushScheduled = false;
  private halfClosed = false;
  private ended = false;
  private welcomed = false;
  private draining = false;
  private concurrency: number;
  private heartbeat: NodeJS.Timeout | undefined;
  private welcomeTimer: NodeJS.Timeout | undefined;
  private call: grpc.ClientDuplexStream<WireWorkerFrame, WireServerFrame> | undefined;
  private client: grpc.Client | undefined;
  private readonly done = deferred<SessionEnd>();

  constructor(
    private readonly worker: Worker,
    private readonly endpoint: Endpoint,
  ) {
    this.maxResult = worker.maxResultSize ?? DEFAULT_MAX_RESULT;
    this.concurrency = worker.concurrency;
  }

  /** Open the stream and serve it until it ends; resolves with how it ended. */
  run(): Promise<SessionEnd> {
    const WorkerService = wire().services.WorkerService;
    const client = new WorkerService(this.endpoint.address, this.endpoint.credentials, CHANNEL_OPTIONS);
    this.client = client;
    const call = (client as unknown as {
      Session(metadata: grpc.Metadata): grpc.ClientDuplexStream<WireWorkerFrame, WireServerFrame>;
    }).Session(this.endpoint.metadata());
    this.call = call;
    call.on("data", (frame: WireServerFrame) => this.onFrame(frame));
    call.on("error", (err: grpc.ServiceError) => this.onEnd(codeName(err.code), err.details ?? err.message));
    call.on("status", (status: grpc.StatusObject) => this.onEnd(codeName(status.code), status.details ?? ""));
    this.write({ hello: this.hello() });
    this.welcomeTimer = setTimeout(() => {
      if (!this.welcomed) {
        this.onEnd("DEADLINE_EXCEEDED", "no Welcome in time");
        call.cancel();
      }
    }, WELCOME_TIMEOUT_MS);
    return this.done.promise;
  }

  hello(): WireHello {
    const w = this.worker;
    const hello: WireHello = {
      queues: { ...w.queues },
      concurrency: w.concurrency,
      labels: { ...w.labels },
      sdk_version: VERSION,
      min_server_version: w.minServerVersion,
      batch_types: [],
      worker_id: w.workerId,
      accepts_dispatches: true,
    };
    // Hello.sdk_name (field 9); a protocol version without it ignores the key.
    if (wireFeatures().sdkName) hello.sdk_name = SDK_NAME;
    return hello;
  }

  private onEnd(code: string, details: string): void {
    if (this.ended) return;
    this.ended = true;
    this.live = false;
    this.stopTimers();
    // The server released every task this session held: handlers still running here
    // would only produce Results nobody reads.
    for (const execution of this.executions.values()) {
      if (!execution.reported) execution.abandon("the session ended");
    }
    this.waiting.clear();
    this.holding.clear();
    this.client?.close();
    if (this.draining) {
      this.done.resolve({ graceful: true });
    } else {
      this.done.resolve({ graceful: false, code: code === "OK" ? "UNAVAILABLE" : code, details: details || "the server ended the stream", welcomed: this.welcomed });
    }
    this.worker.changes.fire();
  }

  private stopTimers(): void {
    if (this.heartbeat !== undefined) clearInterval(this.heartbeat);
    if (this.welcomeTimer !== undefined) clearTimeout(this.welcomeTimer);
    this.heartbeat = undefined;
    this.welcomeTimer = undefined;
  }

  // ---------------------------------------------------------------- frames in

  private onFrame(frame: WireServerFrame): void {
    if (this.ended) return;
    const kind = frame.frame;
    if (!this.welcomed) {
      if (kind !== "welcome" || !frame.welcome) {
        this.onEnd("UNKNOWN", `expected Welcome, got ${kind}`);
        this.call?.cancel();
        return;
      }
      this.onWelcome(frame.welcome);
      return;
    }
    this.worker.log.debug("worker.frame", { kind, tasks: frame.dispatches?.tasks.length });
    switch (kind) {
      case "dispatch":
        if (frame.dispatch?.task) this.onDispatch(frame.dispatch.task);
        break;
      case "dispatches":
        // Exactly the same tasks as consecutive Dispatch frames: each checked on its own.
        for (const envelope of frame.dispatches?.tasks ?? []) this.onDispatch(envelope);
        break;
      case "cancel":
        if (frame.cancel) this.onCancel(frame.cancel);
        break;
      case "batch_dispatch":
        if (frame.batch_dispatch) this.onBatchDispatch(frame.batch_dispatch);
        break;
      case "ping":
        break; // keepalive: no answer
      default:
        this.worker.log.debug("worker.frame_ignored", { kind });
    }
  }

  private onWelcome(welcome: WireWelcome): void {
    this.welcomed = true;
    this.live = true;
    if (this.welcomeTimer !== undefined) clearTimeout(this.welcomeTimer);
    this.sessionId = welcome.session_id;
    const announced = Number(welcome.max_result);
    if (this.worker.maxResultSize === undefined && announced > 0) this.maxResult = announced;
    let interval = durationFromWire(welcome.heartbeat_interval);
    if (!interval) {
      const ttl = durationFromWire(welcome.lease_ttl);
      interval = ttl ? ttl / 3 : DEFAULT_HEARTBEAT_MS;
    }
    this.heartbeat = setInterval(() => this.queueControl({ heartbeat: {} }), Math.max(interval, 10));
    this.worker.log.info("worker.session_started", {
      session_id: welcome.session_id,
      server_version: welcome.server_version,
      concurrency: this.concurrency,
    });
    if (this.worker.stopping) void this.drain();
  }

  private onDispatch(envelope: WireTaskEnvelope): void {
    const { id, lease_id: leaseId } = envelope;
    if (!id || !leaseId) {
      this.worker.log.warn("worker.dispatch_malformed", { task_id: id });
      return;
    }
    if (this.halfClosed) {
      // Nothing can be written any more; the server releases what the session holds
      // when the stream ends.
      return;
    }
    const key = keyOf(id, leaseId);
    if (this.worker.stopping) {
      this.send(result(id, leaseId, "OUTCOME_RELEASE"));
      return;
    }
    if (this.holding.has(key)) {
      this.worker.log.warn("worker.dispatch_duplicate", { task_id: id, lease_id: leaseId });
      return;
    }
    if (this.holding.size >= this.concurrency) {
      this.worker.log.warn("worker.dispatch_over_capacity", { task_id: id, held: this.holding.size, concurrency: this.concurrency });
      this.send(result(id, leaseId, "OUTCOME_RELEASE"));
      return;
    }
    const handler = this.worker.handlerFor(envelope.type);
    if (handler === undefined) {
      this.worker.log.warn("worker.no_handler", { task_id: id, type: envelope.type });
      this.send(result(id, leaseId, "OUTCOME_FAILURE", { error: `no handler for type ${envelope.type}` }));
      return;
    }
    this.holding.add(key);
    if (this.worker.full) {
      this.worker.log.info("worker.dispatch_waiting", { task_id: id });
      this.waiting.set(key, { envelope, handler });
    } else {
      this.start(envelope, handler);
    }
  }

  private start(envelope: WireTaskEnvelope, handler: Handler): void {
    const execution = new Execution(envelope, handler, this);
    this.executions.set(execution.key, execution);
    this.worker.started(execution);
  }

  /** A local slot freed: start the oldest waiting dispatch. */
  slotFreed(): void {
    while (this.waiting.size > 0 && !this.worker.full && this.live) {
      const [key, entry] = this.waiting.entries().next().value as [Key, { envelope: WireTaskEnvelope; handler: Handler }];
      this.waiting.delete(key);
      if (this.worker.stopping) {
        this.send(result(entry.envelope.id, entry.envelope.lease_id, "OUTCOME_RELEASE"));
      } else {
        this.start(entry.envelope, entry.handler);
      }
    }
  }

  settled(execution: Execution): void {
    this.executions.delete(execution.key);
    this.holding.delete(execution.key);
  }

  private onCancel(cancel: WireCancel): void {
    const key = keyOf(cancel.task_id, cancel.lease_id);
    if (this.waiting.delete(key)) {
      this.holding.delete(key);
      return;
    }
    let execution = this.executions.get(key);
    if (execution === undefined && !cancel.lease_id) {
      execution = [...this.executions.values()].find((e) => e.taskId === cancel.task_id);
    }
    if (execution === undefined) {
      this.worker.log.debug("worker.cancel_unknown", { task_id: cancel.task_id });
      return;
    }
    this.worker.log.info("worker.cancel", { task_id: cancel.task_id, reason: cancel.reason });
    execution.abandon(cancel.reason ? `cancelled by the server: ${cancel.reason}` : "cancelled by the server");
  }

  private onBatchDispatch(batch: WireBatchDispatch): void {
    // This SDK declares no batch types (Hello.batch_types is empty).
    this.worker.log.warn("worker.batch_dispatch_unsupported", { type: batch.type, n: batch.tasks.length });
    for (const envelope of batch.tasks) {
      this.send(result(envelope.id, envelope.lease_id, "OUTCOME_FAILURE", { error: `this worker does not accept batches of type ${batch.type}` }));
    }
  }

  // ---------------------------------------------------------------- frames out

  /** Queue a Result, unless the session can no longer send it. */
  send(res: WireResult): void {
    this.forget(keyOf(res.task_id, res.lease_id));
    this.worker.changes.fire();
    if (!this.live || this.halfClosed) return;
    this.results.push(res);
    this.scheduleFlush();
  }

  forget(key: Key): void {
    this.holding.delete(key);
  }

  sendProgress(taskId: string, leaseId: string, data: Buffer): void {
    if (!this.live || this.halfClosed) return;
    this.progress.set(keyOf(taskId, leaseId), { task_id: taskId, lease_id: leaseId, progress: data });
    this.scheduleFlush();
  }

  private queueControl(frame: WireWorkerFrame): void {
    if (!this.live || this.halfClosed) return;
    this.control.push(frame);
    this.scheduleFlush();
  }

  private scheduleFlush(): void {
    if (this.flushScheduled) return;
    this.flushScheduled = true;
    // Results that finish in the same turn of the event loop share one BatchResult.
    setImmediate(() => this.flush());
  }

  private flush(): void {
    this.flushScheduled = false;
    if (this.ended || this.halfClosed) return;
    for (const frame of this.control.splice(0)) this.write(frame);
    for (const progress of this.progress.values()) this.write({ progress });
    this.progress.clear();
    const results = this.results.splice(0);
    if (results.length === 1) this.write({ result: results[0]! });
    else if (results.length > 1) this.write({ batch_result: { results } });
  }

  private write(frame: WireWorkerFrame): void {
    if (this.ended || this.halfClosed || this.call === undefined) return;
    try {
      this.call.write(frame);
    } catch (err) {
      this.worker.log.error("worker.write_failed", { error: describeError(err) });
    }
  }

  // ---------------------------------------------------------------- shutdown

  /** Graceful shutdown of this session: Drain, let running handlers finish within the
   * grace period, RELEASE the rest, half-close, and wait for the server to end the stream. */
  async drain(): Promise<void> {
    if (this.draining || this.ended) return;
    this.draining = true;
    if (!this.welcomed) {
      // Stopped before Welcome: nothing is held; end the call.
      this.call?.cancel();
      return;
    }
    if (wireFeatures().drain) {
      this.queueControl({ drain: {} });
    } else {
      this.worker.log.debug("worker.drain_unsupported", { reason: "the loaded protos have no WorkerFrame.drain" });
    }
    for (const [key, entry] of [...this.waiting]) {
      this.waiting.delete(key);
      this.send(result(entry.envelope.id, entry.envelope.lease_id, "OUTCOME_RELEASE"));
    }
    await this.worker.graceOver(() => this.ended || [...this.executions.values()].every((e) => e.reported));
    for (const execution of this.executions.values()) {
      if (!execution.reported) execution.release("the worker is shutting down");
    }
    if (this.ended) return;
    this.flush();
    this.halfClosed = true;
    this.stopTimers();
    this.call?.end();
    // The server ends the stream (status OK) once it has seen the half-close; that
    // resolves `done` through onEnd.
    let timer: NodeJS.Timeout | undefined;
    await Promise.race([this.done.promise, new Promise<void>((r) => (timer = setTimeout(r, CLOSE_TIMEOUT_MS)))]);
    clearTimeout(timer);
    if (!this.ended) {
      this.call?.cancel();
      this.onEnd("CANCELLED", "no end of stream after the half-close");
    }
    this.worker.log.info("worker.session_closed", { session_id: this.sessionId });
  }
}

// ------------------------------------------------------------------ worker

/**
 * Runs task handlers for the tasks the server pushes to it.
 *
 * ```ts
 * const worker = new Worker({ queues: { emails: 3, reports: 1 }, concurrency: 8 });
 * worker.task("email.send", async (payload, ctx) => {
 *   await ctx.progress({ step: "sending" });
 *   return { deliveredTo: payload.to };
 * });
 * await worker.run(); // until SIGTERM/SIGINT or worker.stop()
 * ```
 *
 * A handler's return value is the task's result. Throwing `SkipRetry` archives the task
 * at once; `RetryAfter(ms)` (or any error with a numeric `retryAfterMs`) retries after that
 * delay; any other error fails the attempt (retried with the server's backoff until
 * `maxRetry` is exhausted).
 */
export class Worker {
  readonly target: string;
  readonly queues: Readonly<Record<string, number>>;
  readonly concurrency: number;
  readonly gracePeriodMs: number;
  readonly workerId: string;
  readonly labels: Readonly<Record<string, string>>;
  readonly minServerVersion: string;
  readonly maxResultSize: number | undefined;
  readonly codec: Codec;
  readonly log: Logger;
  private readonly backoff: ReconnectBackoff;
  private readonly handleSignals: boolean;
  private readonly endpoint: Endpoint;
  private readonly handlers = new Map<string, Handler>();
  /** Executions whose handler has not returned yet (they hold the local slots). */
  private readonly running = new Set<Execution>();
  /** @internal fired whenever a handler returns, a session ends, or a stop is asked for. */
  readonly changes = new Changes();
  private session: Session | undefined;
  private runPromise: Promise<void> | undefined;
  private stopRequested = false;
  private force = false;

  constructor(options: WorkerOptions = {}) {
    this.target = options.target ?? DEFAULT_TARGET;
    this.endpoint = endpoint(this.target, options);
    this.queues = Object.freeze(queueWeights(options.queues ?? { default: 1 }));
    const concurrency = options.concurrency ?? 10;
    if (!Number.isInteger(concurrency) || concurrency < 1 || concurrency > MAX_CONCURRENCY) {
      throw new InvalidArgument(`concurrency must be an integer in 1..${MAX_CONCURRENCY}, got ${concurrency}`);
    }
    this.concurrency = concurrency;
    const grace = options.gracePeriodMs ?? 30_000;
    if (typeof grace !== "number" || !(grace >= 0)) throw new InvalidArgument("gracePeriodMs must be >= 0");
    this.gracePeriodMs = grace;
    const workerId = options.workerId ?? `${hostname()}:${process.pid}`.slice(-MAX_WORKER_ID_LEN);
    if (typeof workerId !== "string" || workerId.length > MAX_WORKER_ID_LEN) {
      throw new InvalidArgument(`workerId must be a string of at most ${MAX_WORKER_ID_LEN} characters`);
    }
    checkText("workerId", workerId);
    this.workerId = workerId;
    this.labels = Object.freeze(checkLabels(options.labels ?? {}));
    const minServerVersion = options.minServerVersion ?? "";
    if (typeof minServerVersion !== "string" || minServerVersion.length > MAX_VERSION_LEN) {
      throw new InvalidArgument(`minServerVersion must be a string of at most ${MAX_VERSION_LEN} characters`);
    }
    checkText("minServerVersion", minServerVersion);
    this.minServerVersion = minServerVersion;
    if (options.maxResultSize !== undefined && !(Number.isInteger(options.maxResultSize) && options.maxResultSize >= 0)) {
      throw new InvalidArgument(`maxResultSize must be an integer >= 0, got ${options.maxResultSize}`);
    }
    this.maxResultSize = options.maxResultSize;
    this.codec = options.codec ?? new JsonCodec();
    this.log = options.logger ?? defaultLogger();
    this.backoff = { ...DEFAULT_BACKOFF, ...(options.reconnect ?? {}) };
    const b = this.backoff;
    if (!(b.initialMs > 0 && b.initialMs <= b.maxMs) || !(b.multiplier >= 1) || !(b.jitter >= 0 && b.jitter < 1)) {
      throw new InvalidArgument("reconnect needs 0 < initialMs <= maxMs, multiplier >= 1, 0 <= jitter < 1");
    }
    this.handleSignals = options.handleSignals ?? true;
  }

  // ---------------------------------------------------------------- registry

  /** Register `handler` for task type `type`; returns the worker (chainable). */
  task<P = any, R = unknown>(type: string, handler: Handler<P, R>): this {
    if (typeof type !== "string" || type === "") throw new InvalidArgument("task type must be a non-empty string");
    if (typeof handler !== "function") throw new TypeError(`the handler of '${type}' is not a function`);
    if (this.handlers.has(type)) throw new InvalidArgument(`task type '${type}' already has a handler`);
    this.handlers.set(type, handler as Handler);
    return this;
  }

  /** The task types this worker has handlers for. */
  get taskTypes(): string[] {
    return [...this.handlers.keys()].sort();
  }

  /** How many handlers are running right now. */
  get runningCount(): number {
    return this.running.size;
  }

  /** The id of the current session, or undefined while disconnected. */
  get sessionId(): string | undefined {
    return this.session?.live ? this.session.sessionId : undefined;
  }

  /** True once shutdown began. */
  get stopping(): boolean {
    return this.stopRequested;
  }

  /** @internal */
  handlerFor(type: string): Handler | undefined {
    return this.handlers.get(type);
  }

  /** @internal every local slot is busy. */
  get full(): boolean {
    return this.running.size >= this.concurrency;
  }

  // ---------------------------------------------------------------- lifecycle

  /** Serve tasks until `stop()` (or SIGTERM/SIGINT); reconnect when the stream breaks.
   * Resolves after the graceful shutdown. Rejects with InvalidArgument,
   * FailedPrecondition, Unauthenticated or PermissionDenied when the server refuses the
   * session: those do not heal by retrying. */
  run(): Promise<void> {
    if (this.runPromise !== undefined) return Promise.reject(new Error("this worker is already running"));
    const onSignal = (signal: NodeJS.Signals) => {
      this.log.info("worker.signal", { signal });
      void this.stop({ force: this.stopRequested });
    };
    if (this.handleSignals) {
      process.on("SIGTERM", onSignal);
      process.on("SIGINT", onSignal);
    }
    if (this.handlers.size === 0) this.log.warn("worker.no_handlers", { worker_id: this.workerId });
    this.log.info("worker.start", { worker_id: this.workerId, queues: this.queues, concurrency: this.concurrency, types: this.taskTypes.join(",") });
    const promise = this.serve().finally(async () => {
      await this.unwind();
      if (this.handleSignals) {
        process.off("SIGTERM", onSignal);
        process.off("SIGINT", onSignal);
      }
      this.runPromise = undefined;
      this.stopRequested = false;
      this.force = false;
      this.log.info("worker.stopped", { worker_id: this.workerId });
    });
    this.runPromise = promise;
    return promise;
  }

  /** Shut down gracefully: send Drain, answer new dispatches with RELEASE, let running
   * handlers finish within the grace period, then abort the rest and give their tasks
   * back, half-close the stream. Resolves once `run()` has finished. `force` skips the
   * grace period. */
  stop(options: { force?: boolean } = {}): Promise<void> {
    const running = this.runPromise;
    if (running === undefined) return Promise.resolve();
    if (options.force) this.force = true;
    const first = !this.stopRequested;
    this.stopRequested = true;
    if (first) {
      this.log.info("worker.stopping", { worker_id: this.workerId, force: this.force });
      void this.session?.drain();
    }
    this.changes.fire();
    return running.then(
      () => undefined,
      () => undefined,
    );
  }

  private async serve(): Promise<void> {
    let attempt = 0;
    while (!this.stopRequested) {
      // Handlers of a broken session keep their local slots until they return; a new
      // session while they fill every slot would only take tasks to hold idle.
      while (this.full && !this.stopRequested) await this.changes.wait();
      if (this.stopRequested) return;
      const session = new Session(this, this.endpoint);
      this.session = session;
      const end = await session.run();
      this.session = undefined;
      if (end.graceful) return;
      if (this.stopRequested) return;
      if (FATAL_CODES.has(end.code)) {
        this.log.error("worker.session_refused", { code: end.code, details: end.details });
        throw errorFromStatus(end.code, `the server refused the worker session: ${end.details}`);
      }
      if (end.welcomed) attempt = 0;
      const delay = this.reconnectDelay(attempt);
      attempt += 1;
      const details = end.code === "UNAVAILABLE" ? this.endpoint.explain(end.details) : end.details;
      this.log.warn("worker.disconnected", { code: end.code, details, retry_in_ms: Math.round(delay) });
      await this.sleepUnlessStopped(delay);
    }
  }

  private reconnectDelay(attempt: number): number {
    const b = this.backoff;
    const base = Math.min(b.initialMs * b.multiplier ** Math.min(attempt, 64), b.maxMs);
    return base * (1 - b.jitter * Math.random());
  }

  private async sleepUnlessStopped(ms: number): Promise<void> {
    const deadline = Date.now() + ms;
    while (!this.stopRequested && Date.now() < deadline) await this.changes.waitFor(deadline - Date.now());
  }

  /** Abort what still runs (after a graceful close: handlers past the grace period, or
   * of a session that ended) and give them a moment to return. */
  private async unwind(): Promise<void> {
    for (const execution of this.running) execution.abort("the worker stopped");
    const deadline = Date.now() + UNWIND_TIMEOUT_MS;
    while (this.running.size > 0 && Date.now() < deadline) await this.changes.waitFor(deadline - Date.now());
  }

  /** @internal resolves once `done()` holds or the grace period is over (at once when
   * forced); checks again at every change. */
  async graceOver(done: () => boolean): Promise<void> {
    const deadline = Date.now() + this.gracePeriodMs;
    while (!done() && !this.force && Date.now() < deadline) await this.changes.waitFor(deadline - Date.now());
  }

  /** @internal start a delivery in a local slot. */
  started(execution: Execution): void {
    this.running.add(execution);
    execution.start(this.codec, (e) => {
      this.running.delete(e);
      e.session.settled(e);
      this.session?.slotFreed();
      this.changes.fire();
    });
  }
}

function queueWeights(queues: Record<string, number> | string[]): Record<string, number> {
  const weights: Record<string, number> = Array.isArray(queues)
    ? Object.fromEntries(queues.map((q) => [q, 1]))
    : { ...queues };
  const names = Object.keys(weights);
  if (names.length === 0) throw new InvalidArgument("a worker needs at least one queue");
  if (names.length > MAX_HELLO_QUEUES) {
    throw new InvalidArgument(`a worker serves at most ${MAX_HELLO_QUEUES} queues, got ${names.length}`);
  }
  for (const [name, weight] of Object.entries(weights)) {
    if (!isQueueName(name)) throw new InvalidArgument(`invalid queue name '${name}'`);
    if (!Number.isInteger(weight) || weight < 1 || weight > MAX_QUEUE_WEIGHT) {
      throw new InvalidArgument(`weight of queue '${name}' must be an integer in 1..${MAX_QUEUE_WEIGHT}, got ${weight}`);
    }
  }
  return weights;
}

function checkLabels(labels: Record<string, string>): Record<string, string> {
  const entries = Object.entries(labels);
  if (entries.length > MAX_LABELS) throw new InvalidArgument(`at most ${MAX_LABELS} labels, got ${entries.length}`);
  for (const [key, value] of entries) {
    if (typeof value !== "string") throw new InvalidArgument("labels must map strings to strings");
    if (key.length === 0 || key.length > MAX_LABEL_KEY_LEN) {
      throw new InvalidArgument(`label key '${key}' must be 1-${MAX_LABEL_KEY_LEN} characters`);
    }
    if (value.length > MAX_LABEL_VALUE_LEN) {
      throw new InvalidArgument(`label '${key}' is longer than ${MAX_LABEL_VALUE_LEN} characters`);
    }
    checkText("a label key", key);
    checkText(`label '${key}'`, value);
  }
  return { ...labels };
}
