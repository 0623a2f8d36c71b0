// How the SDK reaches a server: the target and its transport security, channel options,
// and the bearer-token metadata (docs/protocol.md, Transport and TLS).

import { readFileSync } from "node:fs";

import * as grpc from "@grpc/grpc-js";

import { InvalidArgument } from "./errors.js";

/** The api server's address when none is given. */
export const DEFAULT_TARGET = "127.0.0.1:50051";

/** A PEM file: its path, or its contents as bytes. */
export type TlsFile = string | Buffer | Uint8Array;

/** Connection options shared by `Client` and `Worker`. */
export interface ConnectionOptions {
  /** Sent as `authorization: Bearer <token>` on every call. */
  token?: string;
  /** Force TLS on (or off) for a bare `host:port` target. */
  tls?: boolean;
  /** CA bundle that verifies the server (default: the system's CAs); selects TLS. */
  tlsCa?: TlsFile;
  /** Client certificate and key, for a server with mutual TLS; select TLS. */
  tlsCert?: TlsFile;
  tlsKey?: TlsFile;
}

/** Responses carry whole tasks (payloads and results): allow more than gRPC's 4 MiB. */
export const CHANNEL_OPTIONS: grpc.ChannelOptions = {
  "grpc.max_receive_message_length": 64 * 1024 * 1024,
  "grpc.max_send_message_length": 64 * 1024 * 1024,
};

export interface Endpoint {
  address: string;
  tls: boolean;
  credentials: grpc.ChannelCredentials;
  metadata(): grpc.Metadata;
  /** An UNAVAILABLE status's details, with what to change first when the two sides
   * seem to disagree about TLS. */
  explain(details: string): string;
}

function pem(argument: string, value: TlsFile | undefined): Buffer | null {
  if (value === undefined) return null;
  if (value instanceof Uint8Array) return Buffer.from(value);
  if (typeof value !== "string") {
    throw new InvalidArgument(`${argument} must be a file path or PEM bytes`);
  }
  try {
    return readFileSync(value);
  } catch (err) {
    throw new InvalidArgument(`${argument}: cannot read ${value}: ${(err as Error).message}`);
  }
}

/** The endpoint for a target and connection options. `https://host:port` selects TLS,
 * `http://host:port` plaintext; a bare `host:port` is plaintext unless `tls` or a TLS file
 * is given. */
export function endpoint(target: string, options: ConnectionOptions = {}): Endpoint {
  if (typeof target !== "string" || target === "") {
    throw new InvalidArgument("target must be a non-empty 'host:port' string");
  }
  const { tls, tlsCa, tlsCert, tlsKey, token } = options;
  let address = target;
  let schemeTls: boolean | undefined;
  const match = /^(https?):\/\/([^/]+)\/?$/i.exec(target);
  if (match) {
    schemeTls = match[1]!.toLowerCase() === "https";
    address = match[2]!;
  } else if (/^https?:\/\//i.test(target)) {
    throw new InvalidArgument(`target '${target}' has a path: give 'https://host:port'`);
  }
  const material = tlsCa !== undefined || tlsCert !== undefined || tlsKey !== undefined;
  if (schemeTls === false && (tls || material)) {
    throw new InvalidArgument(`target '${target}' is plaintext (http://) but TLS was asked for: use https://`);
  }
  if (schemeTls === true && tls === false) {
    throw new InvalidArgument(`target '${target}' is https:// but tls is false`);
  }
  if (tls === false && material) {
    throw new InvalidArgument("tls: false with tlsCa, tlsCert or tlsKey: drop one or the other");
  }
  if ((tlsCert === undefined) !== (tlsKey === undefined)) {
    throw new InvalidArgument("tlsCert and tlsKey go together: give both or neither");
  }
  const useTls = schemeTls ?? Boolean(tls || material);
  const credentials = useTls
    ? grpc.credentials.createSsl(pem("tlsCa", tlsCa), pem("tlsKey", tlsKey), pem("tlsCert", tlsCert))
    : grpc.credentials.createInsecure();
  return {
    address,
    tls: useTls,
    credentials,
    metadata() {
      const metadata = new grpc.Metadata();
      if (token) metadata.set("authorization", `Bearer ${token}`);
      return metadata;
    },
    explain(details: string) {
      const hint = transportHint(details, useTls);
      return hint ? `${hint} (${details})` : details;
    },
  };
}

/** What an UNAVAILABLE status's details most likely mean for TLS, or undefined. Covers
 * the wording of grpc-js (Node's TLS errors) as well as the C-core's the protocol doc
 * quotes. */
export function transportHint(details: string, tls: boolean): string | undefined {
  const low = details.toLowerCase();
  if (low.includes("wrong_version_number") || low.includes("wrong version number") || low.includes("packet_length_too_long")) {
    return "TLS handshake failed: the server does not speak TLS; use a plain 'host:port' target (no https://, no tls, no TLS files)";
  }
  const verify = /CERTIFICATE_VERIFY_FAILED:\s*([^:]+)/i.exec(details);
  const nodeVerify = /(self[- ]signed certificate[^,;)]*|unable to verify the first certificate|unable to get local issuer certificate|certificate has expired)/i.exec(details);
  if (verify || nodeVerify) {
    const reason = (verify?.[1] ?? nodeVerify?.[1] ?? "").trim();
    return `TLS handshake failed: the server's certificate is not trusted (${reason}): pass tlsCa with the CA bundle that signed it`;
  }
  if (low.includes("hostname verification") || low.includes("peer name") || low.includes("does not match certificate's altnames")) {
    return "TLS handshake failed: the server's certificate does not name this host; connect by a name the certificate lists";
  }
  const closed = ["socket closed", "connection reset", "end of tcp stream", "econnreset", "socket disconnected", "socket hang up"]
    .some((marker) => low.includes(marker));
  if (closed && !tls) {
    return "the server closed the connection at once: if it speaks TLS, use an 'https://host:port' target (or tls: true), with tlsCa for a private CA";
  }
  if (closed && tls) {
    return "the server closed the connection during the TLS handshake: if it requires a client certificate (mutual TLS), pass tlsCert and tlsKey with one its CA signed";
  }
  return undefined;
}
