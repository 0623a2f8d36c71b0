// The producer client: TaskService (Enqueue, EnqueueBatch, GetTask).

import * as grpc from "@grpc/grpc-js";

import { CHANNEL_OPTIONS, type ConnectionOptions, DEFAULT_TARGET, type Endpoint, endpoint } from "./channel.js";
import { type Codec, JsonCodec } from "./codec.js";
import { ConveyorError, InvalidArgument, errorFromRpc, errorFromStatus } from "./errors.js";
import {
  type EnqueueOptions,
  type EnqueueResult,
  MAX_BATCH,
  type TaskInfo,
  type TaskSpec,
  specToWire,
  taskFromWire,
} from "./types.js";
import { type WireEnqueueItemResult, type WireTask, wire } from "./wire.js";

export interface ClientOptions extends ConnectionOptions {
  /** Encodes payloads and decodes payloads, progress and results (JSON by default). */
  codec?: Codec;
  /** Bound on every call in milliseconds (default 30 s; 0: none). */
  timeoutMs?: number;
}

type Unary = (
  request: unknown,
  metadata: grpc.Metadata,
  options: grpc.CallOptions,
  callback: (err: grpc.ServiceError | null, response: unknown) => void,
) => grpc.ClientUnaryCall;

/** A gRPC client of one Conveyor service, with the SDK's error mapping. @internal */
export class RpcClient {
  readonly endpoint: Endpoint;
  readonly timeoutMs: number;
  private readonly client: grpc.Client;

  constructor(service: grpc.ServiceClientConstructor, target: string, options: ClientOptions) {
    this.endpoint = endpoint(target, options);
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.client = new service(this.endpoint.address, this.endpoint.credentials, CHANNEL_OPTIONS);
  }

  call<T>(method: string, request: unknown, taskId?: string): Promise<T> {
    const fn = (this.client as unknown as Record<string, Unary>)[method];
    if (typeof fn !== "function") {
      return Promise.reject(new ConveyorError(`the loaded protos have no method ${method}`));
    }
    const options: grpc.CallOptions = {};
    if (this.timeoutMs > 0) options.deadline = new Date(Date.now() + this.timeoutMs);
    return new Promise<T>((resolve, reject) => {
      fn.call(this.client, request, this.endpoint.metadata(), options, (err, response) => {
        if (err) {
          const mapped = errorFromRpc(err, taskId);
          if (mapped.code === "UNAVAILABLE") mapped.message = this.endpoint.explain(mapped.message);
          reject(mapped);
        } else {
          resolve(response as T);
        }
      });
    });
  }

  close(): void {
    this.client.close();
  }
}

/**
 * Enqueue tasks and read them back.
 *
 * ```ts
 * const client = new Client("127.0.0.1:50051");
 * const task = await client.enqueue("email.send", { to: "a@example.com" }, { queue: "emails" });
 * const info = await client.getTask(task.id);
 * client.close();
 * ```
 *
 * `target` is `host:port` (plaintext), or `https://host:port` for TLS.
 */
export class Client {
  readonly target: string;
  readonly codec: Codec;
  private readonly rpc: RpcClient;

  constructor(target: string = DEFAULT_TARGET, options: ClientOptions = {}) {
    this.target = target;
    this.codec = options.codec ?? new JsonCodec();
    this.rpc = new RpcClient(wire().services.TaskService, target, options);
  }

  /** Enqueue one task of `type` and return it as stored. Enqueue is idempotent on `id`:
   * an existing id returns the stored task unchanged. Throws `AlreadyExists` (with
   * `existingId`) when a live task holds `uniqueKey`, `InvalidArgument` for bad input. */
  async enqueue(type: string, payload?: unknown, options: EnqueueOptions = {}): Promise<TaskInfo> {
    const task = specToWire({ ...options, type, payload }, this.codec);
    const response = await this.rpc.call<{ task: WireTask }>("Enqueue", { task });
    return taskFromWire(response.task, this.codec);
  }

  /** Enqueue up to 1000 tasks; each succeeds or fails on its own. One result per spec,
   * in order: `task` on success, `error` (not thrown) on failure. */
  async enqueueBatch(specs: TaskSpec[]): Promise<EnqueueResult[]> {
    if (specs.length === 0) return [];
    if (specs.length > MAX_BATCH) {
      throw new InvalidArgument(`a batch holds at most ${MAX_BATCH} tasks, got ${specs.length}`);
    }
    const tasks = specs.map((spec) => specToWire(spec, this.codec));
    const response = await this.rpc.call<{ results: WireEnqueueItemResult[] }>("EnqueueBatch", { tasks });
    if (response.results.length !== tasks.length) {
      throw new ConveyorError(`the server answered ${response.results.length} results for ${tasks.length} tasks`);
    }
    return response.results.map((item) => this.itemResult(item));
  }

  /** The task with this id, its payload, progress and result decoded; throws
   * `TaskNotFound` when there is none. */
  async getTask(id: string): Promise<TaskInfo> {
    const response = await this.rpc.call<{ task: WireTask }>("GetTask", { id }, id);
    return taskFromWire(response.task, this.codec);
  }

  /** Close the channel. */
  close(): void {
    this.rpc.close();
  }

  private itemResult(item: WireEnqueueItemResult): EnqueueResult {
    if (item.error_code || item.error) {
      const error = errorFromStatus(item.error_code || "UNKNOWN", item.error || item.error_code);
      if (item.existing_id) (error as { existingId?: string }).existingId = item.existing_id;
      return { task: null, created: false, error };
    }
    if (!item.task) {
      return { task: null, created: false, error: new ConveyorError("the server returned neither a task nor an error", "INTERNAL") };
    }
    return { task: taskFromWire(item.task, this.codec), created: item.created, error: null };
  }
}
