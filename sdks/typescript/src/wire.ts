// The wire contract: protos/conveyor/v1/*.proto loaded at run time with
// @grpc/proto-loader (the build copies them into dist/protos), and TypeScript shapes of
// the messages this SDK reads and writes (keepCase: field names as in the .proto files).
//
// Fields this SDK knows about but the loaded protos may predate (Hello.sdk_name,
// WorkerFrame.drain) are probed on the loaded descriptors: see `wireFeatures`.

import { existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

const here = dirname(fileURLToPath(import.meta.url));

/** Where the .proto files are: `CONVEYOR_PROTO_DIR`, else the copy the build made. */
export function protoRoot(): string {
  const candidates = [
    process.env.CONVEYOR_PROTO_DIR,
    join(here, "protos"), // dist/protos, made by scripts/copy-protos.mjs
  ].filter((dir): dir is string => Boolean(dir));
  for (const dir of candidates) {
    if (existsSync(join(dir, "conveyor", "v1", "service.proto"))) return dir;
  }
  throw new Error(
    `conveyor: the protos are missing (looked in ${candidates.join(", ")}); run \`npm run build\``,
  );
}

const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: true,
  longs: String,
  enums: String,
  defaults: true,
  oneofs: true,
};

interface Loaded {
  definition: protoLoader.PackageDefinition;
  services: {
    TaskService: grpc.ServiceClientConstructor;
    WorkerService: grpc.ServiceClientConstructor;
    AdminService: grpc.ServiceClientConstructor;
  };
}

let loaded: Loaded | undefined;

/** The loaded protos (loaded once per process). */
export function wire(): Loaded {
  if (loaded !== undefined) return loaded;
  const root = protoRoot();
  const definition = protoLoader.loadSync(
    [join(root, "conveyor", "v1", "service.proto"), join(root, "conveyor", "v1", "task.proto")],
    { ...LOADER_OPTIONS, includeDirs: [root] },
  );
  const pkg = grpc.loadPackageDefinition(definition) as unknown as {
    conveyor: { v1: Record<string, grpc.ServiceClientConstructor> };
  };
  const v1 = pkg.conveyor.v1;
  loaded = {
    definition,
    services: {
      TaskService: v1.TaskService!,
      WorkerService: v1.WorkerService!,
      AdminService: v1.AdminService!,
    },
  };
  return loaded;
}

function hasField(message: string, field: string): boolean {
  const type = wire().definition[`conveyor.v1.${message}`] as
    | { type?: { field?: Array<{ name?: string }> } }
    | undefined;
  return Boolean(type?.type?.field?.some((f) => f.name === field));
}

/** Protocol additions present in the loaded protos. */
export interface WireFeatures {
  /** `Hello.sdk_name` (field 9). */
  sdkName: boolean;
  /** `WorkerFrame.drain` (field 7). */
  drain: boolean;
}

let features: WireFeatures | undefined;

export function wireFeatures(): WireFeatures {
  features ??= { sdkName: hasField("Hello", "sdk_name"), drain: hasField("WorkerFrame", "drain") };
  return features;
}

// ------------------------------------------------------------------ message shapes

/** google.protobuf.Duration / Timestamp as proto-loader hands them (longs as strings). */
export interface WireDuration {
  seconds: string | number;
  nanos: number;
}
export type WireTimestamp = WireDuration;

export type WireTaskState =
  | "TASK_STATE_UNSPECIFIED"
  | "TASK_STATE_PENDING"
  | "TASK_STATE_SCHEDULED"
  | "TASK_STATE_AGGREGATING"
  | "TASK_STATE_BLOCKED"
  | "TASK_STATE_ACTIVE"
  | "TASK_STATE_RETRY"
  | "TASK_STATE_COMPLETED"
  | "TASK_STATE_ARCHIVED"
  | "TASK_STATE_CANCELED"
  | "TASK_STATE_HELD";

export type WireOnFailure =
  | "ON_FAILURE_UNSPECIFIED"
  | "ON_FAILURE_BLOCK"
  | "ON_FAILURE_CONTINUE"
  | "ON_FAILURE_CASCADE_CANCEL";

export type WireOutcome =
  | "OUTCOME_UNSPECIFIED"
  | "OUTCOME_SUCCESS"
  | "OUTCOME_FAILURE"
  | "OUTCOME_SKIP_RETRY"
  | "OUTCOME_RELEASE";

