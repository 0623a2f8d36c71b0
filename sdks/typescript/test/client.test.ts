// The producer client against a real server, and the pieces that need none.

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, test } from "node:test";

import {
  Client,
  InvalidArgument,
  JsonCodec,
  SDK_NAME,
  TaskNotFound,
  VERSION,
  wireFeatures,
} from "@conveyor/sdk";

import { PACKAGE_ROOT, serverTarget, uniqueQueue } from "./helpers.js";

describe("without a server", () => {
  test("the version sent in Hello is package.json's", () => {
    const pkg = JSON.parse(readFileSync(join(PACKAGE_ROOT, "package.json"), "utf8")) as { version: string };
    assert.equal(VERSION, pkg.version);
    assert.match(VERSION, /^\d+\.\d+\.\d+$/);
    assert.equal(SDK_NAME, "conveyor-typescript");
  });

  test("the JSON codec writes what the Python SDK's JsonCodec writes", () => {
    const codec = new JsonCodec();
    // json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    assert.equal(codec.encode({ to: "ü@example.com", n: [1, 2.5, null, true] }).toString("utf8"), '{"to":"ü@example.com","n":[1,2.5,null,true]}');
    assert.deepEqual(codec.decode(Buffer.from('{"a": [1, 2]}')), { a: [1, 2] });
  });

  test("features probed on the loaded protos are booleans", () => {
    const features = wireFeatures();
    assert.equal(typeof features.drain, "boolean");
    assert.equal(typeof features.sdkName, "boolean");
  });

  test("bad input is refused before anything is sent", async () => {
    const client = new Client("127.0.0.1:1");
    try {
      await assert.rejects(client.enqueue("t", {}, { queue: "no spaces" }), InvalidArgument);
      await assert.rejects(client.enqueue("", {}), InvalidArgument);
      await assert.rejects(client.enqueue("t\u0007", {}), InvalidArgument);
      await assert.rejects(client.enqueue("t", {}, { processAt: new Date(), processInMs: 5 }), InvalidArgument);
      await assert.rejects(client.enqueue("t", 10n), InvalidArgument);
    } finally {
      client.close();
    }
  });

  test("targets: https selects TLS, a path is refused", () => {
    assert.throws(() => new Client("https://example.com:443/x"), InvalidArgument);
    assert.throws(() => new Client("http://127.0.0.1:1", { tls: true }), InvalidArgument);
    new Client("https://127.0.0.1:1").close();
  });
});

describe("Client against a server", () => {
  let client: Client;
  before(async () => {
    client = new Client(await serverTarget());
  });
  after(() => client.close());

  test("enqueue then getTask returns the stored task, payload decoded", async () => {
    const queue = uniqueQueue("client");
    const payload = { to: "a@example.com", n: 3, nested: { list: [1, "two", null] } };
    const task = await client.enqueue("email.send", payload, {
      queue,
      maxRetry: 4,
      headers: { tenant: "acme" },
      timeoutMs: 2500,
    });
    assert.match(task.id, /^[0-9A-HJKMNP-TV-Z]{26}$/);
    assert.equal(task.state, "pending");
    assert.equal(task.queue, queue);
    assert.equal(task.maxRetry, 4);
    const read = await client.getTask(task.id);
    assert.deepEqual(read.payload, payload);
    assert.deepEqual(read.headers, { tenant: "acme" });
    assert.equal(read.options.timeoutMs, 2500);
    assert.equal(read.options.maxRetry, 4);
    assert.equal(read.result, null);
    assert.equal(read.retried, 0);
    assert.ok(read.createdAt instanceof Date);
  });

  test("enqueue is idempotent on id", async () => {
    const queue = uniqueQueue("client");
    const first = await client.enqueue("t", { v: 1 }, { queue });
    const again = await client.enqueue("t", { v: 2 }, { queue, id: first.id });
    assert.equal(again.id, first.id);
    assert.deepEqual((await client.getTask(first.id)).payload, { v: 1 });
  });

  test("a null payload is stored as no bytes and reads back as null", async () => {
    const task = await client.enqueue("t", null, { queue: uniqueQueue("client") });
    assert.equal((await client.getTask(task.id)).payload, null);
  });

  test("scheduled tasks start scheduled", async () => {
    const task = await client.enqueue("t", {}, { queue: uniqueQueue("client"), processInMs: 60_000 });
    assert.equal(task.state, "scheduled");
    assert.ok(task.nextProcessAt instanceof Date);
  });

  test("enqueueBatch: each item on its own", async () => {
    const queue = uniqueQueue("client");
    const results = await client.enqueueBatch([
      { type: "a", payload: 1, queue },
      { type: "b", payload: { x: 2 }, queue, uniqueKey: "k" },
      { type: "c", payload: 3, queue, uniqueKey: "k" },
    ]);
    assert.equal(results.length, 3);
    assert.equal(results[0]!.error, null);
    assert.equal(results[0]!.created, true);
    assert.equal(results[1]!.task?.type, "b");
    assert.ok(results[2]!.error, "the second task with the same unique key is refused");
    assert.equal((results[2]!.error as { code?: string }).code, "ALREADY_EXISTS");
    assert.equal((results[2]!.error as { existingId?: string }).existingId, results[1]!.task!.id);
    assert.deepEqual(await client.enqueueBatch([]), []);
  });

  test("getTask of an unknown id is TaskNotFound", async () => {
    await assert.rejects(client.getTask("01JAAAAAAAAAAAAAAAAAAAAAAA"), (err: unknown) => {
      assert.ok(err instanceof TaskNotFound);
      assert.equal(err.code, "NOT_FOUND");
      assert.equal(err.taskId, "01JAAAAAAAAAAAAAAAAAAAAAAA");
      return true;
    });
  });
});
