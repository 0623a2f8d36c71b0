// The SDK's public data model, the input rules it checks before sending anything, and
// their wire forms.

import { type Codec, encodeValue } from "./codec.js";
import { CodecError, InvalidArgument } from "./errors.js";
import {
  type WireNewTask,
  type WireOnFailure,
  type WireTask,
  type WireTaskOptions,
  type WireTaskState,
  durationFromWire,
  durationToWire,
  timestampFromWire,
  timestampToWire,
} from "./wire.js";

/** Where a task is in its lifecycle. Waiting: pending, scheduled, aggregating, blocked,
 * held, retry. Running: active. Terminal: completed, archived, canceled. `unknown`: a state
 * this SDK version does not know (a newer server). */
export type TaskState =
  | "pending"
  | "scheduled"
  | "aggregating"
  | "blocked"
  | "held"
  | "active"
  | "retry"
  | "completed"
  | "archived"
  | "canceled"
  | "unknown";

export const TERMINAL_STATES: ReadonlySet<TaskState> = new Set(["completed", "archived", "canceled"]);

/** True for states a task never leaves on its own. */
export function isTerminal(state: TaskState): boolean {
  return TERMINAL_STATES.has(state);
}

/** What a dependent task does when one of its dependencies fails for good. */
export type OnFailure = "block" | "continue" | "cascade_cancel";

/** How a task is run; every field is optional. Durations are in milliseconds. */
export interface TaskOptions {
  /** Retries after the first attempt (unset: the server default). */
  maxRetry?: number;
  /** Bound on each attempt. */
  timeoutMs?: number;
  /** Absolute deadline of the whole task, across attempts. */
  deadline?: Date;
  /** Run no earlier than this instant (exclusive with processInMs). */
  processAt?: Date;
  /** Run no earlier than this long after enqueue. */
  processInMs?: number;
  /** A task still waiting at this instant is archived. */
  expiresAt?: Date;
  /** How long a completed task is kept before it is purged. */
  retentionMs?: number;
  /** At most one incomplete task per queue and key. */
  uniqueKey?: string;
  /** How long the unique claim lasts at most (needs uniqueKey). */
  uniqueTtlMs?: number;
  /** Aggregation group. */
  group?: string;
  /** Task ids this task waits for. */
  dependsOn?: string[];
  onFailure?: OnFailure;
  /** Tasks sharing a concurrency key are limited per queue. */
  concurrencyKey?: string;
}

/** The options of `Client.enqueue`: where the task goes, its id and headers, and how it
 * is run. */
export interface EnqueueOptions extends TaskOptions {
  /** The queue (default "default"). */
  queue?: string;
  /** A ULID; enqueue is idempotent on it. */
  id?: string;
  /** Free-form string pairs passed to the handler. */
  headers?: Record<string, string>;
}

/** One task of `Client.enqueueBatch`. */
export interface TaskSpec extends EnqueueOptions {
  type: string;
  payload?: unknown;
}

/** A stored task as read back; payload, progress and result decoded by the client's codec
 * (`null` when absent). */
export interface TaskInfo {
  id: string;
  queue: string;
  type: string;
  state: TaskState;
  payload: unknown;
  headers: Record<string, string>;
  options: TaskOptions;
  /** The effective value. */
  maxRetry: number;
  /** How many retries have happened. */
  retried: number;
  progress: unknown;
  result: unknown;
  lastError: string | null;
  createdAt?: Date;
  updatedAt?: Date;
  startedAt?: Date;
  completedAt?: Date;
  nextProcessAt?: Date;
  leaseExpiresAt?: Date;
}

/** One item of `enqueueBatch`: the task, or the error for that item (not thrown). */
export interface EnqueueResult {
  task: TaskInfo | null;
  /** False when a task with the same id already existed. */
  created: boolean;
  error: Error | null;
}

// ------------------------------------------------------------------ limits

