// @conveyor/sdk: the TypeScript SDK of Conveyor, written from docs/protocol.md.

export { Client, type ClientOptions } from "./client.js";
export {
  Worker,
  TaskCancelled,
  DEFAULT_BACKOFF,
  FATAL_CODES,
  TIMED_OUT,
  describeError,
  type Handler,
  type Logger,
  type ReconnectBackoff,
  type TaskContext,
  type WorkerOptions,
} from "./worker.js";
export {
  AlreadyExists,
  CodecError,
  ConveyorError,
  DeadlineExceeded,
  FailedPrecondition,
  InvalidArgument,
  PermissionDenied,
  ResourceExhausted,
  RetryAfter,
  SkipRetry,
  TaskNotFound,
  Unauthenticated,
  Unavailable,
  Unimplemented,
} from "./errors.js";
export { type Codec, JsonCodec, RawCodec } from "./codec.js";
export { type ConnectionOptions, DEFAULT_TARGET, type TlsFile } from "./channel.js";
export {
  type EnqueueOptions,
  type EnqueueResult,
  type OnFailure,
  type TaskInfo,
  type TaskOptions,
  type TaskSpec,
  type TaskState,
  TERMINAL_STATES,
  isTerminal,
} from "./types.js";
export { SDK_NAME, VERSION } from "./version.js";
export { wireFeatures, type WireFeatures } from "./wire.js";