export interface WireTaskOptions {
  max_retry?: number | null;
  timeout?: WireDuration | null;
  deadline?: WireTimestamp | null;
  process_at?: WireTimestamp | null;
  process_in?: WireDuration | null;
  expires_at?: WireTimestamp | null;
  retention?: WireDuration | null;
  unique_key?: string;
  unique_ttl?: WireDuration | null;
  group?: string;
  depends_on?: string[];
  on_failure?: WireOnFailure;
  concurrency_key?: string;
}

export interface WireNewTask {
  id?: string;
  queue: string;
  type: string;
  payload: Buffer;
  headers?: Record<string, string>;
  options?: WireTaskOptions;
}

export interface WireTask {
  id: string;
  queue: string;
  type: string;
  payload: Buffer;
  headers: Record<string, string>;
  options: WireTaskOptions | null;
  state: WireTaskState;
  max_retry: number;
  retried: number;
  progress: Buffer;
  result: Buffer;
  last_error: string;
  created_at: WireTimestamp | null;
  updated_at: WireTimestamp | null;
  started_at: WireTimestamp | null;
  completed_at: WireTimestamp | null;
  next_process_at: WireTimestamp | null;
  lease_expires_at: WireTimestamp | null;
}

export interface WireEnqueueItemResult {
  task: WireTask | null;
  created: boolean;
  error_code: string;
  error: string;
  existing_id: string;
}

export interface WireTaskEnvelope {
  id: string;
  queue: string;
  type: string;
  payload: Buffer;
  headers: Record<string, string>;
  lease_id: string;
  attempt: number;
  max_retry: number;
  timeout: WireDuration | null;
  deadline: WireTimestamp | null;
  lease_expires_at: WireTimestamp | null;
  group: string;
  concurrency_key: string;
  enqueued_at: WireTimestamp | null;
  probe: boolean;
}

export interface WireHello {
  queues: Record<string, number>;
  concurrency: number;
  labels: Record<string, string>;
  sdk_version: string;
  min_server_version: string;
  batch_types: string[];
  worker_id: string;
  accepts_dispatches: boolean;
  sdk_name?: string;
}

export interface WireWelcome {
  session_id: string;
  lease_ttl: WireDuration | null;
  heartbeat_interval: WireDuration | null;
  server_version: string;
  min_sdk_version: string;
  max_result: string | number;
}

export interface WireResult {
  task_id: string;
  lease_id: string;
  outcome: WireOutcome;
  result?: Buffer;
  error?: string;
  retry_after?: WireDuration | null;
}

export interface WireCancel {
  task_id: string;
  lease_id: string;
  reason: string;
}

export interface WireBatchDispatch {
  queue: string;
  group: string;
  type: string;
  tasks: WireTaskEnvelope[];
}

/** A ServerFrame as read: `frame` names the oneof member that is set. */
export interface WireServerFrame {
  frame?: string;
  welcome?: WireWelcome | null;
  dispatch?: { task: WireTaskEnvelope | null } | null;
  batch_dispatch?: WireBatchDispatch | null;
  cancel?: WireCancel | null;
  ping?: { sent_at: WireTimestamp | null } | null;
  dispatches?: { tasks: WireTaskEnvelope[] } | null;
}

/** A WorkerFrame to write: exactly one member set. */
export type WireWorkerFrame =
  | { hello: WireHello }
  | { result: WireResult }
  | { batch_result: { results: WireResult[] } }
  | { heartbeat: Record<string, never> }
  | { credit: { queue: string; n: number } }
  | { progress: { task_id: string; lease_id: string; progress: Buffer } }
  | { drain: Record<string, never> };

// ------------------------------------------------------------------ conversions

export function durationToWire(ms: number): WireDuration {
  const seconds = Math.floor(ms / 1000);
  const nanos = Math.round((ms - seconds * 1000) * 1e6);
  return { seconds: String(seconds), nanos };
}

export function durationFromWire(value: WireDuration | null | undefined): number | undefined {
  if (value === null || value === undefined) return undefined;
  return Number(value.seconds) * 1000 + value.nanos / 1e6;
}

export function timestampToWire(date: Date): WireTimestamp {
  return durationToWire(date.getTime());
}

export function timestampFromWire(value: WireTimestamp | null | undefined): Date | undefined {
  const ms = durationFromWire(value);
  return ms === undefined ? undefined : new Date(ms);
}