export const QUEUE_RE = /^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$/;
// Controls (C0, DEL, C1) and lone surrogates: no text field may hold them.
// eslint-disable-next-line no-control-regex
const CONTROL_RE = /[\u0000-\u001f\u007f-\u009f]|[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/;
export const MAX_TYPE_LEN = 256;
export const MAX_KEY_LEN = 256;
export const MAX_BATCH = 1000;
export const MAX_HELLO_QUEUES = 1000;
export const MAX_QUEUE_WEIGHT = 1000;
export const MAX_CONCURRENCY = 10_000;
export const MAX_LABELS = 16;
export const MAX_LABEL_KEY_LEN = 64;
export const MAX_LABEL_VALUE_LEN = 256;
export const MAX_WORKER_ID_LEN = 256;
export const MAX_VERSION_LEN = 64;

export function isQueueName(name: unknown): name is string {
  return typeof name === "string" && QUEUE_RE.test(name);
}

export function checkText(name: string, value: string): void {
  const found = CONTROL_RE.exec(value);
  if (found) {
    const code = found[0].codePointAt(0)!.toString(16).padStart(4, "0").toUpperCase();
    throw new InvalidArgument(
      `${name} contains the control character U+${code} at index ${found.index}: text fields may not hold U+0000-U+001F or U+007F-U+009F`,
    );
  }
}

function checkDuration(name: string, value: number | undefined, allowZero = false): void {
  if (value === undefined) return;
  if (typeof value !== "number" || !Number.isFinite(value) || value < 0 || (value === 0 && !allowZero)) {
    throw new InvalidArgument(`${name} must be a number of milliseconds ${allowZero ? ">= 0" : "> 0"}, got ${value}`);
  }
}

function checkInstant(name: string, value: Date | undefined): void {
  if (value === undefined) return;
  if (!(value instanceof Date) || Number.isNaN(value.getTime())) {
    throw new InvalidArgument(`${name} must be a valid Date`);
  }
}

function checkKey(name: string, value: string | undefined): void {
  if (value === undefined) return;
  if (typeof value !== "string" || value.length === 0 || value.length > MAX_KEY_LEN) {
    throw new InvalidArgument(`${name} must be a string of 1-${MAX_KEY_LEN} characters`);
  }
  checkText(name, value);
}

const ON_FAILURE_TO_WIRE: Record<OnFailure, WireOnFailure> = {
  block: "ON_FAILURE_BLOCK",
  continue: "ON_FAILURE_CONTINUE",
  cascade_cancel: "ON_FAILURE_CASCADE_CANCEL",
};

/** Checks a spec the way the Python SDK's `spec()` does; throws InvalidArgument. */
export function checkSpec(spec: TaskSpec): void {
  if (typeof spec.type !== "string" || spec.type.length === 0 || spec.type.length > MAX_TYPE_LEN) {
    throw new InvalidArgument(`task type must be a string of 1-${MAX_TYPE_LEN} characters`);
  }
  checkText("task type", spec.type);
  const queue = spec.queue ?? "default";
  if (!isQueueName(queue)) {
    throw new InvalidArgument(
      `invalid queue name '${queue}': 1-128 ASCII letters, digits, '_' or '-', starting with a letter or digit`,
    );
  }
  if (spec.id !== undefined && (typeof spec.id !== "string" || spec.id === "")) {
    throw new InvalidArgument("id must be a non-empty string (a ULID) or undefined");
  }
  for (const [key, value] of Object.entries(spec.headers ?? {})) {
    if (key === "" || typeof value !== "string") {
      throw new InvalidArgument("headers must map non-empty strings to strings");
    }
    checkText("a header key", key);
    checkText(`header '${key}'`, value);
  }
  if (spec.maxRetry !== undefined && (!Number.isInteger(spec.maxRetry) || spec.maxRetry < 0)) {
    throw new InvalidArgument(`maxRetry must be an integer >= 0, got ${spec.maxRetry}`);
  }
  checkDuration("timeoutMs", spec.timeoutMs);
  checkDuration("processInMs", spec.processInMs, true);
  checkDuration("retentionMs", spec.retentionMs, true);
  checkDuration("uniqueTtlMs", spec.uniqueTtlMs);
  checkInstant("deadline", spec.deadline);
  checkInstant("processAt", spec.processAt);
  checkInstant("expiresAt", spec.expiresAt);
  if (spec.processAt !== undefined && spec.processInMs !== undefined) {
    throw new InvalidArgument("processAt and processInMs are exclusive");
  }
  checkKey("uniqueKey", spec.uniqueKey);
  checkKey("group", spec.group);
  checkKey("concurrencyKey", spec.concurrencyKey);
  if (spec.uniqueTtlMs !== undefined && spec.uniqueKey === undefined) {
    throw new InvalidArgument("uniqueTtlMs needs a uniqueKey");
  }
  if (spec.dependsOn !== undefined) {
    if (!Array.isArray(spec.dependsOn) || !spec.dependsOn.every((d) => typeof d === "string" && d !== "")) {
      throw new InvalidArgument("dependsOn must be an array of task ids");
    }
  }
  if (spec.onFailure !== undefined && !(spec.onFailure in ON_FAILURE_TO_WIRE)) {
    throw new InvalidArgument(`onFailure must be one of block, continue, cascade_cancel, got '${spec.onFailure}'`);
  }
}

// ------------------------------------------------------------------ wire forms

export function optionsToWire(o: TaskOptions): WireTaskOptions {
  const wire: WireTaskOptions = {
    depends_on: [...(o.dependsOn ?? [])],
    on_failure: ON_FAILURE_TO_WIRE[o.onFailure ?? "block"],
  };
  if (o.maxRetry !== undefined) wire.max_retry = o.maxRetry;
  if (o.timeoutMs !== undefined) wire.timeout = durationToWire(o.timeoutMs);
  if (o.processInMs !== undefined) wire.process_in = durationToWire(o.processInMs);
  if (o.retentionMs !== undefined) wire.retention = durationToWire(o.retentionMs);
  if (o.uniqueTtlMs !== undefined) wire.unique_ttl = durationToWire(o.uniqueTtlMs);
  if (o.deadline !== undefined) wire.deadline = timestampToWire(o.deadline);
  if (o.processAt !== undefined) wire.process_at = timestampToWire(o.processAt);
  if (o.expiresAt !== undefined) wire.expires_at = timestampToWire(o.expiresAt);
  if (o.uniqueKey !== undefined) wire.unique_key = o.uniqueKey;
  if (o.group !== undefined) wire.group = o.group;
  if (o.concurrencyKey !== undefined) wire.concurrency_key = o.concurrencyKey;
  return wire;
}

const ON_FAILURE_FROM_WIRE: Partial<Record<WireOnFailure, OnFailure>> = {
  ON_FAILURE_BLOCK: "block",
  ON_FAILURE_CONTINUE: "continue",
  ON_FAILURE_CASCADE_CANCEL: "cascade_cancel",
};

export function optionsFromWire(w: WireTaskOptions | null | undefined): TaskOptions {
  if (!w) return {};
  const o: TaskOptions = {};
  if (w.max_retry !== undefined && w.max_retry !== null) o.maxRetry = w.max_retry;
  const set = <K extends keyof TaskOptions>(key: K, value: TaskOptions[K] | undefined) => {
    if (value !== undefined) o[key] = value;
  };
  set("timeoutMs", durationFromWire(w.timeout));
  set("processInMs", durationFromWire(w.process_in));
  set("retentionMs", durationFromWire(w.retention));
  set("uniqueTtlMs", durationFromWire(w.unique_ttl));
  set("deadline", timestampFromWire(w.deadline));
  set("processAt", timestampFromWire(w.process_at));
  set("expiresAt", timestampFromWire(w.expires_at));
  if (w.unique_key) o.uniqueKey = w.unique_key;
  if (w.group) o.group = w.group;
  if (w.concurrency_key) o.concurrencyKey = w.concurrency_key;
  if (w.depends_on && w.depends_on.length > 0) o.dependsOn = [...w.depends_on];
  const onFailure = w.on_failure ? ON_FAILURE_FROM_WIRE[w.on_failure] : undefined;
  if (onFailure !== undefined && onFailure !== "block") o.onFailure = onFailure;
  return o;
}

export function specToWire(spec: TaskSpec, codec: Codec): WireNewTask {
  checkSpec(spec);
  let payload: Buffer;
  try {
    payload = encodeValue(codec, spec.payload, `payload of '${spec.type}'`);
  } catch (err) {
    throw new InvalidArgument((err as Error).message);
  }
  return {
    id: spec.id ?? "",
    queue: spec.queue ?? "default",
    type: spec.type,
    payload,
    headers: { ...(spec.headers ?? {}) },
    options: optionsToWire(spec),
  };
}

const STATE_FROM_WIRE: Partial<Record<WireTaskState, TaskState>> = {
  TASK_STATE_PENDING: "pending",
  TASK_STATE_SCHEDULED: "scheduled",
  TASK_STATE_AGGREGATING: "aggregating",
  TASK_STATE_BLOCKED: "blocked",
  TASK_STATE_HELD: "held",
  TASK_STATE_ACTIVE: "active",
  TASK_STATE_RETRY: "retry",
  TASK_STATE_COMPLETED: "completed",
  TASK_STATE_ARCHIVED: "archived",
  TASK_STATE_CANCELED: "canceled",
};

export function stateFromWire(state: WireTaskState | string): TaskState {
  return STATE_FROM_WIRE[state as WireTaskState] ?? "unknown";
}

function decodeField(codec: Codec, data: Buffer, what: string, id: string): unknown {
  if (data.length === 0) return null;
  try {
    return codec.decode(data);
  } catch (err) {
    const e = err as Error;
    throw new CodecError(`cannot decode the ${what} of task '${id}': ${e.name}: ${e.message}`);
  }
}

export function taskFromWire(t: WireTask, codec: Codec): TaskInfo {
  const info: TaskInfo = {
    id: t.id,
    queue: t.queue,
    type: t.type,
    state: stateFromWire(t.state),
    payload: decodeField(codec, t.payload, "payload", t.id),
    headers: { ...t.headers },
    options: optionsFromWire(t.options),
    maxRetry: t.max_retry,
    retried: t.retried,
    progress: decodeField(codec, t.progress, "progress", t.id),
    result: decodeField(codec, t.result, "result", t.id),
    lastError: t.last_error || null,
  };
  const times = {
    createdAt: t.created_at,
    updatedAt: t.updated_at,
    startedAt: t.started_at,
    completedAt: t.completed_at,
    nextProcessAt: t.next_process_at,
    leaseExpiresAt: t.lease_expires_at,
  } as const;
  for (const [key, value] of Object.entries(times)) {
    const date = timestampFromWire(value);
    if (date !== undefined) info[key as keyof typeof times] = date;
  }
  return info;
}
