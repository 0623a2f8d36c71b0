// Payloads, results and progress values as bytes on the wire.
//
// The default codec is the Python SDK's (conveyor.JsonCodec): compact UTF-8 JSON. Empty
// bytes mean "no value" both ways: `null` and `undefined` encode as empty bytes, and
// empty bytes decode as `null` (Python's None). A codec never sees either.

import { CodecError } from "./errors.js";

/** Encodes values to bytes and back (payloads, results, progress). */
export interface Codec {
  encode(value: unknown): Buffer;
  decode(data: Buffer): unknown;
}

/** Compact UTF-8 JSON, the default (what the Python SDK's JsonCodec writes and reads). */
export class JsonCodec implements Codec {
  encode(value: unknown): Buffer {
    const text = JSON.stringify(value);
    if (text === undefined) {
      throw new TypeError(`a ${typeof value} cannot be encoded as JSON`);
    }
    return Buffer.from(text, "utf8");
  }

  decode(data: Buffer): unknown {
    return JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(data));
  }
}

/** Bytes passed through unchanged (Buffer or Uint8Array), for payloads already serialized. */
export class RawCodec implements Codec {
  encode(value: unknown): Buffer {
    if (value instanceof Uint8Array) return Buffer.from(value);
    throw new TypeError(`RawCodec encodes bytes only, not ${typeof value}`);
  }

  decode(data: Buffer): unknown {
    return Buffer.from(data);
  }
}

/** `null`/`undefined` as empty bytes, anything else through `codec`. */
export function encodeValue(codec: Codec, value: unknown, what = "value"): Buffer {
  if (value === null || value === undefined) return Buffer.alloc(0);
  try {
    return codec.encode(value);
  } catch (err) {
    throw new CodecError(`cannot encode ${what}: ${describe(err)}`);
  }
}

/** Empty bytes as `null`, anything else through `codec`. */
export function decodeValue(codec: Codec, data: Buffer | Uint8Array | null | undefined, what = "value"): unknown {
  if (data === null || data === undefined || data.length === 0) return null;
  try {
    return codec.decode(Buffer.from(data.buffer, data.byteOffset, data.byteLength));
  } catch (err) {
    throw new CodecError(`cannot decode ${what}: ${describe(err)}`);
  }
}

function describe(err: unknown): string {
  return err instanceof Error ? `${err.name}: ${err.message}` : String(err);
}
