// Errors the SDK raises, and the signals a handler throws.

import type * as grpc from "@grpc/grpc-js";
import { status } from "@grpc/grpc-js";

/** Base class of every error the SDK raises on purpose. `code` is the gRPC status code
 * name the server answered with ("NOT_FOUND", ...), or undefined for errors the SDK found
 * itself. */
export class ConveyorError extends Error {
  readonly code: string | undefined;
  constructor(message: string, code?: string) {
    super(message);
    this.name = new.target.name;
    this.code = code;
  }
}

/** The request is malformed (bad queue name, negative timeout...). Nothing was stored. */
export class InvalidArgument extends ConveyorError {}
/** No task has this id. */
export class TaskNotFound extends ConveyorError {
  readonly taskId: string | undefined;
  constructor(message: string, code = "NOT_FOUND", taskId?: string) {
    super(message, code);
    this.taskId = taskId;
  }
}
/** A live task already holds the unique key; `existingId` names it when the server says. */
export class AlreadyExists extends ConveyorError {
  readonly existingId: string | undefined;
  constructor(message: string, code = "ALREADY_EXISTS", existingId?: string) {
    super(message, code);
    this.existingId = existingId;
  }
}
/** The versions do not match, or the task is not in a state that allows the request. */
export class FailedPrecondition extends ConveyorError {}
/** A missing or unknown token. */
export class Unauthenticated extends ConveyorError {}
/** The token's role does not allow the request. */
export class PermissionDenied extends ConveyorError {}
/** The server could not be reached (or went away); retrying may help. */
export class Unavailable extends ConveyorError {}
/** A deadline passed before the server answered. */
export class DeadlineExceeded extends ConveyorError {}
/** A limit was hit (message size, rate). */
export class ResourceExhausted extends ConveyorError {}
/** The server does not implement the request. */
export class Unimplemented extends ConveyorError {}
/** A payload, result or progress value the codec could not encode or decode. */
export class CodecError extends ConveyorError {}

const BY_CODE: Record<string, new (message: string, code?: string) => ConveyorError> = {
  INVALID_ARGUMENT: InvalidArgument,
  OUT_OF_RANGE: InvalidArgument,
  NOT_FOUND: TaskNotFound,
  ALREADY_EXISTS: AlreadyExists,
  FAILED_PRECONDITION: FailedPrecondition,
  UNAUTHENTICATED: Unauthenticated,
  PERMISSION_DENIED: PermissionDenied,
  UNAVAILABLE: Unavailable,
  DEADLINE_EXCEEDED: DeadlineExceeded,
  RESOURCE_EXHAUSTED: ResourceExhausted,
  UNIMPLEMENTED: Unimplemented,
};

/** The name of a numeric gRPC status code ("UNAVAILABLE"). */
export function codeName(code: number | undefined): string {
  if (code === undefined) return "UNKNOWN";
  return (status as unknown as Record<number, string>)[code] ?? "UNKNOWN";
}

/** The SDK error for a status code name and message (unknown codes: the base class). */
export function errorFromStatus(code: string, message: string): ConveyorError {
  const cls = BY_CODE[code] ?? ConveyorError;
  return new cls(message, code);
}

/** The SDK error for a failed call; `taskId` fills TaskNotFound, and the server's
 * `conveyor-existing-id` trailer fills AlreadyExists. */
export function errorFromRpc(err: unknown, taskId?: string): ConveyorError {
  const e = err as Partial<grpc.ServiceError>;
  if (typeof e?.code !== "number") {
    return new ConveyorError(err instanceof Error ? err.message : String(err));
  }
  const code = codeName(e.code);
  const message = e.details || e.message || code;
  if (code === "NOT_FOUND") return new TaskNotFound(message, code, taskId);
  if (code === "ALREADY_EXISTS") {
    const existing = e.metadata?.get("conveyor-existing-id")[0];
    return new AlreadyExists(message, code, existing === undefined ? undefined : String(existing));
  }
  return errorFromStatus(code, message);
}

// ------------------------------------------------------------------ handler signals

/** Throw from a handler to fail the task for good: it is archived at once, whatever
 * retries remain. The message becomes the task's last error. */
export class SkipRetry extends Error {
  constructor(message = "") {
    super(message);
    this.name = "SkipRetry";
  }
}

/** Throw from a handler to fail this attempt and retry after `delayMs` milliseconds
 * (the retry still counts against the task's max_retry). Any error with a numeric
 * `retryAfterMs` property has the same effect. */
export class RetryAfter extends Error {
  readonly retryAfterMs: number;
  constructor(delayMs: number, message = "") {
    super(message);
    if (!Number.isFinite(delayMs) || delayMs < 0) {
      throw new RangeError(`retry delay must be a number >= 0, got ${delayMs}`);
    }
    this.name = "RetryAfter";
    this.retryAfterMs = delayMs;
  }
}
